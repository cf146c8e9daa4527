"""A bucket on a live mesh (`BucketRun`): its gather sets' flat buffers and the
collectives over them. Forward packs the shards into one buffer per gather set and
all-gathers it (or takes a gather issued earlier, the prefetch) and copies each weight
out; backward packs the gradients the same way and issues, per bucket, one all-reduce per
other mesh dim where gradients are partial (the tp all-reduce of sequence-parallel norm
weights), one reduce-scatter over the gathered dims (fsdp, or fsdp x cp as one flattened
group), then one all-reduce of the shards over the replica dims (dp: HSDP, or plain dp).
The autograd functions that call it are parallel/bucket_gather.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial

from ..layout.buckets import DATA_AXES, Bucket, Member, gather_sets
from ..layout.plan import Plan
from .bucket_groups import Groups, InFlight


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
        return {j: unshard(full[:, off:off + self.numels[j]], self.bucket.members[j], self.padded[j]).contiguous()
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
        locals_, places = [], []
        packed = {j for s in self.sets for j in s.members}
        for j, (g, shard) in enumerate(zip(grads, shards)):
            local, placements = self._normalise(j, g, shard, j in packed)
            locals_.append(local)
            places.append(placements)
        out = list(locals_)
        last_packed = self._reduce_scatter(locals_, places, shards, out)
        by_dims = self._still_partial(places, out)
        if self.hold:  # a micro-step before the last: the partial sums accumulate locally
            self._held = True
            return [None if g is None else g.contiguous() for g in out]
        self._all_reduce_partial(by_dims, leaves, out)
        del last_packed  # held through the all-reduce (see _reduce_scatter)
        self._held = False
        return [g.contiguous() for g in out]

    def _reduce_scatter(self, locals_, places, shards, out: list) -> torch.Tensor | None:
        """One reduce-scatter per gather set, its members' shards into `out` (None while
        `hold` and `unsharded` keep the packed gradients here instead). Returns the last
        set's packed buffer, which `reduce` holds until the reduction ends: the peak the
        planner counts and bench/step_peak_cpu.py measures (the packed gradients beside
        the dp all-reduce's buffers)."""
        accumulate = self.hold and self.unsharded
        buf = None
        for k, s in enumerate(self.sets):
            buf = self._pack_grads(s, locals_, places, shards[0].device)
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
        return buf

    def _pack_grads(self, s: _Set, locals_, places, device) -> torch.Tensor:
        """Gather set s's gradients in one (ways, numel) buffer in the parameter dtype,
        each member padded and split rank by rank as its shards are."""
        ways = s.ways
        buf = torch.empty(ways, s.numel, dtype=self.param_dtypes[s.members[0]], device=device)
        for j, off in zip(s.members, s.offsets):
            m, padded = self.bucket.members[j], self.padded[j]
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
        return buf

    def _still_partial(self, places, out: list) -> dict[tuple, dict[int, torch.Tensor]]:
        """What is still partial after the reduce-scatters (over dp: HSDP's replicas, plain
        dp; over tp: sequence-parallel norms), as shards, by the mesh dims to all-reduce."""
        gathered = {j for s in self.sets for j in s.members}
        by_dims: dict[tuple, dict[int, torch.Tensor]] = {}
        for j, m in enumerate(self.bucket.members):
            done = set(m.gather) if j in gathered else set()
            # A dim of one rank (a 1-rank mesh) has nothing to add up and no group.
            dims = tuple(i for i, q in enumerate(places[j])
                         if q.is_partial() and i not in done and self.mesh_shape[i] > 1)
            if dims:
                by_dims.setdefault(dims, {})[j] = out[j]
        return by_dims

    def _all_reduce_partial(self, by_dims, leaves, out: list) -> None:
        """One all-reduce per set of mesh dims in `by_dims`, into `out`, with the partial
        sums that earlier micro-steps held back in the leaves' .grad added in first."""
        for dims, items in by_dims.items():
            for j in items:  # what earlier micro-steps held back joins this one's reduction
                held = leaves[j].grad if self._held else None
                if held is not None:
                    items[j] = items[j] + held._local_tensor
                    leaves[j].grad = None
            self.all_reduce(items, dims)
            for j, g in items.items():
                out[j] = g


def unshard(pieces: torch.Tensor, m: Member, padded: tuple[int, ...]) -> torch.Tensor:
    """Member m's gathered weight from its padded shards (ways, numel), rank by rank."""
    ways = pieces.shape[0]
    merged = pieces.reshape(ways, *padded).movedim(0, m.dim)
    merged = merged.reshape(*padded[:m.dim], ways * padded[m.dim], *padded[m.dim + 1:])
    return merged.narrow(m.dim, 0, m.shape[m.dim])


def grad_layouts(run: BucketRun) -> list[tuple]:
    """The layout each gathered weight's gradient is taken in: Partial over the dims that
    split the tokens (the data dims, and the sequence dims for a weight used whole)."""
    return [tuple(Partial() if q.is_replicate() and run.mesh_shape[i] > 1 and (i in run.data or i in run.seq_dims)
                  else q for i, q in enumerate(compute))
            for compute in run.compute]


def held_partials(run: BucketRun) -> dict[tuple[int, ...], list[int]]:
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
