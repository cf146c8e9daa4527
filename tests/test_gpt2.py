"""GPT-2 family: the pure forward against an independent nn.Module GPT-2, and the
sharded training step (fsdp x tp with sequence parallelism) against one process."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from meshtrain.errors import ConfigError
from meshtrain.models import FAMILIES, LocalContext, ModelDef, ParamSpec, build, gpt2
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks
from meshtrain.train.optim import AdamW
from meshtrain.train.step import TrainState, make_train_step


# --- an independent GPT-2, written the way the original (and Hugging Face) does it ------

class _Block(nn.Module):
    def __init__(self, dim, n_heads, ffn_dim, eps):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.c_attn = nn.Linear(dim, 3 * dim)  # fused q, k, v
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.c_fc = nn.Linear(dim, ffn_dim)
        self.mlp_proj = nn.Linear(ffn_dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.n_heads
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, hd).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(att)
        h = self.c_fc(self.ln_2(x))
        # GELU, tanh approximation, written out as in the GPT-2 code.
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h.pow(3))))
        return x + self.mlp_proj(h)


class _RefGPT2(nn.Module):
    def __init__(self, cfg: gpt2.GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg.dim, cfg.n_heads, cfg.ffn_dim, cfg.norm_eps)
                                    for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@torch.no_grad()
def _load_reference(cfg, params) -> _RefGPT2:
    ref = _RefGPT2(cfg)
    ref.wte.weight.copy_(params["tok_emb"])
    ref.wpe.weight.copy_(params["pos_emb"])
    for i, blk in enumerate(ref.blocks):
        p = f"layers.{i}."
        blk.ln_1.weight.copy_(params[p + "attn_norm"])
        blk.ln_1.bias.copy_(params[p + "attn_norm_bias"])
        blk.c_attn.weight.copy_(torch.cat([params[p + f"attn.w{w}"] for w in "qkv"]))
        blk.c_attn.bias.copy_(torch.cat([params[p + f"attn.b{w}"] for w in "qkv"]))
        blk.c_proj.weight.copy_(params[p + "attn.wo"])
        blk.c_proj.bias.copy_(params[p + "attn.bo"])
        blk.ln_2.weight.copy_(params[p + "mlp_norm"])
        blk.ln_2.bias.copy_(params[p + "mlp_norm_bias"])
        blk.c_fc.weight.copy_(params[p + "mlp.w_up"])
        blk.c_fc.bias.copy_(params[p + "mlp.b_up"])
        blk.mlp_proj.weight.copy_(params[p + "mlp.w_down"])
        blk.mlp_proj.bias.copy_(params[p + "mlp.b_down"])
    ref.ln_f.weight.copy_(params["norm"])
    ref.ln_f.bias.copy_(params["norm_bias"])
    if not cfg.tie_embeddings:
        ref.lm_head.weight.copy_(params["output"])
    return ref


def _random_params(specs, seed=0):
    """Every parameter random, norm scales around 1 and biases nonzero, so a bias or
    norm used wrongly (or not at all) shows in the logits."""
    params = {}
    for name, spec in specs.items():
        value = init_slice(dataclasses.replace(spec, init="normal", std=0.1), name, seed)
        params[name] = value + 1.0 if spec.init == "ones" else value
    return params


# --- single device ---------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
def test_forward_matches_reference_module(tie):
    cfg = gpt2.GPT2Config(dim=48, n_layers=3, n_heads=3, ffn_dim=100, vocab_size=131, max_seq_len=23,
                          tie_embeddings=tie)
    model = build("gpt2", cfg)
    params = _random_params(model.specs)
    assert ("output" in params) == (not tie)
    tokens = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    logits = model.forward(params, tokens, LocalContext())
    assert logits.shape == (3, 17, cfg.vocab_size)
    ref = _load_reference(cfg, params)
    n_ref = sum(t.numel() for t in ref.parameters())
    assert n_ref == sum(p.numel() for p in params.values())  # nothing unused, nothing missing
    with torch.no_grad():
        expected = ref(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_specs_and_init():
    cfg = gpt2.GPT2Config(dim=64, n_layers=6, n_heads=4, vocab_size=97, max_seq_len=40)
    assert cfg.ffn_dim == 256
    specs = gpt2.param_specs(cfg)
    assert specs["pos_emb"].shape == (40, 64) and specs["pos_emb"].axes == ("positions", "embed")
    assert "output" not in specs
    assert specs["layers.0.attn.wq"].units == (16, 1) and specs["layers.0.attn.bq"].units == (16,)
    assert specs["layers.5.mlp.b_up"].axes == ("mlp",)
    from meshtrain.layout.rules import LOGICAL_AXES

    assert {a for s in specs.values() for a in s.axes} <= set(LOGICAL_AXES)
    for name, spec in specs.items():
        if name.endswith(("norm",)):
            assert spec.init == "ones" and spec.axes == ("norm",)
        elif name.endswith("norm_bias") or ".b" in name:
            assert spec.init == "zeros", name
    out_std = 0.02 / math.sqrt(12)
    for name in ("layers.3.attn.wo", "layers.3.mlp.w_down"):
        assert specs[name].std == pytest.approx(out_std)
    assert specs["layers.3.attn.wq"].std == 0.02
    assert gpt2.GPT2Config(dim=64, n_heads=4, ffn_dim=100).ffn_dim == 100
    assert FAMILIES["gpt2"] is gpt2.FAMILY


def test_gpt2_124m_preset():
    cfg = gpt2.PRESETS["gpt2"]
    n = sum(s.numel for s in gpt2.param_specs(cfg).values())
    assert n == 124_439_808  # the published GPT-2 small count (tied embeddings)
    assert "tiny" in gpt2.PRESETS


def test_config_errors():
    with pytest.raises(ConfigError, match=r"model\.dim=50.*model\.n_heads=3"):
        gpt2.GPT2Config(dim=50, n_heads=3)
    with pytest.raises(ConfigError, match=r"model\.n_heads"):
        gpt2.GPT2Config(n_heads=0)
    cfg = gpt2.GPT2Config(dim=16, n_layers=1, n_heads=2, vocab_size=11, max_seq_len=8)
    model = build("gpt2", cfg)
    params = {n: init_slice(s, n, 0) for n, s in model.specs.items()}
    with pytest.raises(ConfigError, match=r"max_seq_len=8"):
        model.forward(params, torch.zeros(1, 9, dtype=torch.long), LocalContext())


# --- fsdp=2 x tp=2 with sequence parallelism against one process -----------------------

CFG = gpt2.GPT2Config(dim=48, n_layers=2, n_heads=4, ffn_dim=100, vocab_size=130, max_seq_len=24,
                      tie_embeddings=True)
STEPS = 10
LR = 3e-4


def _biased(spec: ParamSpec) -> ParamSpec:
    # Biases start at zero in GPT-2; start them random here so their layouts matter from step 1.
    return dataclasses.replace(spec, init="normal", std=0.05) if spec.init == "zeros" else spec


# The gpt2 family with random-start biases, importable by the ranks.
_GPT2_RANDOM_BIAS = dataclasses.replace(
    gpt2.FAMILY, param_specs=lambda cfg: {n: _biased(s) for n, s in gpt2.param_specs(cfg).items()})


def _model(tie: bool) -> ModelDef:
    return ModelDef(_GPT2_RANDOM_BIAS, dataclasses.replace(CFG, tie_embeddings=tie))


def _batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        t = torch.randint(0, CFG.vocab_size, (2, 4, 17), generator=g)  # (micro, batch, seq + 1)
        yield {"tokens": t[..., :-1], "targets": t[..., 1:]}


def _train_single(tie: bool):
    model = _model(tie)
    params = {n: init_slice(s, n, 0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, optimizer=AdamW(lr=LR))
    state = TrainState.create(params)
    losses = [step(state, b)["loss"] for b in _batches()]
    return losses, {n: p.detach() for n, p in params.items()}


def _train_sharded_both():
    """Tied and untied in one launch of the ranks (the launch costs more than the runs)."""
    return {tie: _train_sharded(tie) for tie in (True, False)}


def _train_sharded(tie: bool):
    import torch.distributed as dist

    from meshtrain.parallel.init import init_params
    from meshtrain.layout.mesh import MeshSpec
    from meshtrain.layout.plan import make_plan
    from meshtrain.layout.rules import Rules

    model = _model(tie)
    plan = make_plan(model.specs, Rules.default(sp=True), MeshSpec(fsdp=2, tp=2), world=dist.get_world_size())
    mesh = plan.mesh.build()
    params = init_params(plan, mesh, seed=0)
    step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=LR))
    state = TrainState.create(params)
    losses = [step(state, b)["loss"] for b in _batches()]
    return losses, {n: p.full_tensor().detach() for n, p in params.items()}


@pytest.mark.slow
def test_fsdp_tp_sp_matches_single_process():
    results = run_ranks(_train_sharded_both, 4)
    for tie in (True, False):
        ref_losses, ref_params = _train_single(tie)
        _check_same_training(ref_losses, ref_params, [r[tie] for r in results])
        # The run must have trained: every parameter moved, including the biases.
        start = {n: init_slice(s, n, 0) for n, s in _model(tie).specs.items()}
        assert all(not torch.equal(ref_params[n], start[n]) for n in start)
        # The key bias adds q.bk to every score of a query, which softmax ignores: its
        # gradient is zero in exact arithmetic and rounding noise in practice, which AdamW
        # turns into steps far below lr (measured: bk moves <= 7.7e-7 in 10 steps, bq
        # >= 1.8e-3). A forward that made bk matter would move it by ~lr per step.
        for name in start:
            moved = (ref_params[name] - start[name]).abs().max().item()
            if name.endswith(".attn.bk"):
                assert moved < 1e-5, (name, moved)
            elif name.endswith(".attn.bq"):
                assert moved > 1e-3, (name, moved)


def _check_same_training(ref_losses, ref_params, results):
    for rank, (losses, params) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert params.keys() == ref_params.keys()
        for name in params:
            # Measured max |difference| 2.7e-7 (7.7e-7 for the key bias, whose update is
            # rounding noise scaled by AdamW's 1/eps: see test_fsdp_tp_sp_matches_single_process).
            torch.testing.assert_close(params[name], ref_params[name], atol=1e-5, rtol=0,
                                       msg=lambda m, name=name: f"rank {rank} {name}: {m}")
