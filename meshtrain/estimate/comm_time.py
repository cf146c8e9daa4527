"""The collectives of a step in seconds, and the part of them a step waits for: the
communication half of the step-time model (step_time.py).

`Clock` prices each collective of `step_collectives`' list (per axis, op, phase: count
and bytes per rank) with `Hardware.collective_seconds` over its group: the ranks of its
mesh axes (several joined by "+", or "world"), and whether they span nodes (ranks are
numbered in mesh order, tp innermost, and a node holds consecutive ones).

What the runtime hides and what it waits for:
- parameter traffic (buckets, parallel/bucket_run.py): gathers are issued `prefetch`
  buckets ahead of their first use, and gradient reductions stay in flight (as many as
  `prefetch`) while backward goes on; each phase is modelled as n equal transfers on a
  stream beside n equal pieces of compute (`overlapped`): the first transfer is waited
  for, then whatever a transfer outlasts the compute ahead of it, and of the rest the
  share the compute does not hide (`Hardware.comm_overlap`, `beside`). prefetch 0 and bucket
  "param" wait for every one. A compiled step's all-reduces held to the last
  micro-batch (and with fsdp_accumulate unsharded its reduce-scatters) run after the
  last backward: waited. Kept weights (parallel.zero 1 and 2, pp_keep_gathered):
  gathered in the first micro-batch (compiled: all before it), reduced in the last
  backward (zero 2: each; compiled: after it);
- activation traffic (tp and sequence parallelism, cp's all-gather and all-to-all, ep's
  all-to-alls, the loss, the norm): the runtime waits for each; cp's ring sends hide
  behind the attention of the same phase (by the same share);
- pipeline sends and receives: priced per boundary and given to the schedule simulator;
- the ranks' drift (`skew_exposed`): a collective issued and waited at once (tp's, cp's
  and ep's in the blocks; the parameters' when nothing hides them) starts when its last
  rank arrives, and ranks drift apart over the compute between two such waits
  (`Hardware.sync_skew` per second of it). Traffic issued ahead of its wait absorbs the
  drift, and once-a-step reductions (the loss, the norm) wait once.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

from .hardware import Hardware

OPS = {"all_gather": "all_gather", "reduce_scatter_sum": "reduce_scatter", "all_reduce_sum": "all_reduce",
       "all_reduce_max": "all_reduce", "all_to_all_single": "all_to_all", "recv": "send_recv"}


def nodes_spanned(mesh, axes, gpus_per_node: int) -> int:
    """Nodes that the group of rank 0 over mesh `axes` (one name or several) touches."""
    axes = [axes] if isinstance(axes, str) else list(axes)
    order = mesh.ORDER  # ranks in mesh order, the last axis innermost (the expert mesh's own order)
    stride = {a: math.prod(mesh.size(b) for b in order[order.index(a) + 1:]) for a in axes}
    strides = [[k * stride[a] for k in range(mesh.size(a))] for a in axes]
    return len({sum(c) // gpus_per_node for c in itertools.product(*strides)})


class Clock:
    """Seconds of the collectives of one rank's step, over the plan's groups."""

    def __init__(self, hw: Hardware, mesh, world: int, gpus_per_node: int):
        self.hw, self.mesh, self.world, self.gpus_per_node = hw, mesh, world, gpus_per_node
        self._groups: dict[str, tuple[int, bool]] = {}

    def group(self, axis: str) -> tuple[int, bool]:
        """(ranks, spans nodes) of the group named `axis`."""
        if axis not in self._groups:
            if axis == "world":
                self._groups[axis] = (self.world, self.world > self.gpus_per_node)
            else:
                axes = axis.split("+")
                mesh = self.mesh if all(a in self.mesh.axes for a in axes) else self.mesh.experts()
                size = 1
                for a in axes:
                    size *= mesh.size(a)
                self._groups[axis] = (size, nodes_spanned(mesh, axes, self.gpus_per_node) > 1)
        return self._groups[axis]

    def seconds(self, e: dict) -> float:
        """One entry of step_collectives' list; a send is priced by its receive."""
        if e["op"] == "send" or not e["count"]:
            return 0.0
        ranks, spans = self.group(e["axis"])
        return e["count"] * self.hw.collective_seconds(OPS[e["op"]], e["bytes"] / e["count"], ranks, spans)

    def p2p(self, nbytes: float) -> float:
        """One pipeline boundary's send: its two ranks are pp neighbours."""
        spans = nodes_spanned(self.mesh, "pp", self.gpus_per_node) > 1 and self.mesh.stride("pp") >= self.gpus_per_node
        return self.hw.collective_seconds("send_recv", nbytes, 2, spans)


def beside(comm: float, compute: float, share: float) -> float:
    """What `comm` beside `compute` adds to it when compute hides `share` of what overlaps
    (Hardware.comm_overlap): the part that outlasts the compute, and the unhidden rest of
    the overlap."""
    return max(0.0, comm - compute) + (1.0 - share) * min(comm, compute)


def overlapped(comm: float, compute: float, n: int, hide: bool, share: float = 1.0) -> float:
    """Waited seconds of `comm` in n equal transfers issued ahead of n equal pieces of
    `compute` (module docstring), compute hiding `share` of what overlaps; hide False:
    all of it."""
    if not hide or n < 1 or comm <= 0:
        return max(comm, 0.0)
    g, c = comm / n, compute / n
    return g + (n - 1) * beside(g, c, share)


def minus(entries: list[dict], part: list[dict]) -> list[dict]:
    """`entries` without `part` (both step_collectives lists), key by key."""
    left = {(e["axis"], e["op"], e["phase"]): dict(e) for e in entries}
    for e in part:
        key = (e["axis"], e["op"], e["phase"])
        if key in left:
            left[key]["count"] -= e["count"]
            left[key]["bytes"] -= e["bytes"]
    return [e for e in left.values() if e["count"] > 0]


def by_axis(clock: Clock, entries: list[dict], keep=lambda e: True) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for e in entries:
        if keep(e):
            out[e["axis"]] += clock.seconds(e)
    return dict(out)


def spread(total: float, weights: dict[str, float]) -> dict[str, float]:
    """`total` shared among the axes in proportion to `weights`."""
    whole = sum(weights.values())
    return {a: total * w / whole for a, w in weights.items()} if whole > 0 else {}


def param_exposed(clock: Clock, entries: list[dict], traffic, *, compiled: bool, buckets: int, micro_steps: int,
                  forward: float, backward: float, held_once: bool) -> dict[str, dict[str, float]]:
    """Per phase ("forward", "backward"), per axis: the waited seconds of a rank's
    parameter traffic over a step (`entries`: its step_collectives with activations
    False), beside one micro-batch's `forward` and `backward` compute. `held_once`: a
    plain step's all-reduces (fsdp_accumulate unsharded: and reduce-scatters) issued
    once per step (not a pipeline rank's)."""
    hide, share = buckets > 0 and traffic.prefetch > 0, clock.hw.comm_overlap
    fwd = by_axis(clock, entries, lambda e: e["phase"] == "forward")
    if traffic.keep_gathered:
        each = micro_steps if traffic.zero == 2 else 1
        bwd = by_axis(clock, entries, lambda e: e["phase"] == "backward")
        return {"forward": spread(overlapped(sum(fwd.values()), forward, buckets, hide and not compiled, share), fwd),
                "backward": spread(overlapped(sum(bwd.values()), backward * each, buckets * each,
                                              hide and not compiled, share), bwd)}
    after = (lambda e: e["op"] == "all_reduce_sum" or (traffic.fsdp_accumulate == "unsharded"
                                                      and e["op"] == "reduce_scatter_sum")) \
        if compiled and held_once else (lambda e: False)
    bwd = by_axis(clock, entries, lambda e: e["phase"] == "backward" and not after(e))
    late = by_axis(clock, entries, lambda e: e["phase"] == "backward" and after(e))
    n = buckets * micro_steps
    out = {"forward": spread(overlapped(sum(fwd.values()), forward * micro_steps, n, hide, share), fwd),
           "backward": spread(overlapped(sum(bwd.values()), backward * micro_steps, n, hide, share), bwd)}
    for axis, s in late.items():
        out["backward"][axis] = out["backward"].get(axis, 0.0) + s
    return out


def activation_exposed(clock: Clock, entries: list[dict], attention: dict[str, float]) -> dict[str, float]:
    """Per axis: the waited seconds of a rank's other traffic (`entries`, pipeline sends
    left out): all of it but cp's ring sends, which hide behind `attention` (seconds per
    phase, "forward" and "backward", over the step)."""
    out: dict[str, float] = defaultdict(float)
    ring = defaultdict(float)
    for e in entries:
        if e["axis"] == "pp" and e["op"] in ("send", "recv"):
            continue
        if e["axis"] == "cp" and e["op"] == "recv":
            ring[e["phase"]] += clock.seconds(e)
        else:
            out[e["axis"]] += clock.seconds(e)
    for phase, s in ring.items():
        out["cp"] += beside(s, attention.get(phase, 0.0), clock.hw.comm_overlap)
    return dict(out)


BLOCK_AXES = ("tp", "cp", "ep")  # whose activation collectives a block issues and waits at once


def skew_exposed(clock: Clock, params: list[dict], others: list[dict], *, hidden: bool,
                 compute: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per phase, per axis: Hardware.sync_skew times the phase's `compute` (seconds over
    the step) where the phase waits for collectives as it issues them (module
    docstring), shared among their axes by their seconds: the blocks' activation
    traffic (`others`), and the parameters' (`params`) unless `hidden` (issued ahead)."""
    skew = clock.hw.sync_skew
    out: dict[str, dict[str, float]] = {phase: {} for phase in compute}
    if skew <= 0:  # the built-ins: nothing to share out (and --search prices many layouts)
        return out
    for phase, seconds in compute.items():
        waited = by_axis(clock, others, lambda e: e["phase"] == phase and e["op"] != "send"
                         and any(a in BLOCK_AXES for a in e["axis"].split("+")))
        if not hidden:
            for axis, s in by_axis(clock, params, lambda e: e["phase"] == phase).items():
                waited[axis] = waited.get(axis, 0.0) + s
        out[phase] = spread(skew * seconds, waited)
    return out
