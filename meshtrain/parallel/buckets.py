"""Parameter buckets: the weights of one block gathered by one collective from one flat
buffer, and their gradients reduced by one collective per mesh group, in place of one
collective per parameter (FSDP2's and Megatron's unit of communication).

`plan_buckets` is pure data (which parameters share a bucket, which mesh dims each one
gathers over), so `meshtrain plan` can count the calls without a process group.
`BucketGather` is the eager runtime (`traced_gather` the compiled one, with the same
collectives): forward packs the shards into one buffer and all-gathers
it (or takes a gather issued earlier, the prefetch) and copies each weight out; backward
packs the gradients the same way and issues, per bucket, one all-reduce per other mesh
dim where gradients are partial (the tp all-reduce of sequence-parallel norm weights),
one reduce-scatter over the gathered dims (fsdp, or fsdp x cp as one flattened group),
then one all-reduce of the shards over the replica dims (dp: HSDP, or plain dp).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import ConfigError
from ..layout.mesh import GATHERED_AXES, MeshSpec
from ..layout.plan import ParamPlan, Plan

BUCKET_UNITS = ("block", "param")
# Every parameter-traffic group made in this process: group name -> its mesh axes joined
# by "+" ("fsdp", "dp+fsdp"), for tools that label recorded collectives by axis.
GROUP_AXES: dict[str, str] = {}
DATA_AXES = ("dp", "fsdp", "cp")  # the mesh axes that split tokens: gradients are partial sums over them


def check_bucket(value, key: str = "parallel.bucket") -> str | float:
    """`block`, `param`, or a size in MB (> 0)."""
    if isinstance(value, str) and value in BUCKET_UNITS:
        return value
    try:
        mb = float(value)
    except (TypeError, ValueError):
        mb = None
    if isinstance(value, bool) or mb is None or not math.isfinite(mb) or mb <= 0:
        raise ConfigError(f"{key}={value!r}: use block (one bucket per transformer block), param (one "
                          "collective per parameter) or a bucket size in MB (a number > 0)")
    return mb


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


def _unit(name: str, seen_block: bool) -> str:
    """Block mode: the bucket a parameter belongs to ('layers.3', or the groups before and
    after the blocks: embeddings, final norm and head)."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1:
        return ".".join(parts[:2])
    return "after" if seen_block else "before"


def plan_buckets(plan: Plan, unit: str | float = "block", names=None) -> tuple[list[Bucket], set[str]]:
    """The buckets of `names` (default: every parameter, in the plan's order, which is
    forward order) and the parameters left to one collective each. A bucket's members
    share a mesh: a block's expert weights on the expert mesh are a bucket of their own,
    between the block's dense weights used before and after them."""
    unit = check_bucket(unit)
    names = list(plan.params) if names is None else list(names)
    alone, groups, keys, meshes = set(), [], [], []
    seen_block, size = False, 0.0
    for name in names:
        p = plan.params[name]
        member = None if unit == "param" else _member(p)
        if member is None:
            alone.add(name)
            continue
        nbytes = _member_bytes(member, plan)
        if unit == "block":
            key = (_unit(name, seen_block), p.mesh)
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


class Groups:
    """Process groups for the parameter traffic, one per set of mesh dims (several dims as
    one flattened group), made when the context is built. They are new groups, not the
    mesh's: a gather or reduction left in flight (prefetch, async reductions) then never
    shares a group with the activations' collectives or context-parallel attention's
    point-to-point exchange, which on one group would have to run in the same order on
    every rank (and on NCCL a group of its own is what lets it overlap)."""

    def __init__(self, mesh, sets):
        self.mesh = mesh
        self._names: dict[tuple[int, ...], str] = {}
        self.axes: dict[str, str] = {}  # group name -> its mesh axes, "fsdp+cp" (for recorders)
        ranks, coord = mesh.mesh, mesh.get_coordinate()
        for dims in sorted(sets):
            index = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
            members = ranks[index].flatten().tolist()  # mesh order: the flattened rank order
            # Only the members meet: the groups of other slices are made by their members.
            group = dist.new_group(members, use_local_synchronization=True)
            self._names[dims] = group.group_name
            self.axes[group.group_name] = group_axes(mesh.mesh_dim_names, dims)
            GROUP_AXES[group.group_name] = self.axes[group.group_name]

    def has(self, dims: tuple[int, ...]) -> bool:
        return dims in self._names

    def name(self, dims: tuple[int, ...]) -> str:
        return self._names[dims]

    def size(self, dims) -> int:
        return math.prod([self.mesh.size(i) for i in dims])


class InFlight:
    """Gradient reductions issued and not yet waited on, at most `limit` of them (the
    oldest is waited when one more is issued): each one's buffers (the packed fp32
    gradients; on gloo also a full-size copy) are freed as backward goes, not held to the
    optimizer for every bucket at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self._issued: collections.deque = collections.deque()

    def add(self, result: torch.Tensor) -> None:
        self._issued.append(result)
        while len(self._issued) > self.limit:
            funcol.wait_tensor(self._issued.popleft())


@dataclass(frozen=True)
class _Set:
    """Members of a bucket gathered together: the same mesh dims and compute dtype."""

    gather: tuple[int, ...]
    dtype: torch.dtype
    members: tuple[int, ...]  # indices into the bucket's members
    offsets: tuple[int, ...]
    numel: int  # per rank, padded
    ways: int  # ranks in the gather group


class BucketRun:
    """A bucket on a live mesh: its gather sets, dtypes and placements."""

    def __init__(self, bucket: Bucket, plan: Plan, mesh, groups: Groups, policy, inflight: InFlight,
                 unsharded: bool = False, seq_dims: frozenset[int] = frozenset()):
        self.bucket, self.mesh, self.groups, self.inflight = bucket, mesh, groups, inflight
        self.hold = False  # set by the step: leave the last all-reduces to a later micro-step
        self._held = False  # .grad holds partial sums that the next reduction must add in
        # parallel.fsdp_accumulate unsharded: while `hold`, the reduce-scatters wait too; the
        # packed gradients of each gather set add up here until the last micro-step.
        self.unsharded = unsharded
        self._packed: dict[int, torch.Tensor] = {}
        # Mesh dims that split the sequence: a weight used whole there gets partial gradients.
        self.seq_dims = seq_dims
        shape = tuple(mesh.shape)
        self.mesh_shape = shape
        self.param_dtypes, self.dtypes, self.compute, self.global_shapes = [], [], [], []
        for m in bucket.members:
            p = plan.params[m.name]
            self.param_dtypes.append(p.spec.dtype)
            self.dtypes.append(policy.param_dtype(m.name) or p.spec.dtype)
            self.compute.append(p.compute_placements())
            self.global_shapes.append(tuple(p.spec.shape))
        self.data = tuple(i for i, a in enumerate(mesh.mesh_dim_names) if a in DATA_AXES and shape[i] > 1)
        # Sizes are plain numbers here, so the traced step sees constants.
        self.padded = [m.padded(shape) for m in bucket.members]
        self.numels = [math.prod(p) for p in self.padded]
        self.sets = []
        for gather, dtype, js in gather_sets(bucket, shape, self.dtypes):
            offsets, n = [], 0
            for j in js:
                offsets.append(n)
                n += self.numels[j]
            self.sets.append(_Set(gather, dtype, tuple(js), tuple(offsets), n, groups.size(gather)))
        # Traced steps with `unsharded`: per set, a leaf whose .grad gathers the whole packed
        # gradient over the micro-steps (one element expanded: only its .grad has the size;
        # made here, as a traced step cannot make a leaf).
        self.sinks = [torch.zeros((), dtype=self.param_dtypes[s.members[0]], device=mesh.device_type)
                      .expand(s.ways * s.numel).requires_grad_() for s in self.sets] if unsharded else []

    def scatter_sinks(self, leaves) -> None:
        """After a traced step's last backward, with `unsharded`: each set's summed packed
        gradient reduce-scattered once, into its members' .grad (the shards' layout, Partial
        where something is still to reduce: `ShardedContext.reduce_held` goes on)."""
        partial = {j: dims for dims, js in held_partials(self).items() for j in js}
        for k, s in enumerate(self.sets):
            sink = self.sinks[k]
            if sink.grad is None:
                continue
            mine = funcol.wait_tensor(funcol.reduce_scatter_single(sink.grad.contiguous(), "sum", 0,
                                                                   self.groups.name(s.gather)))
            sink.grad = None
            for j, off in zip(s.members, s.offsets):
                leaf = leaves[j]
                local = self._shard_of(mine, j, off, leaf._local_tensor)
                placements = [Partial() if i in partial.get(j, ()) else q for i, q in enumerate(leaf.placements)]
                leaf.grad = DTensor.from_local(local.contiguous(), leaf.device_mesh, placements, run_check=False,
                                               shape=leaf.shape, stride=leaf.stride())

    def _shard_of(self, mine: torch.Tensor, j: int, off: int, shard: torch.Tensor) -> torch.Tensor:
        """Member j's gradient shard out of this rank's reduce-scattered set (`mine`, at
        offset `off`): its padded piece cut to the shard's own length."""
        m = self.bucket.members[j]
        return mine[off:off + self.numels[j]].view(self.padded[j]).narrow(m.dim, 0, shard.shape[m.dim])

    # ------------------------------------------------------------------ forward
    def pack(self, s: _Set, locals_) -> torch.Tensor:
        """This rank's shards of a gather set in one flat buffer (padded, compute dtype)."""
        buf = torch.empty(s.numel, dtype=s.dtype, device=locals_[s.members[0]].device)
        for j, off in zip(s.members, s.offsets):
            m, padded = self.bucket.members[j], self.padded[j]
            view = buf[off:off + self.numels[j]].view(padded)
            shard = locals_[j]
            have = shard.shape[m.dim]
            view.narrow(m.dim, 0, have).copy_(shard)
            if have < padded[m.dim]:
                view.narrow(m.dim, have, padded[m.dim] - have).zero_()
        return buf

    def issue(self, s: _Set, locals_) -> torch.Tensor:
        with torch.no_grad():
            return funcol.all_gather_single(self.pack(s, locals_), 0, self.groups.name(s.gather))

    def unpack(self, s: _Set, gathered: torch.Tensor) -> dict[int, torch.Tensor]:
        ways = s.ways
        # Waited here, at first use (an issued gather runs until then); a piece that is
        # already contiguous (a bucket of one) stays a view of the gathered buffer.
        full = funcol.wait_tensor(gathered).view(ways, s.numel)
        return {j: _unshard(full[:, off:off + self.numels[j]], self.bucket.members[j], self.padded[j]).contiguous()
                for j, off in zip(s.members, s.offsets)}

    def wrap(self, j: int, local: torch.Tensor) -> DTensor:
        shape = self.global_shapes[j]
        return DTensor.from_local(local, self.mesh, self.compute[j], run_check=False, shape=shape,
                                  stride=make_contiguous_strides_for(shape))

    # ------------------------------------------------------------------ backward
    def _normalise(self, j: int, grad: DTensor | None, like: torch.Tensor,
                   packed: bool = False) -> tuple[torch.Tensor, tuple]:
        """(local gradient in the parameter dtype, its placements): Partial or Replicate on
        the data dims and on dims where the weight is used whole; the compute placement
        elsewhere (anything else is redistributed there first, by DTensor, in the parameter
        dtype). `packed`: a member copied into a gather set's buffer, which casts it: left
        in the compute dtype when nothing is redistributed (no fp32 copy of it is made)."""
        compute = self.compute[j]
        if grad is None:
            return torch.zeros(self.bucket.members[j].shape, dtype=self.param_dtypes[j], device=like.device), \
                tuple(Partial() if i in self.data else q for i, q in enumerate(compute))
        fixed = [g if (g.is_partial() or g.is_replicate()) and (i in self.data or q.is_replicate()) else q
                 for i, (g, q) in enumerate(zip(grad.placements, compute))]
        if tuple(fixed) != tuple(grad.placements):
            grad = grad.to(self.param_dtypes[j]).redistribute(self.mesh, fixed)
        elif not packed:
            grad = grad.to(self.param_dtypes[j])
        return grad._local_tensor, tuple(grad.placements)

    def all_reduce(self, items: dict[int, torch.Tensor], dims: tuple[int, ...]) -> None:
        """One all-reduce of several gradients over the mesh dims `dims` (one flattened
        group; dim by dim where no such group was made), in place of items."""
        flat = torch.cat([g.reshape(-1) for g in items.values()])
        for group in ([dims] if self.groups.has(dims) else [(i,) for i in dims]):
            flat = funcol.all_reduce(flat, "sum", self.groups.name(group))
        self.inflight.add(flat)
        off = 0
        for j, g in items.items():
            items[j] = flat[off:off + g.numel()].view(g.shape)
            off += g.numel()

    def reduce(self, grads, shards, leaves) -> list[torch.Tensor]:
        """Local gradients of the shards (stored layout) from the gradients of the
        gathered weights: the collectives of the module docstring. With `hold` set (a
        micro-step before the step's last), the all-reduces after the reduce-scatter are
        left out and the partial sums accumulate in the parameters' .grad; the last
        micro-step adds them in and reduces once (DDP's no_sync). With `unsharded` too, the
        reduce-scatters wait as well: the packed gradients add up here (None for those
        shards) and the last micro-step reduce-scatters their sum."""
        members = self.bucket.members
        locals_, places = [], []
        packed = {j for s in self.sets for j in s.members}
        for j, (g, shard) in enumerate(zip(grads, shards)):
            local, placements = self._normalise(j, g, shard, j in packed)
            locals_.append(local)
            places.append(placements)
        out = list(locals_)
        accumulate = self.hold and self.unsharded
        for k, s in enumerate(self.sets):  # one reduce-scatter per gather set
            ways = s.ways
            buf = torch.empty(ways, s.numel, dtype=self.param_dtypes[s.members[0]], device=shards[0].device)
            for j, off in zip(s.members, s.offsets):
                m, padded = members[j], self.padded[j]
                g = locals_[j]
                # A gradient already whole on a gathered dim is counted once, by the rank
                # at index 0 of that dim.
                if not all([self.mesh.get_local_rank(i) == 0 for i in s.gather if places[j][i].is_replicate()]):
                    g = torch.zeros_like(g)
                whole = ways * padded[m.dim]
                if whole != g.shape[m.dim]:
                    pad = list(g.shape)
                    pad[m.dim] = whole - g.shape[m.dim]
                    g = torch.cat([g, g.new_zeros(pad)], m.dim)
                split = g.reshape(*padded[:m.dim], ways, padded[m.dim], *padded[m.dim + 1:]).movedim(m.dim, 0)
                buf[:, off:off + self.numels[j]].view(ways, *padded).copy_(split)
            if k in self._packed:  # what earlier micro-steps accumulated unsharded
                buf += self._packed.pop(k)
            if accumulate:
                self._packed[k] = buf
                for j in s.members:
                    out[j] = None  # nothing reaches the shard's .grad before the last micro-step
                continue
            mine = funcol.reduce_scatter_single(buf.view(-1), "sum", 0, self.groups.name(s.gather))
            self.inflight.add(mine)
            for j, off in zip(s.members, s.offsets):
                out[j] = self._shard_of(mine, j, off, shards[j])
        # What is still partial (over dp: HSDP's replicas, plain dp; over tp: sequence-
        # parallel norms), as shards: one all-reduce per set of mesh dims.
        gathered = {j for s in self.sets for j in s.members}
        by_dims: dict[tuple, dict[int, torch.Tensor]] = {}
        for j, m in enumerate(members):
            done = set(m.gather) if j in gathered else set()
            # A dim of one rank (a 1-rank mesh) has nothing to add up and no group.
            dims = tuple(i for i, q in enumerate(places[j])
                         if q.is_partial() and i not in done and self.mesh_shape[i] > 1)
            if dims:
                by_dims.setdefault(dims, {})[j] = out[j]
        if self.hold:  # a micro-step before the last: the partial sums accumulate locally
            self._held = True
            return [None if g is None else g.contiguous() for g in out]
        for dims, items in by_dims.items():
            for j in items:  # what earlier micro-steps held back joins this one's reduction
                held = leaves[j].grad if self._held else None
                if held is not None:
                    items[j] = items[j] + held._local_tensor
                    leaves[j].grad = None
            self.all_reduce(items, dims)
            for j, g in items.items():
                out[j] = g
        self._held = False
        return [g.contiguous() for g in out]


def _unshard(pieces: torch.Tensor, m: Member, padded: tuple[int, ...]) -> torch.Tensor:
    """Member m's gathered weight from its padded shards (ways, numel), rank by rank."""
    ways = pieces.shape[0]
    merged = pieces.reshape(ways, *padded).movedim(0, m.dim)
    merged = merged.reshape(*padded[:m.dim], ways * padded[m.dim], *padded[m.dim + 1:])
    return merged.narrow(m.dim, 0, m.shape[m.dim])


class _GatherFlat(torch.autograd.Function):
    """A traced step's gather of one packed buffer: forward casts this rank's shards to
    the compute dtype and all-gathers them; backward reduce-scatters the gradient in the
    shards' dtype (fp32 reductions whatever the compute dtype). Plain tensors only: a
    traced custom Function sees its gradients' metadata, which DTensor placements are not
    (see BucketGather)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, dtype, group: str, ways: int):
        ctx.dtype, ctx.group = flat.dtype, group
        # (Traced, a functional collective is waited where it is issued: parallel/overlap.py
        # moves the gathers ahead in the compiled graph.)
        return funcol.all_gather_tensor(flat.to(dtype), 0, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.reduce_scatter_tensor(grad.to(ctx.dtype).contiguous(), "sum", 0, ctx.group), None, None, None


class _GatherFlatUnsharded(torch.autograd.Function):
    """_GatherFlat for parallel.fsdp_accumulate unsharded: backward hands the whole packed
    gradient to `sink`, a leaf whose .grad adds up the step's micro-steps, instead of
    reduce-scattering it; `ShardedContext.reduce_held` reduce-scatters that sum once."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, sink: torch.Tensor, dtype, group: str):
        ctx.dtype = flat.dtype
        return funcol.all_gather_tensor(flat.to(dtype), 0, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad.to(ctx.dtype).reshape(-1), None, None


def grad_layouts(run: "BucketRun") -> list[tuple]:
    """The layout each gathered weight's gradient is taken in: Partial over the dims that
    split the tokens (the data dims, and the sequence dims for a weight used whole)."""
    return [tuple(Partial() if q.is_replicate() and run.mesh_shape[i] > 1 and (i in run.data or i in run.seq_dims)
                  else q for i, q in enumerate(compute))
            for compute in run.compute]


def held_partials(run: "BucketRun") -> dict[tuple[int, ...], list[int]]:
    """The members whose gradients a traced step leaves partial after the reduce-scatters,
    by the mesh dims they are partial over (replica dims; tp where a norm meets sequence-
    parallel activations: `seq_dims`): `ShardedContext.reduce_held` sums them once per
    step."""
    gathered = {j: s.gather for s in run.sets for j in s.members}
    out: dict[tuple, list[int]] = {}
    for j, layout in enumerate(grad_layouts(run)):
        dims = tuple(i for i, q in enumerate(layout) if q.is_partial() and i not in gathered.get(j, ()))
        if dims:
            out.setdefault(dims, []).append(j)
    return out


def traced_gather(run: "BucketRun", *shards: DTensor) -> tuple[DTensor, ...]:
    """A bucket's gather written as differentiable ops on local tensors, for traced steps:
    one all-gather per gather set forward, one reduce-scatter per set backward. What is
    still partial after that (`held_partials`) stays partial in the shards' gradients,
    declared so (Partial placements), and accumulates over the step's micro-steps:
    `ShardedContext.reduce_held` all-reduces it once after the last backward (a traced
    graph cannot hold on some micro-steps and not on others without a second graph).
    The gathered weights declare the gradient layout they take (`grad_layouts`), so
    DTensor turns whatever backward brings into that layout first."""
    held = {j: dims for dims, js in held_partials(run).items() for j in js}
    locals_ = [s.to_local(grad_placements=[Partial() if i in held.get(j, ()) else q
                                           for i, q in enumerate(s.placements)])
               for j, s in enumerate(shards)]
    layouts = grad_layouts(run)
    gathered = {j: s.gather for s in run.sets for j in s.members}
    out = {j: t.to(run.dtypes[j]) for j, t in enumerate(locals_) if j not in gathered}
    for k, s in enumerate(run.sets):
        pieces = []
        for j in s.members:
            m, padded = run.bucket.members[j], run.padded[j]
            t = locals_[j]
            missing = padded[m.dim] - t.shape[m.dim]
            if missing:
                pad = list(t.shape)
                pad[m.dim] = missing
                t = torch.cat([t, t.new_zeros(pad)], m.dim)
            pieces.append(t.reshape(-1))
        flat, group = torch.cat(pieces), run.groups.name(s.gather)
        full = (_GatherFlatUnsharded.apply(flat, run.sinks[k], s.dtype, group) if run.unsharded
                else _GatherFlat.apply(flat, s.dtype, group, s.ways)).view(s.ways, s.numel)
        # split, not slices: backward concatenates the pieces' gradients into one buffer
        # (a slice's backward would fill a whole-bucket buffer of zeros for each member).
        for j, piece in zip(s.members, full.split([run.numels[j] for j in s.members], dim=1)):
            out[j] = _unshard(piece, run.bucket.members[j], run.padded[j])
    return tuple(DTensor.from_local(out[j], run.mesh, run.compute[j], run_check=False, shape=run.global_shapes[j],
                                    stride=make_contiguous_strides_for(run.global_shapes[j]),
                                    grad_placements=layouts[j])
                 for j in range(len(shards)))


class BucketGather(torch.autograd.Function):
    """(run, pending gathers or None per gather set, *shards) -> gathered weights as
    DTensors in their compute layout; backward: `BucketRun.reduce`, the gradients back as
    DTensors in the shards' layout.

    Eager only: backward reads each gradient's placements (Partial where it is a sum
    still to reduce), and a traced step hands a custom Function's backward its outputs'
    placements instead of the gradients' (torch 2.13: the norm came out halved at fsdp
    2); traced steps use `traced_gather`."""

    @staticmethod
    def forward(ctx, run: BucketRun, *args):
        pending, shards = args[:len(run.sets)], args[len(run.sets):]
        ctx.run, ctx.leaves = run, shards
        ctx.shards = [(s.placements, s.shape, s.stride()) for s in shards]
        locals_ = [s._local_tensor.to(d) for s, d in zip(shards, run.dtypes)]
        out = dict(enumerate(locals_))
        for s, ready in zip(run.sets, pending):
            gathered = ready if ready is not None else \
                funcol.all_gather_single(run.pack(s, locals_), 0, run.groups.name(s.gather))
            out.update(run.unpack(s, gathered))
        return tuple([run.wrap(j, out[j]) for j in range(len(shards))])

    @staticmethod
    def backward(ctx, *grads):
        # The shards' local tensors are read from the parameters, not saved for backward:
        # a checkpointed block's recompute must save exactly what its forward saved, and a
        # bucket gathered in another block's forward is gathered in this one's recompute.
        run = ctx.run
        shards = [leaf._local_tensor for leaf in ctx.leaves]
        local = run.reduce(grads, shards, ctx.leaves)
        out = [None if g is None else
               DTensor.from_local(g, run.mesh, placements, run_check=False, shape=shape, stride=stride)
               for g, (placements, shape, stride) in zip(local, ctx.shards)]
        return (None, *([None] * len(run.sets)), *out)
