"""Per-rank memory of one training step, from the Plan and the model's shapes alone.

`per_rank_memory` is the dry-run estimate behind `meshtrain plan`: no process group, no
tensors, so it answers for any world size in microseconds. Every number is bytes on the
most loaded rank (uneven fsdp shards round up, so rank 0 may hold more).

State (fp32, exact: straight from the Plan's local shapes)
  params     sum of ParamPlan.bytes_per_rank
  grads      the same shapes, fp32 (the gradient reaches the shard in the parameter's dtype)
  optimizer  AdamW exp_avg + exp_avg_sq: 2 x params

Activations: what autograd keeps for backward for ONE micro-batch on one rank, counted
per saved tensor (unique storage) in the dtype it is saved in, with its local shape from
the plan's activation layouts (batch split over the axes the "batch" rule names, dp x
fsdp by default; heads / mlp / vocab over tp; the residual stream's sequence over tp when
sequence parallel maps seq_sp to tp). Tensors that exist before the forward (parameters,
input tokens) are not counted. With c = bytes of the compute dtype (4 fp32, 2 bf16),
B x S local tokens, and each term taking the local size of its logical axes, Llama keeps
per layer, per token:

  attention norm   c*D  its input (models/layers.py: backward rebuilds the rest)  [seq_sp]
                   4    rsqrt (one fp32 per token)                                [seq_sp]
  q/k/v matmuls    c*D  the normed input; under sp this rank's sequence shard,
                        gathered again in backward (eager; parallel/regather.py)  [seq_sp]
  attention        c*hd*(Hq + 2*Hkv)  rotated q, rotated k, v (flash/fused kernel)
                   c*hd*Hq + 4*Hq     output and log-sum-exp (the output is also wo's input)
  qk norms         c*hd + 4 per q and k head (qk_norm): the linears' outputs, rsqrt
  mlp norm         c*D + 4                                                       [seq_sp]
  mlp matmuls      c*D  normed input (its shard under sp)                         [seq_sp]
                   4*c*F  gate pre-activation (silu), silu output and up (the product),
                          the product (w_down's input)

In bf16 (c = 2) and units of D bytes that is 12 + 4 g + 8 F / D per token, g = Hkv /
Hq: Korthikanti et al.'s (2022) accounting for RMSNorm, GQA, SwiGLU and a fused
attention kernel (41 for llama3-8b), plus 8 + 4 Hq bytes of fp32 row statistics; every
term divided by tp under tp + sp (docs/plan.md derives it).

Once per micro-batch: RoPE cos and sin (S x hd each, c); the final norm (c*D + 4)
and the output matmul's input (c*D, its shard under sp); the loss (models.losses), which never gathers the
vocab and makes no fp32 copy of the logits: the local logits slice itself (c*V/tp per
token), the fp32 log-sum-exp per token, and under cp the targets (int64; this rank's
zigzag copy); the vocab-parallel embedding's
clamped ids (int64) and mask (bool). GPT-2 differs where its forward does: LayerNorm
keeps a mean besides the rsqrt (c*D + 8), no GQA, learned positions, and the MLP keeps
2*F (GELU input, GELU output): 12 + 8 F / D per token in bf16.

MoE blocks (llama `moe_layers`; the others stay dense) keep the attention half of a dense
block, then, in place of the MLP, what ShardedContext.moe, routed_experts and the shared
experts keep (model/moe.py, models/experts.py). Routing-dependent sizes are taken at the
uniform-routing expectation: each rank routes its T local tokens ([batch, seq]) x k =
top_k slots, K = T k rows (with a capacity factor, at most E x the capacity of them), and
its experts receive N = K rows (as many as it sends). E experts, E_l = E / ep local, F_l
= expert_ffn_dim / tp, Fs = shared_experts x expert_ffn_dim (split like an mlp), D dim:

  mlp norm         c*D + 4                                                       [seq_sp]
  block input      c*D when shared experts (their matmuls) or fp32 (the router's
                   h.float() is h), its shard under sp; 4*D under bf16 (the
                   router's fp32 copy)                                             [seq]
  router (fp32)    4*E scores (softmax / sigmoid output), 8*k chosen experts; sigmoid:
                   4 (their sum); norm_topk with k > 1: 4*k chosen scores + 4 their sum;
                   balance aux: 4*E per sequence (the counts); z-loss: 4*E logits + 4
  slots            8*k the sort order; 8 per kept slot (its token, the gather and the
                   scatter index);
                   per received row c*D (the rows the experts multiply), 4*c*F_l (gate
                   pre-activation, silu, up, product); per kept slot 2*c*D (expert output,
                   and the gated product that index_add keeps) + c (its gate); ep > 1:
                   2 x 8 per received row (arrival order and its inverse); 3 x 4*E_l offsets
  shared experts   4*c*Fs                                                          [seq]

Router and expert weights are used as local tensors (to_local); eager steps swap those
for their shard as they do any gathered weight. Under bf16 the router's fp32 copy is
kept (`saved_weights`), eager or compiled. The
expert bias (aux_free) is added, never kept. Checkpointing of MoE blocks: full keeps the
layer input; selective (an estimate) keeps the attention part as above, the router
scores, chosen experts and gates, and the matmul outputs (routed and shared gate / up
pre-activations, the expert output). A pipeline rank given only a layer count, which cannot
say which of its blocks are MoE, counts each layer as the larger kind (the pipeline
estimate gives layer indices).

Context parallelism (cp > 1) replaces the kernel by parallel/cp_attention.py, which keeps
q, k, v, output and log-sum-exp like a fused kernel (a2a: on the head split, the same
sizes, plus its own copy of the output, the zigzag order and its inverse, int64 per
position); allgather keeps the gathered K/V (cp x the local k and v) instead of the
local ones, and the zigzag order. The token ids a rank selects are a new tensor under
cp, kept by a lookup that is not vocab-parallel.

Attention kernel: the fused kernels (CPU's flash kernel, CUDA flash / mem-efficient)
keep q, k, v, output and log-sum-exp and recompute the probabilities. The math path
keeps q and k expanded to Hq heads (GQA), v expanded, the probabilities (B, Hq, S, S)
and a contiguous copy of the output; it is selected with attention="math" and is what
CUDA runs for fp32 GQA (no fused kernel takes fp32 + GQA there).

Packed documents (data.document_mask): attention keeps its masks for backward as
additive masks in the compute dtype (c per query and key), shared by the heads and, once
per micro-batch, by every layer. Compiled: a window of W keys per query (W: a tile plus a
document, rounded up to 128 x a power of two; the compiled graph computes the mask
once), and per layer the keys and values padded with W - 128 positions in front of the
row (2*c*(W - 128)*hd*Hkv per row), or, where W would reach the row, one dense mask (S
keys per query). Eager: a mask per tile of 128 queries over
its documents' span (about a tile plus half a document of keys per query;
models/attention.py builds them at the first layer), and per layer the tiles' outputs
joined into one tensor (c*hd*Hq per token) beside the ones each tile keeps. Under cp
none: its blocks rebuild their masks in backward from the segment ids. Measured on CPU
(fp32; `tests/test_plan_documents.py` checks the estimate against the bytes a forward
keeps); `mask_keys` gives the keys per query; the segment ids and positions (int64 per
token, once) are left out like the tokens.

Weights kept for backward (`saved_weights`, part of activations): matmuls and norm
scales save the weight they multiply by. Parameters that are not gathered are saved as
themselves in fp32 (no new memory) but as a new bf16 copy under bf16, except a block's
under full or selective checkpointing, whose recompute casts again. Gathered (fsdp)
weights are gathered again in backward (ZeRO-3, parallel.reshard_after_forward, eager
and compiled): nothing kept. Without resharding every gathered weight autograd saves is
kept from forward to backward (`gathered_weights`), except a block's under full or
selective checkpointing, whose recompute gathers again.

Activation checkpointing (train.activation_checkpointing; the runtime's policies are
models/policy.py):
  full       each layer keeps only its input (c*D, [seq_sp]); backward recomputes one
             layer at a time, so one layer's activations come back as a transient.
  selective  op-level (torchtitan's "op" policy): keep the layer input, the outputs of
             the matmuls (q, k, v before RoPE, gate and up pre-activations: GPT-2 up
             alone, Costs.mlp_matmuls) and of attention (output, log-sum-exp), and wo's
             and w_down's outputs as reduced over tp ([seq_sp]: the row-parallel matmul
             is recomputed, its reduce-scatter kept); recompute norms, RoPE,
             activation functions and products. With the math kernel the (S x S)
             probabilities are recomputed too (Korthikanti et al. 2022). MoE blocks'
             selective figure is an estimate (not measured).

A pp rank under parallel.pp_keep_gathered (`keep_gathered`; parallel/keep_gathered.py)
gathers its parameters once per step in fp32 and holds them over the micro-batches
(`kept_weights`: the gathered ones' compute-local elements, x 4), their gradients adding
up unsharded beside them (`kept_grads`, as many bytes) until one reduction after the last
backward. Autograd keeps none of them: under fp32 a step uses the kept weights as they
are (`Tensor.to` of their own dtype is the tensor itself, and a bucket with nothing left
to gather hands out its members: no copy, so no transient either); under bf16 each
bucket is cast per use and cast again in backward (a `held` ShardedContext), so the
casts are a transient as a layer's gathered weights are today, and a bucketed
parameter's cast is never saved.

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
from typing import Sequence

from ..models.experts import expert_capacity
from ..models.losses import CHUNK_ROWS
from ..models.policy import keeps_fp32
from ..layout.buckets import plan_buckets
from ..layout.mesh import GATHERED_AXES
from ..layout.plan import Plan
from .compute import MaskKeys

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}  # fp8: bf16 activations, fp8 GEMM operands transient
FP32, INT64, BOOL = 4, 8, 1
# A GPU's caching allocator rounds blocks up and fragments: a stated share of the peak,
# not measured here (no GPU; docs/plan.md "Peak memory").
ALLOCATOR_SLACK = 0.05


def _local(plan: Plan, shape: Sequence[int], axes: Sequence[str | None]) -> int:
    """Elements of this activation on the most loaded rank."""
    return math.prod(plan.activation(axes).local_shape(shape, plan.mesh))


def _compute_numel(plan: Plan, name: str) -> int:
    """Elements of a parameter where it is used: gathered over fsdp, tp shards kept. An
    uneven fsdp dim is gathered padded (fsdp x the largest shard), as the all-gather
    buffer is, and the gathered tensor is a view of that buffer."""
    p = plan.params[name]
    shape = list(p.spec.shape)
    for d, axes in enumerate(p.layout.dim_axes):
        for a in axes:
            n = plan.mesh.size(a)
            shape[d] = math.ceil(shape[d] / n) * (n if a in GATHERED_AXES else 1)
    return math.prod(shape)


def _is_gathered(plan: Plan, name: str) -> bool:
    p = plan.params[name]
    return tuple(p.compute_placements()) != tuple(p.placements)


class _Bucket:
    """One bucket's bytes (a block's weights, or those before or after the blocks) for its
    transients: compute-local elements, their compute copies, and the gathered part."""

    def __init__(self, kept: bool):
        self.kept = kept  # parallel.pp_keep_gathered: gathered once per step, reduced at its end
        self.copies = self.grads = self.gathered = self.replica_grads = 0
        self.ways = 1

    def add(self, plan: Plan, name: str, n: int, width: int, gathered: bool) -> None:
        # The weight gradient autograd makes, in the compute dtype, and its fp32 copy for
        # the reductions (BucketRun._normalise) where that differs; a gathered one is cast
        # as it is packed for its reduce-scatter, with no copy.
        self.grads += n * width + (n * FP32 if width != FP32 and not gathered else 0)
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

    def transients(self, prefetch: int, reshard: bool, replicas: int, device: str) -> tuple[int, int, int]:
        """(forward, backward, the backward's communication buffers), as the eager bucket
        path (parallel/bucket_run.py) allocates them. Forward: the gathered flat buffer and
        the weights unpacked from it, the packed shards, and `prefetch` gathers issued
        ahead. Backward: the weights gathered again (with resharding) and `prefetch`
        ahead, the weight gradients, the packed fp32 buffer of the reduce-scatter and
        `prefetch` + 1 of its outputs in flight, and with dp replicas the all-reduce's
        concatenated input and output; on a GPU the inputs of the reductions in flight
        are held too (until their collective ends). Kept gathered (`kept`), a micro-batch's
        backward makes the weight gradients only, and the communication buffers are the
        step end's (`total_peak`): the packed buffer and the outputs in flight but the
        last (which is the shard's gradient)."""
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
        backward = (self.copies if reshard else 0) + self.grads + comm
        return forward, int(backward), int(comm)


def _norm(plan: Plan, B: int, S: int, D: int, c: int, stats: int) -> int:
    """A norm on the residual stream: its input (c) and `stats` fp32 values per row."""
    res = ("batch", "seq_sp", None)
    return c * _local(plan, (B, S, D), res) + FP32 * stats * _local(plan, (B, S, 1), res)


def _attention_saved(plan, B, S, Hq, Hkv, hd, c, kernel: str) -> int:
    q = _local(plan, (B, S, Hq, hd), ("batch", "seq", "q_heads", None))
    kv = _local(plan, (B, S, Hkv, hd), ("batch", "seq", "kv_heads", None))
    lse = _local(plan, (B, Hq, S), ("batch", "q_heads", "seq"))
    if plan.mesh.cp > 1:  # parallel/cp_attention.py keeps q, k, v, output, lse and its orders
        if plan.cp_comm == "allgather":  # the gathered K/V (cp x the local shard) instead of k, v
            return c * (q + 2 * kv * plan.mesh.cp + q) + FP32 * lse + INT64 * S
        if plan.cp_comm == "a2a":  # its output on the head split, besides the one wo keeps; two orders
            return c * (q + 2 * kv + q + q) + FP32 * lse + 2 * INT64 * S
        return c * (q + 2 * kv + q) + FP32 * lse
    if kernel == "flash":
        return c * (q + 2 * kv + q) + FP32 * lse
    probs = _local(plan, (B, Hq, S, S), ("batch", "q_heads", "seq", None))
    return c * (4 * q + probs)  # q, k and v at Hq heads, output copy; probabilities


def _moe_saved(plan: Plan, m, B: int, S: int, D: int, c: int, stats: int, checkpointing: str) -> tuple[int, int]:
    """(kept without checkpointing, kept with `checkpointing`) of one MoE block's feed-forward
    half (from the mlp norm on), at the uniform-routing expectation: each rank routes its T
    local tokens x top_k rows and receives as many; see the module docstring."""
    full = ("batch", "seq", None)
    x_full, x_res = _local(plan, (B, S, D), full), _local(plan, (B, S, D), ("batch", "seq_sp", None))
    T = _local(plan, (B, S), ("batch", "seq"))
    Bl = _local(plan, (B, 1), ("batch", None))
    E, k = m.num_experts, m.top_k
    K = T * k
    if m.capacity_factor is not None:  # what the experts keep of the slots, routing uniform
        K = min(K, E * expert_capacity(T, k, E, m.capacity_factor))
    # Experts and hidden size of this rank (split over ep and tp), from the first MoE
    # block's plan (a pipeline stage's plan may hold only some blocks).
    expert = next(p for n, p in plan.params.items() if n.endswith(".moe.w_gate"))
    E_l, F_l = expert.local_shape[0], expert.local_shape[1]
    ep = expert.mesh.ep
    # The shared experts' hidden: split like a dense mlp's (rule "mlp").
    shared = _local(plan, (B, S, m.shared_experts * m.expert_ffn_dim), ("batch", "seq", "mlp")) \
        if m.shared_experts else 0
    # Block input h: the shared experts' matmuls keep it; the fp32 router keeps h.float()
    # (h itself in fp32, a new fp32 copy otherwise).
    kept = _norm(plan, B, S, D, c, stats) + (c * x_res if m.shared_experts or c == FP32 else 0) \
        + (FP32 * x_full if c != FP32 else 0)
    routing = FP32 * T * E + INT64 * T * k  # scores (softmax / sigmoid output), chosen experts
    if m.router == "sigmoid":
        routing += FP32 * T  # their sum, the probabilities' divisor
    if m.norm_topk and k > 1:
        routing += FP32 * (T * k + T)  # chosen scores and their sum
    if m.balance == "aux":
        routing += FP32 * Bl * E  # per-sequence counts, kept by the balance loss's product
    if m.z_loss_coef:
        routing += FP32 * (T * E + T)  # logits and logsumexp
    # Slots: the sort order (T k) and the token index of the kept slots (gather rows,
    # scatter back); the rows the experts see (N = K received), under ep with their order
    # and its inverse; 3 grouped-matmul offsets; the hidden (gate pre-activation, silu,
    # up, product); the expert output, its gate, and the gated product (index_add keeps it).
    N = K
    slots = INT64 * (T * k + K) + c * N * D + 3 * 4 * E_l + 4 * c * N * F_l + c * (2 * K * D + K)
    if ep > 1:
        slots += 2 * INT64 * N
    kept += routing + slots + 4 * c * shared
    if checkpointing == "none":
        return kept, kept
    if checkpointing == "full":
        return kept, 0
    # selective (estimate): keep the routing decisions and the matmul outputs (routed and
    # shared gate / up pre-activations, the expert output); recompute the rest.
    return kept, FP32 * T * E + INT64 * T * k + FP32 * T * k + 2 * c * (N * F_l + shared) + c * K * D


def per_rank_memory(plan: Plan, model, *, micro_batch: int, seq_len: int, precision: str = "fp32",
                    activation_checkpointing: str = "none", reshard_after_forward: bool = True,
                    fsdp_accumulate: str = "sharded", device: str = "cpu", attention: str | None = None, names=None, layers: int | None = None,
                    embedding: bool = True, head: bool = True, in_flight: int = 1,
                    mask_keys=None, keep_gathered: bool = False, prefetch: int = 1) -> dict:
    """Bytes on the most loaded rank for one training step (see the module docstring for
    what is counted). micro_batch: sequences per data-parallel rank per micro-step.
    device: "cpu" | "cuda" picks the attention kernel unless `attention` ("flash" |
    "math") names it. Returns params, grads, optimizer, activations (kept for backward,
    including saved weights), peak, and a breakdown.

    A pipeline rank (plan: the stage plan without pp) holds only `names`, runs `layers`
    layers per micro-batch, the embedding and the head/loss only where it holds them, and
    keeps the activations of `in_flight` micro-batches at once (the schedule's peak).

    mask_keys: with data.document_mask, what the masks attention keeps
    (estimate.compute.mask_keys; None: no masks). keep_gathered: a pp rank under
    parallel.pp_keep_gathered (the module docstring). prefetch: parallel.prefetch, the
    gathers issued ahead and the reductions left in flight."""
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"precision={precision!r}: choose fp32, bf16 or fp8")
    if activation_checkpointing not in ("none", "full", "selective"):
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r}: choose none, full or selective")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: choose cpu or cuda")
    family, cfg, mesh = model.family, model.cfg, plan.mesh
    c = _DTYPE_BYTES[precision]
    Hq, Hkv = cfg.n_heads, family.kv_heads(cfg)
    gqa = Hkv != Hq
    if attention is None:
        attention = "math" if device == "cuda" and precision == "fp32" and gqa else "flash"
    if attention not in ("flash", "math"):
        raise ValueError(f"attention={attention!r}: choose flash or math")

    B, S, D, hd, F = micro_batch * mesh.dp * mesh.fsdp, seq_len, cfg.dim, cfg.head_dim, cfg.ffn_dim
    V = cfg.vocab_size
    stats = family.costs.norm_stats
    res = ("batch", "seq_sp", None)
    mlp = _local(plan, (B, S, F), ("batch", "seq", "mlp"))
    x_res = _local(plan, (B, S, D), res)
    tokens = _local(plan, (B, S), ("batch", "seq"))

    # One layer, nothing recomputed.
    queries = _local(plan, (B, S), ("batch", None))  # this rank's: every head shares a query's mask
    mask_keys = mask_keys or MaskKeys()
    # Per layer: eager tiles' outputs joined into one more tensor (joined); compiled
    # windows' keys and values padded in front of the row (pads).
    joined = pads = 0
    if mask_keys.tiled:
        joined = c * _local(plan, (B, S, Hq, hd), ("batch", "seq", "q_heads", None))
    if mask_keys.padded:
        pads = 2 * c * _local(plan, (B, mask_keys.padded, Hkv, hd), ("batch", None, "kv_heads", None))
    qk_norms = 0
    if getattr(cfg, "qk_norm", False):  # per-head norms keep q and k before them and a rsqrt per head
        heads = _local(plan, (B, S, Hq), ("batch", "seq", "q_heads")) \
            + _local(plan, (B, S, Hkv), ("batch", "seq", "kv_heads"))
        qk_norms = (c * hd + FP32 * stats) * heads
    attn = (_norm(plan, B, S, D, c, stats) + c * x_res + _attention_saved(plan, B, S, Hq, Hkv, hd, c, attention)
            + qk_norms + joined + pads)
    mlp_saved = _norm(plan, B, S, D, c, stats) + c * x_res + family.costs.mlp_saved * c * mlp
    layer_none = attn + mlp_saved
    if activation_checkpointing == "none":
        layer = layer_none
    elif activation_checkpointing == "full":
        layer = c * x_res
    else:
        q = _local(plan, (B, S, Hq, hd), ("batch", "seq", "q_heads", None))
        kv = _local(plan, (B, S, Hkv, hd), ("batch", "seq", "kv_heads", None))
        lse = _local(plan, (B, Hq, S), ("batch", "q_heads", "seq"))
        # The layer input; q, k, v, the attention output; wo's and w_down's outputs as
        # reduced over tp (a sequence shard under sp: ShardedContext's row-parallel
        # matmuls are recomputed, their reductions kept); the MLP's up (and gate) outputs.
        layer = c * (3 * x_res + q + 2 * kv + q) + FP32 * lse + family.costs.mlp_matmuls * c * mlp \
            + joined + pads
    recompute = 0 if activation_checkpointing == "none" else max(0, layer_none - layer)
    moe_cfg = getattr(cfg, "moe", None)
    moe_ids = set(cfg.moe_layers) if moe_cfg is not None else set()
    moe_layer = None
    if moe_ids:  # an MoE block: the attention half as a dense block's, then the routed experts
        moe_none, moe_kept = _moe_saved(plan, moe_cfg, B, S, D, c, stats, activation_checkpointing)
        moe_layer_none = attn + moe_none
        moe_layer = moe_layer_none if activation_checkpointing == "none" else \
            layer if activation_checkpointing == "full" else \
            layer - (family.costs.mlp_matmuls * mlp + x_res) * c + moe_kept
        recompute = max(recompute, 0 if activation_checkpointing == "none" else max(0, moe_layer_none - moe_layer))

    # Once per micro-batch: the family's per-sequence tensors (RoPE tables, position ids),
    # embedding, final norm, loss.
    once = sum(nbytes * _local(plan, shape, axes) for shape, axes, nbytes in family.costs.per_sequence(cfg, S, c))
    masks = int(c * mask_keys.keys * queries)  # the documents' masks, which every layer shares
    once += masks
    if embedding and any(a for a in plan.params["tok_emb"].layout.dim_axes[0] if a not in GATHERED_AXES):
        once += tokens * (INT64 + BOOL)  # vocab-parallel lookup: clamped ids, in-slice mask
    elif embedding and mesh.cp > 1:
        once += tokens * INT64  # the lookup keeps its ids: under cp, this rank's zigzag copy
    logits = _local(plan, (B, S, V), ("batch", "seq", "vocab"))
    loss = 0
    if head:
        once += _norm(plan, B, S, D, c, stats) + c * x_res
        loss = c * logits + tokens * (FP32 + (INT64 if mesh.cp > 1 else 0))
    names = set(plan.params if names is None else names)
    if layers is None:
        run = list(range(cfg.n_layers))
    elif isinstance(layers, int):
        run = list(range(layers)) if not moe_ids else None
    else:
        run = list(layers)
    if run is None:  # a count of layers with MoE blocks somewhere: each as the larger kind
        layers_bytes = layers * max(layer, moe_layer)
    else:
        n_moe = sum(i in moe_ids for i in run)
        layers_bytes = (len(run) - n_moe) * layer + n_moe * (moe_layer or 0)

    # Weights autograd keeps, and the transient of gathering them. Kept gathered, the
    # fp32 weights are held (kept_weights): only a cast is new, and it is made again in
    # backward for every bucketed parameter.
    alone = plan_buckets(plan)[1] if keep_gathered else set()
    saved_weights = gathered_weights = 0
    layer_weights: dict[str, int] = {}
    buckets: dict[str, _Bucket] = {}
    for name in plan.params:
        if name not in names:
            continue
        gathered, n = _is_gathered(plan, name), _compute_numel(plan, name)
        width = FP32 if keeps_fp32(name) else c  # the router stays fp32
        new_copy = (gathered and not keep_gathered) or width != FP32  # otherwise the parameter itself is used
        group = name.split(".")[1] if name.startswith("layers.") else name
        if new_copy:
            layer_weights[group] = layer_weights.get(group, 0) + n * width
        if plan.params[name].spec.trainable:
            unit = name.split(".")[1] if name.startswith("layers.") else "before" if name == "tok_emb" else "after"
            buckets.setdefault(unit, _Bucket(keep_gathered)).add(plan, name, n, width, gathered)
        if not new_copy or not family.costs.weight_saved(cfg, name):
            continue
        # A block's checkpoint gathers or casts its weights again in the recompute.
        recast = (activation_checkpointing != "none" and name.startswith("layers.")
                  or keep_gathered and name not in alone)
        if gathered and not keep_gathered:
            kept = not reshard_after_forward and not recast
            gathered_weights += n * width if kept else 0
        elif not recast:
            saved_weights += n * width

    # Per layer: a dense block's, or an MoE block's where every layer run is MoE.
    all_moe = run is not None and bool(run) and all(i in moe_ids for i in run)
    activations_per_layer = moe_layer if all_moe else layer
    activations = in_flight * (layers_bytes + once + loss) + saved_weights + gathered_weights
    params = sum(p.bytes_per_rank for n, p in plan.params.items() if n in names)
    grads = sum(math.prod(p.local_shape) * FP32 for n, p in plan.params.items() if n in names)
    # The gathered parameters whole, fp32. parallel.fsdp_accumulate unsharded (with
    # micro-steps): their gradients, held from the first micro-step to the reduce-scatter;
    # parallel.pp_keep_gathered: the weights held for the step, and their gradients summed
    # over its micro-batches beside them.
    whole = sum(_compute_numel(plan, n) * FP32 for n in plan.params if n in names and _is_gathered(plan, n))
    unsharded_grads = whole if fsdp_accumulate == "unsharded" else 0
    kept_weights = kept_grads = whole if keep_gathered else 0
    optimizer = 2 * grads
    rows = min(tokens, CHUNK_ROWS)
    loss_logits = 2 * c * logits + FP32 * logits // tokens * rows if head else 0
    # The largest transient: a bucket's gather in forward, the loss at the turn, or a
    # bucket's backward (its weight gradients and reductions, where the layer backward has
    # just run has freed what it kept, when a micro-batch is counted here).
    replicas = mesh.size("dp") if "dp" in mesh.axes else 1
    sets = [b.transients(prefetch, reshard_after_forward, replicas, device) for b in buckets.values()]
    forward = max((f for f, _, _ in sets), default=0)
    backward, comm_buffers = max(((bw, cb) for _, bw, cb in sets), default=(0, 0))
    freed = activations_per_layer if in_flight and run else 0
    transient = max(max(layer_weights.values(), default=0), forward, loss_logits, backward - freed)
    out = {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "activations_per_layer": activations_per_layer, "activations_layers": in_flight * layers_bytes,
        "activations_once": once, "loss_saved": loss, "saved_weights": saved_weights,
        "gathered_weights": gathered_weights, "recompute": recompute, "transient": transient,
        "unsharded_grads": unsharded_grads, "kept_weights": kept_weights, "kept_grads": kept_grads,
        "transient_forward": forward, "transient_backward": backward, "comm_buffers": comm_buffers,
        # Kept gathered: the step's end, beside the kept weights and gradients: the shards'
        # gradients as they are reduced into and the reductions' buffers.
        "release": grads + comm_buffers if keep_gathered else 0,
        "transient_layer_weights": max(layer_weights.values(), default=0), "logits": loss_logits,
        "attention_kernel": attention, "document_masks": masks, "tiles_joined_per_layer": joined,
        "window_pads_per_layer": pads,
        **({"activations_per_moe_layer": moe_layer} if moe_layer is not None else {}),
    }
    out["peak"], out["allocator_slack"] = total_peak(out, device)
    return out


def total_peak(m: dict, device: str) -> tuple[int, int]:
    """(peak, its allocator_slack) of per_rank_memory's terms `m` (a pipeline rank's with
    its micro-batches in flight added): the state, then the step's working set: the
    gradients, activations, recompute and the largest transient together; kept gathered
    (m["release"] > 0), the larger of the micro-batches' working set (the shards'
    gradients do not exist yet) and the step end's."""
    base = m["params"] + m["optimizer"] + m["unsharded_grads"] + m["kept_weights"] + m["kept_grads"]
    working = m["activations"] + m["recompute"] + m["transient"]
    peak = base + (max(working, m["release"]) if m["release"] else m["grads"] + working)
    # The caching allocator's rounding and fragmentation on a GPU, stated (ALLOCATOR_SLACK).
    slack = int(ALLOCATOR_SLACK * peak) if device == "cuda" else 0
    return peak + slack, slack
