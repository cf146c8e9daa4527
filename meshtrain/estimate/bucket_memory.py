"""The transients of one parameter bucket in a step (`per_rank_memory`'s transient and
communication buffers, memory.py): what the eager bucket path (parallel/bucket_run.py)
allocates to gather a bucket's weights in forward and to gather them again and reduce
their gradients in backward."""

from __future__ import annotations

import math

from ..layout.mesh import GATHERED_AXES
from ..layout.plan import Plan
from ..layout.traffic import Traffic
from .dtype_bytes import FP32


class BucketBytes:
    """One bucket's bytes (a block's weights, or those before or after the blocks) for its
    transients: compute-local elements, their compute copies, and the gathered part."""

    def __init__(self, kept: bool):
        self.kept = kept  # parallel.zero 1/2, pp_keep_gathered: gathered once per step, reduced at its end
        self.copies = self.grads = self.gathered = self.replica_grads = 0
        self.ways = 1

    def add(self, plan: Plan, name: str, n: int, width: int, gathered: bool) -> None:
        # The weight gradient autograd makes, in the compute dtype, and its fp32 copy for
        # the reductions (BucketRun._normalise) where that differs; a gathered one is cast
        # as it is packed for its reduce-scatter, with no copy. Kept weights are held in
        # the compute dtype: their gradients' fp32 sums are state (`kept_grads`).
        self.grads += n * width + (n * FP32 if width != FP32 and not gathered and not self.kept else 0)
        if gathered:
            p = plan.params[name]
            ways = math.prod(p.mesh.size(a) for a, q in zip(p.mesh.axes, p.placements)
                             if a in GATHERED_AXES and not q.is_replicate())
            self.ways = max(self.ways, ways)
            self.copies += 0 if self.kept else n * width
            self.gathered += n * FP32
            self.replica_grads += n * FP32 // ways
        else:
            self.replica_grads += n * FP32

    def transients(self, traffic: Traffic, replicas: int, device: str) -> tuple[int, int, int]:
        """(forward, backward, the backward's communication buffers), as the eager bucket
        path (parallel/bucket_run.py) allocates them under `traffic`'s prefetch and
        reshard_after_forward. Forward: the gathered flat buffer and the weights unpacked
        from it, the packed shards, and `prefetch` gathers issued ahead. Backward: the
        weights gathered again (with resharding) and `prefetch` ahead, the weight gradients, the packed fp32 buffer of the reduce-scatter and
        `prefetch` + 1 of its outputs in flight, and with dp replicas the all-reduce's
        concatenated input and output; on a GPU the inputs of the reductions in flight
        are held too (until their collective ends). Kept gathered (`kept`), a micro-batch's
        backward makes the weight gradients only, and the communication buffers are the
        step end's (`total_peak`): the packed buffer and the outputs in flight but the
        last (which is the shard's gradient)."""
        prefetch = traffic.prefetch
        gather = self.copies * (1 + 1 / self.ways)
        forward = int(self.copies * 2 + prefetch * gather) if self.copies else 0
        comm = 0
        if self.gathered:
            comm += prefetch * self.copies + self.gathered + (prefetch + 1) * self.gathered // self.ways
            comm += prefetch * self.gathered if device == "cuda" else 0
        if replicas > 1:
            comm += 2 * self.replica_grads
        if self.kept:
            return forward, self.grads, int(comm - (self.gathered // self.ways if self.gathered else 0))
        backward = (self.copies if traffic.reshard_after_forward else 0) + self.grads + comm
        return forward, int(backward), int(comm)


def largest_transients(buckets, traffic: Traffic, replicas: int, device: str) -> tuple[int, int, int]:
    """(forward, backward, its communication buffers) of `buckets` (BucketBytes) under
    `traffic`: the largest forward, and the largest backward with its buffers."""
    sets = [b.transients(traffic, replicas, device) for b in buckets]
    forward = max((f for f, _, _ in sets), default=0)
    backward, comm_buffers = max(((bw, cb) for _, bw, cb in sets), default=(0, 0))
    return forward, backward, comm_buffers
