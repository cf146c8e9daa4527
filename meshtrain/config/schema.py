"""The run configuration: what `meshtrain fit` reads from YAML and the command line.

Every field has an attribute docstring (jsonargparse shows it in --help). `validate()`
raises ConfigError naming the key and the fix for any value that cannot work, and for
any feature the keys already name but that is not implemented yet: nothing is accepted
and then silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError
from .checks import (
    _check_int,
    _validate_checkpoint,
    _validate_data,
    _validate_model,
    _validate_parallel,
    _validate_train,
)
from .sections import (
    BYTES_VOCAB,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)


@dataclass
class RunConfig:
    """A training run."""

    run_dir: str = "runs/tiny"
    """Directory for config.yaml, plan.json, metrics.jsonl and checkpoints/."""
    seed: int = 0
    """Seed of the parameter initialisation and of the data sampler."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimisation loop."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""

    # --- conversion --------------------------------------------------------------

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "RunConfig":
        """Build from nested mappings (a parsed YAML file); unknown keys are ConfigErrors."""
        sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in sections:
                raise ConfigError(f"unknown config key {key!r}; known keys are {', '.join(sections)}")
            if key in SECTIONS:
                kwargs[key] = _section_from_dict(SECTIONS[key], key, value)
            else:
                kwargs[key] = value
        return RunConfig(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    # --- validation --------------------------------------------------------------

    def validate(self) -> "RunConfig":
        """Raise ConfigError for the first value that cannot work. Needs no process group:
        checks that depend on the world size (fsdp=-1) are repeated once it is known."""
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise ConfigError("run_dir must be a non-empty path")
        _check_int(self.seed, "seed", minimum=0)
        _validate_model(self.model)
        _validate_parallel(self.parallel)
        _validate_train(self.train)
        _validate_data(self.data)
        _validate_checkpoint(self.checkpoint)
        m, p, t = self.model, self.parallel, self.train
        if t.seq_len > m.max_seq_len:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                              f"use a shorter seq_len or raise max_seq_len")
        if self.data.tokenizer == "bytes" and m.vocab_size < BYTES_VOCAB:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the bytes tokenizer's "
                              f"vocabulary ({BYTES_VOCAB}: 256 bytes, BOS, EOS): set model.vocab_size to at least "
                              f"{BYTES_VOCAB}")
        if t.eval_every and not self.data.valid_fraction:
            raise ConfigError(f"train.eval_every={t.eval_every} needs a validation split, but "
                              "data.valid_fraction=0: set data.valid_fraction (e.g. 0.01), or train.eval_every 0")
        if p.tp > 1:
            split = {"model.n_heads": m.n_heads, "model.vocab_size": m.vocab_size}
            if m.arch == "llama":
                split["model.n_kv_heads"] = m.n_kv_heads or m.n_heads
            split["model.ffn_dim"] = m.ffn_dim or 4 * m.dim
            if m.moe is not None:
                split["model.moe.expert_ffn_dim"] = m.moe.expert_ffn_dim
            for key, n in split.items():
                if n % p.tp:
                    options = [d for d in range(1, max(split.values()) + 1)
                               if all(v % d == 0 for v in split.values())]
                    raise ConfigError(f"parallel.tp={p.tp} does not divide {key}={n} (tensor parallelism "
                                      f"splits it evenly over the tp ranks): choose parallel.tp among "
                                      f"{', '.join(map(str, options))}, or change {key}")
            if p.sp and t.seq_len % p.tp:
                raise ConfigError(f"parallel.sp=true shards the sequence over parallel.tp={p.tp} ranks, but "
                                  f"train.seq_len={t.seq_len} is not divisible by {p.tp}: choose a seq_len "
                                  f"that is a multiple of tp, or set parallel.sp false")
        if p.cp > 1:
            _validate_context_parallel(self)
        if p.ep > 1:
            _validate_experts(self)
        if p.fsdp_accumulate == "unsharded":
            _validate_unsharded_accumulation(self)
        if p.pp_keep_gathered:
            _validate_keep_gathered(self)
        if self.checkpoint.export:  # what Hugging Face cannot express fails now, not after training
            from ..interop.hf import to_hf_config

            try:
                to_hf_config(m.arch, self.family_config())
            except ConfigError as e:
                raise ConfigError(f"checkpoint.export=true: {e}; or set checkpoint.export false") from None

        dp = p.dp * (1 if p.fsdp == -1 else p.fsdp)
        if t.global_batch % (t.micro_batch * dp):
            raise ConfigError(_batch_message(t, p.dp, p.fsdp, dp))
        if p.pp > 1:
            _validate_pipeline(self)
        elif p.pp_layout is not None:  # one stage: a layout must say so, not be ignored
            from ..pipeline.partition import partition

            partition(self.model_def(), 1, 1, p.pp_layout, seq_len=t.seq_len, micro_batch=t.micro_batch)
        # Any other layout problem the planner can see before the world size is known (a
        # -1 axis taken as the least that lets ep fold from fsdp x cp).
        self.plan(world=None, fill=p.ep // math.gcd(p.ep, p.cp))
        return self

    def plan(self, world: int | None, fill: int | None = None):
        """The Plan of this config for `world` ranks (None: the product of the fixed sizes,
        with a -1 axis taken as `fill`)."""
        from ..layout.plan import make_plan
        from ..train.step import check_compile

        plan = make_plan(self.model_def().specs, self.rules(), self.mesh_spec(fill=fill), world=world,
                         cp_comm=self.parallel.cp_comm)
        if world is not None:  # the batch against the resolved data-parallel size, before any rank starts
            self._check_batch_at(plan.mesh)
        if self.train.compile:
            check_compile(self.train.activation_checkpointing, sharded=plan.mesh.world > 1)
        return plan

    def notes(self, mesh) -> list[str]:
        """One line per setting that does nothing on `mesh` (the resolved layout), said at
        the start of fit and in plan rather than refused: a preset's keys run at another
        size or with one axis overridden (a setting that can never act is a ConfigError)."""
        p, out = self.parallel, []
        default = ParallelConfig.__dataclass_fields__["pp_schedule"].default
        if p.pp == 1 and p.pp_schedule != default:
            out.append(f"note: parallel.pp_schedule={p.pp_schedule} does nothing with parallel.pp=1 (no pipeline "
                       "to schedule); set parallel.pp > 1 to run it")
        if p.pp_keep_gathered and p.pp > 1 and mesh.fsdp * mesh.cp == 1:
            out.append(f"note: parallel.pp_keep_gathered=true does nothing at world size {mesh.world}: "
                       f"parallel.fsdp=-1 takes {mesh.fsdp} rank (parallel.cp={mesh.cp}), so no stage weights are "
                       "sharded")
        return out

    # --- what the run is built from ----------------------------------------------

    def family_config(self):
        """The model family's own config (LlamaConfig, GPT2Config)."""
        return self.model.family_config()

    def model_def(self):
        from ..models import build

        return build(self.model.arch, self.family_config())

    def rules(self):
        from ..layout.rules import Rules

        return Rules.default(sp=self.parallel.sp)

    def mesh_spec(self, fill: int | None = None):
        """The MeshSpec of parallel.*; `fill` replaces a -1 axis (None keeps -1)."""
        from ..layout.mesh import MeshSpec

        p = self.parallel
        sizes = {a: getattr(p, a) for a in ("pp", "dp", "fsdp", "cp", "tp", "ep")}
        if fill is not None:
            sizes = {a: fill if n == -1 else n for a, n in sizes.items()}
        return MeshSpec(**sizes)

    def _check_batch_at(self, mesh) -> None:
        """accumulation_steps for a resolved mesh, naming the -1 axis that took the world's ranks."""
        p, t = self.parallel, self.train
        dp_size = mesh.dp * mesh.fsdp
        filled = [a for a in ("dp", "fsdp") if getattr(p, a) == -1]
        if filled and t.global_batch % (t.micro_batch * dp_size):
            per = t.micro_batch * dp_size
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by train.micro_batch={t.micro_batch} x "
                f"data-parallel size {dp_size} (parallel.dp={mesh.dp} x parallel.fsdp={mesh.fsdp}, where "
                f"parallel.{filled[0]}=-1 takes the ranks left of world size {mesh.world}; "
                f"parallel.nproc_per_node={p.nproc_per_node}) = {per} sequences per micro-step: choose a "
                f"global_batch that is a multiple of {per}, a smaller micro_batch, or fewer ranks "
                "(parallel.nproc_per_node, the launcher's, or meshtrain plan --world)")
        self.accumulation_steps(dp_size)

    def accumulation_steps(self, dp_size: int) -> int:
        """Micro-steps per optimizer step for `dp_size` data-parallel ranks (dp * fsdp)."""
        t = self.train
        if t.global_batch % (t.micro_batch * dp_size):
            raise ConfigError(_batch_message(t, self.parallel.dp, dp_size // max(self.parallel.dp, 1), dp_size))
        m = t.global_batch // (t.micro_batch * dp_size)
        if self.parallel.pp > 1:
            _check_micro_batches(self.parallel, m, t, dp_size)
        return m


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig}


def _section_from_dict(cls, key: str, value: Any):
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a mapping of its fields, got {value!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in value if k not in names]
    if unknown:
        raise ConfigError(f"unknown config key {key}.{unknown[0]}; {key} has {', '.join(names)}")
    value = dict(value)
    if cls is ModelConfig and value.get("moe") is not None:
        from ..models.moe import MoeConfig

        value["moe"] = _section_from_dict(MoeConfig, "model.moe", value["moe"])
    return cls(**value)


def _batch_message(t: TrainConfig, dp: int, fsdp: int, dp_size: int) -> str:
    per_micro = t.micro_batch * dp_size
    return (f"train.global_batch={t.global_batch} is not divisible by train.micro_batch={t.micro_batch} x "
            f"data-parallel size {dp_size} (parallel.dp={dp} x parallel.fsdp={fsdp}) = {per_micro} sequences "
            f"per micro-step: choose a global_batch that is a multiple of {per_micro}, or a smaller micro_batch")


def _validate_experts(cfg: "RunConfig") -> None:
    p, m = cfg.parallel, cfg.model
    if m.moe is None:
        raise ConfigError(f"parallel.ep={p.ep} shards experts, but model.moe is null (no experts): set "
                          "parallel.ep 1, or configure model.moe")
    if m.moe.num_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide model.moe.num_experts={m.moe.num_experts}: each "
                          "ep rank holds an equal share of the experts; choose an ep that divides num_experts")


def _validate_unsharded_accumulation(cfg: "RunConfig") -> None:
    p = cfg.parallel
    for bad, why in ((p.bucket == "param", "parallel.bucket param (the per-parameter reference path)"),
                     (p.pp > 1, "parallel.pp > 1 (a pipeline reduces every micro-batch; "
                                "parallel.pp_keep_gathered true reduces once per step)")):
        if bad:
            raise ConfigError(f"parallel.fsdp_accumulate=unsharded does not work with {why}: set "
                              "parallel.fsdp_accumulate sharded")


def _validate_keep_gathered(cfg: "RunConfig") -> None:
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


def _validate_context_parallel(cfg: "RunConfig") -> None:
    p, t = cfg.parallel, cfg.train
    if t.seq_len % (2 * p.cp):
        raise ConfigError(f"parallel.cp={p.cp} splits each sequence into 2 x cp = {2 * p.cp} equal chunks "
                          f"(zigzag), but train.seq_len={t.seq_len} is not a multiple of {2 * p.cp}: choose a "
                          f"seq_len that is (e.g. {t.seq_len // (2 * p.cp) * 2 * p.cp or 2 * p.cp})")
    if p.sp and p.tp > 1 and t.seq_len % (p.cp * p.tp):
        raise ConfigError(f"parallel.sp=true splits each cp rank's positions over parallel.tp={p.tp} ranks: "
                          f"train.seq_len={t.seq_len} must be a multiple of cp x tp = {p.cp * p.tp}; choose "
                          "such a seq_len or set parallel.sp false")


def _validate_pipeline(cfg: "RunConfig") -> None:
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
        _check_micro_batches(p, t.global_batch // (t.micro_batch * dp), t, dp)
    from ..pipeline.partition import partition

    partition(cfg.model_def(), p.pp, p.pp_virtual, p.pp_layout, seq_len=t.seq_len, micro_batch=t.micro_batch)


def _check_micro_batches(p: ParallelConfig, m: int, t: TrainConfig, dp_size: int) -> None:
    """The micro-batch count m = global_batch / (micro_batch x dp x fsdp) against the schedule."""
    if p.pp_schedule == "interleaved" and m % p.pp:
        good = t.micro_batch * dp_size * p.pp * -(-m // p.pp)
        raise ConfigError(f"parallel.pp_schedule=interleaved needs the micro-batch count (train.global_batch="
                          f"{t.global_batch} / (train.micro_batch={t.micro_batch} x data-parallel size {dp_size}) = "
                          f"{m}) to be a multiple of parallel.pp={p.pp}: change global_batch (e.g. {good}) or "
                          "micro_batch so that it is")

