"""A model family defined here, registered the way models/__init__.py registers llama and
gpt2, goes through the same code as they do: it trains sharded (fsdp2 x tp2 + sp) equal to
one process, decodes with a KV cache through its own blocks, plans and dry-runs from a run
config, and its collective and memory estimates equal what its steps do — with no cost
code of its own: the estimators read its costs from its forward (models/recording.py).
It has no Hugging Face format, and export says so.

The family, "nope": RMSNorm, multi-head attention without positional encodings (NoPE:
causal attention alone tells positions apart), a GELU MLP without biases.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import ModelConfig
from meshtrain.config.schema import RunConfig
from meshtrain.errors import ConfigError
from meshtrain.estimate.dryrun import dry_run
from meshtrain.estimate.memory import per_rank_memory
from meshtrain.models import FAMILIES, Family, LocalContext, ModelDef, ParamSpec, build, register
from meshtrain.models.family import BLOCK_IN, RESIDUAL
from meshtrain.models.layers import rms_norm
from meshtrain.models.spec import init_slice
from meshtrain.layout.mesh import MeshSpec
from meshtrain.layout.plan import make_plan
from meshtrain.layout.rules import Rules
from meshtrain.testing import run_ranks
from meshtrain.train.optim import AdamW
from meshtrain.train.step import TrainState, make_train_step
from support.collectives import run_model_step
from support.comms import assert_same, estimate, totals
from support.memory import kept_instead


# ----------------------------------------------------------------------------- the family

@dataclass(frozen=True)
class NopeConfig:
    dim: int = 48
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 96
    vocab_size: int = 130
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")


def from_fields(m) -> NopeConfig:
    return NopeConfig(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, ffn_dim=m.ffn_dim or 4 * m.dim,
                      vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, norm_eps=m.norm_eps,
                      tie_embeddings=m.tie_embeddings)


def param_specs(cfg: NopeConfig) -> dict[str, ParamSpec]:
    d, f, hd = cfg.dim, cfg.ffn_dim, cfg.head_dim
    specs = {"tok_emb": ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=cfg.init_std,
                                  reused=cfg.tie_embeddings)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        specs[p + "attn_norm"] = ParamSpec((d,), ("norm",), init="ones")
        for w in "qkv":
            specs[p + f"attn.w{w}"] = ParamSpec((d, d), ("q_heads", "embed"), std=cfg.init_std, units=(hd, 1))
        specs[p + "attn.wo"] = ParamSpec((d, d), ("embed", "q_heads"), std=cfg.init_std, units=(1, hd))
        specs[p + "mlp_norm"] = ParamSpec((d,), ("norm",), init="ones")
        specs[p + "mlp.w_up"] = ParamSpec((f, d), ("mlp", "embed"), std=cfg.init_std)
        specs[p + "mlp.w_down"] = ParamSpec((d, f), ("embed", "mlp"), std=cfg.init_std)
    specs["norm"] = ParamSpec((d,), ("norm",), init="ones")
    if not cfg.tie_embeddings:
        specs["output"] = ParamSpec((cfg.vocab_size, d), ("vocab", "embed"), std=cfg.init_std)
    return specs


def _block(cfg, p, prefix, x, ctx):
    h = ctx.constrain(rms_norm(x, p[prefix + "attn_norm"], cfg.norm_eps), BLOCK_IN)
    q, k, v = (ctx.constrain(ctx.linear(h, p, prefix + f"attn.w{w}").unflatten(-1, (-1, cfg.head_dim)),
                             ("batch", "seq", "q_heads", None)) for w in "qkv")
    x = x + ctx.constrain(ctx.linear(ctx.attention(q, k, v).flatten(-2), p, prefix + "attn.wo"), RESIDUAL)
    h = ctx.constrain(rms_norm(x, p[prefix + "mlp_norm"], cfg.norm_eps), BLOCK_IN)
    up = F.gelu(ctx.linear(h, p, prefix + "mlp.w_up"), approximate="tanh")
    return x + ctx.constrain(ctx.linear(up, p, prefix + "mlp.w_down"), RESIDUAL)


def forward_stage(cfg, params, x, ctx, layers, first, last):
    p = ctx.bind(params)
    if first:
        x = ctx.constrain(ctx.embedding(ctx.constrain(x, ("batch", "seq")), p["tok_emb"]), RESIDUAL)
    for i in range(*layers):
        x = ctx.remat(_block, cfg, p, f"layers.{i}.", x, ctx)
    return head(cfg, p, x, ctx) if last else x


def head(cfg, p, x, ctx):
    x = ctx.constrain(rms_norm(x, p["norm"], cfg.norm_eps), BLOCK_IN)
    return ctx.constrain(ctx.linear(x, p, "tok_emb" if cfg.tie_embeddings else "output"), ("batch", "seq", "vocab"))


NOPE = register(Family(
    name="nope", config=NopeConfig, from_fields=from_fields, param_specs=param_specs, forward_stage=forward_stage,
    head=head, kv_heads=lambda cfg: cfg.n_heads, presets={"tiny": NopeConfig()}))

CFG = NopeConfig()
STEPS, LR = 4, 3e-4  # test_gpt2's rate: AdamW turns rounding noise in near-zero gradients into ~lr steps


# ----------------------------------------------------------------------------- training

def _batches():
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        t = torch.randint(0, CFG.vocab_size, (2, 4, 17), generator=g)  # (micro, batch, seq + 1)
        yield {"tokens": t[..., :-1], "targets": t[..., 1:]}


def _model(tie: bool) -> ModelDef:
    return build("nope", dataclasses.replace(CFG, tie_embeddings=tie))


def _train_single(tie: bool):
    model = _model(tie)
    params = {n: init_slice(s, n, 0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, optimizer=AdamW(lr=LR))
    state = TrainState.create(params)
    metrics = [step(state, b) for b in _batches()]
    return [(m["loss"], m["grad_norm"]) for m in metrics], {n: p.detach() for n, p in params.items()}


def _train_sharded(tie: bool):
    import torch.distributed as dist

    from meshtrain.parallel.init import init_params

    model = _model(tie)
    plan = make_plan(model.specs, Rules.default(sp=True), MeshSpec(fsdp=2, tp=2), world=dist.get_world_size())
    mesh = plan.mesh.build()
    params = init_params(plan, mesh, seed=0)
    step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=LR))
    state = TrainState.create(params)
    metrics = [step(state, b) for b in _batches()]
    return [(m["loss"], m["grad_norm"]) for m in metrics], {n: p.full_tensor().detach() for n, p in params.items()}


def _on_ranks():
    return {tie: _train_sharded(tie) for tie in (True, False)}


@pytest.mark.slow
def test_a_registered_family_trains_sharded_like_one_process():
    results = run_ranks(_on_ranks, 4)
    for tie in (True, False):
        ref_metrics, ref_params = _train_single(tie)
        start = {n: init_slice(s, n, 0) for n, s in _model(tie).specs.items()}
        assert all(not torch.equal(ref_params[n], start[n]) for n in start), "the reference did not train"
        for rank, (metrics, params) in enumerate(r[tie] for r in results):
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(metrics, ref_metrics)):
                assert loss == pytest.approx(ref_loss, rel=1e-5), (tie, rank, step)
                assert norm == pytest.approx(ref_norm, rel=1e-5), (tie, rank, step)
            for name in ref_params:
                torch.testing.assert_close(params[name], ref_params[name], atol=1e-5, rtol=0,
                                           msg=lambda m, name=name: f"tied={tie} rank {rank} {name}: {m}")


# ----------------------------------------------------------------------------- decoding

def test_a_registered_family_decodes_through_its_own_blocks():
    params = {n: init_slice(s, n, 0) for n, s in param_specs(CFG).items()}
    ids = torch.randint(0, CFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    full = NOPE.forward(CFG, params, ids, LocalContext())
    cache = NOPE.init_cache(CFG, 1, 12)
    steps = [NOPE.decode(CFG, params, ids[:, :7], cache, 0)]
    steps += [NOPE.decode(CFG, params, ids[:, i:i + 1], cache, i) for i in range(7, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- plans and estimates

def _run_config(**parallel) -> RunConfig:
    cfg = RunConfig()
    cfg.model = ModelConfig(arch="nope", dim=64, n_layers=4, n_heads=4, n_kv_heads=None, ffn_dim=128,
                            vocab_size=258, max_seq_len=64, rope_theta=None)
    cfg.train = dataclasses.replace(cfg.train, seq_len=64, micro_batch=1, global_batch=8)
    cfg.parallel = dataclasses.replace(cfg.parallel, **parallel)
    return cfg.validate()


def test_a_registered_family_plans_and_dry_runs_from_a_run_config():
    assert "nope" in FAMILIES
    cfg = _run_config(fsdp=2, tp=2, sp=True)
    assert cfg.family_config() == NopeConfig(dim=64, n_layers=4, n_heads=4, ffn_dim=128, vocab_size=258)
    run = dry_run(cfg, 4, "h100")
    assert run.model.startswith("nope, 4 layers"), run.model
    assert run.collectives and run.memory["peak"] > 0
    piped = dry_run(_run_config(pp=2, fsdp=2), 4, "h100")  # the partitioner's costs come from the family too
    assert len(piped.pipeline.stages) == 2
    with pytest.raises(ConfigError, match=r"model\.arch='nop': choose one of llama, gpt2, .*nope"):
        dataclasses.replace(cfg.model, arch="nop").family_config()


LAYOUTS = [("fsdp2", dict(fsdp=2), False, 2), ("tp2-sp", dict(tp=2), True, 2),
           ("fsdp2xtp2-sp", dict(fsdp=2, tp=2), True, 4)]


@pytest.mark.parametrize("bucket", ["param", "block"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name,layout,sp,world", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_a_registered_family_collective_estimate_equals_its_step(name, layout, sp, world, tie, bucket):
    model = _model(tie)
    rec = totals(run_model_step(model, layout, bucket=bucket, sp=sp, batch=4, seq=8, world=world))
    assert_same(estimate(model, layout, bucket=bucket, sp=sp, batch=4, seq=8, world=world), rec)


def _saved_bytes(model, plan, mesh, micro, seq):
    """Bytes autograd keeps for one forward + backward on this rank (saved-tensor hooks)."""
    from torch.distributed.tensor import DTensor

    from meshtrain.parallel.context import ShardedContext
    from meshtrain.parallel.init import init_params

    def storage(t):
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    params = init_params(plan, mesh, seed=0)
    ctx = ShardedContext(plan, mesh)
    g = torch.Generator().manual_seed(0)
    rows = micro * plan.mesh.dp * plan.mesh.fsdp
    tokens, targets = (torch.randint(0, model.cfg.vocab_size, (rows, seq), generator=g) for _ in range(2))
    before = {storage(p).data_ptr() for p in params.values()} | {tokens.untyped_storage().data_ptr(),
                                                                 targets.untyped_storage().data_ptr()}
    kept = {}

    def pack(t):
        s = storage(t)
        ptr = s.data_ptr()
        instead = kept_instead(ctx, t)  # gathered: the runtime keeps the shard instead
        if instead and instead[0] == "shard":  # (a weight's shard exists already)
            kept[storage(instead[1]).data_ptr()] = (storage(instead[1]).nbytes(), instead[1])
        elif not instead and ptr not in before:
            kept[ptr] = (s.nbytes(), t)  # hold the tensor: its address stays unique
        return t

    with ctx.regather_in_backward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ctx.cross_entropy_sum(model.forward(params, tokens, ctx), targets)
    loss.backward()
    return sum(n for n, _ in kept.values())


def _measure_activations():
    import torch.distributed as dist

    model = _model(False)
    plan = make_plan(model.specs, Rules.default(sp=True), MeshSpec(fsdp=2, tp=2), world=dist.get_world_size())
    return _saved_bytes(model, plan, plan.mesh.build(), 2, 16)


@pytest.mark.slow
def test_a_registered_family_memory_estimate_equals_its_saved_tensors():
    model = _model(False)
    plan = make_plan(model.specs, Rules.default(sp=True), MeshSpec(fsdp=2, tp=2), world=4)
    measured = max(run_ranks(_measure_activations, 4))
    est = per_rank_memory(plan, model, micro_batch=2, seq_len=16)
    assert est["activations"] == measured, (est, measured)
    assert math.isfinite(est["peak"])


def test_a_family_without_a_hugging_face_format_says_so_on_export(tmp_path):
    from meshtrain.interop.hf import save_hf

    params = {n: init_slice(s, n, 0) for n, s in param_specs(CFG).items()}
    with pytest.raises(ConfigError, match=r"model\.arch='nope': Hugging Face interop supports llama, gpt2"):
        save_hf(params, "nope", CFG, tmp_path / "out")
    assert not (tmp_path / "out").exists()
