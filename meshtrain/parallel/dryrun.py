"""`meshtrain plan`: a layout at any scale, before a GPU is allocated.

From a RunConfig and a world size alone (no process group, no memory: parameters are
specs), `dry_run` gives the mesh and which ranks share a node on each axis, every
parameter's sharding, per-rank memory of the most loaded rank (`memory.py`) and every
collective of one step by mesh axis and phase (`comms.py`), with warnings for layouts
that will be slow and an error, listing layouts that fit, for one that does not fit the
chosen GPU. Ranks are numbered in mesh order (pp, dp, fsdp, cp, tp: tp innermost), as
`MeshSpec.build` lays them out and as torchrun places consecutive ranks on one node.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

from ..errors import ConfigError
from .mesh import MESH_AXES
from .plan import Plan, placement_str
from .plan_table import human_bytes

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "peak")
# Device memory in bytes (data sheet capacities).
GPU_MEMORY = {"h100": 80 * 10**9, "h200": 141 * 10**9, "a100": 80 * 10**9}


@dataclass
class DryRun:
    world: int
    gpus_per_node: int
    plan: Plan
    memory: dict
    collectives: list[dict]
    axis_nodes: dict[str, int]  # mesh axis -> nodes one group of that axis spans
    gpu: str | None = None
    warnings: list[str] = field(default_factory=list)
    error: str | None = None  # why the layout cannot run (peak memory over the GPU's), with layouts that fit
    pipeline: object | None = None  # PipelineEstimate when parallel.pp > 1: memory and collectives are its most loaded rank's
    expert_exchange: dict | None = None  # comms.expert_exchange: MoE blocks with ep > 1, per layer per micro-step

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
            "per_rank_bytes": {k: int(self.memory[k]) for k in MEMORY_KEYS},
            "memory_detail": {k: v for k, v in self.memory.items() if k not in MEMORY_KEYS},
            "collectives": self.collectives,
            "params": [{"name": p.name, "shape": list(p.spec.shape),
                        "placements": [placement_str(x) for x in p.placements],
                        "local_shape": list(p.local_shape)} for p in self.plan.params.values()],
            "warnings": self.warnings,
            "error": self.error,
            "pipeline": self.pipeline.to_dict() if self.pipeline is not None else None,
            **({"expert_all_to_all": self.expert_exchange} if self.expert_exchange is not None else {}),
        }

    def render(self, width: int = 140) -> str:
        from rich.console import Console

        console = Console(width=width, record=True, file=io.StringIO(), highlight=False)
        for renderable in self.renderables():
            console.print(renderable)
        return console.export_text()

    def renderables(self) -> list:
        from rich.table import Table

        from .plan_table import activation_table, plan_table

        mesh = self.plan.mesh
        nodes = max(1, self.world // self.gpus_per_node)
        head = Table(title=f"mesh: world {self.world} = {nodes} node(s) x {self.gpus_per_node} ranks")
        for col in ("axis", "size", "rank stride", "one group spans"):
            head.add_column(col, justify="right" if col != "axis" else "left")
        for axis in mesh.axes:
            span = self.axis_nodes[axis]
            head.add_row(axis, str(mesh.size(axis)), str(_stride(mesh, axis)),
                         "one node" if span == 1 else f"{span} nodes")
        memory = Table(title="memory of the most loaded rank")
        memory.add_column("")
        memory.add_column("bytes", justify="right")
        for key in MEMORY_KEYS:
            memory.add_row(key, human_bytes(self.memory[key]))
        if self.gpu:
            memory.add_row(f"{self.gpu} capacity", human_bytes(GPU_MEMORY[self.gpu]))
        comms = Table(title="collectives per step (bytes per rank)")
        for col in ("axis", "op", "phase", "count", "bytes"):
            comms.add_column(col, justify="right" if col in ("count", "bytes") else "left")
        for c in self.collectives:
            comms.add_row(c["axis"], c["op"], c["phase"], f"{c['count']:,}", human_bytes(c["bytes"]))
        out = [head, plan_table(self.plan), activation_table(self.plan)]
        if self.pipeline is not None:
            memory.title = f"memory of the most loaded rank (pp rank {self.memory['pp_rank']})"
            comms.title = f"collectives per step (bytes per rank; pp rank {self.pipeline.busiest['pp_rank']}, the busiest)"
            out += _pipeline_renderables(self.pipeline)
        out += [memory, comms]
        if self.expert_exchange is not None:
            out.append(_expert_line(self.expert_exchange))
        out += [f"[yellow]warning: {w}[/]" for w in self.warnings]
        if self.error:
            out.append(f"[red]error: {self.error}[/]")
        return out


def _pipeline_renderables(est) -> list:
    from rich.table import Table

    s, t = est.schedule, est.timing
    stages = Table(title=f"pipeline: {s.pp} ranks x {s.v} stage(s) each, schedule {s.name}, {s.m} micro-batches")
    for col in ("stage", "pp rank", "layers", "holds", "GFLOP / micro-batch"):
        stages.add_column(col, justify="right" if col in ("stage", "pp rank", "GFLOP / micro-batch") else "left")
    for st in est.stages:
        holds = [k for k, on in (("embedding", st.has_embedding), ("head+loss", st.has_head)) if on]
        holds += [f"shares {n}" for n in st.shared]
        stages.add_row(str(st.index), str(st.rank), f"{st.layers[0]}..{st.layers[1] - 1}", ", ".join(holds),
                       f"{st.flops / 1e9:,.1f}")
    ranks = Table(title="per pp rank (simulated with FLOP-proportional stage costs)")
    for col in ("pp rank", "layers", "peak in flight", "peak memory", "bytes moved"):
        ranks.add_column(col, justify="right")
    from .plan_table import human_bytes

    for r in est.ranks:
        ranks.add_row(str(r["pp_rank"]), str(r["layers"]), str(t.peak_in_flight[r["pp_rank"]]),
                      human_bytes(r["memory"]["peak"]), human_bytes(sum(c["bytes"] for c in r["collectives"])))
    lines = [f"timeline (compute actions per rank in order; F forward, B backward, I/W its input/weight halves; "
             f"stage.micro): simulated bubble {t.bubble:.1%}"]
    lines += est.to_dict()["timeline"]
    return [stages, ranks, "\n".join(lines)]


def _expert_line(x: dict) -> str:
    """The ep all-to-alls of one MoE layer in one micro-step (comms.expert_exchange)."""
    return (f"expert all-to-all over ep ({x['ep']} ranks; {x['moe_layers']} MoE layers), per MoE layer per "
            f"micro-step at uniform routing: {x['all_to_alls']} calls, {human_bytes(x['bytes'])} per rank\n"
            f"  = {x['rows']:,} routed rows x {human_bytes(x['row_bytes'])}, dispatched and combined, forward and "
            f"backward, + {human_bytes(x['counts_bytes'])} of counts; ~{human_bytes(x['leaving_bytes'])} "
            f"((ep-1)/ep) leaves the rank")


def _stride(mesh, axis: str) -> int:
    after = MESH_AXES[MESH_AXES.index(axis) + 1:]
    return math.prod(mesh.size(a) for a in after)


def _nodes_spanned(mesh, axis: str, gpus_per_node: int) -> int:
    """Nodes that the group of rank 0 along `axis` touches (every group is alike)."""
    stride = _stride(mesh, axis)
    return len({k * stride // gpus_per_node for k in range(mesh.size(axis))})


def default_world(cfg) -> int:
    """The world a config implies: its fixed axes, or one node when an axis is -1."""
    sizes = [getattr(cfg.parallel, a) for a in MESH_AXES]
    return math.prod(sizes) if -1 not in sizes else cfg.parallel.nproc_per_node


def dry_run(cfg, world: int | None = None, gpu: str | None = None, *, suggest: bool = True) -> DryRun:
    """Plan `cfg` (a validated RunConfig) at `world` ranks. With `gpu` (h100, h200, a100),
    a peak over the device's memory sets `error`, naming layouts that fit (`check()`
    raises it). Layouts that cannot be built at all raise ConfigError here."""
    from .comms import expert_exchange, step_collectives
    from .memory import per_rank_memory

    if gpu is not None and gpu not in GPU_MEMORY:
        raise ConfigError(f"--gpu {gpu!r}: choose one of {', '.join(GPU_MEMORY)}")
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
    micro_steps = cfg.accumulation_steps(dp_size)
    compiled = bool(t.compile)
    if plan.mesh.pp > 1:  # ranks differ by stage: report the most loaded
        from ..pipeline.estimate import pipeline_estimate

        pipeline = pipeline_estimate(plan, model, schedule=p.pp_schedule, virtual=p.pp_virtual, layout=p.pp_layout,
                                     micro_batch=t.micro_batch, seq_len=t.seq_len, micro_steps=micro_steps,
                                     precision=t.precision, compiled=compiled,
                                     activation_checkpointing=t.activation_checkpointing)
        memory = {**pipeline.most_loaded["memory"], "pp_rank": pipeline.most_loaded["pp_rank"]}
        collectives = pipeline.busiest["collectives"]
    else:
        pipeline = None
        memory = per_rank_memory(plan, model, micro_batch=t.micro_batch, seq_len=t.seq_len, precision=t.precision,
                                 activation_checkpointing=t.activation_checkpointing, compiled=compiled,
                                 device="cuda")  # a plan is for GPUs: fused attention kernels
        collectives = step_collectives(plan, model, micro_batch_rows=t.micro_batch * dp_size, seq_len=t.seq_len,
                                       micro_steps=micro_steps, precision=t.precision, compiled=compiled)
    experts = None if pipeline is not None else expert_exchange(
        plan, model, micro_batch_rows=t.micro_batch * dp_size, seq_len=t.seq_len, precision=t.precision)
    axis_nodes = {a: _nodes_spanned(plan.mesh, a, gpus_per_node) for a in plan.mesh.axes}
    run = DryRun(world, gpus_per_node, plan, memory, collectives, axis_nodes, gpu, pipeline=pipeline,
                 expert_exchange=experts)
    for axis in ("tp", "cp"):
        if axis_nodes.get(axis, 1) > 1:
            run.warnings.append(f"parallel.{axis}={plan.mesh.size(axis)} spans {axis_nodes[axis]} nodes: its "
                                f"per-layer collectives will run over the inter-node network; keep {axis} within "
                                f"a node (at most {gpus_per_node} ranks)")
    if gpu and suggest and memory["peak"] > GPU_MEMORY[gpu]:
        run.error = _over_capacity(cfg, world, gpu, memory["peak"])
    return run


def _over_capacity(cfg, world: int, gpu: str, peak: float) -> str:
    """The message for a layout that does not fit: the nearest layouts that do."""
    import dataclasses

    fits = []
    t, p = cfg.train, cfg.parallel
    # Cheapest change first: recompute at the same layout, then more tp / smaller micro-batches.
    ac_now = t.activation_checkpointing
    candidates = [(p.tp, t.micro_batch, ac) for ac in ("selective", "full") if ac != ac_now]
    candidates += [(tp, micro, ac_now) for tp in (p.tp, 2 * p.tp, 4 * p.tp, 8 * p.tp)
                   for micro in sorted({t.micro_batch, max(1, t.micro_batch // 2), 1}, reverse=True)
                   if (tp, micro) != (p.tp, t.micro_batch)]
    for tp, micro, ac in candidates:
        alt = dataclasses.replace(cfg, parallel=dataclasses.replace(p, tp=tp, fsdp=-1 if tp != p.tp else p.fsdp),
                                  train=dataclasses.replace(t, micro_batch=micro, activation_checkpointing=ac))
        try:
            alt_peak = dry_run(alt.validate(), world, gpu, suggest=False).memory["peak"]
        except ConfigError:
            continue
        if alt_peak <= GPU_MEMORY[gpu]:
            change = f"--train.activation_checkpointing {ac}" if ac != ac_now else \
                f"--parallel.tp {tp} --parallel.fsdp -1 --train.micro_batch {micro}"
            fits.append(f"{change} ({human_bytes(alt_peak)})")
        if len(fits) == 3:
            break
    if fits:
        hint = "; ".join(fits)
    else:
        hint = (f"none with activation checkpointing, tp x2..x8 or a smaller micro_batch; the activations alone "
                f"take {human_bytes(dry_run(cfg, world, gpu, suggest=False).memory['activations'])} per rank: "
                "split the sequence with parallel.cp; pipeline parallelism does not help here, since 1F1B keeps "
                "pp micro-batches of L/pp layers on rank 0")
    return (f"peak memory {human_bytes(peak)} per rank exceeds the {gpu} ({human_bytes(GPU_MEMORY[gpu])}): "
            f"layouts that fit at world {world}: {hint}")
