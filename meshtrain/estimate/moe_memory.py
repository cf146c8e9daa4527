"""What one MoE block's feed-forward half keeps for backward (from the mlp norm on), the
MoE term of `per_rank_memory` (memory.py); its attention half is a dense block's
(activation_memory.py).

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
"""

from __future__ import annotations

from ..models.experts import expert_capacity
from ..models.family import BLOCK_IN, RESIDUAL, TOKENS
from .activation_memory import MicroBatch, norm_saved
from .dtype_bytes import FP32, INT64


def moe_block(mb: MicroBatch, attention: int, dense: int, checkpointing: str) -> tuple[int, int]:
    """(kept, recompute transient) of one MoE block: the attention half (`attention`,
    nothing recomputed) as a dense block's, then the routed experts; `dense`: a dense
    layer's bytes under `checkpointing`."""
    none, kept = moe_saved(mb, mb.cfg.moe, checkpointing)
    if checkpointing == "none":
        return attention + none, 0
    block = dense if checkpointing == "full" else \
        dense - (mb.costs.mlp_matmuls * mb.mlp() + mb.x_res()) * mb.c + kept
    return block, max(0, attention + none - block)


def moe_saved(mb: MicroBatch, m, checkpointing: str) -> tuple[int, int]:
    """(kept without checkpointing, kept with `checkpointing`) of one MoE block's feed-forward
    half (from the mlp norm on), at the uniform-routing expectation: each rank routes its T
    local tokens x top_k rows and receives as many; see the module docstring."""
    B, S, D, c = mb.B, mb.S, mb.D, mb.c
    x_full, x_res = mb.local((B, S, D), BLOCK_IN), mb.local((B, S, D), RESIDUAL)
    T = mb.local((B, S), TOKENS)
    E, k = m.num_experts, m.top_k
    K = T * k
    if m.capacity_factor is not None:  # what the experts keep of the slots, routing uniform
        K = min(K, E * expert_capacity(T, k, E, m.capacity_factor))
    # The shared experts' hidden: split like a dense mlp's (rule "mlp").
    shared = mb.local((B, S, m.shared_experts * m.expert_ffn_dim), ("batch", "seq", "mlp")) \
        if m.shared_experts else 0
    # Block input h: the shared experts' matmuls keep it; the fp32 router keeps h.float()
    # (h itself in fp32, a new fp32 copy otherwise).
    kept = norm_saved(mb) + (c * x_res if m.shared_experts or c == FP32 else 0) \
        + (FP32 * x_full if c != FP32 else 0)
    kept += _routing(mb, m, T) + _slots(mb, T, K, k) + 4 * c * shared
    if checkpointing == "none":
        return kept, kept
    if checkpointing == "full":
        return kept, 0
    # selective (estimate): keep the routing decisions and the matmul outputs (routed and
    # shared gate / up pre-activations, the expert output); recompute the rest.
    F_l = _expert_weight(mb).local_shape[1]
    return kept, FP32 * T * E + INT64 * T * k + FP32 * T * k + 2 * c * (K * F_l + shared) + c * K * D


def _routing(mb: MicroBatch, m, T: int) -> int:
    """The fp32 router's tensors for T local tokens."""
    E, k = m.num_experts, m.top_k
    routing = FP32 * T * E + INT64 * T * k  # scores (softmax / sigmoid output), chosen experts
    if m.router == "sigmoid":
        routing += FP32 * T  # their sum, the probabilities' divisor
    if m.norm_topk and k > 1:
        routing += FP32 * (T * k + T)  # chosen scores and their sum
    if m.balance == "aux":  # per-sequence counts, kept by the balance loss's product
        routing += FP32 * mb.local((mb.B, 1), ("batch", None)) * E
    if m.z_loss_coef:
        routing += FP32 * (T * E + T)  # logits and logsumexp
    return routing


def _slots(mb: MicroBatch, T: int, K: int, k: int) -> int:
    """The routed slots: the sort order (T k) and the token index of the K kept slots
    (gather rows, scatter back); the rows the experts see (N = K received), under ep with
    their order and its inverse; 3 grouped-matmul offsets; the hidden (gate
    pre-activation, silu, up, product); the expert output, its gate, and the gated
    product (index_add keeps it)."""
    expert = _expert_weight(mb)
    E_l, F_l, c, N = expert.local_shape[0], expert.local_shape[1], mb.c, K
    slots = INT64 * (T * k + K) + c * N * mb.D + 3 * 4 * E_l + 4 * c * N * F_l + c * (2 * K * mb.D + K)
    if expert.mesh.ep > 1:
        slots += 2 * INT64 * N
    return slots


def _expert_weight(mb: MicroBatch):
    """The first MoE block's expert weight plan: this rank's experts and hidden size
    (split over ep and tp); a pipeline stage's plan may hold only some blocks."""
    return next(p for n, p in mb.plan.params.items() if n.endswith(".moe.w_gate"))
