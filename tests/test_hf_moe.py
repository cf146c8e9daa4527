"""Hugging Face interop of the llama family's mixture-of-experts and Qwen3 features:
export as MixtralForCausalLM / Qwen3MoeForCausalLM / Qwen3ForCausalLM (logits compared
with transformers in fp32), import of what transformers' save_pretrained writes (the
hub's per-expert layout and the fused one), reading only the experts asked for, the
streamed export of a DCP checkpoint, and the refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshtrain.config import DataConfig, ModelConfig, RunConfig
from meshtrain.errors import ConfigError
from meshtrain.interop import export as hf_export
from meshtrain.interop import hf
from meshtrain.interop import load as hf_load
from meshtrain.interop.hf_config import _model_fields
from meshtrain.interop.hf import (from_hf_config, load_hf_params, read_hf_config, save_hf,
                                  to_hf_config)
from meshtrain.models import LocalContext, build
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.moe import MoeConfig
from meshtrain.models.spec import init_slice
from meshtrain.run.export import export_checkpoint
from meshtrain import checkpoint as ckpt
from meshtrain.train.step import TrainState

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
MOE = MoeConfig(num_experts=4, top_k=2, expert_ffn_dim=32)
MIXTRAL = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100, max_seq_len=64,
                      moe=MOE)
# Qwen3-MoE: block 0 dense, a head dim of its own (24, not 64 / 4), q/k norms, and a single
# expert weighted by its probability in the second variant.
QWEN3_MOE = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100, max_seq_len=64,
                        qk_norm=True, attn_head_dim=24, norm_eps=1e-6,
                        moe=dataclasses.replace(MOE, layers="1:", norm_topk=False))


def _params(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random parameters, norms moved off their ones; routers scaled up so that the
    choice of experts is decisive (a swapped expert or router row shows in the logits)."""
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, spec in build("llama", cfg).specs.items():
        t = init_slice(spec, name, seed)
        if spec.init != "normal":
            t = t + 0.2 * torch.randn(spec.shape, generator=g)
        out[name] = t * 20 if name.endswith("moe.router") else t
    return out


def _ours(cfg, params, tokens) -> torch.Tensor:
    with torch.no_grad():
        return build("llama", cfg).forward(params, tokens, LocalContext())


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def _hf_load(directory: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _family(fields: dict):
    return RunConfig(model=ModelConfig(**fields)).family_config()


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("cfg, cls", [(MIXTRAL, "MixtralForCausalLM"), (QWEN3_MOE, "Qwen3MoeForCausalLM")],
                         ids=["mixtral", "qwen3_moe"])
def test_export_loads_in_transformers_and_imports_back(tmp_path, cfg, cls):
    params = _params(cfg)
    save_hf(params, "llama", cfg, tmp_path, dtype="fp32")
    files = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [cls] and config["num_experts_per_tok"] == 2
    if cls == "MixtralForCausalLM":  # the hub layout: one tensor per expert and weight
        down = files["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
        assert torch.equal(down, params["layers.1.moe.w_down"][3])
        assert torch.equal(files["model.layers.0.block_sparse_moe.gate.weight"], params["layers.0.moe.router"])
        assert (config["num_local_experts"], config["intermediate_size"]) == (4, 32)
    else:
        assert torch.equal(files["model.layers.1.mlp.experts.2.up_proj.weight"], params["layers.1.moe.w_up"][2])
        assert torch.equal(files["model.layers.0.mlp.gate_proj.weight"], params["layers.0.mlp.w_gate"])
        assert torch.equal(files["model.layers.1.self_attn.k_norm.weight"], params["layers.1.attn.k_norm"])
        assert (config["mlp_only_layers"], config["decoder_sparse_step"], config["norm_topk_prob"]) == ([0], 1, False)
        assert (config["head_dim"], config["intermediate_size"], config["moe_intermediate_size"]) == (24, 96, 32)
    assert len(files) == sum(4 if n.endswith(("moe.w_gate", "moe.w_up", "moe.w_down")) else 1 for n in params)

    model = _hf_load(tmp_path)
    assert type(model).__name__ == cls
    experts = model.model.layers[1].mlp.experts  # transformers fuses gate and up in memory
    assert torch.equal(experts.gate_up_proj, torch.cat([params["layers.1.moe.w_gate"], params["layers.1.moe.w_up"]], 1))
    tokens = _tokens(cfg.vocab_size)
    ours = _ours(cfg, params, tokens)
    diff = (_hf_logits(model, tokens) - ours).abs().max().item()
    assert diff < ATOL, f"{cls}: max |logit difference| {diff}"
    # The MoE blocks matter: experts 0 and 1 swapped give other logits.
    swapped = {**params, "layers.1.moe.w_down": params["layers.1.moe.w_down"][[1, 0, 2, 3]]}
    assert (_ours(cfg, swapped, tokens) - ours).abs().max() > 100 * ATOL

    back = load_hf_params(tmp_path, "llama", cfg)  # checks config.json against cfg too
    assert back.keys() == params.keys() and all(torch.equal(back[n], params[n]) for n in params)
    fields = read_hf_config(tmp_path)
    again = _family(fields)
    assert again.moe_layers == cfg.moe_layers and again.head_dim == cfg.head_dim and again.qk_norm == cfg.qk_norm
    same = ("num_experts", "top_k", "expert_ffn_dim", "norm_topk", "router", "aux_coef")
    assert all(getattr(again.moe, k) == getattr(cfg.moe, k) for k in same)
    assert fields == {**_model_fields("llama", cfg), **({"ffn_dim": 32} if cls == "MixtralForCausalLM" else {}),
                      "moe": {**_model_fields("llama", cfg)["moe"], "layers": fields["moe"]["layers"]}}


def test_qwen3_dense_qk_norm_exports_as_qwen3(tmp_path):
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=100, max_seq_len=64,
                      qk_norm=True, attn_head_dim=24, tie_embeddings=True)
    params = _params(cfg)
    save_hf(params, "llama", cfg, tmp_path, dtype="fp32")
    model = _hf_load(tmp_path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    tokens = _tokens(100)
    diff = (_hf_logits(model, tokens) - _ours(cfg, params, tokens)).abs().max().item()
    assert diff < ATOL, f"max |logit difference| {diff}"
    assert read_hf_config(tmp_path) == _model_fields("llama", cfg)
    back = load_hf_params(tmp_path, "llama", cfg)
    assert all(torch.equal(back[n], params[n]) for n in params)


# --------------------------------------------------------------------------- import


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=90, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:  # experts in blocks 1 and 3 (decoder_sparse_step 2), renormalised top-2 gates
        config = transformers.Qwen3MoeConfig(
            hidden_size=64, intermediate_size=80, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, vocab_size=90, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=2, norm_topk_prob=True, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_import_from_transformers_both_expert_layouts(tmp_path, kind):
    model = _hf_model(kind)
    tokens = _tokens(90)
    expected = _hf_logits(model, tokens)
    model.save_pretrained(tmp_path / "hub")  # transformers 5 writes the hub's per-expert tensors
    model.save_pretrained(tmp_path / "fused", save_original_format=False)  # its in-memory fused ones
    hub_names = set(load_file(tmp_path / "hub" / "model.safetensors"))
    fused_names = set(load_file(tmp_path / "fused" / "model.safetensors"))
    experts = "block_sparse_moe.experts.3.w2.weight" if kind == "mixtral" else "mlp.experts.3.down_proj.weight"
    assert f"model.layers.1.{experts}" in hub_names and "model.layers.1.mlp.experts.gate_up_proj" in fused_names

    fields = read_hf_config(tmp_path / "hub")
    moe = fields["moe"]
    assert (moe["num_experts"], moe["top_k"], moe["expert_ffn_dim"], moe["norm_topk"]) == (4, 2, 32, True)
    if kind == "mixtral":
        assert moe["layers"] == "all" and fields["rope_theta"] == 1e6 and "qk_norm" not in fields
    else:
        assert moe["layers"] == "1::2" and fields["qk_norm"] and fields["head_dim"] == 24 and fields["ffn_dim"] == 80
    cfg = _family(fields)
    params = load_hf_params(tmp_path / "hub", "llama", cfg)
    diff = (_ours(cfg, params, tokens) - expected).abs().max().item()
    assert diff < ATOL, f"{kind}: max |logit difference| {diff}"
    fused = load_hf_params(tmp_path / "fused", "llama", cfg)
    assert all(torch.equal(fused[n], params[n]) for n in params)


def test_reads_only_the_experts_asked_for(tmp_path):
    """A rank holding experts [1, 3) of a stacked weight reads those experts' tensors."""
    params = _params(MIXTRAL)
    save_hf(params, "llama", MIXTRAL, tmp_path, dtype="fp32")
    layout = hf.hf_layout("llama", MIXTRAL)
    read: list[str] = []
    with hf_load._WeightFiles(tmp_path) as files:
        where = files.match(layout, "llama", False)
        real = files.read
        files.read = lambda w, piece, index: read.append(w[1]) or real(w, piece, index)
        pieces = hf_load._pieces_of(layout)["layers.1.moe.w_up"]
        block = hf_load._read_param(files, where, pieces, (slice(1, 3), slice(8, 24), slice(0, 64)))
    assert torch.equal(block, params["layers.1.moe.w_up"][1:3, 8:24])
    assert read == [f"model.layers.1.block_sparse_moe.experts.{j}.w3.weight" for j in (1, 2)]


def test_init_from_checks_structure_not_training_fields(tmp_path):
    params = _params(MIXTRAL)
    save_hf(params, "llama", MIXTRAL, tmp_path, dtype="fp32")
    # Balancing and capacity are training choices; aux-free starts its expert bias at 0.
    trained = dataclasses.replace(MIXTRAL, moe=dataclasses.replace(MOE, balance="aux_free", aux_coef=0.0,
                                                                   capacity_factor=1.25, z_loss_coef=1e-3))
    got = load_hf_params(tmp_path, "llama", trained)
    assert torch.equal(got["layers.0.moe.expert_bias"], torch.zeros(4))
    tokens = _tokens(100)
    assert torch.allclose(_ours(MIXTRAL, params, tokens), _ours(MIXTRAL, got, tokens))
    for change, key in (({"top_k": 3}, "model.moe.top_k=2 but the model config has model.moe.top_k=3"),
                        ({"layers": "1:"}, 'model.moe.layers="all" but the model config has model.moe.layers="1:"')):
        other = dataclasses.replace(MIXTRAL, moe=dataclasses.replace(MOE, **change))
        with pytest.raises(ConfigError, match=key):
            load_hf_params(tmp_path, "llama", other)
    with pytest.raises(ConfigError, match="model.qk_norm=false but the model config has model.qk_norm=true"):
        load_hf_params(tmp_path, "llama", dataclasses.replace(MIXTRAL, qk_norm=True))


def test_export_checkpoint_reads_each_expert_stack_once(tmp_path, monkeypatch):
    params = _params(QWEN3_MOE)
    run = RunConfig(model=ModelConfig(**_model_fields("llama", QWEN3_MOE)), data=DataConfig(tokenizer="bytes"))
    ckpt.save(tmp_path / "run" / "checkpoints", 2, TrainState.create(params), {"config": run.to_dict()}, keep_last=1)
    reads: list[str] = []
    real = hf_export._read_checkpoint_param
    monkeypatch.setattr(hf_export, "_read_checkpoint_param", lambda path, name, *a: reads.append(name) or real(path, name, *a))
    export_checkpoint(tmp_path / "run", tmp_path / "out", dtype="fp32")
    assert sorted(reads) == sorted(params)  # 4 experts per stack, one read each
    save_hf(params, "llama", QWEN3_MOE, tmp_path / "memory", dtype="fp32", tokenizer="bytes")
    exported, memory = (tmp_path / d / "model.safetensors" for d in ("out", "memory"))
    assert exported.read_bytes() == memory.read_bytes()


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("cfg, key", [
    (dict(router="sigmoid"), "model.moe.router=\"sigmoid\" cannot be exported"),
    (dict(shared_experts=1), "model.moe.shared_experts=1"),
    (dict(route_scale=2.5), "model.moe.route_scale=2.5 cannot be exported"),
    (dict(balance="aux_free"), "model.moe.balance=\"aux_free\" cannot be exported"),
    (dict(layers="1:"), "model.moe.layers=\"1:\" leaves blocks \\[0\\] dense"),
    (dict(top_k=1), "model.moe.top_k=1 cannot be exported as Mixtral"),
    (dict(norm_topk=False), "model.moe.norm_topk=false cannot be exported as Mixtral"),
], ids=["sigmoid", "shared", "route_scale", "aux_free", "dense_block", "top1", "no_norm_topk"])
def test_export_refusals_name_the_field(tmp_path, cfg, key):
    model = dataclasses.replace(MIXTRAL, moe=dataclasses.replace(MOE, **cfg))
    with pytest.raises(ConfigError, match=key) as e:
        save_hf(_params(model), "llama", model, tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    if "top_k" in cfg or "norm_topk" in cfg:  # Qwen3-MoE holds both
        qwen = dataclasses.replace(model, qk_norm=True)
        assert to_hf_config("llama", qwen)["norm_topk_prob"] is False


@pytest.mark.parametrize("base, change, key", [
    ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok=1 is not supported"),
    ("mixtral", {"sliding_window": 16}, "sliding_window=16 is not supported"),
    ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob=true with num_experts_per_tok=1"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window=16 is not supported"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=true is not supported"),
    ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers=\"0\" must be a list"),
])
def test_import_refusals(base, change, key):
    good = to_hf_config("llama", MIXTRAL if base == "mixtral" else QWEN3_MOE)
    with pytest.raises(ConfigError, match=key) as e:
        from_hf_config({**good, **change})
    assert "\n" not in str(e.value)
    # A window as long as the context is no window.
    assert from_hf_config({**good, "use_sliding_window": True, "sliding_window": 64}) == from_hf_config(good)


# --------------------------------------------------------------------------- 2 ranks, ep 2


def _expert_parallel_ranks(directory: str, balance: str):
    """On each of 2 ranks (fsdp 2, ep 2): load the Mixtral directory by plan into a model
    balanced by `balance` while counting the bytes read, and compare every local shard
    with the full tensor's."""
    from meshtrain.interop import load as hf_load
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from meshtrain.layout.mesh import MeshSpec
    from meshtrain.layout.plan import make_plan
    from meshtrain.layout.rules import Rules

    fields = read_hf_config(directory)
    cfg = _family({**fields, "moe": {**fields["moe"], "balance": balance}})
    full = load_hf_params(directory, "llama", cfg)
    plan = make_plan(build("llama", cfg).specs, Rules.default(), MeshSpec(fsdp=2, ep=2), world=dist.get_world_size())
    mesh = plan.mesh.build()
    read, real_open = {"bytes": 0, "names": set()}, hf_load.safe_open  # where the importer looks it up

    class Slice:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def __getitem__(self, index):
            t = self.inner[index]
            read["bytes"] += t.numel() * t.element_size()
            read["names"].add(self.name)
            return t

        def get_shape(self):
            return self.inner.get_shape()

        def get_dtype(self):
            return self.inner.get_dtype()

    class Handle:
        def __init__(self, inner):
            self.inner = inner

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name), name)

        def keys(self):
            return self.inner.keys()

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            return Handle(self.inner.__enter__())

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    hf_load.safe_open = CountingOpen
    try:
        params = load_hf_params(directory, "llama", cfg, plan, mesh)
    finally:
        hf_load.safe_open = real_open
    mismatched = [n for n, p in plan.params.items() if not torch.equal(
        params[n].to_local(), distribute_tensor(full[n], mesh, p.placements, src_data_rank=None).to_local())]
    experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in read["names"] if ".experts." in n})
    return {"mismatched": mismatched, "experts": experts, "read": read["bytes"],
            "shard_bytes": sum(params[n].to_local().numel() * 4 for n in params if not n.endswith("expert_bias")),
            "grad": {n: params[n].requires_grad for n in params if "moe" in n},
            "zero_bias": all(torch.equal(params[f"layers.{i}.moe.expert_bias"].full_tensor(), torch.zeros(4))
                             for i in range(cfg.n_layers))}


@pytest.mark.slow
def test_expert_parallel_import_reads_only_own_experts(tmp_path):
    from meshtrain.testing import run_ranks

    save_hf(_params(MIXTRAL), "llama", MIXTRAL, tmp_path, dtype="fp32")
    # Fine-tuned aux-free: the expert bias is in no file; it starts at 0 and is not trainable.
    results = run_ranks(_expert_parallel_ranks, 2, str(tmp_path), "aux_free", timeout=120)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], f"rank {rank}: local shards differ from the full tensors"
        assert r["experts"] == [2 * rank, 2 * rank + 1], f"rank {rank} read experts {r['experts']}"
        assert r["read"] == r["shard_bytes"], f"rank {rank}: read {r['read']} B for {r['shard_bytes']} B"
        assert r["grad"]["layers.1.moe.expert_bias"] is False and r["grad"]["layers.1.moe.w_up"] is True
        assert r["zero_bias"]
