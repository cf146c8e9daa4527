"""Bucket planning: which parameters share a bucket (the weights of one block gathered by
one collective from one flat buffer, their gradients reduced by one collective per mesh
group, in place of one collective per parameter: FSDP2's and Megatron's unit of
communication), which mesh dims each member gathers over, and the groups the buckets'
collectives run over.

Pure data, a function of the Plan alone: `meshtrain plan` counts the calls from it
without a process group, and parallel/bucket_run.py runs the buckets it plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .mesh import GATHERED_AXES, MeshSpec
from .plan import ParamPlan, Plan
from .traffic import check_bucket

DATA_AXES = ("dp", "fsdp", "cp")  # the mesh axes that split tokens: gradients are partial sums over them


@dataclass(frozen=True)
class Member:
    """One parameter of a bucket: the mesh dims its shard is gathered over (`gather`, all
    splitting tensor dim `dim`), and its compute-local shape (after the gather)."""

    name: str
    gather: tuple[int, ...]
    dim: int | None
    shape: tuple[int, ...]  # compute-local: tp shards stay, the gathered dim is whole

    def ways(self, mesh_shape) -> int:
        return math.prod(mesh_shape[i] for i in self.gather)

    def padded(self, mesh_shape) -> tuple[int, ...]:
        """This shard's shape padded to the largest rank's (torch.chunk sizes)."""
        if self.dim is None:
            return self.shape
        out = list(self.shape)
        out[self.dim] = math.ceil(out[self.dim] / self.ways(mesh_shape))
        return tuple(out)


@dataclass(frozen=True)
class Bucket:
    index: int
    members: tuple[Member, ...]
    mesh: MeshSpec  # the mesh its members' placements (and `Member.gather`) refer to

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members)

    def nbytes(self, plan: Plan) -> int:
        """The bucket's size as a size in MB bounds it: its members' compute-local
        elements (tp shards stay, the gathered dim is whole) in the parameters' dtype."""
        return sum(_member_bytes(m, plan) for m in self.members)


def _member_bytes(m: Member, plan: Plan) -> int:
    return math.prod(m.shape) * plan.params[m.name].spec.dtype.itemsize


def _member(p: ParamPlan) -> Member | None:
    """How `p` is gathered over the mesh its placements refer to (the expert mesh for
    expert weights), or None where a bucket cannot hold it (strided or nested shards,
    frozen tensors): those keep one collective per parameter."""
    if any(isinstance(q, _StridedShard) for q in p.placements) or not p.spec.trainable:
        return None  # (a frozen tensor, e.g. the aux-free expert bias, has no gradient to reduce)
    mesh = p.mesh
    axes = mesh.axes
    gather = tuple(i for i, (a, q) in enumerate(zip(axes, p.placements)) if a in GATHERED_AXES and isinstance(q, Shard))
    dims = {p.placements[i].dim for i in gather}
    if len(dims) > 1:
        return None
    dim = dims.pop() if dims else None
    if dim is not None and any(isinstance(q, Shard) and q.dim == dim and i not in gather
                               for i, q in enumerate(p.placements)):
        return None  # the gathered dim is also split by tp: DTensor's own redistribute handles it
    shape = list(p.spec.shape)
    for i, q in enumerate(p.placements):
        if isinstance(q, Shard) and i not in gather:
            shape[q.dim] //= mesh.size(axes[i])
    ways = math.prod(mesh.size(axes[i]) for i in gather)
    if len(gather) > 1 and shape[dim] % ways:
        return None  # nested uneven shards are not one flat chunking
    return Member(p.name, gather, dim, tuple(shape))


def _unit(name: str, seen_block: bool, block_names: set[str], modules_in_block: set[str]) -> str:
    """Block mode: the bucket a parameter belongs to ('layers.3'; the groups before and
    after the blocks: embeddings, final norm and head; a multi-token prediction module's
    block, 'mtp.0', run after the head, and its other parameters before ('mtp.0.in') and
    after it ('mtp.0.out'): a checkpointed block recomputes with all of its bucket, and
    the module's norms and projection keep theirs outside it). `block_names`: a block's
    parameter names after 'layers.N.'; `modules_in_block`: the modules whose block
    parameters came already."""
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) > 1:
        return ".".join(parts[:2])
    if parts[0] == "mtp" and len(parts) > 2:
        module = ".".join(parts[:2])
        if parts[2] in block_names:
            modules_in_block.add(module)
            return module
        return module + (".out" if module in modules_in_block else ".in")
    return "after" if seen_block else "before"


# The buckets of a plan lately asked for: the estimators ask again for each stage, each
# checkpointing and micro-batch of a layout, on the same (cached, frozen) plan. Keyed by
# the plan's identity, and holding the plan so that identity is not reused.
_BUCKETS: dict = {}
_BUCKETS_KEPT = 256


def plan_buckets(plan: Plan, unit: str | float = "block", names=None) -> tuple[list[Bucket], set[str]]:
    """The buckets of `names` (default: every parameter, in the plan's order, which is
    forward order) and the parameters left to one collective each. A bucket's members
    share a mesh: a block's expert weights on the expert mesh are a bucket of their own,
    between the block's dense weights used before and after them."""
    unit = check_bucket(unit)
    key = (id(plan), unit, None if names is None else tuple(names))
    hit = _BUCKETS.get(key)
    if hit is None or hit[0] is not plan:
        if len(_BUCKETS) >= _BUCKETS_KEPT:
            _BUCKETS.pop(next(iter(_BUCKETS)))
        hit = _BUCKETS[key] = (plan, *_plan_buckets(plan, unit, names))
    return list(hit[1]), set(hit[2])


def _plan_buckets(plan: Plan, unit: str | float, names) -> tuple[list[Bucket], set[str]]:
    names = list(plan.params) if names is None else list(names)
    alone, groups, keys, meshes = set(), [], [], []
    seen_block, size = False, 0.0
    block_names = {n.split(".", 2)[2] for n in plan.params if n.startswith("layers.") and n.count(".") >= 2}
    modules_in_block: set[str] = set()
    for name in names:
        p = plan.params[name]
        member = None if unit == "param" else _member(p)
        if member is None:
            alone.add(name)
            continue
        nbytes = _member_bytes(member, plan)
        if unit == "block":
            key = (_unit(name, seen_block, block_names, modules_in_block), p.mesh)
            seen_block = seen_block or key[0].startswith("layers.")
            new = not keys or keys[-1] != key
        else:
            new = not groups or size + nbytes > unit * 2 ** 20 or meshes[-1] != p.mesh
            key = len(groups)
        if new:
            groups.append([])
            keys.append(key)
            meshes.append(p.mesh)
            size = 0.0
        groups[-1].append(member)
        size += nbytes
    return [Bucket(i, tuple(g), m) for i, (g, m) in enumerate(zip(groups, meshes))], alone


def gather_sets(bucket: Bucket, mesh_shape, dtypes) -> list[tuple[tuple[int, ...], object, tuple[int, ...]]]:
    """The members of `bucket` gathered together, by first member: (the mesh dims of size
    > 1 they are gathered over, their compute dtype (`dtypes`, one per member), their
    indices in the bucket). A member with nothing to gather is in none. Each set is one
    all-gather in forward and one reduce-scatter in backward."""
    sets: dict[tuple, list[int]] = {}
    for j, m in enumerate(bucket.members):
        live = tuple(i for i in m.gather if mesh_shape[i] > 1)
        if live:
            sets.setdefault((live, dtypes[j]), []).append(j)
    return [(gather, dtype, tuple(js)) for (gather, dtype), js in sets.items()]


def group_axes(axes, dims: tuple[int, ...]) -> str:
    """The name a group over mesh dims `dims` is reported by: their axes joined by "+"."""
    return "+".join(axes[i] for i in dims)


def group_dims(buckets: list[Bucket], plan: Plan, mesh: MeshSpec | None = None) -> set[tuple[int, ...]]:
    """Every set of dims of `mesh` (default: the plan's, the dense mesh) that the
    collectives of the buckets on it (and, on the dense mesh, the step's loss) run over:
    each becomes one process group at run time."""
    mesh = plan.mesh if mesh is None else mesh
    data = tuple(i for i, a in enumerate(mesh.axes) if a in DATA_AXES and mesh.size(a) > 1)
    out = set()
    for b in buckets:
        if b.mesh != mesh:
            continue
        for m in b.members:
            live = tuple(i for i in m.gather if mesh.shape[i] > 1)
            out.add(live)
            # What may stay partial after the gather dims: the other data dims, and dims
            # where the weight is used whole (a norm under sequence parallelism).
            whole = {i for i, q in enumerate(plan.params[m.name].compute_placements())
                     if q.is_replicate() and mesh.shape[i] > 1}
            out.add(tuple(sorted((set(data) | whole) - set(live))))
    if mesh == plan.mesh:
        out.add(data)  # the loss
    for dims in list(out):  # one dim at a time, where no flattened group is made
        out.update((i,) for i in dims)
    return {s for s in out if s}
