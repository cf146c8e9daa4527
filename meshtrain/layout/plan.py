"""specs + rules + mesh -> Plan: one pure function, no process group needed.

The Plan says, for every parameter, which mesh axes shard which dim, the DTensor
placements that encode it, the local shape on the most loaded rank and the bytes that
rank holds; and, for any activation named by logical axes, the placements it takes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..errors import ConfigError
from ..models.spec import ParamSpec
from .mesh import CP_COMMS, GATHERED_AXES, MESH_AXES, ExpertMeshSpec, MeshSpec
from .placements import MARKED_ACTIVATIONS, placement_str
from .rules import Rules


@dataclass(frozen=True)
class Layout:
    """Which mesh axes shard each dim (major first), and the placements per mesh dim."""

    dim_axes: tuple[tuple[str, ...], ...]
    placements: tuple[Placement, ...]

    def local_shape(self, shape: Sequence[int], mesh: MeshSpec) -> tuple[int, ...]:
        """Shape on the most loaded rank (uneven shards round up, as torch.chunk does)."""
        out = list(shape)
        for d, axes in enumerate(self.dim_axes):
            for a in axes:
                out[d] = math.ceil(out[d] / mesh.size(a))
        return tuple(out)


def layout_for(axes: Sequence[str | None], rules: Rules, mesh: MeshSpec, param: str | None = None) -> Layout:
    """Placements for a tensor whose dims carry these logical axes. A mesh axis shards at
    most one dim (the first that asks for it); axes of size 1 are dropped."""
    used: set[str] = set()
    dim_axes = []
    for axis in axes:
        chosen = tuple(a for a in rules.lookup(axis, param) if a in mesh.axes and a not in used)
        used.update(chosen)
        dim_axes.append(chosen)
    placements: list[Placement] = [Replicate()] * len(mesh.axes)
    for d, chosen in enumerate(dim_axes):
        order = [mesh.axes.index(a) for a in chosen]
        if order == sorted(order):
            for i in order:
                placements[i] = Shard(d)
        elif len(chosen) == 2:
            # Major axis lies later in the mesh (e.g. tp before fsdp on one dim): the
            # earlier mesh dim holds strided pieces of the later one's shards.
            major, minor = order
            placements[minor] = _StridedShard(d, split_factor=mesh.size(chosen[0]))
            placements[major] = Shard(d)
        else:
            raise ConfigError(f"rules for {param or 'an activation'} dim {d}: mesh axes {list(chosen)} "
                              "can nest out of mesh order only two at a time; list them in mesh order "
                              "(pp, dp, fsdp, cp, tp)")
    return Layout(tuple(dim_axes), tuple(placements))


@dataclass(frozen=True)
class ParamPlan:
    name: str
    spec: ParamSpec
    layout: Layout
    local_shape: tuple[int, ...]
    mesh: MeshSpec  # the mesh its placements refer to (the expert mesh for expert weights)

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.layout.placements

    @property
    def bytes_per_rank(self) -> int:
        return math.prod(self.local_shape) * self.spec.dtype.itemsize

    def __post_init__(self):
        # Made once, here: the planners ask per lookup, rank and candidate layout, and a lazy
        # cache would be written inside a compiled step's trace (refused under checkpointing).
        object.__setattr__(self, "_compute", tuple(Replicate() if a in GATHERED_AXES else p
                                                   for a, p in zip(self.mesh.axes, self.placements)))

    def compute_placements(self) -> tuple[Placement, ...]:
        """Placements where the parameter is used: shards on gathered axes (fsdp) are
        replicated; tensor- and expert-parallel shards stay."""
        return self._compute

    def to_dict(self) -> dict:
        out = {"name": self.name, "shape": list(self.spec.shape), "axes": list(self.spec.axes),
               "dtype": str(self.spec.dtype).removeprefix("torch."),
               "mesh_axes": [list(a) for a in self.layout.dim_axes],
               "placements": [placement_str(p) for p in self.placements],
               "local_shape": list(self.local_shape), "bytes_per_rank": self.bytes_per_rank}
        if isinstance(self.mesh, ExpertMeshSpec):  # placements refer to the plan's expert_mesh
            out["mesh"] = "experts"
        return out


@dataclass(frozen=True)
class Plan:
    mesh: MeshSpec
    rules: Rules
    params: dict[str, ParamPlan] = field(default_factory=dict)
    cp_comm: str = "allgather"

    def activation(self, axes: Sequence[str | None]) -> Layout:
        return layout_for(axes, self.rules, self.mesh)

    @property
    def param_bytes_per_rank(self) -> int:
        return sum(p.bytes_per_rank for p in self.params.values())

    def to_dict(self) -> dict:
        experts = {"expert_mesh": {a: self.mesh.experts().size(a) for a in self.mesh.experts().axes}} \
            if self.mesh.ep > 1 else {}
        return {
            "world": self.mesh.world,
            "mesh": {a: self.mesh.size(a) for a in self.mesh.axes},
            **experts,
            "rules": self.rules.to_dict(),
            "cp_comm": self.cp_comm,
            "params": [p.to_dict() for p in self.params.values()],
            "activations": {name: {"axes": list(axes),
                                   "placements": [placement_str(p) for p in self.activation(axes).placements]}
                            for name, axes in MARKED_ACTIVATIONS.items()},
            "param_bytes_per_rank": self.param_bytes_per_rank,
        }

    def to_json(self, indent: int = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self):
        from .plan_table import plan_table

        return plan_table(self)

    def __str__(self) -> str:
        from .plan_table import render

        return render(self)


# Plans made lately, by their inputs: the layout search and the dry run plan one mesh of
# 405B at 16384 ranks a dozen times over (each stage group, validation, each candidate's
# checkpointing and micro-batch). A Plan is frozen and never changed in place.
_PLANS: dict = {}
_PLANS_KEPT = 256


def make_plan(specs: Mapping[str, ParamSpec], rules: Rules, mesh: MeshSpec, world: int | None = None,
              cp_comm: str = "allgather") -> Plan:
    """The Plan for these parameters on this mesh; `cp_comm` is how attention exchanges
    the sequence when cp > 1. Raises ConfigError for any layout that cannot work, before
    a process group exists."""
    key = (tuple(specs.items()), rules.key(), mesh, world, cp_comm)
    if key not in _PLANS:
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = _make_plan(specs, rules, mesh, world, cp_comm)
    return _PLANS[key]


def _make_plan(specs: Mapping[str, ParamSpec], rules: Rules, mesh: MeshSpec, world: int | None,
               cp_comm: str) -> Plan:
    if world is None:
        if any(mesh.size(a) == -1 for a in MESH_AXES):
            raise ConfigError("parallel: an axis is -1, so the world size must be given to fill it "
                              "(make_plan(..., world=N) or meshtrain plan --world N)")
        world = mesh.world
    mesh = mesh.resolve(world)
    params, layouts = {}, {}
    experts = mesh.experts()
    for name, spec in specs.items():
        where = experts if "experts" in spec.axes else mesh
        # Layer after layer asks for the same few layouts: build each once (a plan of 405B
        # at 16384 ranks is planned many times over by `meshtrain plan`'s advice).
        key = (spec.axes, where is mesh, tuple(g for g in rules.overrides if fnmatch.fnmatchcase(name, g)))
        if key not in layouts:
            layouts[key] = layout_for(spec.axes, rules, where, name)
        layout = layouts[key]
        for d, axes in enumerate(layout.dim_axes):
            _check_divisible(name, spec, d, axes, where)
        params[name] = ParamPlan(name, spec, layout, layout.local_shape(spec.shape, where), where)
    plan = Plan(mesh, rules, params, cp_comm)
    _check_context_parallel(plan)
    return plan


def _check_context_parallel(plan: Plan) -> None:
    if plan.cp_comm not in CP_COMMS:
        raise ConfigError(f"parallel.cp_comm={plan.cp_comm!r}: choose one of {', '.join(CP_COMMS)}")
    if plan.mesh.cp == 1:
        return
    # The sequence is sharded over cp everywhere or nowhere: attention is the only op that
    # knows the (zigzag) order of a cp-sharded sequence.
    for axis in ("seq", "seq_sp"):
        if "cp" not in plan.rules.lookup(axis):
            raise ConfigError(f"parallel.cp={plan.mesh.cp}: the rule for {axis!r} must include mesh axis cp "
                              f"(it maps to {list(plan.rules.lookup(axis))}); add cp to it")
    if plan.cp_comm != "a2a":
        return
    # Ulysses trades the sequence shard for a head shard: each rank's heads must split cp ways.
    for logical, key in (("q_heads", "model.n_heads"), ("kv_heads", "model.n_kv_heads")):
        for p in plan.params.values():
            if logical in p.spec.axes:
                d = p.spec.axes.index(logical)
                heads = p.spec.shape[d] // p.spec.units[d]
                local = heads // math.prod(plan.mesh.size(a) for a in p.layout.dim_axes[d])
                if local % plan.mesh.cp:
                    per = f"{heads} / parallel.tp={heads // local}" if local != heads else f"{heads}"
                    raise ConfigError(f"parallel.cp_comm=a2a splits the heads of each rank over parallel.cp="
                                      f"{plan.mesh.cp} ranks, but {key} gives {per} = {local} heads per rank, "
                                      f"not divisible by {plan.mesh.cp}: use parallel.cp_comm allgather or ring, "
                                      f"or a cp that divides {local}")
                break


def _check_divisible(name: str, spec: ParamSpec, d: int, axes: tuple[str, ...], mesh: MeshSpec) -> None:
    """Compute-sharded dims must split evenly into whole units (heads); storage-only
    (fsdp) shards may be uneven unless they nest with another axis."""
    if not axes:
        return
    ways = math.prod(mesh.size(a) for a in axes)
    size, unit = spec.shape[d], spec.units[d]
    must_divide = len(axes) > 1 or any(a not in GATHERED_AXES for a in axes)
    if not must_divide:
        return
    if size % unit or (size // unit) % ways:
        what = f"{size // unit} heads of {unit}" if unit > 1 else f"size {size}"
        split = " x ".join(f"{a}={mesh.size(a)}" for a in axes)
        logical = spec.axes[d]
        field = {"q_heads": "model.n_heads", "kv_heads": "model.n_kv_heads", "vocab": "model.vocab_size",
                 "mlp": "model.moe.expert_ffn_dim" if ".moe." in name else "model.ffn_dim",
                 "experts": "model.moe.num_experts"}.get(logical)
        sizes = axes[0] if len(axes) == 1 else "sizes whose product " + " x ".join(axes)
        target = f"{field}={size // unit}" if field else f"{size // unit}"
        fix = f"choose {sizes} dividing {target}" if len(axes) == 1 else \
            f"choose {sizes} divides {target}, or shard this dim on fewer mesh axes"
        raise ConfigError(f"parameter {name} dim {d} ({logical}: {what}) cannot be split {ways} ways "
                          f"over {split}: {fix}")


def without_pp(plan: Plan) -> Plan:
    """The plan of one pipeline stage group: the same rules on the mesh without its pp axis
    (what each pp rank's sub-mesh holds; parameters keep their placements on the rest)."""
    mesh = dataclasses.replace(plan.mesh, pp=1)
    return make_plan({n: p.spec for n, p in plan.params.items()}, plan.rules, mesh, mesh.world, plan.cp_comm)


def gathered(plan: Plan, policy=None) -> Plan:
    """The plan with every parameter stored where it is used (`compute_placements`: fsdp
    and cp shards whole, tensor- and expert-parallel shards kept): the layout of the
    weights held gathered over a step (parallel.zero 1 and 2, pp_keep_gathered), in the
    dtype `policy` (models/policy.py) uses each in, as they are held."""
    params = {}
    for name, p in plan.params.items():
        axes = tuple(tuple(a for a in dim if a not in GATHERED_AXES) for dim in p.layout.dim_axes)
        layout = Layout(axes, p.compute_placements())
        dtype = policy.param_dtype(name) if policy is not None else None
        spec = dataclasses.replace(p.spec, dtype=dtype) if dtype is not None else p.spec
        params[name] = dataclasses.replace(p, spec=spec, layout=layout,
                                           local_shape=layout.local_shape(p.spec.shape, p.mesh))
    return dataclasses.replace(plan, params=params)
