"""Strided sharding (_StridedShard) on real gloo ranks.

Mesh fsdp=2 x tp=2; the MLP weights put their "mlp" dim on ("tp", "fsdp") — tp the
major split, although it is the later mesh dim — so their fsdp mesh dim holds
_StridedShard pieces. Checked: init values, each rank's local shard, and five training
steps against the single-process run.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.models import build
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.spec import init_slice
from meshtrain.layout.mesh import MeshSpec
from meshtrain.layout.plan import make_plan, placement_str
from meshtrain.layout.rules import Rules
from meshtrain.train.optim import AdamW
from meshtrain.train.step import TrainState, make_train_step

pytestmark = pytest.mark.slow

CFG = LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=100, vocab_size=130, max_seq_len=16)
SEED = 1234
MESH = MeshSpec(fsdp=2, tp=2)
STEPS, MICRO, BATCH, SEQ = 5, 2, 4, 8
STRIDED = [f"layers.{i}.mlp.{w}" for i in range(CFG.n_layers) for w in ("w_gate", "w_up", "w_down")]


def strided_rules() -> Rules:
    base = Rules.default(sp=True)
    # "embed": () so that w_down's mlp dim (dim 1) gets fsdp too: without it, embed (dim 0)
    # claims fsdp first and only w_gate / w_up would be strided.
    return Rules(base.mapping, {"layers.*.mlp.*": {"mlp": ("tp", "fsdp"), "embed": ()}})


def make_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, CFG.vocab_size, (MICRO, BATCH, SEQ), generator=g)
        targets = torch.randint(0, CFG.vocab_size, (MICRO, BATCH, SEQ), generator=g)
        targets[:, 0, :2] = -100  # some ignored targets
        out.append({"tokens": tokens, "targets": targets})
    return out


def _rank_main():
    import torch.distributed as dist

    from meshtrain.parallel.init import init_params

    model = build("llama", CFG)
    plan = make_plan(model.specs, strided_rules(), MESH, world=dist.get_world_size())
    mesh = plan.mesh.build()
    params = init_params(plan, mesh, seed=SEED)
    out = {
        "coord": tuple(mesh.get_coordinate()),  # (fsdp rank, tp rank)
        "placements": {n: [placement_str(x) for x in p.placements] for n, p in params.items()},
        "init_full": {n: p.full_tensor().detach().clone() for n, p in params.items()},
        "init_local": {n: p.to_local().detach().clone() for n, p in params.items()},
    }
    state = TrainState.create(params)
    step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=3e-4))
    metrics = [step(state, batch) for batch in make_batches()]
    out["losses"] = [m["loss"] for m in metrics]
    out["grad_norms"] = [m["grad_norm"] for m in metrics]
    out["final"] = {n: p.full_tensor().detach().clone() for n, p in state.params.items()}
    return out


@pytest.fixture(scope="module")
def ranks():
    from meshtrain.testing import run_ranks

    return run_ranks(_rank_main, MESH.world, timeout=600)


@pytest.fixture(scope="module")
def reference():
    model = build("llama", CFG)
    params = {n: init_slice(s, n, SEED).requires_grad_(True) for n, s in model.specs.items()}
    init = {n: p.detach().clone() for n, p in params.items()}
    state = TrainState.create(params)
    step = make_train_step(model, None, optimizer=AdamW(lr=3e-4))
    metrics = [step(state, batch) for batch in make_batches()]
    return {"init": init, "losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
            "final": {n: p.detach() for n, p in state.params.items()}}


def test_plan_is_strided():
    plan = make_plan(build("llama", CFG).specs, strided_rules(), MESH)
    assert plan.mesh.axes == ("fsdp", "tp")
    for name in STRIDED:
        d = 1 if name.endswith("w_down") else 0
        assert [placement_str(p) for p in plan.params[name].placements] == [f"SS({d},2)", f"S({d})"], name
        assert plan.params[name].local_shape[d] == CFG.ffn_dim // 4
    assert [placement_str(p) for p in plan.params["layers.0.attn.wq"].placements] == ["S(1)", "S(0)"]


def test_init_gathered_equals_single_process(ranks, reference):
    for r, out in enumerate(ranks):
        for name in STRIDED:
            assert out["placements"][name][0].startswith("SS("), (r, name, out["placements"][name])
        assert set(out["init_full"]) == set(reference["init"])
        for name, full in out["init_full"].items():
            assert torch.equal(full, reference["init"][name]), f"rank {r}: {name} differs after full_tensor()"


def test_strided_local_shards(ranks, reference):
    """Rank (r_fsdp, r_tp) holds tp-chunk r_tp of the mlp dim, then fsdp sub-chunk r_fsdp of it."""
    coords = sorted(out["coord"] for out in ranks)
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    tp, fsdp = MESH.tp, MESH.fsdp
    for out in ranks:
        r_fsdp, r_tp = out["coord"]
        for name in STRIDED:
            d = 1 if name.endswith("w_down") else 0
            full = reference["init"][name]
            n = full.shape[d]
            start = r_tp * (n // tp) + r_fsdp * (n // (tp * fsdp))
            expected = full.narrow(d, start, n // (tp * fsdp))
            got = out["init_local"][name]
            assert got.shape == expected.shape, (out["coord"], name, got.shape, expected.shape)
            assert torch.equal(got, expected), f"rank {out['coord']}: local shard of {name} is not rows " \
                                               f"{start}:{start + n // (tp * fsdp)} of dim {d}"
            # and not the plain left-to-right (fsdp-major) slice
            plain = full.narrow(d, (r_fsdp * tp + r_tp) * (n // (tp * fsdp)), n // (tp * fsdp))
            if r_fsdp != r_tp:
                assert not torch.equal(got, plain), (out["coord"], name)


def test_training_matches_single_process(ranks, reference):
    for out in ranks:
        # Worst parameters first, so that a mismatch points at its source.
        errors = sorted(((full - reference["final"][n]).abs().max().item(), n) for n, full in out["final"].items())
        worst = ", ".join(f"{n} {e:.2e}" for e, n in reversed(errors[-3:]))
        torch.testing.assert_close(torch.tensor(out["losses"], dtype=torch.float64),
                                   torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-5, atol=0,
                                   msg=lambda m: f"rank {out['coord']} losses {out['losses']} vs single-process "
                                                 f"{reference['losses']}; largest final param errors: {worst}: {m}")
        torch.testing.assert_close(torch.tensor(out["grad_norms"], dtype=torch.float64),
                                   torch.tensor(reference["grad_norms"], dtype=torch.float64), rtol=1e-5, atol=0)
        for name, full in out["final"].items():
            torch.testing.assert_close(full, reference["final"][name], atol=1e-5, rtol=0,
                                       msg=lambda m: f"rank {out['coord']}: {name} after {STEPS} steps: {m}")
    # the parameters moved, so the comparison is not vacuous
    assert any(not torch.equal(reference["final"][n], reference["init"][n]) for n in STRIDED)
    assert reference["losses"][-1] < reference["losses"][0]
