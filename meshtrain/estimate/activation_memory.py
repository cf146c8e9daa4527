"""The activation terms of `per_rank_memory` (memory.py), per dense layer and once per
micro-batch. An MoE block's feed-forward half is moe_memory.py's; the weights autograd
keeps, weight_memory.py's.

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

Activation checkpointing (train.activation_checkpointing; the runtime's policies are
models/policy.py):
  full       each layer keeps only its input (c*D, [seq_sp]); backward recomputes one
             layer at a time, so one layer's activations come back as a transient.
  selective  op-level (torchtitan's "op" policy): keep the layer input, the outputs of
             the matmuls (q, k, v before RoPE, gate and up pre-activations: GPT-2 up
             alone, CostTerms.mlp_matmuls) and of attention (output, log-sum-exp), and wo's
             and w_down's outputs as reduced over tp ([seq_sp]: the row-parallel matmul
             is recomputed, its reduce-scatter kept); recompute norms, RoPE,
             activation functions and products. With the math kernel the (S x S)
             probabilities are recomputed too (Korthikanti et al. 2022). MoE blocks'
             selective figure is an estimate (not measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..layout.mesh import GATHERED_AXES
from ..layout.plan import Plan
from ..models.cost_terms import CostTerms, cost_terms
from ..models.family import RESIDUAL, TOKENS
from ..models.losses import CHUNK_ROWS
from .compute import MaskKeys
from .dtype_bytes import BOOL, FP32, INT64


def local_numel(plan: Plan, shape: Sequence[int], axes: Sequence[str | None]) -> int:
    """Elements of this activation on the most loaded rank."""
    return math.prod(plan.activation(axes).local_shape(shape, plan.mesh))


@dataclass(frozen=True)
class MicroBatch:
    """The sizes the activation terms read: one micro-batch of B sequences (every
    data-parallel rank's) x S positions on the plan, c bytes per compute-dtype element,
    and the model's dims (D, head_dim hd, ffn F, vocab V, heads Hq and Hkv, `stats` fp32
    row statistics per norm)."""

    plan: Plan
    cfg: object
    costs: CostTerms  # what the family's recorded forward keeps
    B: int
    S: int
    c: int
    Hq: int
    Hkv: int

    @classmethod
    def of(cls, plan: Plan, model, micro_batch: int, seq_len: int, c: int) -> MicroBatch:
        family, cfg, mesh = model.family, model.cfg, plan.mesh
        dtype = torch.float32 if c == FP32 else torch.bfloat16
        return cls(plan, cfg, cost_terms(model, seq_len, dtype), micro_batch * mesh.dp * mesh.fsdp, seq_len, c,
                   cfg.n_heads, family.kv_heads(cfg))

    def local(self, shape: Sequence[int], axes: Sequence[str | None]) -> int:
        return local_numel(self.plan, shape, axes)

    @property
    def D(self) -> int:
        return self.cfg.dim

    @property
    def hd(self) -> int:
        return self.cfg.head_dim

    @property
    def stats(self) -> int:
        return self.costs.norm_stats

    def x_res(self) -> int:
        """The residual stream's elements (its sequence shard under sp)."""
        return self.local((self.B, self.S, self.D), RESIDUAL)

    def mlp(self) -> int:
        """One ffn-wide tensor's elements (split over tp by rule "mlp")."""
        return self.local((self.B, self.S, self.cfg.ffn_dim), ("batch", "seq", "mlp"))

    def tokens(self) -> int:
        return self.local((self.B, self.S), TOKENS)

    def logits(self) -> int:
        return self.local((self.B, self.S, self.cfg.vocab_size), ("batch", "seq", "vocab"))


def norm_saved(mb: MicroBatch) -> int:
    """A norm on the residual stream: its input (c) and `stats` fp32 values per row."""
    return mb.c * mb.local((mb.B, mb.S, mb.D), RESIDUAL) + FP32 * mb.stats * mb.local((mb.B, mb.S, 1), RESIDUAL)


def attention_saved(mb: MicroBatch, kernel: str) -> int:
    """What the attention kernel keeps (q, k, v, output, log-sum-exp; the math kernel's
    expanded heads and probabilities; context parallelism's own)."""
    plan, B, S, hd, c = mb.plan, mb.B, mb.S, mb.hd, mb.c
    q = local_numel(plan, (B, S, mb.Hq, hd), ("batch", "seq", "q_heads", None))
    kv = local_numel(plan, (B, S, mb.Hkv, hd), ("batch", "seq", "kv_heads", None))
    lse = local_numel(plan, (B, mb.Hq, S), ("batch", "q_heads", "seq"))
    if plan.mesh.cp > 1:  # parallel/cp_attention.py keeps q, k, v, output, lse and its orders
        if plan.cp_comm == "allgather":  # the gathered K/V (cp x the local shard) instead of k, v
            return c * (q + 2 * kv * plan.mesh.cp + q) + FP32 * lse + INT64 * S
        if plan.cp_comm == "a2a":  # its output on the head split, besides the one wo keeps; two orders
            return c * (q + 2 * kv + q + q) + FP32 * lse + 2 * INT64 * S
        return c * (q + 2 * kv + q) + FP32 * lse
    if kernel == "flash":
        return c * (q + 2 * kv + q) + FP32 * lse
    probs = local_numel(plan, (B, mb.Hq, S, S), ("batch", "q_heads", "seq", None))
    return c * (4 * q + probs)  # q, k and v at Hq heads, output copy; probabilities


def mask_tensors(mb: MicroBatch, mask_keys: MaskKeys) -> tuple[int, int]:
    """Per layer, beside the masks: (eager tiles' outputs joined into one more tensor,
    compiled windows' keys and values padded in front of the row)."""
    joined = pads = 0
    if mask_keys.tiled:
        joined = mb.c * mb.local((mb.B, mb.S, mb.Hq, mb.hd), ("batch", "seq", "q_heads", None))
    if mask_keys.padded:
        pads = 2 * mb.c * mb.local((mb.B, mask_keys.padded, mb.Hkv, mb.hd), ("batch", None, "kv_heads", None))
    return joined, pads


def qk_norms_saved(mb: MicroBatch) -> int:
    """Per-head norms (qk_norm) keep q and k before them and a rsqrt per head."""
    if not getattr(mb.cfg, "qk_norm", False):
        return 0
    heads = mb.local((mb.B, mb.S, mb.Hq), ("batch", "seq", "q_heads")) \
        + mb.local((mb.B, mb.S, mb.Hkv), ("batch", "seq", "kv_heads"))
    return (mb.c * mb.hd + FP32 * mb.stats) * heads


def attention_half(mb: MicroBatch, kernel: str, joined: int, pads: int) -> int:
    """A block's attention half, nothing recomputed: its norm, the matmuls' input, the
    kernel's tensors, qk norms and the document masks' per-layer tensors."""
    return (norm_saved(mb) + mb.c * mb.x_res() + attention_saved(mb, kernel)
            + qk_norms_saved(mb) + joined + pads)


def mlp_half(mb: MicroBatch) -> int:
    """A dense block's MLP half, nothing recomputed: its norm, the matmuls' input, and the
    family's ffn-wide tensors."""
    return norm_saved(mb) + mb.c * mb.x_res() + mb.costs.mlp_saved * mb.c * mb.mlp()


def checkpointed_layer(mb: MicroBatch, none: int, checkpointing: str, joined: int, pads: int) -> int:
    """A dense layer's bytes under `checkpointing`, `none` being what it keeps without."""
    if checkpointing == "none":
        return none
    if checkpointing == "full":
        return mb.c * mb.x_res()
    q = mb.local((mb.B, mb.S, mb.Hq, mb.hd), ("batch", "seq", "q_heads", None))
    kv = mb.local((mb.B, mb.S, mb.Hkv, mb.hd), ("batch", "seq", "kv_heads", None))
    lse = mb.local((mb.B, mb.Hq, mb.S), ("batch", "q_heads", "seq"))
    # The layer input; q, k, v, the attention output; wo's and w_down's outputs as
    # reduced over tp (a sequence shard under sp: ShardedContext's row-parallel
    # matmuls are recomputed, their reductions kept); the MLP's up (and gate) outputs.
    return mb.c * (3 * mb.x_res() + q + 2 * kv + q) + FP32 * lse + mb.costs.mlp_matmuls * mb.c * mb.mlp() \
        + joined + pads


def once_per_micro_batch(mb: MicroBatch, mask_keys: MaskKeys, embedding: bool, head: bool) -> tuple[int, int, int]:
    """(kept once per micro-batch, of it the documents' masks, the loss's): the family's
    per-sequence tensors (RoPE tables, position ids), the masks every layer shares, the
    embedding's ids, the final norm and the loss where the rank runs them."""
    plan, c, tokens = mb.plan, mb.c, mb.tokens()
    queries = mb.local((mb.B, mb.S), ("batch", None))  # this rank's: every head shares a query's mask
    once = sum(nbytes * mb.local(shape, axes) for shape, axes, nbytes in mb.costs.per_sequence)
    masks = int(c * mask_keys.keys * queries)
    once += masks
    if embedding and any(a for a in plan.params["tok_emb"].layout.dim_axes[0] if a not in GATHERED_AXES):
        once += tokens * (INT64 + BOOL)  # vocab-parallel lookup: clamped ids, in-slice mask
    elif embedding and plan.mesh.cp > 1:
        once += tokens * INT64  # the lookup keeps its ids: under cp, this rank's zigzag copy
    loss = 0
    if head:
        once += norm_saved(mb) + c * mb.x_res()
        loss = c * mb.logits() + tokens * (FP32 + (INT64 if plan.mesh.cp > 1 else 0))
    return once, masks, loss


def loss_transient(mb: MicroBatch) -> int:
    """The loss's working set at the turn: the local logits slice and its gradient (c
    bytes), and one fp32 chunk of rows."""
    logits, tokens = mb.logits(), mb.tokens()
    rows = min(tokens, CHUNK_ROWS)
    return 2 * mb.c * logits + FP32 * logits // tokens * rows
