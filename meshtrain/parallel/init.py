"""Materialise a Plan's parameters: each rank fills only its own shards."""

from __future__ import annotations

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ..models.spec import init_slice
from ..layout.mesh import device_mesh_for
from ..layout.plan import Plan


def init_params(plan: Plan, mesh: DeviceMesh, seed: int = 0, device: str | torch.device = "cpu",
                names=None) -> dict[str, DTensor]:
    """DTensor parameters whose gathered values are the same for every layout (they depend
    on seed, name and shape only). On the meta device nothing is computed. `names`: only
    these (a pipeline stage's), else all the plan's."""
    params = {}
    device_mesh_for(mesh, plan.mesh.experts())  # built on every rank, holding experts or not
    for name, p in plan.params.items():
        if names is not None and name not in names:
            continue
        spec = p.spec
        mesh_of = device_mesh_for(mesh, p.mesh)
        if any(isinstance(x, _StridedShard) for x in p.placements):
            # A strided shard is not one contiguous slice: build the full value, keep ours.
            full = init_slice(spec, name, seed, device=device) if str(device) != "meta" else \
                torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            dt = distribute_tensor(full, mesh_of, p.placements, src_data_rank=None)
        else:
            local_shape, offset = compute_local_shape_and_global_offset(spec.shape, mesh_of, p.placements)
            if str(device) == "meta":
                local = torch.empty(local_shape, dtype=spec.dtype, device="meta")
            else:
                index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
                local = init_slice(spec, name, seed, index, device=device)
            dt = DTensor.from_local(local, mesh_of, p.placements, run_check=False,
                                    shape=torch.Size(spec.shape), stride=make_contiguous_strides_for(spec.shape))
        params[name] = dt.requires_grad_(spec.trainable) if dt.is_floating_point() else dt
    return params
