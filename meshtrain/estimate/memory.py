"""Per-rank memory of one training step, from the Plan and the model's shapes alone.

`per_rank_memory` is the dry-run estimate behind `meshtrain plan`: no process group, no
tensors, so it answers for any world size in microseconds. Every number is bytes on the
most loaded rank (uneven fsdp shards round up, so rank 0 may hold more).

State (fp32, exact: straight from the Plan's local shapes)
  params     sum of ParamPlan.bytes_per_rank
  grads      the same shapes, fp32 (the gradient reaches the shard in the parameter's dtype)
  optimizer  AdamW exp_avg + exp_avg_sq: 2 x params (train.optimizer muon: 1 x its matrices)

Activations (activation_memory.py: per dense layer and once per micro-batch;
moe_memory.py: an MoE block's feed-forward half), the weights a step holds beyond the
shards (weight_memory.py) and each bucket's transients (bucket_memory.py) are terms of
their own; `per_rank_memory` composes them.

Peak = params + grads + optimizer + activations + recompute (+ `unsharded_grads`: the
whole fp32 gradients of the gathered parameters, held between micro-steps under
parallel.fsdp_accumulate unsharded; + `kept_weights` + `kept_grads`) + the largest transient:
one layer's gathered weights in the compute dtype (fsdp gathers a layer's weights at a
time; under bf16 a non-gathered weight is cast per use) or the loss's (the local logits
slice and its gradient in c bytes, and one fp32 chunk of rows). Grads are counted as resident for the whole
step (true from the second micro-step; an upper bound for the first). Allocator
fragmentation, communication buffers and the CUDA context are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..layout.plan import Plan
from ..layout.traffic import Traffic
from ..models.cost_terms import cost_terms
from ..models.policy import ACTIVATION_MODES, keeps_fp32
from ..train.muon import muon_name
from .activation_memory import (MicroBatch, attention_half, block_tables, checkpointed_layer, loss_transient,
                                mask_tensors, mlp_half, mtp_extras, offload_stays, once_per_micro_batch)
from .bucket_memory import largest_transients
from .compute import MaskKeys
from .dtype_bytes import FP32
from .moe_memory import moe_block
from .weight_memory import compute_numel, is_gathered, weight_bytes

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8: bf16 activations, fp8 GEMM operands transient
# A GPU's caching allocator rounds blocks up and fragments: a stated share of the peak,
# not measured here (no GPU; docs/plan.md "Peak memory").
ALLOCATOR_SLACK = 0.05


def per_rank_memory(plan: Plan, model, *, micro_batch: int, seq_len: int, precision: str = "fp32",
                    activation_checkpointing: str = "none", traffic: Traffic = Traffic(), device: str = "cpu",
                    attention: str | None = None, names=None, layers: int | None = None, embedding: bool = True,
                    head: bool = True, in_flight: int = 1, mask_keys=None, optimizer: str = "adamw",
                    optimizer_offload: bool = False) -> dict:
    """Bytes on the most loaded rank for one training step (see the module docstring for
    what is counted). micro_batch: sequences per data-parallel rank per micro-step.
    device: "cpu" | "cuda" picks the attention kernel unless `attention` ("flash" |
    "math") names it. Returns params, grads, optimizer, activations (kept for backward,
    including saved weights), peak, and a breakdown.

    A pipeline rank (plan: the stage plan without pp) holds only `names`, runs `layers`
    layers per micro-batch, the embedding and the head/loss only where it holds them, and
    keeps the activations of `in_flight` micro-batches at once (the schedule's peak).

    mask_keys: with data.document_mask, what the masks attention keeps
    (estimate.compute.mask_keys; None: no masks). traffic: the step's parameter traffic
    (layout/traffic.py) as the runtime takes it: reshard_after_forward, fsdp_accumulate,
    prefetch (the gathers issued ahead and the reductions left in flight) and
    keep_gathered (a pp rank under parallel.pp_keep_gathered; the module docstring).
    optimizer: train.optimizer (muon keeps one fp32 buffer per Muon matrix, not two).

    Offload (the terms are device bytes; host_* what moved to host memory): under
    activation_checkpointing offload the blocks' saved activations and weight copies
    (host_activations, host_saved_weights), one block's coming back as a transient
    (recompute); with optimizer_offload AdamW's moments (host_optimizer)."""
    attention = _checked(model, seq_len, precision, activation_checkpointing, device, attention)
    mb = MicroBatch.of(plan, model, micro_batch, seq_len, _DTYPE_BYTES[precision])
    mask_keys = mask_keys or MaskKeys()
    names = set(plan.params if names is None else names)
    layer = _layer(mb, attention, activation_checkpointing, mask_keys)
    once, masks, loss = once_per_micro_batch(mb, mask_keys, embedding, head)
    if layer.host is not None:  # the tables the blocks keep go to the host with them
        once -= block_tables(mb)
    mtp = _mtp_modules(mb, layer) if head else 0
    layers_bytes, per_layer, ran = _layers(model.cfg, layers, layer)
    weights = weight_bytes(plan, model, names, mb.c, activation_checkpointing, traffic)
    state = _state(plan, names, traffic, optimizer, mb.c)
    host = _offloaded(plan, model, names, mb, traffic, layers, layer, weights, head)
    if optimizer_offload:
        host["host_optimizer"], state = state.optimizer, replace(state, optimizer=0)
    # The largest transient: a layer's gathered or cast weights, a bucket's gather in
    # forward, the loss at the turn, or a bucket's backward (its weight gradients and
    # reductions, where the layer backward has just run has freed what it kept, when a
    # micro-batch is counted here).
    replicas = plan.mesh.size("dp") if "dp" in plan.mesh.axes else 1
    forward, backward, comm_buffers = largest_transients(weights.buckets, traffic, replicas, device)
    loss_logits = loss_transient(mb) if head else 0
    freed = per_layer if in_flight and ran else 0
    out = {
        "params": state.params, "grads": state.grads, "optimizer": state.optimizer,
        "activations": in_flight * (layers_bytes + once + loss + mtp) + weights.saved + weights.gathered,
        "activations_per_layer": per_layer, "activations_layers": in_flight * layers_bytes,
        "activations_once": once, "loss_saved": loss, "mtp_saved": mtp, "saved_weights": weights.saved,
        "gathered_weights": weights.gathered, "recompute": layer.recompute,
        "transient": max(weights.layer_copies, forward, loss_logits, backward - freed),
        "unsharded_grads": state.unsharded_grads, "kept_weights": state.kept_weights, "kept_grads": state.kept_grads,
        "micro_grads": state.micro_grads,
        "transient_forward": forward, "transient_backward": backward, "comm_buffers": comm_buffers,
        # Kept gathered: a release, beside the kept weights and the sums: its reductions'
        # buffers, and under zero 2 the shards' gradients and one micro-batch's sums (zero 1
        # drops each bucket's sums as its shards' gradients are made: at most one bucket's
        # more, the first, whose shards had none).
        "release": (state.grads + state.micro_grads if traffic.zero == 2 else 0) + comm_buffers
        if traffic.keep_gathered else 0,
        "transient_layer_weights": weights.layer_copies, "logits": loss_logits,
        "attention_kernel": attention, "document_masks": masks, "tiles_joined_per_layer": layer.joined,
        "window_pads_per_layer": layer.pads,
        **({"activations_per_moe_layer": layer.moe} if layer.moe is not None else {}),
        "host_activations": in_flight * host["host_activations"], "host_saved_weights": host["host_saved_weights"],
        "activations_offloaded": in_flight * host["activations_offloaded"] + host["host_saved_weights"],
        "host_optimizer": host.get("host_optimizer", 0),
    }
    out["peak"], out["allocator_slack"] = total_peak(out, device)
    return out


def _checked(model, seq_len: int, precision: str, checkpointing: str, device: str, attention: str | None) -> str:
    """The attention kernel, after checking the step's settings: the math kernel where
    torch has no fused one (CUDA: fp32 with GQA; CPU: values narrower than keys, as
    MLA's) unless `attention` names one."""
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"precision={precision!r}: choose fp32, bf16, fp16 or fp8")
    if checkpointing not in ACTIVATION_MODES:
        raise ValueError(f"activation_checkpointing={checkpointing!r}: choose one of {', '.join(ACTIVATION_MODES)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: choose cpu or cuda")
    gqa = model.family.kv_heads(model.cfg) != model.cfg.n_heads
    terms = cost_terms(model, seq_len, torch.float32).attention
    narrow = terms is not None and terms.attend.v[-1] != terms.attend.k[-1]
    if attention is None:
        fused = not (gqa and precision == "fp32") if device == "cuda" else not narrow
        attention = "flash" if fused else "math"
    if attention not in ("flash", "math"):
        raise ValueError(f"attention={attention!r}: choose flash or math")
    # The CPU's math kernel computes a bf16 attention in fp32 (its output cast back).
    return "math_fp32" if attention == "math" and device == "cpu" and precision != "fp32" else attention


@dataclass(frozen=True)
class _Layer:
    dense: int  # what a dense layer keeps on the device under the checkpointing
    moe: int | None  # an MoE layer's (None: the model has no MoE blocks)
    recompute: int  # the largest layer's recompute transient in backward
    joined: int  # per layer: eager document tiles' outputs joined into one tensor
    pads: int  # per layer: compiled document windows' padded keys and values
    host: "_Layer | None" = None  # offload: what the layers keep in host memory instead


def _layer(mb: MicroBatch, kernel: str, checkpointing: str, mask_keys: MaskKeys) -> _Layer:
    """One layer's activations, dense and (where the model has them) MoE. Offload: none's,
    in host memory; on the device a block's come back as its backward runs, one saved
    tensor at a time (counted whole as the transient: an upper bound)."""
    if checkpointing == "offload":
        none, stays = _layer(mb, kernel, "none", mask_keys), offload_stays(mb)
        host = _Layer(none.dense - stays + block_tables(mb), None if none.moe is None else none.moe - stays + block_tables(mb),
                      0, none.joined, none.pads)
        return _Layer(stays, None if none.moe is None else stays, max(none.dense, none.moe or 0) - stays, none.joined,
                      none.pads, host)
    joined, pads = mask_tensors(mb, mask_keys)
    attention = attention_half(mb, kernel, joined, pads)
    none = attention + mlp_half(mb)
    dense = checkpointed_layer(mb, none, checkpointing, kernel, joined, pads)
    recompute = 0 if checkpointing == "none" else max(0, none - dense)
    moe = None
    if _moe_ids(mb.cfg):  # an MoE block: the attention half as a dense block's, then the routed experts
        moe, moe_recompute = moe_block(mb, attention, dense, checkpointing)
        recompute = max(recompute, moe_recompute)
    return _Layer(dense, moe, recompute, joined, pads)


def _offloaded(plan: Plan, model, names: set[str], mb: MicroBatch, traffic: Traffic, layers, layer: _Layer,
               weights, head: bool) -> dict:
    """Under activation offload, what one micro-batch's blocks (the layers', and the
    multi-token prediction modules' after the head) keep in host memory, as none keeps
    them on the device, and the weight copies autograd saved in the layers."""
    if layer.host is None:
        return {"host_activations": 0, "host_saved_weights": 0, "activations_offloaded": 0}
    kept = weight_bytes(plan, model, names, mb.c, "none", traffic)
    tables, host = block_tables(mb), layer.host
    moved = _Layer(host.dense - tables, None if host.moe is None else host.moe - tables, 0, 0, 0)
    extras = mb.costs.mtp_depth * mtp_extras(mb)  # the modules' parts outside their blocks stay
    return {"host_activations": _layers(model.cfg, layers, host)[0] + (_mtp_modules(mb, host) - extras if head else 0),
            "host_saved_weights": kept.saved + kept.gathered - weights.saved - weights.gathered,
            # what leaves the device per micro-batch: each block's own, the tables once
            "activations_offloaded": _layers(model.cfg, layers, moved)[0] + tables
            + (_mtp_modules(mb, moved) - extras if head else 0)}


def _mtp_modules(mb: MicroBatch, layer: _Layer) -> int:
    """What the multi-token prediction modules after the head keep: each its block (of
    its kind, under the checkpointing) and the rest of the module (mtp_extras)."""
    depth, moe = mb.costs.mtp_depth, mb.costs.mtp_moe
    return depth * mtp_extras(mb) + moe * (layer.moe or 0) + (depth - moe) * layer.dense


def _moe_ids(cfg) -> set[int]:
    return set(cfg.moe_layers) if getattr(cfg, "moe", None) is not None else set()


def _layers(cfg, layers, layer: _Layer) -> tuple[int, int, bool]:
    """(the layers' bytes, one layer's, whether any layer is run and known) for `layers`:
    None (all), a count (the first that many) or the indices. A count with MoE blocks
    somewhere counts each layer as the larger kind; one layer is an MoE block's where
    every layer run is MoE."""
    moe_ids = _moe_ids(cfg)
    if layers is None:
        run = list(range(cfg.n_layers))
    elif isinstance(layers, int):
        run = list(range(layers)) if not moe_ids else None
    else:
        run = list(layers)
    if run is None:
        return layers * max(layer.dense, layer.moe), layer.dense, False
    n_moe = sum(i in moe_ids for i in run)
    all_moe = bool(run) and all(i in moe_ids for i in run)
    per_layer = layer.moe if all_moe else layer.dense
    return (len(run) - n_moe) * layer.dense + n_moe * (layer.moe or 0), per_layer, bool(run)


@dataclass(frozen=True)
class _State:
    params: int
    grads: int
    optimizer: int
    unsharded_grads: int
    kept_weights: int
    kept_grads: int
    micro_grads: int


def _state(plan: Plan, names: set[str], traffic: Traffic, optimizer: str = "adamw", c: int = FP32) -> _State:
    """Parameters, gradients (the trainable ones') and the optimizer's state of `names`
    (AdamW's two moments; under Muon its matrices' one momentum buffer); under
    parallel.fsdp_accumulate unsharded (with micro-steps) the gathered parameters' whole
    fp32 gradients, held from the first micro-step to the reduce-scatter. Kept gathered
    (parallel.zero 1 and 2, parallel.pp_keep_gathered; parallel/keep_gathered.py): the
    weights held for the step in the compute dtype c (the router fp32; an fp32 weight
    not gathered is the parameter itself), and every trainable one's fp32 gradient sum
    beside them: over the step's micro-batches (`kept_grads`), or under zero 2 one
    micro-batch's until its reduction (`micro_grads`)."""
    params = sum(p.bytes_per_rank for n, p in plan.params.items() if n in names)
    # State the step updates itself (the aux-free expert bias) has no gradient; AdamW's
    # state keeps (zero) moments for every parameter (train/optim.py init_state).
    moments = sum(math.prod(p.local_shape) * FP32 * _buffers(optimizer, n, p.spec) for n, p in plan.params.items()
                  if n in names)
    grads = sum(math.prod(p.local_shape) * FP32 for n, p in plan.params.items() if n in names and p.spec.trainable)
    whole = sum(compute_numel(plan, n) * FP32 for n in plan.params if n in names and is_gathered(plan, n))
    kept = sums = 0
    if traffic.keep_gathered:
        for n in names:
            width = FP32 if keeps_fp32(n) else c
            kept += compute_numel(plan, n) * width if is_gathered(plan, n) or width != FP32 else 0
            sums += compute_numel(plan, n) * FP32 if plan.params[n].spec.trainable else 0
    per_micro = traffic.zero == 2
    return _State(params, grads, moments, whole if traffic.fsdp_accumulate == "unsharded" else 0, kept,
                  0 if per_micro else sums, sums if per_micro else 0)


def _buffers(optimizer: str, name: str, spec) -> int:
    """fp32 buffers of the optimizer's state per element of parameter `name`."""
    return 1 if optimizer == "muon" and muon_name(name, len(spec.shape)) else 2


def total_peak(m: dict, device: str) -> tuple[int, int]:
    """(peak, its allocator_slack) of per_rank_memory's terms `m` (a pipeline rank's with
    its micro-batches in flight added): the state, then the step's working set: the
    gradients, activations, recompute and the largest transient together; kept gathered
    (m["release"] > 0), the larger of the micro-batches' working set (the shards'
    gradients do not exist yet) and the step end's; under ZeRO-2 (m["micro_grads"] > 0) the
    shards' gradients exist from the first micro-batch's reduction on, beside either.
    """
    base = m["params"] + m["optimizer"] + m["unsharded_grads"] + m["kept_weights"] + m["kept_grads"]
    working = m["activations"] + m["recompute"] + m["transient"]
    if m.get("micro_grads"):
        working += m["grads"]
    peak = base + (max(working, m["release"]) if m["release"] else m["grads"] + working)
    # The caching allocator's rounding and fragmentation on a GPU, stated (ALLOCATOR_SLACK).
    slack = int(ALLOCATOR_SLACK * peak) if device == "cuda" else 0
    return peak + slack, slack
