"""Each section's own fields checked: types, bounds, choices, and what one section alone
can rule out. Every failure is a ConfigError naming the key and the fix. model.moe checks
its own fields (models/moe.py:MoeConfig); here only how it fits the rest of the model."""

from __future__ import annotations

from ..errors import ConfigError, check_bool, check_choice, check_float, check_int
from ..layout.mesh import CP_COMMS
from ..pipeline.schedule import PP_SCHEDULES
from ..train.lr_schedule import LR_SCHEDULES
from .sections import (
    MAX_SIZES,
    MAX_STEPS,
    MAX_TIMEOUT_S,
    NONFINITE,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)


def _check_int(value, key: str, minimum: int | None = None, maximum: int | None = None) -> None:
    check_int(value, key, minimum, MAX_SIZES.get(key) if maximum is None else maximum)


def _validate_model(m: ModelConfig) -> None:
    from ..models import FAMILIES

    check_choice(m.arch, "model.arch", tuple(FAMILIES))
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
        _check_int(getattr(m, key), f"model.{key}", minimum=1)
    for key in ("n_kv_heads", "ffn_dim"):
        if getattr(m, key) is not None:
            _check_int(getattr(m, key), f"model.{key}", minimum=1)
    check_float(m.norm_eps, "model.norm_eps", positive=True)
    check_bool(m.tie_embeddings, "model.tie_embeddings")
    if m.init_from is not None and (not isinstance(m.init_from, str) or not m.init_from):
        raise ConfigError(f"model.init_from={m.init_from!r}: give the path of a Hugging Face model directory, "
                          "or null")
    check_bool(m.qk_norm, "model.qk_norm")
    if m.head_dim is not None:
        _check_int(m.head_dim, "model.head_dim", minimum=2)
    FAMILIES[m.arch].check_fields(m)  # the keys only some families read (RoPE, GQA, q/k norms, ...)
    if m.moe is not None:
        _validate_moe_in_model(m)
    # The family's own checks (head divisibility, even head dim, ...).
    m.family_config()


def _validate_moe_in_model(m: ModelConfig) -> None:
    """model.moe within the model: a MoeConfig (which checked its own fields when built)
    whose layers select some of model.n_layers."""
    from ..models.moe import MoeConfig

    e = m.moe
    if not isinstance(e, MoeConfig):
        raise ConfigError(f"model.moe={e!r} must be a mapping of its fields, or null")
    if not e.moe_layers(m.n_layers):
        raise ConfigError(f"model.moe.layers={e.layers!r} selects no block of model.n_layers={m.n_layers}: choose "
                          "some, or set model.moe null")


def _validate_parallel(p: ParallelConfig) -> None:
    _check_int(p.nproc_per_node, "parallel.nproc_per_node", minimum=1)
    check_bool(p.sp, "parallel.sp")
    _check_int(p.ep, "parallel.ep", minimum=1)
    _check_int(p.cp, "parallel.cp", minimum=1)
    check_choice(p.cp_comm, "parallel.cp_comm", CP_COMMS)
    _check_int(p.pp, "parallel.pp", minimum=1)
    _check_int(p.pp_virtual, "parallel.pp_virtual", minimum=1)
    check_choice(p.pp_schedule, "parallel.pp_schedule", PP_SCHEDULES)
    if p.pp == 1 and p.pp_virtual > 1:
        raise ConfigError(f"parallel.pp_virtual={p.pp_virtual} sets pipeline stages per pp rank, but parallel.pp=1 "
                          "(no pipeline): set pp_virtual 1, or parallel.pp > 1")
    if p.pp_layout is not None:
        if not isinstance(p.pp_layout, list) or not p.pp_layout:
            raise ConfigError(f"parallel.pp_layout={p.pp_layout!r}: give a list of layers per stage, e.g. [3, 2], "
                              "or null to balance by cost")
        for i, k in enumerate(p.pp_layout):
            _check_int(k, f"parallel.pp_layout[{i}]", minimum=1)
    p.traffic().check()
    check_float(p.collective_timeout_s, "parallel.collective_timeout_s", positive=True)
    if p.collective_timeout_s > MAX_TIMEOUT_S:
        raise ConfigError(f"parallel.collective_timeout_s={p.collective_timeout_s} exceeds {MAX_TIMEOUT_S:g} s "
                          "(about 3 years), more than a process group's timeout can hold: choose a smaller "
                          "timeout (the default is 900)")
    check_float(p.watchdog_s, "parallel.watchdog_s", minimum=0.0)
    if p.watchdog_s and p.watchdog_s >= p.collective_timeout_s:
        raise ConfigError(f"parallel.watchdog_s={p.watchdog_s} must be below parallel.collective_timeout_s="
                          f"{p.collective_timeout_s}, or a timed-out collective ends the run before the watchdog "
                          "can name the stalled rank: lower watchdog_s, raise collective_timeout_s, or set "
                          "watchdog_s 0 (off)")
    fill = []
    for axis in ("dp", "fsdp", "tp"):
        n = getattr(p, axis)
        _check_int(n, f"parallel.{axis}")
        if n == 0 or n < -1:
            raise ConfigError(f"parallel.{axis}={n}: sizes must be positive, or -1 to take the remaining ranks")
        if n == -1:
            fill.append(axis)
    if len(fill) > 1:
        raise ConfigError(f"parallel: only one axis may be -1 (it takes the remaining ranks), got "
                          f"{', '.join(f'parallel.{a}=-1' for a in fill)}; give all but one a fixed size")


def _validate_train(t: TrainConfig) -> None:
    from ..models.fp8 import RECIPES
    from ..models.policy import CHECKPOINTING, PRECISIONS

    for key in ("steps", "global_batch", "micro_batch", "seq_len", "log_every", "eval_batches"):
        _check_int(getattr(t, key), f"train.{key}", minimum=1)
    for key in ("steps", "warmup_steps", "stop_at", "eval_every"):  # a typo, not a run
        _check_int(getattr(t, key), f"train.{key}", minimum=0, maximum=MAX_STEPS)
    if t.global_batch % t.micro_batch:
        raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by train.micro_batch="
                          f"{t.micro_batch}: choose a global_batch that is a multiple of micro_batch")
    check_float(t.lr, "train.lr", positive=True)
    check_float(t.min_lr, "train.min_lr", minimum=0.0)
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} exceeds train.lr={t.lr}: min_lr is where the decay ends")
    check_choice(t.lr_schedule, "train.lr_schedule", LR_SCHEDULES)
    check_float(t.weight_decay, "train.weight_decay", minimum=0.0)
    if t.grad_clip is not None:
        check_float(t.grad_clip, "train.grad_clip", minimum=0.0)
    check_choice(t.precision, "train.precision", PRECISIONS)
    check_bool(t.compile, "train.compile")
    check_choice(t.fp8_recipe, "train.fp8_recipe", RECIPES)
    check_choice(t.activation_checkpointing, "train.activation_checkpointing", CHECKPOINTING)
    check_choice(t.nonfinite, "train.nonfinite", NONFINITE)
    _check_int(t.max_skipped, "train.max_skipped", minimum=0)
    check_float(t.spike_factor, "train.spike_factor", minimum=0.0)
    if 0 < t.spike_factor <= 1:
        raise ConfigError(f"train.spike_factor={t.spike_factor}: a spike is a loss above factor x the recent mean, "
                          "so the factor must exceed 1 (e.g. 1.5), or be 0 to turn the warning off")


def _validate_data(d: DataConfig) -> None:
    # The shape of data.paths only; files and tokens are checked when the data is opened.
    from ..data import DataError, parse_paths

    try:
        parse_paths(d.paths)
    except DataError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(d.tokenizer, str) or not d.tokenizer:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: give bytes or the path of a tokenizer.json")
    check_float(d.valid_fraction, "data.valid_fraction", minimum=0.0)
    if d.valid_fraction >= 1:
        raise ConfigError(f"data.valid_fraction={d.valid_fraction} leaves no training data: choose a value "
                          "below 1 (e.g. 0.01)")
    for key in ("document_mask", "reset_positions", "eod_mask_loss"):
        check_bool(getattr(d, key), f"data.{key}")
    _check_int(d.mean_doc_len, "data.mean_doc_len", minimum=0, maximum=2**31 - 1)


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _check_int(c.every, "checkpoint.every", minimum=0)
    _check_int(c.keep_last, "checkpoint.keep_last", minimum=1)
    check_bool(c.export, "checkpoint.export")
    check_bool(c.async_save, "checkpoint.async_save")
    if not isinstance(c.resume, str) or not c.resume:
        raise ConfigError(f"checkpoint.resume={c.resume!r}: give auto, none, restart, or a checkpoint directory")

