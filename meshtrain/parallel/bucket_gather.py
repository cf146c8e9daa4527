"""A bucket's gather as autograd sees it: `BucketGather` in eager steps (backward runs
`BucketRun.reduce`), `traced_gather` in compiled ones (differentiable ops on local tensors:
one all-gather per gather set forward, one reduce-scatter per set backward).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial

from .bucket_run import BucketRun, grad_layouts, held_partials, unshard


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


def traced_gather(run: BucketRun, *shards: DTensor) -> tuple[DTensor, ...]:
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
            out[j] = unshard(piece, run.bucket.members[j], run.padded[j])
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
