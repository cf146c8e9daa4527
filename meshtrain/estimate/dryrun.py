"""`meshtrain plan`: a layout at any scale, before a GPU is allocated.

From a RunConfig and a world size alone (no process group, no memory: parameters are
specs), `dry_run` gives the parameter count, the mesh and which ranks share a node on
each axis, every parameter's sharding, per-rank memory of the most loaded rank
(`step_memory.py`), the step's model FLOPs (`compute.py`) and every collective of one
step by mesh axis and phase (`comms.py`), with warnings for layouts that will be slow
and, for one that does not fit the chosen GPU, an error and the layouts that fit,
or what would: more cp or more ranks (`advice.py`); `dryrun_view.py` prints it. Ranks
are numbered in mesh order (pp, dp, fsdp, cp, tp: tp innermost), as `MeshSpec.build`
lays them out and as torchrun places consecutive ranks on one node.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass, field

from rich.console import Console

from ..config import RunConfig
from ..errors import ConfigError
from ..layout.buckets import plan_buckets
from ..layout.traffic import check_bucket
from ..layout.mesh import MESH_AXES
from ..layout.plan import Plan, placement_str, without_pp
from ..layout.plan_table import human_bytes
from .advice import Fit, layouts_that_fit, nothing_fits, search_space, what_would_fit
from .comms import expert_exchange, step_collectives
from .compute import step_compute
from .hardware import Hardware
from .hardware_builtins import BUILTINS
from .layout_search import fastest_first, fastest_layouts
from .dryrun_view import renderables
from .step_memory import GPU_MEMORY, MEMORY_KEYS, step_memory
from .step_time import plain_collectives, step_time

# The advice of a layout over the device: the fastest ADVICE by the step-time model of the
# first ADVICE_POOL that fit, cheapest first by advice.COST.
ADVICE, ADVICE_POOL = 3, 8
# GPU_MEMORY is read from here too (tests, scripts): the built-ins' capacities.
__all__ = ["DryRun", "GPU_MEMORY", "bucket_summary", "default_world", "dry_run", "keep_gathered_sides", "zero_sides"]


@dataclass
class DryRun:
    world: int
    gpus_per_node: int
    plan: Plan
    memory: dict
    collectives: list[dict]
    axis_nodes: dict[str, int]  # mesh axis -> nodes one group of that axis spans
    gpu: str | None = None  # the device's name (a built-in, or a --hardware file's name)
    gpu_memory: int | None = None  # its memory in bytes, the peak's bound
    warnings: list[str] = field(default_factory=list)
    error: str | None = None  # why the layout cannot run (peak memory over the GPU's), with layouts that fit
    pipeline: object | None = None  # PipelineEstimate when parallel.pp > 1: memory and collectives are its most loaded rank's
    expert_exchange: dict | None = None  # comms.expert_exchange: MoE blocks with ep > 1, per layer per micro-step
    keep_gathered: dict | None = None  # keep_gathered_sides: parallel.pp_keep_gathered off and on
    zero_stages: dict | None = None  # zero_sides: parallel.zero 1, 2 and 3 (without pp)
    model: str = ""  # the model in a few words: family, layers, dim, experts
    setup: str = ""  # what sets the activations: micro-batch, sequence, precision, checkpointing, compile
    total_params: int = 0
    active_params: int | None = None  # per token, when experts are routed
    advice: list[Fit] = field(default_factory=list)  # layouts that fit the GPU, fastest first (step-time model)
    lowest: Fit | None = None  # the lowest peak the advice planned, the layout given among them
    would_fit: list[Fit] = field(default_factory=list)  # with no layout that fits: more cp, more ranks
    search: str = ""  # what the advice tried, in words
    buckets: dict | None = None  # bucket_summary: parallel.bucket's unit, count, largest bucket's bytes
    compute: dict = field(default_factory=dict)  # compute.step_compute: the step's model FLOPs
    time: dict | None = None  # step_time.step_time on the device (h100 when none is given)
    fastest: list | None = None  # --search: layout_search.fastest_layouts' Ranked, and what it tried (`searched`)
    searched: dict | None = None

    @property
    def fits(self) -> bool | None:
        """Does the peak fit the GPU (None without one)?"""
        return None if self.gpu_memory is None else self.memory["peak"] <= self.gpu_memory

    def check(self) -> "DryRun":
        if self.error:
            raise ConfigError(self.error)
        return self

    def to_dict(self) -> dict:
        mesh = self.plan.mesh
        return {
            "world": self.world,
            "mesh": {a: mesh.size(a) for a in mesh.axes},
            "gpus_per_node": self.gpus_per_node,
            "nodes_per_group": dict(self.axis_nodes),
            "gpu": self.gpu,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "fits": self.fits,
            "advice": [{"flags": f.flags, "peak": int(f.peak), "tokens_per_s_per_gpu": f.tokens_per_s_per_gpu}
                       for f in self.advice],
            "per_rank_bytes": {k: int(self.memory[k]) for k in MEMORY_KEYS},
            "memory_detail": {k: v for k, v in self.memory.items() if k not in MEMORY_KEYS},
            "collectives": self.collectives,
            "buckets": self.buckets,
            "compute": self.compute,
            "time": self.time,
            "params": [{"name": p.name, "shape": list(p.spec.shape),
                        "placements": [placement_str(x) for x in p.placements],
                        "local_shape": list(p.local_shape)} for p in self.plan.params.values()],
            "warnings": self.warnings,
            "error": self.error,
            "pipeline": {**self.pipeline.to_dict(), "keep_gathered": self.keep_gathered}
            if self.pipeline is not None else None,
            **({"expert_all_to_all": self.expert_exchange} if self.expert_exchange is not None else {}),
            **({"zero_stages": self.zero_stages} if self.zero_stages is not None else {}),
            **(self._search_dict() if self.lowest is not None else {}),
            **({"search": {"fastest": [r.to_dict() for r in self.fastest], **self.searched}}
               if self.fastest is not None else {}),
        }

    def _search_dict(self) -> dict:
        """The advice search beyond `advice`, where it ran: its lowest peak and what would fit."""
        return {"lowest": {"flags": self.lowest.flags, "peak": int(self.lowest.peak)},
                "would_fit": [{"world": f.world, "flags": f.flags, "peak": int(f.peak)} for f in self.would_fit]}

    def render(self, width: int = 80) -> str:
        console = Console(width=width, record=True, file=io.StringIO(), highlight=False)
        for renderable in self.renderables():
            console.print(renderable)
        return console.export_text()

    def renderables(self) -> list:
        """The verdict (parameters, peak, fits or not, layouts that fit), then the tables."""
        return renderables(self)


def _nodes_spanned(mesh, axis: str, gpus_per_node: int) -> int:
    """Nodes that the group of rank 0 along `axis` touches (every group is alike)."""
    stride = mesh.stride(axis)
    return len({k * stride // gpus_per_node for k in range(mesh.size(axis))})


def default_world(cfg: RunConfig) -> int:
    """The smallest world a config can run at on whole nodes: its fixed axes, times (when
    an axis is -1) the least fill that lets ep fold from fsdp x cp, rounded up to whole
    nodes of parallel.nproc_per_node ranks."""
    p = cfg.parallel
    sizes = [getattr(p, a) for a in MESH_AXES]
    fixed = math.prod(n for n in sizes if n != -1)
    if -1 not in sizes:
        return fixed
    return math.lcm(fixed * (p.ep // math.gcd(p.ep, p.cp)), p.nproc_per_node)


def dry_run(cfg: RunConfig, world: int | None = None, gpu: str | Hardware | None = None, *,
            suggest: bool = True, search: bool = False) -> DryRun:
    """Plan `cfg` (a validated RunConfig) at `world` ranks (default: `default_world`). With
    `gpu` (a built-in's name: h100, h200, b200, a100; or a Hardware, e.g. a --hardware
    file's), a peak over the device's memory sets `error` and `advice`, the layouts that
    fit (`check()` raises the error). `search`: also the ten fastest layouts that fit the
    device (h100 without one; layout_search.py). Layouts that cannot be built at all raise
    ConfigError here."""
    if isinstance(gpu, str) and gpu not in BUILTINS:
        raise ConfigError(f"--gpu {gpu!r}: choose one of {', '.join(BUILTINS)}")
    device = BUILTINS[gpu] if isinstance(gpu, str) else gpu
    world = default_world(cfg) if world is None else world
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"--world {world!r}: give a positive number of ranks")
    t, p = cfg.train, cfg.parallel
    gpus_per_node = min(p.nproc_per_node, world)
    if world % gpus_per_node:
        raise ConfigError(f"--world {world} is not a whole number of nodes of parallel.nproc_per_node="
                          f"{p.nproc_per_node} ranks: choose a multiple of {p.nproc_per_node}")
    model = cfg.model_def()
    plan = cfg.plan(world=world)
    dp_size = plan.mesh.dp * plan.mesh.fsdp
    cfg.accumulation_steps(dp_size)  # refuses a batch the mesh cannot split, before any estimate
    memory, pipeline = step_memory(cfg, plan, model)
    keep_gathered = zero = None
    params = None
    if pipeline is not None:
        collectives, experts = pipeline.busiest["collectives"], None
        keep_gathered = keep_gathered_sides(cfg, plan, model, pipeline)
    else:
        collectives, params = plain_collectives(cfg, plan, model)
        experts = expert_exchange(plan, model, micro_batch_rows=t.micro_batch * dp_size, seq_len=t.seq_len,
                                  precision=t.precision)
        zero = zero_sides(cfg, plan, model, memory, collectives)
    axis_nodes = {a: _nodes_spanned(plan.mesh, a, gpus_per_node) for a in plan.mesh.axes}
    total, active = _param_counts(model)
    run = DryRun(world, gpus_per_node, plan, memory, collectives, axis_nodes,
                 device.name if device else None, device.memory_bytes if device else None, pipeline=pipeline,
                 expert_exchange=experts, keep_gathered=keep_gathered, zero_stages=zero, model=_describe(cfg.model),
                 setup=_setup(t),
                 total_params=total, active_params=active, buckets=bucket_summary(plan, p.bucket),
                 compute=step_compute(cfg, model, world))
    hw = device or BUILTINS["h100"]
    run.time = {**step_time(cfg, model, plan, hw, world=world, gpus_per_node=gpus_per_node,
                            collectives=collectives, params=params, pipeline=pipeline), "hardware_given": bool(device)}
    if search:
        run.fastest, run.searched = fastest_layouts(cfg, world, hw)
    run.warnings += [note.removeprefix("note: ") for note in cfg.notes(plan.mesh)]  # what does nothing here
    if cfg.data.mean_doc_len and not cfg.data.document_mask:
        run.warnings.append(f"data.mean_doc_len={cfg.data.mean_doc_len} counts for nothing without "
                            "data.document_mask: attention spans the whole row; turn data.document_mask on")
    for axis in ("tp", "cp"):
        if axis_nodes.get(axis, 1) > 1:
            run.warnings.append(f"parallel.{axis}={plan.mesh.size(axis)} spans {axis_nodes[axis]} nodes: its "
                                f"per-layer collectives will run over the inter-node network; keep {axis} within "
                                f"a node (at most {gpus_per_node} ranks)")
    if device and suggest and not run.fits:
        pool, run.lowest = layouts_that_fit(cfg, world, device.memory_bytes, limit=ADVICE_POOL)
        run.advice = fastest_first(pool, world, hw)[:ADVICE]
        run.search = search_space(cfg, world)
        if not run.advice:
            run.would_fit = what_would_fit(cfg, world, device.memory_bytes)
        run.error = _over_capacity(run)
    return run


def keep_gathered_sides(cfg: RunConfig, plan: Plan, model, pipeline) -> dict | None:
    """parallel.pp_keep_gathered off and on, for a pipelined layout (`pipeline`: its
    estimate as configured) whose stage mesh gathers parameters (fsdp or cp > 1) in
    buckets: per side, the pp rank with the highest peak, that peak and its parameter
    traffic per step (`param_bytes`), so the choice is made from numbers; and which side
    the config sets (`configured`). None otherwise."""
    mesh = without_pp(plan).mesh
    if mesh.fsdp * mesh.cp == 1 or check_bucket(cfg.parallel.bucket) == "param":
        return None
    on = cfg.parallel.pp_keep_gathered
    sides = {on: pipeline, not on: step_memory(cfg, plan, model, keep_gathered=not on)[1]}
    return {"off": _side(sides[False]), "on": _side(sides[True]), "configured": "on" if on else "off"}


def zero_sides(cfg: RunConfig, plan: Plan, model, memory: dict, collectives: list[dict]) -> dict | None:
    """parallel.zero 1, 2 and 3 for a layout without pp whose fsdp x cp shards parameters
    in buckets (`memory`, `collectives`: the configured stage's): per stage the peak and
    the bytes of every collective of a step, and which stage the config sets. Under pp,
    keep_gathered_sides weighs zero 1 (pp_keep_gathered) against 3. None otherwise."""
    p, mesh = cfg.parallel, plan.mesh
    if mesh.pp > 1 or mesh.fsdp * mesh.cp == 1 or check_bucket(p.bucket) == "param":
        return None
    t = cfg.train
    out: dict = {"configured": p.zero}
    for zero in (1, 2, 3):
        peak, moved = memory["peak"], collectives
        if zero != p.zero:
            accumulate = "sharded" if zero < 3 else p.fsdp_accumulate
            other = dataclasses.replace(cfg, parallel=dataclasses.replace(p, zero=zero, fsdp_accumulate=accumulate))
            peak = step_memory(other, plan, model)[0]["peak"]
            moved = step_collectives(plan, model, micro_batch_rows=t.micro_batch * mesh.dp * mesh.fsdp,
                                           seq_len=t.seq_len, micro_steps=cfg.accumulation_steps(mesh.dp * mesh.fsdp),
                                           precision=t.precision, compiled=bool(t.compile),
                                           traffic=other.parallel.traffic(),
                                           activation_checkpointing=t.activation_checkpointing, optimizer=t.optimizer)
        out[str(zero)] = {"peak_bytes": int(peak), "collective_bytes": sum(e["bytes"] for e in moved)}
    return out


def _side(pipeline) -> dict:
    r = pipeline.most_loaded
    return {"pp_rank": r["pp_rank"], "peak_bytes": int(r["memory"]["peak"]), "param_bytes": r["param_bytes"]}


def bucket_summary(plan: Plan, bucket) -> dict:
    """parallel.bucket's buckets over the whole model (under pp, the stage mesh's: each pp
    rank holds some of them): the unit, how many, and the largest one's bytes (its
    members' compute-local elements in the parameters' dtype: what a size in MB bounds).
    With bucket param, none."""
    unit = check_bucket(bucket)
    sub = without_pp(plan) if plan.mesh.pp > 1 else plan
    buckets, _ = plan_buckets(sub, unit)
    return {"unit": unit, "count": len(buckets), "largest_bytes": max((b.nbytes(sub) for b in buckets), default=0)}


def _param_counts(model) -> tuple[int, int | None]:
    """(total, active per token): a token runs top_k of a block's routed experts."""
    total = sum(s.numel for s in model.specs.values())
    moe = getattr(model.cfg, "moe", None)
    if moe is None:
        return total, None
    routed = sum(s.numel for s in model.specs.values() if "experts" in s.axes)
    return total, total - routed + routed * moe.top_k // moe.num_experts


def _describe(m) -> str:
    words = f"{m.arch}, {m.n_layers} layers, dim {m.dim}"
    return words + (f", {m.moe.num_experts} experts top {m.moe.top_k}" if m.moe is not None else "")


def _setup(t) -> str:
    checkpointing = {"none": "no checkpointing", "offload": "activations offloaded"}.get(
        t.activation_checkpointing, f"{t.activation_checkpointing} checkpointing")
    return (f"micro_batch {t.micro_batch} x seq_len {t.seq_len}, {t.precision}, {checkpointing}, "
            f"{'compiled' if t.compile else 'eager'}" + (", optimizer state offloaded" if t.optimizer_offload else ""))


def _over_capacity(run: DryRun) -> str:
    """The one-line error of a layout over the GPU's memory, with the layouts that fit."""
    capacity = run.gpu_memory
    head = (f"peak memory {human_bytes(run.memory['peak'])} per rank exceeds the {run.gpu} "
            f"({human_bytes(capacity)}) at world {run.world}")
    if run.advice:
        return f"{head}; layouts that fit, fastest first (modelled): " + "; ".join(
            f"{f.flags} ({human_bytes(f.peak)})" for f in run.advice)
    return "; ".join([head, *nothing_fits(run.search, run.lowest, run.would_fit, run.world)])
