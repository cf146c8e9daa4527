"""What a pipelined layout costs on each pp rank, from the plan alone (`meshtrain plan`).

Ranks of different pipeline stages hold different parameters and run different layers,
so memory and collectives are estimated per pp rank and the most loaded one is reported:

- memory: `per_rank_memory` on the stage plan (the mesh without pp) with the rank's
  parameters: their state, the weights autograd keeps and the transients once, plus the
  activations of the micro-batches in flight (from a stage's F until its B, or its W when
  the backward is split: `simulate.in_flight`), each counted at its own stage: that
  stage's layers and what every stage builds per micro-batch (RoPE tables, document
  masks), the embedding's ids only on the first stage, the head and loss only on the
  last. The moment counted is the one in the rank's action order where these bytes
  are largest (with stages of different sizes not always the one with the most
  micro-batches in flight).
- collectives: `step_collectives` on the stage plan for the rank's layers (the loss per
  micro-step), plus its parameters' traffic (its buckets: those it holds whole), less
  the backward gathers its schedule saves (a backward that starts with the bucket the
  rank's last backward gathered again, with no forward between, takes that); with
  parallel.pp_keep_gathered (`keep_gathered`) that traffic once per step instead
  (`step_collectives` parameters "kept": every bucket gathered in the compute dtype before
  the first micro-batch, the fp32 gradient sums reduced after the last backward; its memory in
  `per_rank_memory`'s `kept_weights` and `kept_grads`); plus the
  point-to-point traffic on pp: per micro-batch, per stage boundary the rank touches, one
  activation forward and one gradient backward, each this rank's shard of the
  (batch, seq, dim) residual stream in the compute dtype; a tied embedding's gradient
  exchange between the first and last stage's ranks; the grad-norm all-reduce over the
  whole world and the loss's over pp.
- timing: the schedule simulated with per-stage costs proportional to the partition's
  FLOPs (forward 1/3, backward 2/3, communication free): step time in units of the mean
  stage's forward, bubble fraction, and peak in-flight micro-batches per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .comms import backward_regathers, step_collectives
from .memory import per_rank_memory, total_peak
from ..models.family import RESIDUAL
from ..layout.plan import Plan, without_pp
from ..layout.traffic import Traffic
from ..pipeline.partition import Stage, partition
from ..pipeline.schedule import B, BI, BW, F, PipelineSchedule, build_pipeline_schedule
from ..pipeline.simulate import Result, in_flight, simulate, stage_costs_from_partition


@dataclass
class PipelineEstimate:
    stages: list[Stage]
    schedule: PipelineSchedule
    timing: Result
    ranks: list[dict]  # per pp rank: pp_rank, stages, layers, memory, collectives, param_collectives, param_bytes

    @property
    def most_loaded(self) -> dict:
        """The pp rank with the highest peak memory."""
        return max(self.ranks, key=lambda r: r["memory"]["peak"])

    @property
    def busiest(self) -> dict:
        """The pp rank that moves the most bytes per step."""
        return max(self.ranks, key=lambda r: sum(c["bytes"] for c in r["collectives"]))

    def to_dict(self) -> dict:
        s = self.schedule
        return {
            "schedule": s.name, "pp": s.pp, "virtual": s.v, "micro_batches": s.m,
            "stages": [{"index": st.index, "pp_rank": st.rank, "layers": list(st.layers),
                        "embedding": st.has_embedding, "head": st.has_head, "params": len(st.params),
                        "shared": list(st.shared), "gflops": st.flops / 1e9} for st in self.stages],
            "bubble": self.timing.bubble, "step_time": self.timing.step_time,
            "peak_in_flight": list(self.timing.peak_in_flight),
            "per_rank": [{"pp_rank": r["pp_rank"], "stages": r["stages"], "layers": r["layers"],
                          "peak_bytes": int(r["memory"]["peak"]), "activations_bytes": int(r["memory"]["activations"]),
                          "collective_bytes": sum(c["bytes"] for c in r["collectives"])} for r in self.ranks],
            "timeline": timeline_lines(s),
        }


def _kept_regathers(collectives: list[dict], actions, regathers: dict) -> None:
    """Take from `collectives` (a pp rank's parameter traffic) the backward gathers its
    schedule saves: the runtime keeps the bucket it gathered again last until the rank's
    next forward, so a backward (B; BI, or BW on stage 0, whose BI does nothing) that
    starts with that bucket does not gather it again. `regathers`: stage ->
    backward_regathers of one micro-batch."""
    held = None
    for a in actions:
        if a.kind == F:
            held = None
        elif a.kind == B or (a.kind == BI and a.stage > 0) or (a.kind == BW and a.stage == 0):
            runs = regathers.get(a.stage) or []
            if runs and runs[0][0] == held:
                for (_, op, axis), (n, nbytes) in runs[0][1].items():
                    entry = next(e for e in collectives
                                 if (e["phase"], e["op"], e["axis"]) == ("backward", op, axis))
                    entry["count"] -= n
                    entry["bytes"] -= nbytes
            if runs:
                held = runs[-1][0]
    collectives[:] = [e for e in collectives if e["count"]]


def _merged(*lists: list[dict]) -> list[dict]:
    """Collective entries summed per (axis, op, phase)."""
    out: dict[tuple, dict] = {}
    for e in (e for entries in lists for e in entries):
        key = (e["axis"], e["op"], e["phase"])
        had = out.get(key)
        out[key] = dict(e) if had is None else {**had, "count": had["count"] + e["count"],
                                                "bytes": had["bytes"] + e["bytes"]}
    return list(out.values())


def timeline_lines(schedule: PipelineSchedule, max_actions: int = 48) -> list[str]:
    """Each rank's compute actions in order (F/B/I/W stage.micro), cut after max_actions."""
    out = []
    for line in schedule.timeline().splitlines():
        head, _, acts = line.partition(": ")
        toks = acts.split()
        more = f" ... (+{len(toks) - max_actions} more)" if len(toks) > max_actions else ""
        out.append(f"{head}: {' '.join(toks[:max_actions])}{more}")
    return out


def pipeline_estimate(plan: Plan, model, *, pp_schedule: str, virtual: int, layout: list[int] | None,
                      micro_batch: int, seq_len: int, micro_steps: int, precision: str = "fp32",
                      compiled: bool = False, activation_checkpointing: str = "none",
                      device: str = "cuda", traffic: Traffic = Traffic(), mask_keys=None,
                      memory_only: bool = False, optimizer: str = "adamw",
                      optimizer_offload: bool = False, collectives_only: bool = False) -> PipelineEstimate:
    """traffic: the stages' parameter traffic, as make_pipeline_step takes it (its
    keep_gathered: parallel.pp_keep_gathered); mask_keys: as per_rank_memory's. Each
    rank's `param_bytes`: its parameters' gathers and reductions over the stage mesh per
    step (not the tied table's exchange).
    memory_only: no collectives (most of the cost; for the advice's search); collectives_only:
    no memory (each rank's is {"peak": 0}; for the layout search, which planned it). optimizer:
    train.optimizer (its state's bytes; Muon's gathers)."""
    pp = plan.mesh.pp
    stages = partition(model, pp, virtual, layout, seq_len=seq_len, micro_batch=micro_batch)
    sched = build_pipeline_schedule(pp_schedule, pp, micro_steps, virtual)
    timing = simulate(sched, stage_costs=stage_costs_from_partition(stages))
    sub = without_pp(plan)
    data = sub.mesh.dp * sub.mesh.fsdp
    c = 2 if precision in ("bf16", "fp16", "fp8") else 4
    boundary = c * math.prod(sub.activation(RESIDUAL).local_shape((micro_batch * data, seq_len, model.cfg.dim),
                                                                  sub.mesh))
    tied_bytes = math.prod(sub.params["tok_emb"].local_shape) * 4 if model.cfg.tie_embeddings else 0
    last = len(stages) - 1
    world_axis = "world" if len(plan.mesh.axes) > 1 else "pp"
    ranks = []
    for r in range(pp):
        mine = [st for st in stages if st.rank == r]
        names = [n for st in mine for n in st.params + st.shared]
        first, has_head = any(st.has_embedding for st in mine), any(st.has_head for st in mine)
        common = dict(micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                      activation_checkpointing=activation_checkpointing, traffic=traffic, device=device, names=names,
                      mask_keys=mask_keys, optimizer=optimizer, optimizer_offload=optimizer_offload)
        memory = {"peak": 0} if collectives_only else _rank_memory(sub, model, mine, sched.ranks[r], common, device)
        if memory_only:
            ranks.append({"pp_rank": r, "stages": [st.index for st in mine], "layers": sum(st.n_layers for st in mine),
                          "memory": memory, "collectives": [], "param_collectives": [], "param_bytes": 0})
            continue
        # The last stage reduces each micro-step's loss over the token-splitting dims (the
        # pipeline step's cross_entropy_sum), not the step's once.
        step = dict(micro_batch_rows=micro_batch * data, seq_len=seq_len, micro_steps=micro_steps,
                    precision=precision, compiled=compiled, layers=[i for st in mine for i in range(*st.layers)],
                    embedding=first, head=has_head, traffic=traffic, names=names, loss_once=False,
                    activation_checkpointing=activation_checkpointing)
        params = step_collectives(sub, model, **step, parameters="kept" if traffic.keep_gathered else "each",
                                  activations=False)
        if not traffic.keep_gathered and not compiled and traffic.reshard_after_forward:
            _kept_regathers(params, sched.ranks[r], {
                st.index: backward_regathers(sub, model, micro_batch_rows=micro_batch * data, seq_len=seq_len,
                                             layers=list(range(*st.layers)), names=names, embedding=st.has_embedding,
                                             head=st.has_head, precision=precision, traffic=traffic)
                for st in mine})
        collectives = _merged(params, [e for e in step_collectives(sub, model, **step, parameters="none",
                                                                   optimizer=optimizer)
                                       if not (e["phase"] == "optimizer" and e["op"] == "all_reduce_sum")])
        collectives += _pipeline_traffic(model, mine, micro_steps, boundary, last,
                                         tied_bytes if (first or has_head) and pp > 1 else 0, world_axis)
        order = ("forward", "backward", "optimizer")
        collectives.sort(key=lambda e: (order.index(e["phase"]), e["axis"] == "world", e["axis"], e["op"]))
        ranks.append({"pp_rank": r, "stages": [st.index for st in mine], "layers": sum(st.n_layers for st in mine),
                      "memory": memory, "collectives": collectives, "param_collectives": params,
                      "param_bytes": sum(e["bytes"] for e in params)})
    return PipelineEstimate(stages, sched, timing, ranks)


def _rank_memory(sub: Plan, model, mine: list[Stage], actions, common: dict, device: str) -> dict:
    """The memory of the pp rank holding stages `mine` (`actions`: its schedule): state,
    saved weights and transients once (no micro-batch in flight); then what one
    micro-batch keeps on each stage, times the stage's micro-batches in flight at the
    moment the rank holds the most."""
    first, has_head = any(st.has_embedding for st in mine), any(st.has_head for st in mine)
    memory = per_rank_memory(sub, model, **common, layers=[i for st in mine for i in range(*st.layers)],
                             embedding=first, head=has_head, in_flight=0)
    per_stage = {st.index: per_rank_memory(sub, model, **common, layers=list(range(*st.layers)),
                                           embedding=st.has_embedding, head=st.has_head)
                 for st in mine}
    held = {s: m["activations_layers"] + m["activations_once"] + m["loss_saved"] for s, m in per_stage.items()}
    at_peak = max(in_flight(actions), key=lambda n: sum(k * held[s] for s, k in n.items()))
    kept = sum(k * held[s] for s, k in at_peak.items())
    memory.update(activations=memory["activations"] + kept,
                  activations_layers=sum(k * per_stage[s]["activations_layers"] for s, k in at_peak.items()),
                  host_activations=sum(k * per_stage[s]["host_activations"] for s, k in at_peak.items()))
    memory["peak"], memory["allocator_slack"] = total_peak(memory, device)
    return memory


def _pipeline_traffic(model, mine: list[Stage], micro_steps: int, boundary: int, last: int, tied_bytes: int,
                      world_axis: str) -> list[dict]:
    """The pipeline's own traffic on a rank holding stages `mine`: per micro-batch an
    activation out of every stage but the last (`boundary` bytes) and a gradient back out
    of every stage but the first; the tied table's gradient exchange (`tied_bytes`, 0:
    none); the grad norm over the world and the loss (with MoE the metrics) over pp."""
    fwd_send = sum(st.index < last for st in mine) * micro_steps
    fwd_recv = sum(st.index > 0 for st in mine) * micro_steps
    p2p = [("send", "forward", fwd_send), ("recv", "forward", fwd_recv),
           ("send", "backward", fwd_recv), ("recv", "backward", fwd_send)]
    out = [{"axis": "pp", "op": op, "phase": phase, "count": n, "bytes": n * boundary} for op, phase, n in p2p if n]
    if tied_bytes:
        out += [{"axis": "pp", "op": op, "phase": "optimizer", "count": 1, "bytes": tied_bytes}
                for op in ("send", "recv")]
    out += [{"axis": world_axis, "op": "all_reduce_sum", "phase": "optimizer", "count": 1, "bytes": 4},
            {"axis": "pp", "op": "all_reduce_sum", "phase": "optimizer", "count": 1, "bytes": 4}]
    if getattr(model.cfg, "moe", None) is not None:  # MoE metrics: worst imbalance, summed terms
        out[-1] = {**out[-1], "count": 2, "bytes": 4 + 8}
        out.append({"axis": "pp", "op": "all_reduce_max", "phase": "optimizer", "count": 1, "bytes": 4})
    return out
