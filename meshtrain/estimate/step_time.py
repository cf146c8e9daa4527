"""How long a step takes, before any rank starts: the `time` of `meshtrain plan`.

The model reads a `Hardware` (hardware.py: a built-in, a file, or `meshtrain calibrate`'s
measurement) and adds up, for the rank that finishes last:

- compute per micro-batch (step_work.py): matmuls, attention, element-wise work and the
  host's launches, from the family's recorded forward on the plan; recomputation for the
  checkpointing mode (full: the blocks' forward again; selective: their element-wise ops);
- communication the step waits for (comm_time.py): parameter gathers and reductions
  beside the compute they hide behind (prefetch, buckets, reshard_after_forward,
  fsdp_accumulate, kept weights), the activations' collectives (tp, cp, ep, the loss),
  and the ranks' drift apart before the collectives waited as they are issued;
- the optimizer update: bytes over the memory bandwidth (AdamW's foreach ops eager, one
  fused pass compiled), and Muon's Newton-Schulz products;
- a pipeline: the schedule simulated (pipeline/simulate.py) with each stage's modelled
  forward, backward and weight-gradient times and the boundary sends; the rank that is
  busiest is reported, its idle time as the bubble.

`breakdown` adds up to `step_s`. What the model does not see is in docs/plan.md:
contention between overlapped compute and communication beyond the hardware's one
measured share, the ranks' drift beyond one measured cost per second of compute,
kernels' efficiency beyond the FLOP curve, activation and optimizer offload's host
transfers, and routing beyond the expected load."""

from __future__ import annotations

import math

from ..config import RunConfig
from ..layout.buckets import plan_buckets
from ..layout.plan import Plan, without_pp
from ..layout.traffic import check_bucket
from ..models.family import RESIDUAL
from ..models.policy import Policy
from ..pipeline.simulate import simulate
from ..train.muon import muon_name
from .comm_time import Clock, activation_exposed, minus, param_exposed, skew_exposed
from .comms import step_collectives
from .compute import attention_span, step_compute
from .hardware import Hardware
from .step_work import Work, WorkWalk, dtype_on, stretch_work
from .walker import Walker

# Bytes per parameter element of one AdamW step: eager, the foreach ops of train/optim.py
# (each reads and writes its operands) with the clip and the norm; compiled, one pass
# reading parameter, gradient and moments and writing parameter and moments.
ADAMW_BYTES = {False: 108, True: 32}
ADAMW_KERNELS = 13  # foreach ops, eager
# Tensors one foreach kernel takes on a GPU (multi_tensor_apply's lists, assumed); a CPU
# (no host overlap) runs a foreach op tensor by tensor.
FOREACH_TENSORS = 24
NEWTON_SCHULZ_STEPS = 5


def step_time(cfg: RunConfig, model, plan: Plan, hw: Hardware, *, world: int, gpus_per_node: int,
              collectives: list[dict], params: list[dict], pipeline=None) -> dict:
    """The step's modelled time on `hw` (module docstring). `collectives`: the rank's
    step_collectives (the dry run's), `params`: those of its parameters
    (activations=False); `pipeline`: the PipelineEstimate, whose ranks carry both."""
    clock = Clock(hw, plan.mesh, world, gpus_per_node)
    part = _pipelined(cfg, model, plan, hw, clock, pipeline) if pipeline is not None else \
        _plain(cfg, model, plan, hw, clock, collectives, params)
    t = cfg.train
    step = sum(v for k, v in part.items() if k != "exposed_comm") + sum(part["exposed_comm"].values())
    tokens = t.global_batch * t.seq_len
    flops = step_compute(cfg, model, world)["step_flops_per_rank"]
    peak = hw.peak_tflops.get(dtype_on(hw, t.precision if t.precision != "fp8" else "bf16"))
    return {"hardware": hw.name, "step_s": step, "tokens_per_s_per_gpu": tokens / step / world,
            "mfu": flops / step / (peak * 1e12) if peak else None,
            "breakdown": {k: ({a: s for a, s in sorted(v.items()) if s > 0} if isinstance(v, dict) else v)
                          for k, v in part.items()}}


def plain_collectives(cfg: RunConfig, plan: Plan, model) -> tuple[list[dict], list[dict]]:
    """A rank's step_collectives without pp: all of them, and its parameters' alone (what
    step_time takes as `collectives` and `params`)."""
    t, data = cfg.train, plan.mesh.dp * plan.mesh.fsdp
    step = dict(micro_batch_rows=t.micro_batch * data, seq_len=t.seq_len, micro_steps=cfg.accumulation_steps(data),
                precision=t.precision, compiled=bool(t.compile), traffic=cfg.parallel.traffic(),
                activation_checkpointing=t.activation_checkpointing, optimizer=t.optimizer)
    return step_collectives(plan, model, **step), step_collectives(plan, model, **step, activations=False)


def _walk(cfg: RunConfig, plan: Plan, hw: Hardware) -> WorkWalk:
    t, mesh = cfg.train, plan.mesh
    c = 4 if t.precision == "fp32" else 2
    rules = Walker(plan, t.micro_batch * mesh.dp * mesh.fsdp, t.seq_len, c, eager=False)
    policy = Policy.of(t.precision, t.fp8_recipe, t.activation_checkpointing)
    return WorkWalk(rules, hw, t.precision, attention_span(cfg), bool(t.compile), policy)


def _recompute(cfg: RunConfig, blocks: Work) -> Work:
    """What backward recomputes of one micro-batch's blocks: full, their forward;
    selective, their element-wise ops (matmul and attention outputs are kept)."""
    mode = cfg.train.activation_checkpointing
    if mode == "full":  # Work.forward takes a third of `attention`: its forward
        return Work(matmul_fwd=blocks.matmul_fwd, attention=blocks.attention,
                    elementwise_fwd=blocks.elementwise_fwd, host_fwd=blocks.host_fwd)
    if mode == "selective":
        return Work(elementwise_fwd=blocks.elementwise_fwd, host_fwd=blocks.host_elementwise_fwd)
    return Work()


def _compute_parts(work: Work, again: Work, k: float) -> dict:
    """The compute lines of the breakdown for `k` micro-batches of `work`, `again` recomputed."""
    return {"matmuls": k * (work.matmul_fwd + work.matmul_bwd), "attention": k * work.attention,
            "elementwise": k * (work.elementwise_fwd + work.elementwise_bwd),
            "recompute": k * again.forward, "host_overhead": k * (work.host_fwd + work.host_bwd)}


def _plain(cfg: RunConfig, model, plan: Plan, hw: Hardware, clock: Clock, collectives, params) -> dict:
    t, p = cfg.train, cfg.parallel
    micro = cfg.accumulation_steps(plan.mesh.dp * plan.mesh.fsdp)
    blocks, ends = stretch_work(_walk(cfg, plan, hw), model, list(range(model.cfg.n_layers)), True, True)
    work, again = blocks + ends, _recompute(cfg, blocks)
    out = _compute_parts(work, again, micro)
    unit = check_bucket(p.bucket)
    buckets = 0 if unit == "param" else len(plan_buckets(plan, unit)[0])
    exposed = param_exposed(clock, params, p.traffic(), compiled=bool(t.compile), buckets=buckets,
                            micro_steps=micro, forward=work.forward, backward=work.backward + again.forward,
                            held_once=True)
    others = minus(collectives, params)
    rest = activation_exposed(clock, others,
                              {"forward": micro * work.attention / 3, "backward": micro * work.attention * 2 / 3})
    drift = skew_exposed(clock, params, others, hidden=_issued_ahead(p.traffic(), buckets),
                         compute={"forward": micro * work.forward, "backward": micro * (work.backward + again.forward)})
    out["exposed_comm"] = _summed(exposed["forward"], exposed["backward"], rest, drift["forward"], drift["backward"])
    out["optimizer"] = optimizer_seconds(cfg, plan, hw, set(plan.params))
    out["pipeline_bubble"] = 0.0
    return out


def _issued_ahead(traffic, buckets: int) -> bool:
    """Whether the parameters' collectives are issued ahead of their waits (prefetch), or
    gathered once (kept weights): not waited as issued (comm_time.skew_exposed)."""
    return (buckets > 0 and traffic.prefetch > 0) or traffic.keep_gathered


def _summed(*parts: dict) -> dict:
    out: dict[str, float] = {}
    for d in parts:
        for a, s in d.items():
            out[a] = out.get(a, 0.0) + s
    return out


def optimizer_seconds(cfg: RunConfig, plan: Plan, hw: Hardware, names: set[str]) -> float:
    """The update of the parameters a rank holds (their stored shards): AdamW's bytes at
    the memory bandwidth, eager ops at least a launch each; Muon's matrices' Newton-Schulz
    products, the rank's share of each (as train/muon.py assembles them whole on owners)."""
    t = cfg.train
    compiled = bool(t.compile)
    elements, tensors, products = 0, 0, 0.0
    for name in names:
        pp = plan.params[name]
        if not pp.spec.trainable:
            continue
        local, whole = math.prod(pp.local_shape), pp.spec.numel
        shape = pp.spec.shape
        if t.optimizer == "muon" and muon_name(name, len(shape)):
            m, n = sorted((shape[0], math.prod(shape[1:])))
            dtype = dtype_on(hw, "bf16")
            steps = hw.matmul_seconds(m, n, m, dtype) * 2 + hw.matmul_seconds(m, m, m, dtype)
            products += NEWTON_SCHULZ_STEPS * steps * local / whole
        elements += local
        tensors += 1
    update = hw.memory_seconds(ADAMW_BYTES[compiled] * elements)
    per_op = math.ceil(tensors / FOREACH_TENSORS) if hw.host_overlap else tensors
    launches = (1 if compiled else ADAMW_KERNELS * per_op) * hw.launch_s
    return (max(update, launches) if hw.host_overlap else update + launches) + products


def _pipelined(cfg: RunConfig, model, plan: Plan, hw: Hardware, clock: Clock, pipeline) -> dict:
    """Each stage's F, B and W from its layers' work and its rank's waited traffic per
    micro-batch; the schedule simulated with them; the parts of the rank that ends the
    step, its idle time as the bubble."""
    t, p = cfg.train, cfg.parallel
    sub, kept = without_pp(plan), p.traffic().keep_gathered
    walk, micro = _walk(cfg, sub, hw), pipeline.schedule.m
    unit = check_bucket(p.bucket)
    all_buckets = [] if unit == "param" else plan_buckets(sub, unit)[0]
    costs, ranks = {}, {}
    for r in pipeline.ranks:
        mine = [st for st in pipeline.stages if st.rank == r["pp_rank"]]
        works = {st.index: stretch_work(walk, model, list(range(*st.layers)), st.has_embedding, st.has_head)
                 for st in mine}
        per = {s: (b + e, _recompute(cfg, b)) for s, (b, e) in works.items()}
        work = sum((w for w, _ in per.values()), Work())
        again = sum((a for _, a in per.values()), Work())
        names = {n for st in mine for n in st.params + st.shared}
        buckets = sum(all(n in names for n in b.names) for b in all_buckets)
        exposed = param_exposed(clock, r["param_collectives"], p.traffic(), compiled=bool(t.compile),
                                buckets=buckets, micro_steps=micro, forward=work.forward,
                                backward=work.backward + again.forward, held_once=False)
        others = minus(r["collectives"], r["param_collectives"])
        rest = activation_exposed(clock, others,
                                  {"forward": micro * work.attention / 3, "backward": micro * work.attention * 2 / 3})
        drift = skew_exposed(clock, r["param_collectives"], others, hidden=_issued_ahead(p.traffic(), buckets),
                             compute={"forward": micro * work.forward,
                                      "backward": micro * (work.backward + again.forward)})
        # Per micro-batch on the stages: the activations' waits and the drift, and the
        # parameters' unless kept gathered (those come once, after the rank's last backward).
        waited = {phase: sum(exposed[phase].values()) for phase in ("forward", "backward")}
        per_f = (sum(drift["forward"].values()) + (0.0 if kept else waited["forward"])) / micro
        per_b = (sum(rest.values()) + sum(drift["backward"].values()) + (0.0 if kept else waited["backward"])) / micro
        share = {s: (w.forward + w.backward + a.forward) / max(work.forward + work.backward + again.forward, 1e-30)
                 for s, (w, a) in per.items()}
        for s, (w, a) in per.items():
            costs[s] = {"F": w.forward + per_f * share[s], "B": w.backward + a.forward + per_b * share[s],
                        "W": w.wgrad}
        parts = _compute_parts(work, again, micro)
        parts["exposed_comm"] = _summed(exposed["forward"], exposed["backward"], rest, drift["forward"],
                                        drift["backward"])
        parts["optimizer"] = optimizer_seconds(cfg, sub, hw, names)
        # After its last backward: the update, and kept weights' gathers and reductions.
        ranks[r["pp_rank"]] = (parts, parts["optimizer"] + (waited["forward"] + waited["backward"] if kept else 0.0))
    boundary = _boundary_bytes(cfg, model, sub)
    result = simulate(pipeline.schedule, stage_costs=costs, cost_comm=clock.p2p(boundary))
    # The step ends with the rank that ends last; its idle time is the bubble.
    last = max(range(len(result.finish)), key=lambda r: result.finish[r] + ranks[r][1])
    parts, after = ranks[last]
    parts["pipeline_bubble"] = result.finish[last] - result.busy[last]
    return parts


def _boundary_bytes(cfg: RunConfig, model, sub: Plan) -> int:
    """One micro-batch's residual stream shard sent between stages (compute dtype)."""
    t, mesh = cfg.train, sub.mesh
    c = 4 if t.precision == "fp32" else 2
    shape = (t.micro_batch * mesh.dp * mesh.fsdp, t.seq_len, model.cfg.dim)
    return c * math.prod(sub.activation(RESIDUAL).local_shape(shape, mesh))

