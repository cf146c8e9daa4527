"""Layouts that fit a device, for a run config whose peak memory does not.

`layouts_that_fit` searches what a user can change without touching the model or the
world size: activation checkpointing (none, selective, full), resharding after forward
(on, where it is off), the micro-batch (halved down to 1), tp (doubled within a node) and pp (2, 4, 8 where they
divide the layers), and returns the layouts whose peak fits, cheapest first, each as the
exact flags to add to the command line.

"Cheapest" is a rough step-time cost of each change, summed (an ordering, not a
prediction): see `COST`. The search plans each candidate (`step_memory`), cheapest first,
and skips a candidate when one that saves at least as much memory on every knob (same
pp) was already over: memory does not grow with more recompute, resharding (no gathered
weights kept), a smaller micro-batch or more tp.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..models.policy import CHECKPOINTING  # least recompute first
from ..parallel.plan_table import human_bytes
from .step_memory import step_memory

# Step-time cost of a change, as a rough fraction of the step: selective checkpointing
# recomputes norms and activation functions (a few %, Korthikanti et al. 2022); full re-runs
# every layer's forward (+1/3 of the compute); resharding gathers the weights once more per
# micro-step (mostly hidden by prefetch); halving the
# micro-batch or doubling tp makes smaller GEMMs and more collectives per token. pp adds
# its bubble, (pp - 1) / (m + pp - 1) of the step for m micro-batches (1F1B), on top.
COST = {"selective": 0.05, "full": 0.33, "reshard": 0.05, "micro_batch_halved": 0.05, "tp_doubled": 0.10}
PP_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class Candidate:
    checkpointing: str
    reshard: bool  # parallel.reshard_after_forward
    micro_batch: int
    tp: int
    pp: int

    def saves_at_least(self, other: "Candidate") -> bool:
        """Does this layout keep at most `other`'s memory on every knob (same pp)?"""
        return (self.pp == other.pp and self.tp >= other.tp and self.micro_batch <= other.micro_batch
                and CHECKPOINTING.index(self.checkpointing) >= CHECKPOINTING.index(other.checkpointing)
                and self.reshard >= other.reshard)


@dataclass(frozen=True)
class Fit:
    flags: str  # to add to the command line
    peak: float  # bytes on the most loaded rank


def layouts_that_fit(cfg, world: int, capacity: float, *, limit: int = 3) -> tuple[list[Fit], Fit | None]:
    """Up to `limit` layouts of `cfg` (validated) at `world` ranks whose peak is at most
    `capacity` bytes, cheapest first; and the lowest peak planned (None if no candidate
    could be planned)."""
    t, p = cfg.train, cfg.parallel
    now = Candidate(t.activation_checkpointing, p.reshard_after_forward, t.micro_batch, p.tp, p.pp)
    # Ties: the layout with fewer changes first.
    candidates = sorted((c for c in _candidates(cfg, world) if c != now),
                        key=lambda c: (_cost(cfg, world, c, now), sum(a != b for a, b in zip(
                            dataclasses.astuple(c), dataclasses.astuple(now)))))
    fits, over, planned = [], [], {}

    def plan(c: Candidate) -> float | None:
        if c not in planned:
            planned[c] = _peak(cfg, world, c)
            if planned[c] is not None and planned[c] > capacity:
                over.append(c)
        return planned[c]

    for c in candidates:
        # The most memory-saving layout of c's tp and pp first: if it is over, so is c.
        plan(Candidate("full", True, 1, c.tp, c.pp))
        if any(o.saves_at_least(c) for o in over):
            continue
        peak = plan(c)
        if peak is not None and peak <= capacity:
            fits.append(Fit(_flags(cfg, c, now), peak))
            if len(fits) == limit:
                break
    tried = [(peak, c) for c, peak in planned.items() if peak is not None and c != now]
    lowest = min(tried, key=lambda x: x[0], default=None)
    return fits, lowest and Fit(_flags(cfg, lowest[1], now), lowest[0])


def nothing_fits(search: str, lowest: Fit | None) -> str:
    """What to say when no layout in the search fits."""
    found = f"; the lowest peak found is {human_bytes(lowest.peak)} with {lowest.flags}" if lowest else ""
    return (f"no layout fits among {search}{found}: add ranks (fsdp shards the state further) or split the "
            "sequence with parallel.cp")


def search_space(cfg, world: int) -> str:
    """What `layouts_that_fit` tried, in words (for when nothing fits)."""
    tried = _candidates(cfg, world)

    def values(knob: str) -> str:
        return "/".join(map(str, sorted({getattr(c, knob) for c in tried}, reverse=knob == "micro_batch")))

    reshard = ", resharding on/off" if len({c.reshard for c in tried}) == 2 else ""
    return (f"activation checkpointing none/selective/full{reshard}, micro_batch {values('micro_batch')}, "
            f"tp {values('tp')}, pp {values('pp')}")


def _candidates(cfg, world: int) -> list[Candidate]:
    t, p = cfg.train, cfg.parallel
    micro = sorted({t.micro_batch >> k for k in range(t.micro_batch.bit_length())}, reverse=True)
    gpus_per_node = min(p.nproc_per_node, world)
    tps = [p.tp] if p.tp == -1 else [p.tp << k for k in range(4) if (p.tp << k) <= max(p.tp, gpus_per_node)]
    pps = [p.pp] + [n for n in PP_SIZES if n > p.pp and cfg.model.n_layers % n == 0]
    reshards = sorted({p.reshard_after_forward, True})
    return [Candidate(ac, r, mb, tp, pp) for ac in CHECKPOINTING for r in reshards for mb in micro
            for tp in tps for pp in pps]


def _cost(cfg, world: int, c: Candidate, now: Candidate) -> float:
    cost = COST.get(c.checkpointing, 0.0) - COST.get(now.checkpointing, 0.0)
    cost += COST["reshard"] * (c.reshard and not now.reshard)
    cost += COST["micro_batch_halved"] * math.log2(now.micro_batch / c.micro_batch)
    cost += COST["tp_doubled"] * math.log2(c.tp / now.tp)  # tp -1 stays -1: log2(1)
    return cost + _bubble(cfg, world, c) - _bubble(cfg, world, now)


def _bubble(cfg, world: int, c: Candidate) -> float:
    """1F1B's idle fraction (pp - 1) / (m + pp - 1); 0 without pp or when m is not whole."""
    if c.pp == 1:
        return 0.0
    tp = c.tp if c.tp > 0 else 1
    data = world // (c.pp * tp * cfg.parallel.cp)
    m = cfg.train.global_batch // max(1, c.micro_batch * data)
    return (c.pp - 1) / (m + c.pp - 1) / cfg.parallel.pp_virtual if m else 0.0


def _apply(cfg, c: Candidate):
    p = cfg.parallel
    fill = p.dp == -1 or p.fsdp == -1 or p.tp == -1
    parallel = dataclasses.replace(p, tp=c.tp, pp=c.pp, sp=p.sp or c.tp != p.tp,  # more tp: with sp, as Megatron
                                   fsdp=p.fsdp if fill or (c.tp, c.pp) == (p.tp, p.pp) else -1,
                                   reshard_after_forward=c.reshard)
    train = dataclasses.replace(cfg.train, activation_checkpointing=c.checkpointing, micro_batch=c.micro_batch)
    return dataclasses.replace(cfg, parallel=parallel, train=train)


def _peak(cfg, world: int, c: Candidate) -> float | None:
    """Peak bytes of `cfg` changed to `c`, or None when that layout cannot run."""
    try:
        alt = _apply(cfg, c).validate()
        memory, _ = step_memory(alt, alt.plan(world=world), alt.model_def())
    except ConfigError:
        return None
    return memory["peak"]


def _flags(cfg, c: Candidate, now: Candidate) -> str:
    """The command-line flags that turn `cfg` into layout `c`."""
    alt, p = _apply(cfg, c).parallel, cfg.parallel
    flags = []
    if c.checkpointing != now.checkpointing:
        flags.append(f"--train.activation_checkpointing {c.checkpointing}")
    if c.reshard != now.reshard:
        flags.append(f"--parallel.reshard_after_forward {str(c.reshard).lower()}")
    if c.micro_batch != now.micro_batch:
        flags.append(f"--train.micro_batch {c.micro_batch}")
    if c.tp != now.tp:
        flags.append(f"--parallel.tp {c.tp}")
    if alt.sp != p.sp:
        flags.append("--parallel.sp true")
    if c.pp != now.pp:
        flags.append(f"--parallel.pp {c.pp}")
    if alt.fsdp != p.fsdp:
        flags.append("--parallel.fsdp -1")
    return " ".join(flags)
