"""`meshtrain plan --search`: the layouts of a run config that fit the device, fastest first.

At the world given, it turns the knobs a user can change without touching the model: the
mesh (tp within a node, with sequence parallelism as Megatron runs it; cp; pp; ep for
MoE; fsdp takes the rest), the pipeline schedule (1F1B, or interleaved with 2 virtual
stages; not zb, whose split backward's traffic the estimate does not count), activation
checkpointing, the micro-batch (halved down to 1), and
keeping weights gathered over the micro-batches (parallel.pp_keep_gathered under pp,
parallel.zero 1 without). Prefetch and precision stay as given. Buckets are tried last,
for each listed layout (`BUCKETS`; its fastest that fits is listed): the ranking itself
is over the layouts at the given bucket, since timing every candidate at each bucket
would take the 405b search past its budget.

Each candidate is planned for memory alone first (`step_memory` without collectives:
milliseconds); one over the device is dropped, and so is every candidate that keeps at
least its memory on each knob (the same mesh and schedule, less recompute or a larger
micro-batch). The rest are timed in two passes: a lower bound (the step-time model with
no communication: compute, optimizer and, under pp, the bubble of those stage times),
then, best bound first, the full model (`step_time`, collectives included) until the
next bound is slower than the `limit`-th fastest timed. So the answer is the model's
ranking, not a heuristic's, at a fraction of its cost. Both passes run over one worker
per core (meshes and schedules split among them; the timing pass n at a time), started
from a forkserver: on 2 cores the 405b search at 16384 ranks took 33-50 s forked from
the caller, where one process took 50-69, and 43-44 s from the server (its start ~3 s).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from functools import partial

from ..config import RunConfig
from ..errors import ConfigError
from ..models.policy import CHECKPOINTING
from ..pools import clean_pool
from .hardware import Hardware
from .step_memory import step_memory
from .step_time import plain_collectives, step_time

TP_SIZES, CP_SIZES, PP_SIZES = (1, 2, 4, 8), (1, 2, 4), (1, 2, 4, 8, 16)
# Under pp. Not zb: the collective estimate leaves out its split backward's second
# gathers (comms.py), so its time would be flattered.
SCHEDULES = (("1f1b", 1), ("interleaved", 2))
EP_SIZES = (1, 2, 4, 8, 16, 32, 64)  # MoE only: those that divide the experts
# parallel.bucket tried for each listed layout: one per block, or MB sizes either side
BUCKETS = ("block", 32.0, 256.0)


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    ep: int
    schedule: tuple[str, int]  # (parallel.pp_schedule, parallel.pp_virtual); the given one without pp
    keep: bool  # pp_keep_gathered under pp, zero 1 without
    checkpointing: str
    micro_batch: int


@dataclass(frozen=True)
class Ranked:
    flags: str  # to add to the command line; "" is the layout as given
    tokens_per_s_per_gpu: float
    step_s: float
    mfu: float | None
    peak: float

    def to_dict(self) -> dict:
        return {"flags": self.flags, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "step_s": self.step_s,
                "mfu": self.mfu, "peak_bytes": int(self.peak)}


def fastest_layouts(cfg: RunConfig, world: int, hw: Hardware, *, limit: int = 10,
                    workers: int | None = None) -> tuple[list[Ranked], dict]:
    """Up to `limit` layouts of `cfg` (validated) that fit `hw` at `world` ranks, fastest
    first; and what the search did (candidates, fitting, timed). `workers` processes
    (default: one per core, at most 8) plan and time the candidates."""
    gpus_per_node = min(cfg.parallel.nproc_per_node, world)
    given = _given(cfg)
    candidates = sorted(_candidates(cfg, world, gpus_per_node), key=_saving_first)
    groups = [list(g) for _, g in itertools.groupby(candidates, key=_mesh_and_schedule)]
    with _Workers(workers) as run:
        planned = run(partial(_plan_group, cfg, world, hw, gpus_per_node), groups)
        fitting = sorted((f for tried, fits in planned for f in fits), key=lambda f: f[0])
        # Best bound first, `run.n` at a time, until the next bound is slower than the
        # limit-th fastest timed. A batch may time one the one-at-a-time loop would have
        # stopped before; its time is at least its bound, so it never enters the list.
        ranked: list[tuple[Ranked, RunConfig]] = []
        timed = 0
        while timed < len(fitting):
            if len(ranked) >= limit and fitting[timed][0] > ranked[limit - 1][0].step_s:
                break
            batch = fitting[timed:timed + run.n]
            ranked += run(partial(_time_layout, cfg, world, hw, gpus_per_node, given), batch)
            ranked.sort(key=lambda r: r[0].step_s)
            timed += len(batch)
        best = run(partial(_best_bucket, world=world, hw=hw, gpus_per_node=gpus_per_node), ranked[:limit])
    best.sort(key=lambda r: r.step_s)
    return best, {"candidates": sum(tried for tried, _ in planned), "fitting": len(fitting), "timed": timed}


def _mesh_and_schedule(c: Layout) -> tuple:
    return c.tp, c.cp, c.pp, c.ep, c.schedule


def _plan_group(cfg: RunConfig, world: int, hw: Hardware, gpus_per_node: int,
                group: list[Layout]) -> tuple[int, list[tuple[float, Layout, float]]]:
    """The candidates of one mesh and schedule, most memory-saving first, planned for
    memory: how many were planned, and (the step-time model's bound, layout, peak) of
    each that fits. One over the device prunes the rest that keep at least its memory."""
    fits, over, tried = [], [], 0
    for layout in group:
        if any(_saves_at_least(o, layout) for o in over):
            continue
        planned = _planned(cfg, layout, world)
        tried += 1
        if planned is None:
            continue
        alt, plan, model, memory, pipeline = planned
        if memory["peak"] > hw.memory_bytes:
            over.append(layout)
            continue
        bound = step_time(alt, model, plan, hw, world=world, gpus_per_node=gpus_per_node, collectives=[],
                          params=[], pipeline=pipeline)["step_s"]
        fits.append((bound, layout, memory["peak"]))
    return tried, fits


def _time_layout(cfg: RunConfig, world: int, hw: Hardware, gpus_per_node: int, given: Layout,
                 fit: tuple[float, Layout, float]) -> tuple[Ranked, RunConfig]:
    """The full step-time model of a fitting layout, as a Ranked (with its config)."""
    _, layout, peak = fit
    alt, plan, model, _, _ = _planned(cfg, layout, world)
    t = _timed(alt, plan, model, hw, world, gpus_per_node)
    return Ranked(_flags(cfg, layout, given), t["tokens_per_s_per_gpu"], t["step_s"], t["mfu"], peak), alt


class _Workers:
    """map over `n` processes (one per core by default, at most 8), in order; in
    this process when n is 1. A worker keeps what it planned (plans, partitions and
    recordings are cached) for the next items it is given."""

    def __init__(self, n: int | None):
        self.n = max(1, min(8, os.cpu_count() or 1) if n is None else n)
        self._pool = None

    def __enter__(self):
        if self.n > 1:  # not forked from this process (meshtrain/pools.py)
            self._pool = clean_pool(self.n, __name__)
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.terminate()
        return False

    def __call__(self, fn, items: list) -> list:
        if self._pool is None or len(items) < 2:
            return [fn(x) for x in items]
        return self._pool.map(fn, items, chunksize=1)


def _best_bucket(ranked: tuple[Ranked, RunConfig], *, world: int, hw: Hardware, gpus_per_node: int) -> Ranked:
    """Layout `r` with the fastest of BUCKETS that fits (its own bucket if none is faster)."""
    r, alt = ranked
    for bucket in BUCKETS:
        if bucket == alt.parallel.bucket:
            continue
        try:
            b = dataclasses.replace(alt, parallel=dataclasses.replace(alt.parallel, bucket=bucket)).validate()
            plan, model = b.plan(world=world), b.model_def()
            memory, _ = step_memory(b, plan, model, memory_only=True)
        except ConfigError:
            continue
        if memory["peak"] > hw.memory_bytes:
            continue
        t = _timed(b, plan, model, hw, world, gpus_per_node)
        if t["step_s"] < r.step_s:
            r = Ranked(f"{r.flags} --parallel.bucket {bucket}".strip(), t["tokens_per_s_per_gpu"], t["step_s"],
                       t["mfu"], memory["peak"])
    return r


def fastest_first(fits: list, world: int, hw: Hardware) -> list:
    """advice.Fit layouts (with their configs) ranked by the step-time model, each with
    its tokens/s per GPU: the dry run's advice for a layout over the device."""
    gpus_per_node = min(fits[0].config.parallel.nproc_per_node, world) if fits else 1
    timed = []
    for fit in fits:
        cfg = fit.config
        t = _timed(cfg, cfg.plan(world=world), cfg.model_def(), hw, world, gpus_per_node)
        timed.append(dataclasses.replace(fit, tokens_per_s_per_gpu=t["tokens_per_s_per_gpu"]))
    return sorted(timed, key=lambda f: -f.tokens_per_s_per_gpu)


def _given(cfg: RunConfig) -> Layout:
    p, t = cfg.parallel, cfg.train
    keep = p.pp_keep_gathered if p.pp > 1 else p.zero < 3
    return Layout(p.tp, p.cp, p.pp, p.ep, (p.pp_schedule, p.pp_virtual), keep, t.activation_checkpointing,
                  t.micro_batch)


def _candidates(cfg: RunConfig, world: int, gpus_per_node: int) -> list[Layout]:
    m, t = cfg.model, cfg.train
    experts = m.moe.num_experts if m.moe is not None else 1
    eps = [e for e in EP_SIZES if experts % e == 0 and e <= world] if m.moe is not None else [1]
    micro = sorted({t.micro_batch >> k for k in range(min(3, t.micro_batch.bit_length()))}, reverse=True)
    out = []
    for tp, cp, pp, ep in itertools.product(TP_SIZES, CP_SIZES, PP_SIZES, eps):
        if tp > gpus_per_node or world % (tp * cp * pp) or pp > m.n_layers:
            continue
        schedules = SCHEDULES if pp > 1 else [(cfg.parallel.pp_schedule, 1)]
        for schedule, keep, ac, mb in itertools.product(schedules, (False, True), CHECKPOINTING, micro):
            out.append(Layout(tp, cp, pp, ep, schedule, keep, ac, mb))
    return out


def _saving_first(c: Layout) -> tuple:
    """Most memory-saving first within a mesh and schedule: a bound that is over prunes."""
    return (c.tp, c.cp, c.pp, c.ep, c.schedule, c.keep, -CHECKPOINTING.index(c.checkpointing), c.micro_batch)


def _saves_at_least(over: Layout, c: Layout) -> bool:
    """Does `over` (over the device) keep at most `c`'s memory on every knob? (Weights kept
    gathered only add to it.)"""
    same = (over.tp, over.cp, over.pp, over.ep, over.schedule) == (c.tp, c.cp, c.pp, c.ep, c.schedule)
    return same and CHECKPOINTING.index(over.checkpointing) >= CHECKPOINTING.index(c.checkpointing) \
        and over.micro_batch <= c.micro_batch and over.keep <= c.keep


def _applied(cfg: RunConfig, c: Layout) -> RunConfig:
    p = dataclasses.replace(cfg.parallel, tp=c.tp, sp=c.tp > 1 or cfg.parallel.sp, cp=c.cp, pp=c.pp, ep=c.ep,
                            dp=1, fsdp=-1, pp_schedule=c.schedule[0], pp_virtual=c.schedule[1], pp_layout=None,
                            pp_keep_gathered=c.keep and c.pp > 1, zero=1 if c.keep and c.pp == 1 else 3)
    t = dataclasses.replace(cfg.train, activation_checkpointing=c.checkpointing, micro_batch=c.micro_batch)
    return dataclasses.replace(cfg, parallel=p, train=t)


def _planned(cfg: RunConfig, c: Layout, world: int):
    """(config, plan, model, memory, memory-only pipeline) of layout c, or None when it
    cannot run."""
    try:
        alt = _applied(cfg, c)
        mesh = alt.mesh_spec().resolve(world)
        if c.keep and mesh.fsdp * mesh.cp == 1:  # nothing sharded to keep gathered: the layout without
            return None
        alt.accumulation_steps(mesh.dp * mesh.fsdp)
        alt = alt.validate()
        plan, model = alt.plan(world=world), alt.model_def()
        memory, pipeline = step_memory(alt, plan, model, memory_only=True)
    except ConfigError:
        return None
    return alt, plan, model, memory, pipeline


def _timed(cfg: RunConfig, plan, model, hw: Hardware, world: int, gpus_per_node: int) -> dict:
    """The full step-time model of a planned layout (collectives included)."""
    if plan.mesh.pp > 1:
        _, pipeline = step_memory(cfg, plan, model, collectives_only=True)
        return step_time(cfg, model, plan, hw, world=world, gpus_per_node=gpus_per_node,
                         collectives=pipeline.busiest["collectives"], params=[], pipeline=pipeline)
    collectives, params = plain_collectives(cfg, plan, model)
    return step_time(cfg, model, plan, hw, world=world, gpus_per_node=gpus_per_node, collectives=collectives,
                     params=params)


def _flags(cfg: RunConfig, c: Layout, given: Layout) -> str:
    """The command-line flags that turn `cfg` into layout `c`."""
    alt, p, t = _applied(cfg, c), cfg.parallel, cfg.train
    flags = []
    for key in ("tp", "sp", "cp", "pp", "ep", "pp_schedule", "pp_virtual", "pp_keep_gathered", "zero", "dp",
                "fsdp"):
        new, old = getattr(alt.parallel, key), getattr(p, key)
        if new != old and not (key in ("pp_schedule", "pp_virtual", "pp_keep_gathered") and c.pp == 1):
            flags.append(f"--parallel.{key} {str(new).lower() if isinstance(new, bool) else new}")
    for key in ("activation_checkpointing", "micro_batch"):
        if getattr(alt.train, key) != getattr(t, key):
            flags.append(f"--train.{key} {getattr(alt.train, key)}")
    return " ".join(flags)
