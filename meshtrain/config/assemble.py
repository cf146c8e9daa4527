"""The assembler: a RunConfig turned into what a run is built from (the model, the
sharding rules, the mesh spec, the plan), and the checks that cross sections, which need
that model, plan or pipeline partition. run/ and estimate/ reach it through RunConfig's
methods of the same names, which import this module when first called: importing the
config, to parse or print one, does not import torch."""

from __future__ import annotations

import math

from ..data.config import BYTES_VOCAB
from ..errors import ConfigError, check_int
from ..interop.hf import to_hf_config
from ..layout.mesh import MeshSpec
from ..layout.plan import Plan, make_plan
from ..layout.rules import Rules
from ..models import ModelDef, build
from ..pipeline.partition import partition
from ..train.step import check_compile
from .schema import RunConfig, batch_message, check_micro_batches


def model_def(cfg: RunConfig) -> ModelDef:
    return build(cfg.model.arch, cfg.family_config())


def rules(cfg: RunConfig) -> Rules:
    return Rules.default(sp=cfg.parallel.sp)


def mesh_spec(cfg: RunConfig, fill: int | None = None) -> MeshSpec:
    """The MeshSpec of parallel.*; `fill` replaces a -1 axis (None keeps -1)."""
    p = cfg.parallel
    sizes = {a: getattr(p, a) for a in ("pp", "dp", "fsdp", "cp", "tp", "ep")}
    if fill is not None:
        sizes = {a: fill if n == -1 else n for a, n in sizes.items()}
    return MeshSpec(**sizes)


def plan(cfg: RunConfig, world: int | None, fill: int | None = None) -> Plan:
    """The Plan of `cfg` for `world` ranks (None: the product of the fixed sizes, with a
    -1 axis taken as `fill`)."""
    out = make_plan(model_def(cfg).specs, rules(cfg), mesh_spec(cfg, fill=fill), world=world,
                    cp_comm=cfg.parallel.cp_comm)
    if world is not None:  # the batch against the resolved data-parallel size, before any rank starts
        cfg.check_batch_at(out.mesh)
    if cfg.train.compile:
        check_compile(cfg.train.activation_checkpointing, sharded=out.mesh.world > 1)
    return out


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ConfigError for the first value that cannot work: each section's own fields,
    then the rules between sections, then what the planner sees."""
    if not isinstance(cfg.run_dir, str) or not cfg.run_dir:
        raise ConfigError("run_dir must be a non-empty path")
    check_int(cfg.seed, "seed", minimum=0)
    for section in (cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.checkpoint):
        section.check()
    _validate_across(cfg)
    p, t = cfg.parallel, cfg.train
    dp = p.dp * (1 if p.fsdp == -1 else p.fsdp)
    if t.global_batch % (t.micro_batch * dp):
        raise ConfigError(batch_message(t, p.dp, p.fsdp, dp))
    if p.pp > 1:
        _validate_pipeline(cfg)
    elif p.pp_layout is not None:  # one stage: a layout must say so, not be ignored
        partition(model_def(cfg), 1, 1, p.pp_layout, seq_len=t.seq_len, micro_batch=t.micro_batch)
    # Any other layout problem the planner can see before the world size is known (a
    # -1 axis taken as the least that lets ep fold from fsdp x cp).
    plan(cfg, world=None, fill=p.ep // math.gcd(p.ep, p.cp))
    return cfg


def _validate_across(cfg: RunConfig) -> None:
    """The rules between sections, in the order a user meets them."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                          f"use a shorter seq_len or raise max_seq_len")
    if cfg.data.tokenizer == "bytes" and m.vocab_size < BYTES_VOCAB:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the bytes tokenizer's "
                          f"vocabulary ({BYTES_VOCAB}: 256 bytes, BOS, EOS): set model.vocab_size to at least "
                          f"{BYTES_VOCAB}")
    if t.eval_every and not cfg.data.valid_fraction:
        raise ConfigError(f"train.eval_every={t.eval_every} needs a validation split, but "
                          "data.valid_fraction=0: set data.valid_fraction (e.g. 0.01), or train.eval_every 0")
    if p.tp > 1:
        _validate_tensor_parallel(cfg)
    if p.cp > 1:
        _validate_context_parallel(cfg)
    if p.ep > 1:
        _validate_experts(cfg)
    if p.fsdp_accumulate == "unsharded":
        _validate_unsharded_accumulation(cfg)
    if p.pp_keep_gathered:
        _validate_keep_gathered(cfg)
    if p.zero != 3:
        _validate_zero(cfg)
    if cfg.checkpoint.export:  # what Hugging Face cannot express fails now, not after training
        try:
            to_hf_config(m.arch, cfg.family_config())
        except ConfigError as e:
            raise ConfigError(f"checkpoint.export=true: {e}; or set checkpoint.export false") from None


def _validate_tensor_parallel(cfg: RunConfig) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    split = {"model.n_heads": m.n_heads, "model.vocab_size": m.vocab_size}
    if m.arch == "llama":
        split["model.n_kv_heads"] = m.n_kv_heads or m.n_heads
    split["model.ffn_dim"] = m.ffn_dim or 4 * m.dim
    if m.moe is not None:
        split["model.moe.expert_ffn_dim"] = m.moe.expert_ffn_dim
    for key, n in split.items():
        if n % p.tp:
            options = [d for d in range(1, max(split.values()) + 1) if all(v % d == 0 for v in split.values())]
            raise ConfigError(f"parallel.tp={p.tp} does not divide {key}={n} (tensor parallelism "
                              f"splits it evenly over the tp ranks): choose parallel.tp among "
                              f"{', '.join(map(str, options))}, or change {key}")
    if p.sp and t.seq_len % p.tp:
        raise ConfigError(f"parallel.sp=true shards the sequence over parallel.tp={p.tp} ranks, but "
                          f"train.seq_len={t.seq_len} is not divisible by {p.tp}: choose a seq_len "
                          f"that is a multiple of tp, or set parallel.sp false")


def _validate_experts(cfg: RunConfig) -> None:
    p, m = cfg.parallel, cfg.model
    if m.moe is None:
        raise ConfigError(f"parallel.ep={p.ep} shards experts, but model.moe is null (no experts): set "
                          "parallel.ep 1, or configure model.moe")
    if cfg.train.compile and m.mtp is not None and m.mtp.depth:
        raise ConfigError(f"train.compile=true with parallel.ep={p.ep} and model.mtp.depth={m.mtp.depth}: the compiled "
                          "step of a multi-token prediction module with experts split over ranks fails in torch "
                          "2.13's graph partitioner (docs/deepseek.md, Known gaps); set train.compile false, "
                          "parallel.ep 1, or model.mtp.depth 0")
    if m.moe.num_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide model.moe.num_experts={m.moe.num_experts}: each "
                          "ep rank holds an equal share of the experts; choose an ep that divides num_experts")


def _validate_unsharded_accumulation(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.pp > 1:  # with parallel.bucket param: Traffic.check
        raise ConfigError("parallel.fsdp_accumulate=unsharded does not work with parallel.pp > 1 (a pipeline "
                          "reduces every micro-batch; parallel.pp_keep_gathered true reduces once per step): set "
                          "parallel.fsdp_accumulate sharded")


def _validate_keep_gathered(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.pp < 2:
        raise ConfigError("parallel.pp_keep_gathered=true keeps a pipeline stage's weights gathered over its "
                          "micro-batches, but parallel.pp is 1: without a pipeline set parallel.reshard_after_forward "
                          "false and parallel.fsdp_accumulate unsharded, or set parallel.pp_keep_gathered false")
    if p.bucket == "param":
        raise ConfigError("parallel.pp_keep_gathered=true needs buckets: set parallel.bucket block (or a size in "
                          "MB), or parallel.pp_keep_gathered false")
    if p.fsdp == 1 and p.cp == 1:  # -1 may take 1 rank too: a note then (RunConfig.notes), at that world
        raise ConfigError("parallel.pp_keep_gathered=true keeps a pipeline stage's sharded weights gathered over its "
                          "micro-batches, but parallel.fsdp=1 and parallel.cp=1 shard none: set parallel.fsdp > 1 "
                          "(or -1, the remaining ranks), or parallel.pp_keep_gathered false")


def _validate_zero(cfg: RunConfig) -> None:
    p = cfg.parallel
    if p.bucket == "param":
        raise ConfigError(f"parallel.zero={p.zero} gathers and reduces the weights by bucket: set parallel.bucket "
                          "block (or a size in MB), or parallel.zero 3")
    if p.fsdp_accumulate == "unsharded":
        raise ConfigError(f"parallel.fsdp_accumulate=unsharded is ZeRO-3's way to reduce once per step; "
                          f"parallel.zero={p.zero} reduces the kept weights' gradients itself: set "
                          "parallel.fsdp_accumulate sharded")
    if p.fsdp == 1 and p.cp == 1:  # -1 may take 1 rank too: a note then (RunConfig.notes), at that world
        raise ConfigError(f"parallel.zero={p.zero} shards the optimizer state over fsdp x cp, but parallel.fsdp=1 and "
                          "parallel.cp=1 shard nothing: set parallel.fsdp > 1 (or -1, the remaining ranks), or "
                          "parallel.zero 3")


def _validate_context_parallel(cfg: RunConfig) -> None:
    p, t = cfg.parallel, cfg.train
    if t.seq_len % (2 * p.cp):
        raise ConfigError(f"parallel.cp={p.cp} splits each sequence into 2 x cp = {2 * p.cp} equal chunks "
                          f"(zigzag), but train.seq_len={t.seq_len} is not a multiple of {2 * p.cp}: choose a "
                          f"seq_len that is (e.g. {t.seq_len // (2 * p.cp) * 2 * p.cp or 2 * p.cp})")
    if p.sp and p.tp > 1 and t.seq_len % (p.cp * p.tp):
        raise ConfigError(f"parallel.sp=true splits each cp rank's positions over parallel.tp={p.tp} ranks: "
                          f"train.seq_len={t.seq_len} must be a multiple of cp x tp = {p.cp * p.tp}; choose "
                          "such a seq_len or set parallel.sp false")


def _validate_pipeline(cfg: RunConfig) -> None:
    """Pipeline rules that need the model and the batch: stages fit the layers, the
    schedule fits the micro-batch count (with fsdp=-1 the count is rechecked once the
    world size is known)."""
    p, t = cfg.parallel, cfg.train
    if p.pp_virtual > 1 and p.pp_schedule != "interleaved":
        raise ConfigError(f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp_schedule interleaved "
                          f"({p.pp_schedule} runs one stage per rank); set pp_virtual 1 or pp_schedule interleaved")
    if p.pp_schedule == "interleaved" and p.pp_virtual < 2:
        raise ConfigError("parallel.pp_schedule=interleaved needs parallel.pp_virtual >= 2 stages per rank; "
                          "set pp_virtual 2 (or use pp_schedule 1f1b)")
    dp = p.dp * (1 if p.fsdp == -1 else p.fsdp)
    if t.global_batch % (t.micro_batch * dp) == 0:
        check_micro_batches(p, t.global_batch // (t.micro_batch * dp), t, dp)
    partition(model_def(cfg), p.pp, p.pp_virtual, p.pp_layout, seq_len=t.seq_len, micro_batch=t.micro_batch)
