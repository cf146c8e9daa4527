"""Layouts that fit a device, for a run config whose peak memory does not.

`layouts_that_fit` searches what a user can change without touching the model or the
world size: activation checkpointing (none, selective, full), resharding after forward
(on, where it is off), the micro-batch (halved down to 1), tp (doubled within a node) and
pp (2, 4, 8 where they divide the layers), and returns the layouts whose peak fits,
cheapest first (the dry run times the first few with the step-time model and lists the
fastest), each as the exact flags to add to the command line. The layout given is
planned too, as one of the candidates for the lowest peak, so the lowest peak named is
never above its own.

"Cheapest" is a rough step-time cost of each change, summed (an ordering, not a
prediction): see `COST`. The search plans each candidate (`step_memory`), cheapest first,
and skips a candidate when one that saves at least as much memory on every knob (same
pp) was already over: memory does not grow with more recompute, resharding (no gathered
weights kept), a smaller micro-batch or more tp. For each tp and pp it first plans the
most memory-saving layout that can run (full checkpointing; selective where compile
refuses full), so a tp and pp that cannot fit costs one plan.

When nothing fits, `what_would_fit` plans what would, with the same search: parallel.cp
doubled (up to 8x) at the same world, and the world doubled (up to 1024x) with cp as
given, or else raised. A world whose ranks cannot hold the model's state spread evenly
is not planned, nor, at larger worlds, a tp and pp whose activations alone are over.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import RunConfig
from ..errors import ConfigError
from ..models.policy import CHECKPOINTING  # least recompute first
from ..layout.plan_table import human_bytes
from .step_memory import step_memory

# Step-time cost of a change, as a rough fraction of the step: selective checkpointing
# recomputes norms and activation functions (a few %, Korthikanti et al. 2022); full re-runs
# every layer's forward (+1/3 of the compute); resharding gathers the weights once more per
# micro-step (mostly hidden by prefetch); halving the
# micro-batch or doubling tp makes smaller GEMMs and more collectives per token. pp adds
# its bubble, (pp - 1) / (m + pp - 1) of the step for m micro-batches (1F1B), on top.
COST = {"selective": 0.05, "full": 0.33, "reshard": 0.05, "micro_batch_halved": 0.05, "tp_doubled": 0.10}
# How much device memory a train.activation_checkpointing keeps, most first. The search
# tries the recompute policies; activation offload, which keeps no block's activations on
# the device (one block's come back in its backward, as full's recompute), is only ever
# the layout given, ranked beside full.
SAVING = {**{ac: i for i, ac in enumerate(CHECKPOINTING)}, "offload": len(CHECKPOINTING)}
PP_SIZES = (2, 4, 8)
CP_DOUBLINGS = 3  # what_would_fit raises parallel.cp up to 8x
WORLD_DOUBLINGS = 10  # and the world up to 1024x
# State per parameter beside the parameter itself, in any layout: its fp32 gradient and
# AdamW's two moments (memory.py). Spread evenly over the world, all the state is a bound
# below every layout's peak.
STATE_BYTES = 12


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
                and SAVING[self.checkpointing] >= SAVING[other.checkpointing]
                and self.reshard >= other.reshard)


@dataclass(frozen=True)
class Fit:
    flags: str  # to add to the command line; "" is the layout as given
    peak: float  # bytes on the most loaded rank
    world: int | None = None  # what_would_fit's: the ranks it was planned at
    config: RunConfig | None = field(default=None, compare=False)  # layouts_that_fit's: the layout (validated)
    tokens_per_s_per_gpu: float | None = None  # the step-time model's, where the dry run ranked it


def layouts_that_fit(cfg: RunConfig, world: int, capacity: float, *, limit: int = 3) -> tuple[list[Fit], Fit | None]:
    """Up to `limit` layouts of `cfg` (validated) at `world` ranks whose peak is at most
    `capacity` bytes, cheapest first by COST (the layout given first where it fits; the dry
    run ranks them again by the step-time model); and the lowest
    peak planned, the layout given among the candidates and named on a tie (None if no
    candidate could be planned)."""
    fits, lowest, _ = _search(cfg, world, capacity, limit)
    return fits, lowest


def _search(cfg, world: int, capacity: float, limit: int,
            skip: frozenset = frozenset()) -> tuple[list[Fit], Fit | None, dict]:
    """layouts_that_fit's answer, leaving out the (tp, pp) in `skip`; and per (tp, pp)
    planned, the least activations of its layouts that more data-parallel ranks would not
    shrink (all but the saved weights' shards)."""
    now = _given(cfg)
    # Ties: the layout with fewer changes first.
    candidates = sorted((c for c in _candidates(cfg, world) if c != now and (c.tp, c.pp) not in skip),
                        key=lambda c: (_cost(cfg, world, c, now), sum(a != b for a, b in zip(
                            dataclasses.astuple(c), dataclasses.astuple(now)))))
    fits, over, planned = [], [], {}

    def plan(c: Candidate) -> float | None:
        if c not in planned:
            planned[c] = _memory(cfg, world, c)
            if planned[c] is not None and planned[c]["peak"] > capacity:
                over.append(c)
        return None if planned[c] is None else planned[c]["peak"]

    # The layout given: a candidate for the lowest peak, and a fit as it is (at another world).
    peak = plan(now) if (now.tp, now.pp) not in skip else None
    if peak is not None and peak <= capacity:
        fits.append(Fit("", peak, config=cfg))
    for c in candidates:
        if len(fits) >= limit:
            break
        # The most memory-saving layout of c's tp and pp that can run first: if it is over, so is c.
        for bound in _bounds(c):
            if plan(bound) is not None:
                break
        if any(o.saves_at_least(c) for o in over):
            continue
        peak = plan(c)
        if peak is not None and peak <= capacity:
            fits.append(Fit(_flags(cfg, c, now), peak, config=_apply(cfg, c).validate()))
    tried = [(m["peak"], c != now, c) for c, m in planned.items() if m is not None]
    floors = {}
    for c, m in planned.items():
        if m is not None:
            floors[c.tp, c.pp] = min(floors.get((c.tp, c.pp), math.inf), m["activations"] - m["saved_weights"])
    if not tried:
        return fits, None, floors
    peak, _, lowest = min(tried, key=lambda x: x[:2])
    return fits, Fit(_flags(cfg, lowest, now), peak), floors


def what_would_fit(cfg: RunConfig, world: int, capacity: float) -> list[Fit]:
    """What fits when no layout of `cfg` does at `world` ranks, each planned: the least
    parallel.cp raise that fits at `world`, and the least larger world (doubled: whole
    nodes, a multiple of the fixed axes) at which a layout fits with cp as given; where
    neither does, the least larger world with cp raised. Empty when none fits within
    CP_DOUBLINGS and WORLD_DOUBLINGS."""
    cp = cfg.parallel.cp
    raised = [cp << k for k in range(1, CP_DOUBLINGS + 1)]
    more = [world << k for k in range(1, WORLD_DOUBLINGS + 1)]
    state = sum(s.numel * (s.dtype.itemsize + STATE_BYTES) for s in cfg.model_def().specs.values())
    more = [w for w in more if state / w <= capacity]  # fewer ranks cannot hold the state
    same = [world] if state / world <= capacity else []
    would = [_first_fit(cfg, same, raised, capacity), _first_fit(cfg, more, [cp], capacity)]
    if would == [None, None]:
        would = [_first_fit(cfg, more, raised, capacity)]
    return [f for f in would if f is not None]


def _first_fit(cfg, worlds: list[int], cps: list[int], capacity: float) -> Fit | None:
    """The cheapest layout that fits at the first world, then the first cp, where one does.
    A tp and pp whose activations alone are over are not planned again at larger worlds:
    more data-parallel ranks do not shrink them (a pipeline's micro-batches in flight
    aside, which fall only once the step has fewer micro-batches than stages)."""
    hopeless = {}  # per cp and flags: the (tp, pp) not to plan again
    for world in worlds:
        for cp in cps:
            for alt, flags in _resized(cfg, cp):
                skip = hopeless.setdefault(flags, set())
                fits, _, floors = _search(alt, world, capacity, 1, frozenset(skip))
                if fits:
                    return Fit(" ".join(f for f in (*flags, fits[0].flags) if f), fits[0].peak, world)
                skip |= {size for size, floor in floors.items() if floor > capacity}
    return None


def _resized(cfg, cp: int) -> list[tuple]:
    """`cfg` with parallel.cp `cp` (validated), each with the flags that say so: as given,
    and with fsdp filling the ranks left (where it is fixed, more ranks would not shard)."""
    p = cfg.parallel
    cp_flag = [f"--parallel.cp {cp}"] if cp != p.cp else []
    out = []
    for fsdp, flags in ((p.fsdp, (*cp_flag,)), (-1, (*cp_flag, "--parallel.fsdp -1")))[:1 + (p.fsdp != -1)]:
        try:
            out.append((dataclasses.replace(cfg, parallel=dataclasses.replace(p, cp=cp, fsdp=fsdp)).validate(), flags))
        except ConfigError:
            pass
    return out


def nothing_fits(search: str, lowest: Fit | None, would: list[Fit], world: int) -> list[str]:
    """What to say when no layout in the search fits at `world`: the lowest peak found
    (the layout given, if nothing lowers it), then what would fit (`what_would_fit`)."""
    found = ("nothing could be planned" if lowest is None else
             f"the lowest peak found is {human_bytes(lowest.peak)} with {lowest.flags}" if lowest.flags else
             f"the layout given has the lowest peak found ({human_bytes(lowest.peak)})")
    ways = []
    for f in would:
        how = f"with {f.flags}" if f.flags else "as given"
        if f.world == world:
            ways.append(f"split the sequence: {f.flags} fits at world {world} ({human_bytes(f.peak)})")
        else:
            ways.append(f"add ranks: --world {f.world} fits {how} ({human_bytes(f.peak)})")
    if not ways:
        ways.append(f"neither more ranks (the world doubled up to {world << WORLD_DOUBLINGS}) nor parallel.cp "
                    f"(doubled up to {1 << CP_DOUBLINGS}x) fits")
    return [f"no layout fits among {search}; {found}", "; or ".join(ways)]


def search_space(cfg: RunConfig, world: int) -> str:
    """What `layouts_that_fit` tried, in words (for when nothing fits): the sizes that can
    make `world` ranks."""
    tried = [c for c in _candidates(cfg, world) if _makes(cfg, c, world)] or [_given(cfg)]

    def values(knob: str) -> str:
        return "/".join(map(str, sorted({getattr(c, knob) for c in tried}, reverse=knob == "micro_batch")))

    reshard = ", resharding on/off" if len({c.reshard for c in tried}) == 2 else ""
    return (f"activation checkpointing none/selective/full{reshard}, micro_batch {values('micro_batch')}, "
            f"tp {values('tp')}, pp {values('pp')}")


def _given(cfg) -> Candidate:
    t, p = cfg.train, cfg.parallel
    return Candidate(t.activation_checkpointing, p.reshard_after_forward, t.micro_batch, p.tp, p.pp)


def _bounds(c: Candidate) -> list[Candidate]:
    """The layouts of c's tp and pp, most memory-saving first (full may not run: compiled)."""
    return [Candidate(ac, True, 1, c.tp, c.pp) for ac in reversed(CHECKPOINTING)]


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


def _makes(cfg, c: Candidate, world: int) -> bool:
    """Do the mesh sizes of `cfg` changed to `c` make `world` ranks?"""
    try:
        _apply(cfg, c).mesh_spec().resolve(world)
    except ConfigError:
        return False
    return True


def _memory(cfg, world: int, c: Candidate) -> dict | None:
    """step_memory of `cfg` changed to `c`, or None when that layout cannot run."""
    try:
        alt = _apply(cfg, c)
        # Sizes or a batch that `world` ranks cannot take fail here, before the costlier checks.
        mesh = alt.mesh_spec().resolve(world)
        alt.accumulation_steps(mesh.dp * mesh.fsdp)
        alt = alt.validate()
        memory, _ = step_memory(alt, alt.plan(world=world), alt.model_def(), memory_only=True)
    except ConfigError:
        return None
    return memory


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
