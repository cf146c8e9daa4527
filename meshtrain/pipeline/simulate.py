"""Check a schedule for deadlocks and mistakes, and simulate its timing.

`check` runs the IR under the semantics in `schedule.py` (isend, blocking recv, FIFO
matching per direction between two ranks) and raises `ScheduleError` naming the rank, the
action index and the reason for the first problem: a compute that is missing, repeated,
on the wrong rank or out of order (F before B before W; a stage's F needs its input, its
B the output gradient), a send without its recv or the reverse, a recv that meets a
different send than it expects, or a deadlock (every unfinished rank waits on a recv).

`simulate` runs the same walk with costs: each compute advances its rank's clock, a
recv completes at max(its rank's clock, the send's post time + cost_comm), sends cost the
sender nothing. Bubble fraction = idle time / (pp x step time).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from .schedule import B, BI, BW, COMM, COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, Action, F, PipelineSchedule


class ScheduleError(ValueError):
    """A schedule that is wrong or would deadlock; the message names rank, action, reason."""


def _err(r: int, i: int, a: Action | None, reason: str) -> ScheduleError:
    where = f"rank {r} action {i}" + (f" ({a})" if a is not None else "")
    return ScheduleError(f"{where}: {reason}")


@dataclass(frozen=True)
class Result:
    step_time: float
    bubble: float  # idle / (pp x step_time)
    busy: tuple[float, ...]  # compute time per rank
    peak_in_flight: tuple[int, ...]  # per rank: max micro-batch activations held (F done, backward not)
    finish: tuple[float, ...]  # per rank

    def __str__(self) -> str:
        return (f"step {self.step_time:.4g}  bubble {self.bubble:.2%}  "
                f"peak in-flight {list(self.peak_in_flight)}")


def _static(sched: PipelineSchedule) -> None:
    pp, S, m = sched.pp, sched.n_stages, sched.m
    if len(sched.ranks) != pp:
        raise ScheduleError(f"schedule has {len(sched.ranks)} rank lists for pp={pp}")
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, acts in enumerate(sched.ranks):
        for i, a in enumerate(acts):
            if a.kind not in COMPUTE + COMM:
                raise _err(r, i, None, f"unknown action kind {a.kind!r}")
            if not (0 <= a.stage < S and 0 <= a.micro < m):
                raise _err(r, i, a, f"stage must be in 0..{S - 1} and micro-batch in 0..{m - 1}")
            if sched.rank_of(a.stage) != r:
                raise _err(r, i, a, f"stage {a.stage} lives on rank {sched.rank_of(a.stage)}, not {r}")
            if a.kind in COMM:
                nb = a.stage + (1 if a.kind in (SEND_F, RECV_B) else -1)
                if not 0 <= nb < S:
                    raise _err(r, i, a, f"stage {a.stage} has no neighbour stage {nb} to exchange with")
                if a.peer != sched.rank_of(nb) or a.peer == r:
                    raise _err(r, i, a, f"peer must be rank {sched.rank_of(nb)} (stage {nb}), got {a.peer}")
            key = (a.kind, a.stage, a.micro)
            if key in seen:
                raise _err(r, i, a, f"repeated (first at action {seen[key][1]})")
            seen[key] = (r, i)
    for s in range(S):
        r = sched.rank_of(s)
        for j in range(m):
            tok = f"{s}.{j}"
            if (F, s, j) not in seen:
                raise _err(r, len(sched.ranks[r]), None, f"F{tok} is missing")
            full, split = (B, s, j) in seen, ((BI, s, j) in seen, (BW, s, j) in seen)
            if full and any(split):
                raise _err(r, seen[(B, s, j)][1], None, f"stage {s} micro {j} has both B and BI/BW")
            if not full and split != (True, True):
                raise _err(r, len(sched.ranks[r]), None,
                           f"backward of stage {s} micro {j} is missing (need B{tok}, or I{tok} and W{tok})")
    # every send needs its recv on the peer, and the reverse
    pairs = {SEND_F: (RECV_F, 1), SEND_B: (RECV_B, -1), RECV_F: (SEND_F, -1), RECV_B: (SEND_B, 1)}
    for (kind, s, j), (r, i) in seen.items():
        if kind in pairs:
            other, ds = pairs[kind]
            if (other, s + ds, j) not in seen:
                a = sched.ranks[r][i]
                what = "recv" if kind.startswith("SEND") else "send"
                raise _err(r, i, a, f"no matching {what} {Action(other, s + ds, j)} on rank {a.peer}")


def _run(sched: PipelineSchedule, cost) -> Result:
    """Walk every rank's list; raise ScheduleError on the first problem."""
    _static(sched)
    pp, S = sched.pp, sched.n_stages
    pc = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    done: list[set] = [set() for _ in range(pp)]
    posted: dict[tuple[int, int], list[tuple[Action, float]]] = {}
    taken: dict[tuple[int, int], int] = {}
    comm_cost = cost("comm", 0)

    def need(r: int, i: int, a: Action, key: tuple, why: str) -> None:
        if key not in done[r]:
            raise _err(r, i, a, why)

    while True:
        progressed = False
        for r in range(pp):
            acts = sched.ranks[r]
            while pc[r] < len(acts):
                i, a = pc[r], acts[pc[r]]
                s, j = a.stage, a.micro
                if a.kind == F:
                    if s > 0:
                        if sched.rank_of(s - 1) == r:
                            need(r, i, a, (F, s - 1, j), f"needs F{s - 1}.{j} (same rank) earlier")
                        else:
                            need(r, i, a, (RECV_F, s, j), f"needs its input: rf{s}.{j} must come earlier")
                elif a.kind in (B, BI):
                    need(r, i, a, (F, s, j), f"backward before its forward F{s}.{j}")
                    if s < S - 1:
                        if sched.rank_of(s + 1) == r:
                            if (B, s + 1, j) not in done[r] and (BI, s + 1, j) not in done[r]:
                                raise _err(r, i, a, f"needs the backward of stage {s + 1} micro {j} earlier")
                        else:
                            need(r, i, a, (RECV_B, s, j), f"needs its output gradient: rb{s}.{j} must come earlier")
                elif a.kind == BW:
                    need(r, i, a, (BI, s, j), f"weight backward before its input backward I{s}.{j}")
                elif a.kind == SEND_F:
                    need(r, i, a, (F, s, j), f"sends before F{s}.{j} produced the activation")
                elif a.kind == SEND_B:
                    if (B, s, j) not in done[r] and (BI, s, j) not in done[r]:
                        raise _err(r, i, a, f"sends before the backward of stage {s} micro {j} produced the gradient")
                if a.kind in (SEND_F, SEND_B):
                    posted.setdefault((r, a.peer), []).append((a, clock[r]))
                elif a.kind in (RECV_F, RECV_B):
                    ch = (a.peer, r)
                    k = taken.get(ch, 0)
                    sent = posted.get(ch, [])
                    if k >= len(sent):
                        break  # blocked: the send is not posted yet
                    sa, t = sent[k]
                    want = Action(SEND_F, s - 1, j) if a.kind == RECV_F else Action(SEND_B, s + 1, j)
                    if (sa.kind, sa.stage, sa.micro) != (want.kind, want.stage, want.micro):
                        raise _err(r, i, a, f"is matched with rank {a.peer}'s send #{k} {sa}, expected {want}: "
                                            f"sends and recvs between ranks {a.peer} -> {r} are in a different order")
                    taken[ch] = k + 1
                    clock[r] = max(clock[r], t + comm_cost)
                else:
                    c = cost(a.kind, s)
                    clock[r] += c
                    busy[r] += c
                done[r].add((a.kind, s, j))
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(sched.ranks[r]) for r in range(pp)):
            break
        if not progressed:
            waits = [f"rank {r} action {pc[r]} ({sched.ranks[r][pc[r]]}) waits on rank {sched.ranks[r][pc[r]].peer}"
                     for r in range(pp) if pc[r] < len(sched.ranks[r])]
            raise ScheduleError("deadlock: " + "; ".join(waits))
    step = max(clock) if clock else 0.0
    idle = sum(step - b for b in busy)
    peak = tuple(max((sum(held.values()) for held in in_flight(acts)), default=0) for acts in sched.ranks)
    return Result(step, idle / (pp * step) if step else 0.0, tuple(busy), peak, tuple(clock))


def in_flight(actions: Sequence[Action]) -> Iterator[dict[int, int]]:
    """After each forward in a rank's `actions`: its micro-batches in flight per stage. A
    micro-batch holds its activations on a stage from its F until its B, or its W when the
    backward is split (the input half keeps what the weight half needs)."""
    held: dict[int, int] = {}
    for a in actions:
        if a.kind == F:
            held[a.stage] = held.get(a.stage, 0) + 1
            yield dict(held)
        elif a.kind in (B, BW):
            held[a.stage] -= 1


def check(sched: PipelineSchedule) -> None:
    """Raise ScheduleError if the schedule is wrong or would deadlock."""
    _run(sched, lambda kind, s: 0.0 if kind == "comm" else 1.0)


def simulate(sched: PipelineSchedule, cost_f: float = 1.0, cost_b: float = 2.0, cost_w: float | None = None,
             cost_comm: float = 0.0, stage_costs: Mapping[int, Mapping[str, float]] | None = None) -> Result:
    """Timing of one step. cost_b is the full backward; for split backwards BW costs cost_w
    (default cost_b / 2) and BI costs cost_b - cost_w. stage_costs overrides per stage,
    e.g. {3: {"F": 1.5, "B": 3.0, "W": 1.0}}. Checks the schedule first."""
    w = cost_b / 2 if cost_w is None else cost_w
    base = {F: cost_f, B: cost_b, BI: cost_b - w, BW: w}

    def cost(kind: str, s: int) -> float:
        if kind == "comm":
            return cost_comm
        o = (stage_costs or {}).get(s)
        if o:
            f, b = o.get("F", cost_f), o.get("B", cost_b)
            ww = o.get("W", b / 2 if cost_w is None else cost_w)
            return {F: f, B: b, BI: b - ww, BW: ww}[kind]
        return base[kind]

    return _run(sched, cost)


def stage_costs_from_partition(stages) -> dict[int, dict[str, float]]:
    """Per-stage F/B costs from a partition's FLOPs (forward 1/3, backward 2/3), in units of
    the mean stage's forward."""
    mean = sum(st.flops for st in stages) / len(stages)
    return {st.index: {"F": st.flops / 3 / (mean / 3), "B": 2 * st.flops / 3 / (mean / 3)} for st in stages}
