"""The pipeline schedule IR: per pp rank, an ordered list of actions.

Compute actions, on the rank that holds the stage (stage s lives on rank s % pp):
  F(s, i)    forward of stage s on micro-batch i
  B(s, i)    full backward (input and weight gradients)
  BI(s, i)   backward for the stage's input only (zero-bubble split)
  BW(s, i)   backward for the weights (after BI(s, i)); B or BI+BW, never both
Communication, between the ranks of neighbouring stages (only when they differ):
  SEND_F(s, i) / RECV_F(s+1, i)   stage s's output activation, to stage s+1's rank
  SEND_B(s, i) / RECV_B(s-1, i)   the gradient of stage s's input, to stage s-1's rank
The recv names the stage that consumes the tensor; the send the stage that produced it.
Generators put each recv right before the compute that needs it and each send right
after the compute that produces it.

Communication semantics (what `simulate.check` verifies and the executor must do): a
rank walks its list in order; a SEND is posted without waiting (isend); a RECV blocks
until its matching send has been posted; between two ranks, in each direction, the k-th
send matches the k-th recv (NCCL/gloo match point-to-point in posting order), so the two
lists must agree on that order.

Tokens: F0.3 = forward of stage 0, micro-batch 3; B, I (backward-input), W
(backward-weight); sf/rf/sb/rb for the sends and recvs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

F, B, BI, BW = "F", "B", "BI", "BW"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, BI, BW)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)
_TOKEN = {F: "F", B: "B", BI: "I", BW: "W", SEND_F: "sf", RECV_F: "rf", SEND_B: "sb", RECV_B: "rb"}


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    micro: int
    peer: int | None = None  # the other rank, for SEND_* / RECV_*

    def __str__(self) -> str:
        return f"{_TOKEN[self.kind]}{self.stage}.{self.micro}"

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "stage": self.stage, "micro": self.micro}
        if self.peer is not None:
            d["peer"] = self.peer
        return d


@dataclass(frozen=True)
class PipelineSchedule:
    pp: int
    v: int
    m: int
    name: str
    ranks: tuple[tuple[Action, ...], ...]  # ranks[r]: rank r's actions in order

    @property
    def n_stages(self) -> int:
        return self.pp * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def timeline(self, comm: bool = False) -> str:
        """One line per rank: its actions in order (compute only unless comm=True)."""
        w = len(str(self.pp - 1))
        lines = []
        for r, acts in enumerate(self.ranks):
            toks = [str(a) for a in acts if comm or a.kind in COMPUTE]
            lines.append(f"rank {r:>{w}}: " + " ".join(toks))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.timeline()

    def to_dict(self) -> dict:
        return {"name": self.name, "pp": self.pp, "v": self.v, "m": self.m,
                "ranks": [[a.to_dict() for a in acts] for acts in self.ranks]}

    @classmethod
    def from_dict(cls, d: dict) -> PipelineSchedule:
        ranks = tuple(tuple(Action(a["kind"], a["stage"], a["micro"], a.get("peer")) for a in acts)
                      for acts in d["ranks"])
        return cls(d["pp"], d["v"], d["m"], d["name"], ranks)


def with_comm(pp: int, v: int, m: int, name: str, compute: list[list[tuple[str, int, int]]]) -> PipelineSchedule:
    """Insert the sends and recvs around per-rank compute orders: a recv right before the
    compute that consumes it, a send right after the compute that produces it."""
    S = pp * v
    ranks = []
    for r, order in enumerate(compute):
        acts: list[Action] = []
        for kind, s, i in order:
            if kind == F and s > 0 and (s - 1) % pp != r:
                acts.append(Action(RECV_F, s, i, (s - 1) % pp))
            if kind in (B, BI) and s < S - 1 and (s + 1) % pp != r:
                acts.append(Action(RECV_B, s, i, (s + 1) % pp))
            acts.append(Action(kind, s, i))
            if kind == F and s < S - 1 and (s + 1) % pp != r:
                acts.append(Action(SEND_F, s, i, (s + 1) % pp))
            if kind in (B, BI) and s > 0 and (s - 1) % pp != r:
                acts.append(Action(SEND_B, s, i, (s - 1) % pp))
        ranks.append(tuple(acts))
    return PipelineSchedule(pp, v, m, name, tuple(ranks))


def _check_pm(pp: int, m: int, v: int = 1) -> None:
    if pp < 1:
        raise ConfigError(f"parallel.pp={pp}: must be >= 1")
    if v < 1:
        raise ConfigError(f"parallel.pp_virtual={v}: must be >= 1")
    if m < 1:
        raise ConfigError(f"micro-batch count m={m}: a pipeline step needs at least one micro-batch")


def gpipe(pp: int, m: int) -> PipelineSchedule:
    """All forwards, then all backwards (in micro-batch order)."""
    _check_pm(pp, m)
    return with_comm(pp, 1, m, "gpipe",
                     [[(F, r, i) for i in range(m)] + [(B, r, i) for i in range(m)] for r in range(pp)])


def _one_f_one_b_order(pp: int, m: int, r: int) -> list[tuple[str, int, int]]:
    warm = min(pp - r - 1, m)
    order = [(F, r, i) for i in range(warm)]
    for k in range(m - warm):
        order += [(F, r, warm + k), (B, r, k)]
    return order + [(B, r, k) for k in range(m - warm, m)]


def one_f_one_b(pp: int, m: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): rank r runs pp - r - 1 warm-up forwards, then alternates one
    forward and one backward, then drains the backwards. At most pp - r micro-batches in
    flight on rank r."""
    _check_pm(pp, m)
    return with_comm(pp, 1, m, "1f1b", [_one_f_one_b_order(pp, m, r) for r in range(pp)])


def zb_h1(pp: int, m: int, extra_in_flight: int = 0) -> PipelineSchedule:
    """ZB-H1 (zero-bubble with 1F1B's activation memory): the backward split into BI (input
    gradient, on the critical path) and BW (weight gradient, off it), the BWs deferred into
    what would be bubbles. The order is made by list-scheduling with unit costs
    (F = BI = BW): whenever a rank is free it runs, in this priority, a BI whose gradient
    has arrived, an F whose input has arrived if fewer than pp - r (+ extra_in_flight)
    micro-batches are held (F done, BW not done; 1F1B's bound), else a pending BW, else it
    waits. With f = bI = w and no slack this idles 2(p-1)f per rank against 1F1B's
    3(p-1)f; the paper's hand-made ZB-H1 reaches (p-1)f (a known gap)."""
    _check_pm(pp, m)
    nf, nb = [0] * pp, [0] * pp  # next micro-batch for F / BI per rank
    f_done = [[None] * m for _ in range(pp)]  # finish tick of F(r, i)
    b_done = [[None] * m for _ in range(pp)]
    pending: list[list[int]] = [[] for _ in range(pp)]
    held = [0] * pp  # F done, BI not done
    kept = [0] * pp  # F done, BW not done
    order: list[list[tuple[str, int, int]]] = [[] for _ in range(pp)]
    t, left = 0, 3 * m * pp
    while left:
        for r in range(pp):
            i, j = nb[r], nf[r]
            if i < j and (r == pp - 1 or (b_done[r + 1][i] is not None and b_done[r + 1][i] <= t)):
                act = (BI, r, i)
                nb[r] += 1
                b_done[r][i] = t + 1
                pending[r].append(i)
                held[r] -= 1
            elif (j < m and held[r] < pp - r and kept[r] < pp - r + extra_in_flight
                  and (r == 0 or (f_done[r - 1][j] is not None and f_done[r - 1][j] <= t))):
                act = (F, r, j)
                nf[r] += 1
                f_done[r][j] = t + 1
                held[r] += 1
                kept[r] += 1
            elif pending[r]:
                act = (BW, r, pending[r].pop(0))
                kept[r] -= 1
            else:
                continue
            order[r].append(act)
            left -= 1
        t += 1
    return with_comm(pp, 1, m, "zb", order)


def interleaved_1f1b(pp: int, v: int, m: int) -> PipelineSchedule:
    """Megatron's interleaved 1F1B: rank r holds stages r, r + pp, ..., r + (v-1) pp (its
    "chunks"). Forwards run in groups of pp micro-batches per chunk, chunk 0 to v-1;
    backwards the same groups, chunk v-1 to 0. Rank r warms up with
    (pp - r - 1) x 2 + (v - 1) x pp forwards, then alternates. Needs m % pp == 0."""
    _check_pm(pp, m, v)
    if v < 2:
        raise ConfigError(f"parallel.pp_virtual={v}: the interleaved schedule needs pp_virtual >= 2 "
                          "(use pp_schedule=1f1b for one stage per rank)")
    if m % pp:
        raise ConfigError(f"parallel.pp_schedule=interleaved needs the micro-batch count m={m} to be a "
                          f"multiple of parallel.pp={pp}: choose m in {pp}, {2 * pp}, {3 * pp}, ...")
    total = m * v

    def fwd(k: int, r: int) -> tuple[str, int, int]:
        chunk = (k // pp) % v
        return F, chunk * pp + r, (k // (pp * v)) * pp + k % pp

    def bwd(k: int, r: int) -> tuple[str, int, int]:
        chunk = v - 1 - (k // pp) % v
        return B, chunk * pp + r, (k // (pp * v)) * pp + k % pp

    compute = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        order = [fwd(k, r) for k in range(warm)]
        for k in range(total - warm):
            order += [fwd(warm + k, r), bwd(k, r)]
        order += [bwd(k, r) for k in range(total - warm, total)]
        compute.append(order)
    return with_comm(pp, v, m, "interleaved", compute)


def forward_only(pp: int, v: int, m: int) -> PipelineSchedule:
    """Forwards only, for evaluation (not a training schedule: `check` wants backwards):
    every rank runs its stages in order on micro-batch 0, 1, ..."""
    return with_comm(pp, v, m, "forward", [[(F, s, i) for i in range(m) for s in range(r, pp * v, pp)]
                                           for r in range(pp)])


def build_pipeline_schedule(name: str, pp: int, m: int, v: int = 1) -> PipelineSchedule:
    """The schedule `parallel.pp_schedule` names."""
    if name == "gpipe":
        sched = gpipe
    elif name == "1f1b":
        sched = one_f_one_b
    elif name == "zb":
        sched = zb_h1
    elif name == "interleaved":
        return interleaved_1f1b(pp, v, m)
    else:
        raise ConfigError(f"parallel.pp_schedule={name!r}: choose gpipe, 1f1b, interleaved or zb")
    if v != 1:
        raise ConfigError(f"parallel.pp_virtual={v} needs parallel.pp_schedule=interleaved "
                          f"({name} runs one stage per rank)")
    return sched(pp, m)
