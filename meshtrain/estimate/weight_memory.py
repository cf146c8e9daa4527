"""The weights a step holds beyond the parameters' shards (terms of `per_rank_memory`,
memory.py): those autograd keeps for backward, the per-layer copies gathering or casting
them makes, and each bucket's bytes for its transients (bucket_memory.py).

Weights kept for backward (`saved_weights`, part of activations): matmuls and norm
scales save the weight they multiply by. Parameters that are not gathered are saved as
themselves in fp32 (no new memory) but as a new bf16 copy under bf16, except a block's
under full or selective checkpointing, whose recompute casts again. Gathered (fsdp)
weights are gathered again in backward (ZeRO-3, parallel.reshard_after_forward, eager
and compiled): nothing kept. Without resharding every gathered weight autograd saves is
kept from forward to backward (`gathered_weights`), except a block's under full or
selective checkpointing, whose recompute gathers again.

Kept gathered (parallel.zero 1 and 2, parallel.pp_keep_gathered: `keep_gathered`;
parallel/keep_gathered.py) a rank gathers its parameters once per step in the compute
dtype and holds them over the micro-batches (memory.py's `kept_weights` and the fp32 sums
of their gradients, `kept_grads`). The step uses the kept weights as they are (`Tensor.to`
of their own dtype is the tensor itself): no copy, no transient, and what autograd saves
of them is the kept weight itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.cost_terms import cost_terms
from ..models.policy import keeps_fp32
from ..layout.mesh import GATHERED_AXES
from ..layout.plan import Plan
from ..layout.traffic import Traffic
from .bucket_memory import BucketBytes
from .dtype_bytes import FP32


def compute_numel(plan: Plan, name: str) -> int:
    """Elements of a parameter where it is used: gathered over fsdp, tp shards kept. An
    uneven fsdp dim is gathered padded (fsdp x the largest shard), as the all-gather
    buffer is, and the gathered tensor is a view of that buffer."""
    p = plan.params[name]
    made = p.__dict__.get("_compute_numel")  # once per parameter plan (frozen) and mesh, as is_gathered
    if made is not None and made[0] is plan.mesh:
        return made[1]
    shape = list(p.spec.shape)
    for d, axes in enumerate(p.layout.dim_axes):
        for a in axes:
            n = plan.mesh.size(a)
            shape[d] = math.ceil(shape[d] / n) * (n if a in GATHERED_AXES else 1)
    p.__dict__["_compute_numel"] = (plan.mesh, math.prod(shape))
    return p.__dict__["_compute_numel"][1]


def is_gathered(plan: Plan, name: str) -> bool:
    p = plan.params[name]
    made = p.__dict__.get("_gathered")  # once per parameter plan (frozen): asked per rank and layout
    if made is None:
        made = p.__dict__["_gathered"] = tuple(p.compute_placements()) != tuple(p.placements)
    return made


@dataclass
class WeightBytes:
    saved: int  # `saved_weights`: the casts autograd keeps
    gathered: int  # `gathered_weights`: the gathered weights kept without resharding
    layer_copies: int  # the largest layer's (or other group's) gathered or cast copies at once
    buckets: list[BucketBytes]  # a block's, and those before and after the blocks


def weight_bytes(plan: Plan, model, names: set[str], c: int, checkpointing: str, traffic: Traffic) -> WeightBytes:
    """The weights of the parameters in `names` (a pipeline rank's), with compute dtype c,
    under `traffic`'s reshard_after_forward and keep_gathered (the weights held in the
    compute dtype: nothing new)."""
    # Which weights an op keeps for backward does not depend on the sequence: read at 1.
    kept_by_ops = cost_terms(model, 1, torch.float32 if c == FP32 else torch.bfloat16)
    keep_gathered = traffic.keep_gathered
    saved_weights = gathered_weights = 0
    layer_weights: dict[str, int] = {}
    buckets: dict[str, BucketBytes] = {}
    for name in plan.params:
        if name not in names:
            continue
        gathered, n = is_gathered(plan, name), compute_numel(plan, name)
        width = FP32 if keeps_fp32(name) else c  # the router stays fp32
        # Otherwise the parameter itself (or the kept weight) is used.
        new_copy = not keep_gathered and (gathered or width != FP32)
        group = name.split(".")[1] if name.startswith("layers.") else name
        if new_copy:
            layer_weights[group] = layer_weights.get(group, 0) + n * width
        if plan.params[name].spec.trainable:
            unit = name.split(".")[1] if name.startswith("layers.") else "before" if name == "tok_emb" else "after"
            buckets.setdefault(unit, BucketBytes(keep_gathered)).add(plan, name, n, width, gathered)
        if not new_copy or not kept_by_ops.weight_saved(name):
            continue
        # A block's checkpoint gathers or casts its weights again in the recompute.
        recast = checkpointing != "none" and name.startswith("layers.")
        if gathered:
            kept = not traffic.reshard_after_forward and not recast
            gathered_weights += n * width if kept else 0
        elif not recast:
            saved_weights += n * width
    return WeightBytes(saved_weights, gathered_weights, max(layer_weights.values(), default=0),
                       list(buckets.values()))
