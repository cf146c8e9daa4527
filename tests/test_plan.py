"""Plans: golden layouts for the Llama-3 presets (checked against real DTensors on a fake
process group), hand-checked layout cases, and every ConfigError a user can cause."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshtrain.errors import ConfigError
from meshtrain.models import build, llama
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.spec import ParamSpec
from meshtrain.parallel.init import init_params
from meshtrain.layout.mesh import MeshSpec
from meshtrain.layout.plan import Layout, layout_for, make_plan, placement_str
from meshtrain.layout.rules import Rules

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("MESHTRAIN_REGEN_GOLDEN") == "1"


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def fake_world(world: int):
    """A fake process group of `world` ranks in this process (we are rank 0); destroyed
    on exit so later tests see a clean state."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group is already initialised"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_meta_params(plan) -> None:
    """init_params on the meta device over a fake world: every DTensor has the plan's
    placements and (rank 0 being the most loaded rank) the plan's local shape."""
    with fake_world(plan.mesh.world):
        mesh = plan.mesh.build()
        assert mesh.mesh_dim_names == plan.mesh.axes
        assert tuple(mesh.shape) == plan.mesh.shape
        params = init_params(plan, mesh, device="meta")
        assert list(params) == list(plan.params)
        for name, p in plan.params.items():
            dt = params[name]
            assert isinstance(dt, DTensor), name
            assert dt.device.type == "meta", name
            assert tuple(dt.shape) == p.spec.shape, name
            assert tuple(dt.to_local().shape) == p.local_shape, (name, tuple(dt.to_local().shape), p.local_shape)
            # Compare by type and value: _StridedShard and Shard must not be confused.
            assert [placement_str(x) for x in dt.placements] == [placement_str(x) for x in p.placements], name
            assert tuple(dt.placements) == p.placements, name


def _normalise(d):
    """What the dict reads as once written to JSON (tuples -> lists)."""
    return json.loads(json.dumps(d))


def _dump_golden(d: dict) -> str:
    """Valid JSON, one parameter (and one activation) per line so diffs stay readable."""
    lines = ["{"]
    keys = list(d)
    for i, key in enumerate(keys):
        comma = "," if i < len(keys) - 1 else ""
        value = d[key]
        if key == "params":
            lines.append(f' "{key}": [')
            lines += [f"  {json.dumps(p)}" + ("," if j < len(value) - 1 else "") for j, p in enumerate(value)]
            lines.append(f" ]{comma}")
        elif key == "activations":
            lines.append(f' "{key}": {{')
            names = list(value)
            lines += [f"  {json.dumps(n)}: {json.dumps(value[n])}" + ("," if j < len(names) - 1 else "")
                      for j, n in enumerate(names)]
            lines.append(f" }}{comma}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _differences(golden, got, path: str = "") -> list[str]:
    if isinstance(golden, dict) and isinstance(got, dict):
        out = []
        for k in golden:
            if k not in got:
                out.append(f"{path}.{k}: missing now (golden {json.dumps(golden[k])[:120]})")
            else:
                out += _differences(golden[k], got[k], f"{path}.{k}")
        out += [f"{path}.{k}: new key (now {json.dumps(got[k])[:120]})" for k in got if k not in golden]
        return out
    if isinstance(golden, list) and isinstance(got, list):
        out = []
        for i, (a, b) in enumerate(zip(golden, got)):
            label = f"[{i}]"
            if isinstance(a, dict) and "name" in a:
                label = f"[{i} {a['name']}]"
            out += _differences(a, b, path + label)
        if len(golden) != len(got):
            out.append(f"{path}: length {len(golden)} in golden, {len(got)} now")
        return out
    if golden != got:
        return [f"{path}: golden {json.dumps(golden)} != now {json.dumps(got)}"]
    return []


def compare_golden(got: dict, filename: str) -> None:
    path = GOLDEN / filename
    got = _normalise(got)
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_dump_golden(got))
        assert json.loads(path.read_text()) == got
    if not path.exists():
        pytest.fail(f"golden file {path} is missing; create it with MESHTRAIN_REGEN_GOLDEN=1")
    golden = json.loads(path.read_text())
    if golden != got:
        diffs = _differences(golden, got, "plan")
        shown = "\n  ".join(diffs[:20])
        more = f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else ""
        pytest.fail(f"plan differs from {path} in {len(diffs)} places (first shown):\n  {shown}{more}\n"
                    "If the change is intended, regenerate with MESHTRAIN_REGEN_GOLDEN=1 and review the diff.",
                    pytrace=False)


def llama_plan(preset: str, mesh: MeshSpec, rules: Rules | None = None):
    return make_plan(llama.param_specs(llama.PRESETS[preset]), rules or Rules.default(sp=True), mesh)


# --------------------------------------------------------------------------- goldens

# Hand-checked numbers. Every weight matrix is split over fsdp x tp = 64 ways; the norm
# scales (2 per layer + the final one) only over fsdp = 8 ways (replicated over tp); dp
# replicates everything. So bytes/rank = (total - norms) * 4 / 64 + norms * 4 / 8.
GOLDEN_CASES = {
    "plan_llama3-8b_fsdp8_tp8.json": dict(
        preset="llama3-8b", mesh=MeshSpec(fsdp=8, tp=8), world=64, n_params=291,
        total=8_030_261_248, norms=(2 * 32 + 1) * 4096, bytes_per_rank=502_007_808),
    "plan_llama3-70b_dp2_fsdp8_tp8.json": dict(
        preset="llama3-70b", mesh=MeshSpec(dp=2, fsdp=8, tp=8), world=128, n_params=723,
        total=70_553_706_496, norms=(2 * 80 + 1) * 8192, bytes_per_rank=4_410_183_680),
}


@pytest.mark.parametrize("filename", list(GOLDEN_CASES))
def test_golden_plan(filename):
    case = GOLDEN_CASES[filename]
    plan = llama_plan(case["preset"], case["mesh"])
    # Sanity before anything is compared with the golden file.
    assert plan.mesh.world == case["world"]
    assert len(plan.params) == case["n_params"]
    assert sum(p.spec.numel for p in plan.params.values()) == case["total"]
    expected = (case["total"] - case["norms"]) * 4 // 64 + case["norms"] * 4 // 8
    assert expected == case["bytes_per_rank"]
    assert plan.param_bytes_per_rank == case["bytes_per_rank"]
    # About total * 4 / 64: only the norm scales (replicated over tp) add to it.
    assert abs(plan.param_bytes_per_rank - case["total"] * 4 / 64) < case["norms"] * 4 / 8
    check_meta_params(plan)
    compare_golden(plan.to_dict(), filename)


def test_golden_diff_is_readable():
    """A changed plan fails with the path of each difference, parameter names included."""
    plan = llama_plan("llama3-8b", MeshSpec(fsdp=8, tp=8))
    got = _normalise(plan.to_dict())
    changed = json.loads(json.dumps(got))
    changed["params"][1]["placements"] = ["S(0)", "S(1)"]
    changed["param_bytes_per_rank"] += 1
    diffs = _differences(got, changed, "plan")
    assert diffs == [
        'plan.params[1 layers.0.attn_norm].placements[1]: golden "R" != now "S(1)"',
        "plan.param_bytes_per_rank: golden 502007808 != now 502007809",
    ]
    assert _differences(got, got) == []


def test_strided_plan_on_fake_world():
    """_StridedShard layouts give the planned local shapes on a real DeviceMesh too."""
    base = Rules.default(sp=True)
    rules = Rules(base.mapping, {"layers.*.mlp.*": {"mlp": ("tp", "fsdp"), "embed": ()}})
    plan = llama_plan("llama3-8b", MeshSpec(fsdp=8, tp=8), rules)
    w = plan.params["layers.0.mlp.w_gate"]
    assert w.placements == (_StridedShard(0, split_factor=8), Shard(0))
    assert w.local_shape == (14336 // 64, 4096)
    d = plan.params["layers.0.mlp.w_down"]
    assert d.placements == (_StridedShard(1, split_factor=8), Shard(1))
    assert d.local_shape == (4096, 14336 // 64)
    check_meta_params(plan)


def test_uneven_fsdp_on_fake_world():
    specs = {"a": ParamSpec((10, 6), ("embed", None)), "n": ParamSpec((7,), ("norm",), init="ones")}
    plan = make_plan(specs, Rules.default(), MeshSpec(fsdp=4))
    assert plan.params["a"].local_shape == (3, 6)
    assert plan.params["n"].local_shape == (2,)
    check_meta_params(plan)


# --------------------------------------------------------------------------- hand-checked layouts

MESH_8x8 = MeshSpec(fsdp=8, tp=8)


def test_fsdp_tp_placements_8b():
    plan = llama_plan("llama3-8b", MESH_8x8)
    assert plan.mesh.axes == ("fsdp", "tp")
    wq = plan.params["layers.0.attn.wq"]  # (q_heads, embed) = (4096, 4096)
    assert wq.layout.dim_axes == (("tp",), ("fsdp",))
    assert wq.placements == (Shard(1), Shard(0))  # fsdp splits embed, tp splits heads
    assert wq.local_shape == (512, 512)
    assert wq.bytes_per_rank == 512 * 512 * 4
    wk = plan.params["layers.0.attn.wk"]  # (kv_heads, embed) = (1024, 4096): 8 kv heads, one per tp rank
    assert wk.placements == (Shard(1), Shard(0)) and wk.local_shape == (128, 512)
    wo = plan.params["layers.0.attn.wo"]  # (embed, q_heads) = (4096, 4096)
    assert wo.layout.dim_axes == (("fsdp",), ("tp",))
    assert wo.placements == (Shard(0), Shard(1))
    assert wo.local_shape == (512, 512)
    emb = plan.params["tok_emb"]  # (vocab, embed) = (128256, 4096)
    assert emb.layout.dim_axes == (("tp",), ("fsdp",))
    assert emb.placements == (Shard(1), Shard(0))
    assert emb.local_shape == (128256 // 8, 4096 // 8) == (16032, 512)
    norm = plan.params["norm"]
    assert norm.placements == (Shard(0), Replicate()) and norm.local_shape == (512,)
    assert plan.params["layers.31.mlp.w_down"].placements == (Shard(0), Shard(1))


def test_compute_placements_replace_fsdp_by_replicate():
    plan = llama_plan("llama3-70b", MeshSpec(dp=2, fsdp=8, tp=8))
    mesh = plan.mesh
    assert mesh.axes == ("dp", "fsdp", "tp")
    assert plan.params["layers.0.attn.wq"].compute_placements() == (Replicate(), Replicate(), Shard(0))
    assert plan.params["layers.0.attn.wo"].compute_placements() == (Replicate(), Replicate(), Shard(1))
    assert plan.params["norm"].compute_placements() == (Replicate(),) * 3
    rules = Rules(Rules.default().mapping, {"*.w_gate": {"mlp": ("tp", "fsdp"), "embed": ()}})
    strided = llama_plan("llama3-70b", MeshSpec(dp=2, fsdp=8, tp=8), rules).params["layers.0.mlp.w_gate"]
    assert strided.placements == (Replicate(), _StridedShard(0, split_factor=8), Shard(0))
    assert strided.compute_placements() == (Replicate(), Replicate(), Shard(0))


def test_out_of_order_axes_give_strided_shard():
    mesh = MeshSpec(fsdp=2, tp=4)
    rules = Rules({"mlp": ("tp", "fsdp"), "embed": ("fsdp",)})
    layout = layout_for(("mlp", "embed"), rules, mesh)
    # tp (the later mesh dim) is the major split: the fsdp mesh dim holds strided pieces.
    assert layout.dim_axes == (("tp", "fsdp"), ())
    assert layout.placements == (_StridedShard(0, split_factor=4), Shard(0))
    assert [placement_str(p) for p in layout.placements] == ["SS(0,4)", "S(0)"]
    assert layout.local_shape((32, 8), mesh) == (4, 8)
    # The same axes in mesh order are two plain shards of one dim.
    in_order = layout_for(("mlp", "embed"), Rules({"mlp": ("fsdp", "tp")}), mesh)
    assert in_order.placements == (Shard(0), Shard(0))
    # Three mesh dims: the strided piece sits on the minor axis' mesh dim, others replicate.
    mesh3 = MeshSpec(dp=2, fsdp=2, tp=4)
    layout3 = layout_for((None, "mlp"), Rules({"mlp": ("tp", "dp")}), mesh3)
    assert layout3.placements == (_StridedShard(1, split_factor=4), Replicate(), Shard(1))
    # More than two axes out of mesh order cannot be expressed.
    with pytest.raises(ConfigError, match=r"w dim 0: mesh axes \['tp', 'cp', 'fsdp'\].*list them in mesh order"):
        layout_for(("mlp",), Rules({"mlp": ("tp", "cp", "fsdp")}), MeshSpec(fsdp=2, cp=2, tp=2), "w")


def test_axes_of_size_one_are_dropped():
    mesh = MeshSpec(fsdp=8).resolve(8)  # tp = 1
    assert mesh.axes == ("fsdp",)
    layout = layout_for(("q_heads", "embed"), Rules.default(), mesh)
    assert layout.dim_axes == ((), ("fsdp",))
    assert layout.placements == (Shard(1),)
    assert layout.local_shape((4096, 4096), mesh) == (4096, 512)
    # A rule naming only absent axes leaves the dim whole; a 1-rank mesh keeps one dp dim.
    one = MeshSpec().resolve(1)
    assert one.axes == ("dp",)
    single = layout_for(("vocab", "embed"), Rules.default(), one)
    assert single == Layout(((), ()), (Replicate(),))
    plan = make_plan(llama.param_specs(LlamaConfig()), Rules.default(), MeshSpec(tp=4, cp=1, pp=1))
    assert plan.mesh.axes == ("tp",) and plan.to_dict()["mesh"] == {"tp": 4}
    assert plan.params["layers.0.attn.wq"].placements == (Shard(0),)


def test_mesh_axis_used_at_most_once_per_tensor():
    mesh = MESH_8x8
    rules = Rules({"q_heads": ("tp",), "embed": ("fsdp", "tp")})
    # wq: q_heads claims tp first, so embed keeps only fsdp.
    wq = layout_for(("q_heads", "embed"), rules, mesh)
    assert wq.dim_axes == (("tp",), ("fsdp",))
    assert wq.placements == (Shard(1), Shard(0))
    # wo: embed comes first and takes both; q_heads is left whole.
    wo = layout_for(("embed", "q_heads"), rules, mesh)
    assert wo.dim_axes == (("fsdp", "tp"), ())
    assert wo.placements == (Shard(0), Shard(0))
    assert wo.local_shape((4096, 4096), mesh) == (64, 4096)
    # Activations follow the same rule.
    act = layout_for(("batch", "seq", "vocab"), Rules({"batch": ("fsdp",), "seq": ("fsdp",), "vocab": ("tp",)}), mesh)
    assert act.dim_axes == (("fsdp",), (), ("tp",))


def test_mesh_axis_listed_twice_in_one_rule_is_refused():
    with pytest.raises(ConfigError, match=r"repeat an axis.*at most once"):
        Rules({"mlp": ("tp", "tp")})


def test_uneven_fsdp_shards_round_up():
    specs = {"norm": ParamSpec((10,), ("norm",), init="ones"),
             "w": ParamSpec((10, 3), ("embed", None))}
    plan = make_plan(specs, Rules.default(), MeshSpec(fsdp=4))
    assert plan.params["norm"].local_shape == (3,)  # ceil(10 / 4), as torch.chunk
    assert plan.params["w"].local_shape == (3, 3)
    assert plan.params["norm"].bytes_per_rank == 12
    # Storage-only sharding may be uneven; compute (tp) or nested sharding may not.
    with pytest.raises(ConfigError, match=r"parameter w dim 0 \(embed: size 10\) cannot be split 4 ways over tp=4"):
        make_plan(specs, Rules({"embed": ("tp",)}), MeshSpec(tp=4))
    with pytest.raises(ConfigError, match=r"cannot be split 4 ways over fsdp=2 x tp=2"):
        make_plan(specs, Rules({"embed": ("fsdp", "tp")}), MeshSpec(fsdp=2, tp=2))


def test_plan_str_groups_layers():
    plan = llama_plan("llama3-8b", MESH_8x8)
    text = str(plan)
    assert "world 64" in text and "fsdp=8 x tp=8" in text
    assert "layers.0." not in text and "layers.31." not in text
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.splitlines() if line.startswith("│")}
    expected_rows = ["tok_emb", "layers.*.attn_norm", "layers.*.attn.wq", "layers.*.attn.wk", "layers.*.attn.wv",
                     "layers.*.attn.wo", "layers.*.mlp_norm", "layers.*.mlp.w_gate", "layers.*.mlp.w_up",
                     "layers.*.mlp.w_down", "norm", "output", "total"]
    activations = ["tokens", "residual", "block_input", "q", "kv", "mlp_hidden", "logits"]
    assert list(rows) == expected_rows + activations
    assert rows["residual"] == ["(batch, seq_sp, -)", "fsdp, tp, -", "[S(0), S(1)]"]
    assert rows["logits"] == ["(batch, seq, vocab)", "fsdp, -, tp", "[S(0), S(2)]"]
    assert rows["layers.*.attn.wq"] == ["32", "(4096, 4096)", "tp, fsdp", "[S(1), S(0)]", "(512, 512)", "1.00 MiB"]
    assert rows["tok_emb"][0] == "1"
    assert rows["norm"][2:4] == ["fsdp", "[S(0), R]"]
    assert rows["total"][0] == "291" and rows["total"][-1] == "478.75 MiB"  # 502,007,808 B


def test_to_json_round_trips():
    base = Rules.default(sp=True)
    rules = Rules(base.mapping, {"*.w_up": {"mlp": ("tp", "fsdp"), "embed": ()}})
    plan = make_plan(llama.param_specs(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                                   vocab_size=256)), rules, MeshSpec(fsdp=-1, tp=2), world=8)
    data = json.loads(plan.to_json())
    assert data == _normalise(plan.to_dict())
    assert data["world"] == 8 and data["mesh"] == {"fsdp": 4, "tp": 2}
    assert data["rules"]["overrides"] == {"*.w_up": {"mlp": ["tp", "fsdp"], "embed": []}}
    up = next(p for p in data["params"] if p["name"] == "layers.1.mlp.w_up")
    assert up == {"name": "layers.1.mlp.w_up", "shape": [128, 64], "axes": ["mlp", "embed"], "dtype": "float32",
                  "mesh_axes": [["tp", "fsdp"], []], "placements": ["SS(0,2)", "S(0)"],
                  "local_shape": [16, 64], "bytes_per_rank": 16 * 64 * 4}
    assert data["activations"]["residual"] == {"axes": ["batch", "seq_sp", None], "placements": ["S(0)", "S(1)"]}
    assert data["activations"]["logits"]["placements"] == ["S(0)", "S(2)"]
    assert data["param_bytes_per_rank"] == plan.param_bytes_per_rank
    assert json.loads(plan.to_json(indent=None)) == data


# --------------------------------------------------------------------------- ConfigErrors

SMALL = dict(dim=64, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=128)


def small_plan(mesh: MeshSpec, rules: Rules | None = None, **cfg):
    return make_plan(llama.param_specs(LlamaConfig(**{**SMALL, **cfg})), rules or Rules.default(sp=True), mesh)


def _bad_precision():
    from meshtrain.train.step import make_train_step

    make_train_step(build("llama", LlamaConfig(**SMALL)), precision="fp12")


def _bad_schedule():
    from meshtrain.train.lr_schedule import LRSchedule

    LRSchedule(lr=1e-3, kind="cosin")


def _bad_warmup():
    from meshtrain.train.lr_schedule import LRSchedule

    LRSchedule(lr=1e-3, warmup_steps=-1, total_steps=10)


# id -> (what raises, substrings the message must contain: field/parameter, sizes, fix)
CONFIG_ERRORS = {
    "heads_not_divisible_by_tp": (
        lambda: small_plan(MeshSpec(tp=16), n_heads=8, n_kv_heads=8, dim=128, vocab_size=256, ffn_dim=128),
        ["layers.0.attn.wq dim 0", "q_heads: 8 heads of 16", "split 16 ways over tp=16",
         "choose tp dividing model.n_heads=8"]),
    "kv_heads_not_divisible_by_tp": (
        lambda: small_plan(MeshSpec(tp=4), n_kv_heads=2),
        ["layers.0.attn.wk dim 0", "kv_heads: 2 heads of 8", "split 4 ways over tp=4",
         "choose tp dividing model.n_kv_heads=2"]),
    "vocab_not_divisible_by_tp": (
        lambda: small_plan(MeshSpec(tp=4), vocab_size=130),
        ["tok_emb dim 0", "vocab: size 130", "split 4 ways over tp=4", "choose tp dividing model.vocab_size=130"]),
    "ffn_not_divisible_by_tp": (
        lambda: small_plan(MeshSpec(tp=4), ffn_dim=98),
        ["layers.0.mlp.w_gate dim 0", "mlp: size 98", "split 4 ways over tp=4",
         "choose tp dividing model.ffn_dim=98"]),
    "ffn_not_divisible_by_nested_tp_fsdp": (
        lambda: small_plan(MeshSpec(fsdp=2, tp=2), Rules(Rules.default().mapping,
                                                         {"*.mlp.*": {"mlp": ("tp", "fsdp")}}), ffn_dim=98),
        ["layers.0.mlp.w_gate dim 0", "mlp: size 98", "split 4 ways over tp=2 x fsdp=2",
         "tp x fsdp divides model.ffn_dim=98", "fewer mesh axes"]),
    "axis_product_not_world": (
        lambda: MeshSpec(fsdp=4, tp=2).resolve(16),
        ["fsdp=4 x tp=2", "multiply to 8", "world size is 16", "make them multiply to 16, set one axis to -1"]),
    "axis_product_not_world_make_plan": (
        lambda: make_plan(llama.param_specs(LlamaConfig(**SMALL)), Rules.default(), MeshSpec(fsdp=4, tp=2), world=4),
        ["fsdp=4 x tp=2", "multiply to 8", "world size is 4"]),
    "two_fill_axes": (
        lambda: MeshSpec(fsdp=-1, tp=-1).resolve(16),
        ["parallel.fsdp=-1", "parallel.tp=-1", "only one axis may be -1", "give all but one of them a fixed size"]),
    "world_not_divisible_by_fixed_axes": (
        lambda: MeshSpec(fsdp=-1, tp=4).resolve(10),
        ["parallel.fsdp=-1", "world size 10", "tp=4", "multiply to 4", "product divides 10"]),
    "non_positive_size": (
        lambda: MeshSpec(tp=0).resolve(4),
        ["parallel.tp=0", "must be positive, or -1 to fill"]),
    "negative_size": (
        lambda: MeshSpec(fsdp=-2).resolve(4),
        ["parallel.fsdp=-2", "must be positive, or -1 to fill"]),
    "ep_not_dividing_fsdp_cp": (
        lambda: MeshSpec(fsdp=4, cp=2, ep=3).resolve(8),
        ["parallel.ep=3", "fsdp x cp = 4 x 2 = 8", "choose an ep that divides 8"]),
    "unknown_logical_axis_in_rules": (
        lambda: Rules({"mpl": ("tp",)}),
        ["rules", "unknown logical axis 'mpl'", "known axes are", "mlp"]),
    "unknown_logical_axis_in_overrides": (
        lambda: Rules(Rules.default().mapping, {"layers.*": {"hidden": ("tp",)}}),
        ["rules.overrides['layers.*']", "unknown logical axis 'hidden'", "known axes are", "mlp"]),
    "unknown_mesh_axis_in_rules": (
        lambda: Rules({"mlp": ("tensor",)}),
        ["rules['mlp']", "unknown mesh axis 'tensor'", "mesh axes are pp, dp, fsdp, cp, tp"]),
    "unknown_mesh_axis_in_overrides": (
        lambda: Rules({}, {"*.wq": {"q_heads": ("model",)}}),
        ["rules.overrides['*.wq']['q_heads']", "unknown mesh axis 'model'", "mesh axes are"]),
    "bad_lr_schedule": (
        _bad_schedule, ["train.lr_schedule='cosin'", "choose one of cosine, linear, wsd, constant"]),
    "bad_warmup": (
        _bad_warmup, ["train.warmup_steps=-1", "at least 0"]),
    "bad_precision": (
        _bad_precision, ["train.precision='fp12'", "choose one of fp32, bf16, fp16, fp8"]),
    "dim_not_divisible_by_heads": (
        lambda: LlamaConfig(dim=100, n_heads=8, n_kv_heads=4),
        ["model.dim=100", "model.n_heads=8", "choose a dim that is a multiple of n_heads"]),
    "heads_not_divisible_by_kv_heads": (
        lambda: LlamaConfig(dim=96, n_heads=12, n_kv_heads=8),
        ["model.n_heads=12", "model.n_kv_heads=8", "whole groups of query heads per kv head"]),
    "odd_head_dim": (
        lambda: LlamaConfig(dim=24, n_heads=8, n_kv_heads=4),
        ["head dim 3", "model.dim / model.n_heads", "even head dim"]),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_error(case):
    make, substrings = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError) as info:
        make()
    message = str(info.value)
    missing = [s for s in substrings if s not in message]
    assert not missing, f"message {message!r} lacks {missing}"


def test_config_error_is_value_error():
    # The CLI catches ConfigError; other callers may catch ValueError.
    assert issubclass(ConfigError, ValueError)


def test_make_plan_resolves_fill_axis():
    plan = make_plan(llama.param_specs(LlamaConfig(**SMALL)), Rules.default(), MeshSpec(fsdp=-1, tp=2), world=16)
    assert (plan.mesh.fsdp, plan.mesh.tp, plan.mesh.world) == (8, 2, 16)
    with pytest.raises(ConfigError, match=re.escape("parallel.fsdp=-1 cannot fill world size 15")):
        make_plan(llama.param_specs(LlamaConfig(**SMALL)), Rules.default(), MeshSpec(fsdp=-1, tp=2), world=15)
