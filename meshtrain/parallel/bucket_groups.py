"""The process groups that bucket traffic runs on (one per set of mesh dims), and the bound
on gradient reductions left in flight.
"""

from __future__ import annotations

import collections
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..layout.buckets import group_axes

# Every parameter-traffic group made in this process: group name -> its mesh axes joined
# by "+" ("fsdp", "dp+fsdp"), for tools that label recorded collectives by axis.
GROUP_AXES: dict[str, str] = {}


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
