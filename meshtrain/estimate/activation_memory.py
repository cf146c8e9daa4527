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

The attention half is not written here as a formula but counted from the family's own
recorded forward (models/cost_terms.py AttentionTerms): each tensor it keeps beside the
kernel in its recorded dtype and its layout on the plan (an all-gathered one as the shard
it came from), and the kernel's tensors from the shapes the forward gave it. For Llama
that is the table above; for MLA (DeepSeek-V3) it adds the query and key/value latents,
their norms' inputs and statistics, and values narrower than q and k.

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
keep q, k, v, output and log-sum-exp and recompute the probabilities. The CPU's flash
kernel needs values as wide as keys: MLA's narrower ones take the math kernel there,
which computes a bf16 attention in fp32 (q, expanded k and v, probabilities; the output
cast back). The math path
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
             activation functions and products. With the math kernel its two
             matmuls' outputs are kept instead of output and log-sum-exp: the (S x S)
             scores and the output, in the kernel's dtype (the softmax is recomputed).
             MLA keeps its latent projections' outputs too (every matmul before the
             kernel, as recorded). MoE blocks'
             selective figure is an estimate (not measured).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..layout.mesh import GATHERED_AXES
from ..layout.plan import Plan
from ..models.cost_terms import CostTerms, cost_terms
from ..models.family import BLOCK_IN, RESIDUAL, TOKENS
from ..models.losses import CHUNK_ROWS
from .compute import MaskKeys
from .dtype_bytes import BOOL, FP32, INT64
from .placement_rules import PlacementRules, gathers, numel_on_rank


def local_numel(plan: Plan, shape: Sequence[int], axes: Sequence[str | None]) -> int:
    """Elements of this activation on the most loaded rank."""
    return math.prod(plan.activation(axes).local_shape(shape, plan.mesh))


@dataclass(frozen=True)
class MicroBatch:
    """The sizes the activation terms read: one micro-batch of B sequences (every
    data-parallel rank's) x S positions on the plan, c bytes per compute-dtype element,
    and the model's dims (D, ffn F, vocab V, `stats` fp32 row statistics per norm); the
    attention's shapes are its recording's (costs.attention)."""

    plan: Plan
    cfg: object
    costs: CostTerms  # what the family's recorded forward keeps
    B: int
    S: int
    c: int

    @classmethod
    def of(cls, plan: Plan, model, micro_batch: int, seq_len: int, c: int) -> MicroBatch:
        dtype = torch.float32 if c == FP32 else torch.bfloat16
        return cls(plan, model.cfg, cost_terms(model, seq_len, dtype), micro_batch * plan.mesh.dp * plan.mesh.fsdp,
                   seq_len, c)

    def local(self, shape: Sequence[int], axes: Sequence[str | None]) -> int:
        return local_numel(self.plan, shape, axes)

    @functools.cached_property
    def rules(self) -> PlacementRules:
        """The placements of recorded layouts on this plan."""
        return PlacementRules(self.plan)

    @property
    def D(self) -> int:
        return self.cfg.dim

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


def kept_bytes(mb: MicroBatch, saved) -> int:
    """Local bytes of recorded saved tensors (models/recording.py, batch 1) at this
    micro-batch: each in its own dtype and layout on the plan, an all-gathered one as the
    shard it was gathered from (the runtime keeps that and gathers again in backward)."""
    total = 0
    for s in saved:
        layout = mb.rules.layout(s.layout)
        if s.src is not None and gathers(src := mb.rules.layout(s.src), layout):
            layout = src
        total += s.dtype.itemsize * numel_on_rank((mb.B, *s.shape[1:]), layout, mb.plan.mesh)
    return total


def attention_saved(mb: MicroBatch, kernel: str) -> int:
    """What the attention kernel keeps (q, k, v, output, log-sum-exp; the math kernel's
    expanded heads and probabilities; context parallelism's own), from the shapes the
    recorded forward gave it: values may be narrower than keys (MLA)."""
    plan, B, S, c = mb.plan, mb.B, mb.S, mb.c
    attend = mb.costs.attention.attend
    Hq, Hkv, dk, dv = attend.q[2], attend.k[2], attend.k[3], attend.v[3]
    heads, kv_heads = ("batch", "seq", "q_heads", None), ("batch", "seq", "kv_heads", None)
    q = local_numel(plan, (B, S, Hq, dk), heads)
    k = local_numel(plan, (B, S, Hkv, dk), kv_heads)
    v = local_numel(plan, (B, S, Hkv, dv), kv_heads)
    out = local_numel(plan, (B, S, Hq, dv), heads)
    lse = local_numel(plan, (B, Hq, S), ("batch", "q_heads", "seq"))
    if plan.mesh.cp > 1:  # parallel/cp_attention.py keeps q, k, v, output, lse and its orders
        if dv != dk:  # values zero-padded to the keys' width; the padded output, and its cut copy
            v, out = k, q + out
        if plan.cp_comm == "allgather":  # the gathered K/V (cp x the local shard) instead of k, v
            return c * (q + (k + v) * plan.mesh.cp + out) + FP32 * lse + INT64 * S
        if plan.cp_comm == "a2a":  # its output on the head split, besides the one wo keeps; two orders
            return c * (q + k + v + out + q) + FP32 * lse + 2 * INT64 * S
        return c * (q + k + v + out) + FP32 * lse
    if kernel == "flash":
        return c * (q + k + v + out) + FP32 * lse
    probs = local_numel(plan, (B, Hq, S, S), ("batch", "q_heads", "seq", None))
    # q; k and v expanded to the query heads; probabilities; a contiguous copy of the output
    inner = FP32 if kernel == "math_fp32" else c
    return inner * (q + q + out + probs) + c * out


def mask_tensors(mb: MicroBatch, mask_keys: MaskKeys) -> tuple[int, int]:
    """Per layer, beside the masks: (eager tiles' outputs joined into one more tensor,
    compiled windows' keys and values padded in front of the row)."""
    attend = mb.costs.attention.attend
    joined = pads = 0
    if mask_keys.tiled:
        joined = mb.c * mb.local((mb.B, mb.S, attend.q[2], attend.v[3]), ("batch", "seq", "q_heads", None))
    if mask_keys.padded:
        pads = mb.c * sum(mb.local((mb.B, mask_keys.padded, *t[2:]), ("batch", None, "kv_heads", None))
                          for t in (attend.k, attend.v))
    return joined, pads


def attention_half(mb: MicroBatch, kernel: str, joined: int, pads: int) -> int:
    """A block's attention half, nothing recomputed: what its recorded forward keeps
    beside the kernel (the norm, the matmuls' input, MLA's latents and their norms, qk
    norms), the kernel's tensors and the document masks' per-layer tensors."""
    return kept_bytes(mb, mb.costs.attention.kept) + attention_saved(mb, kernel) + joined + pads


def mlp_half(mb: MicroBatch) -> int:
    """A dense block's MLP half, nothing recomputed: its norm, the matmuls' input, and the
    family's ffn-wide tensors."""
    return norm_saved(mb) + mb.c * mb.x_res() + mb.costs.mlp_saved * mb.c * mb.mlp()


def checkpointed_layer(mb: MicroBatch, none: int, checkpointing: str, kernel: str, joined: int, pads: int) -> int:
    """A dense layer's bytes under `checkpointing`, `none` being what it keeps without."""
    if checkpointing == "none":
        return none
    if checkpointing == "full":
        return mb.c * mb.x_res()
    terms = mb.costs.attention
    attend = terms.attend
    projections = sum(numel_on_rank((mb.B, *p.shape[1:]), mb.rules.layout(p.layout), mb.plan.mesh)
                      for p in terms.projections)
    out = mb.local((mb.B, mb.S, attend.q[2], attend.v[3]), ("batch", "seq", "q_heads", None))
    if kernel == "flash":  # the fused kernel's output and log-sum-exp
        attention = mb.c * out + FP32 * mb.local((mb.B, attend.q[2], mb.S), ("batch", "q_heads", "seq"))
    else:  # the math kernel's two matmuls: the scores (S x S) and the output, in its dtype
        scores = mb.local((mb.B, attend.q[2], mb.S, mb.S), ("batch", "q_heads", "seq", None))
        attention = (FP32 if kernel == "math_fp32" else mb.c) * (scores + out)
    # The layer input; the projections before the kernel (q, k, v before RoPE; MLA's
    # latents and up-projections); the attention's; wo's and w_down's outputs as reduced
    # over tp (a sequence shard under sp: ShardedContext's row-parallel matmuls are
    # recomputed, their reductions kept); the MLP's up (and gate) outputs.
    return mb.c * (3 * mb.x_res() + projections) + attention + mb.costs.mlp_matmuls * mb.c * mb.mlp() \
        + joined + pads


def offload_stays(mb: MicroBatch) -> int:
    """Under activation offload (models/offload.py), what a dense layer still keeps on the
    device: the shards of the sequence-parallel gathers before attention and the MLP,
    which the regather hooks keep in place of the gathered input (parallel/regather.py)
    and the offload hooks leave alone."""
    return 2 * mb.c * mb.x_res() if mb.local((mb.B, mb.S, mb.D), BLOCK_IN) != mb.x_res() else 0


def block_tables(mb: MicroBatch) -> int:
    """The per-sequence tables the blocks keep (RoPE's cos and sin): one copy per micro-batch
    on the device; under activation offload one per block on the host."""
    return sum(nbytes * mb.local(shape, axes) for shape, axes, nbytes in mb.costs.block_tables)


def once_per_micro_batch(mb: MicroBatch, mask_keys: MaskKeys, embedding: bool, head: bool) -> tuple[int, int, int]:
    """(kept once per micro-batch, of it the documents' masks, the loss's): the family's
    per-sequence tensors (RoPE tables, position ids), the masks every layer shares, the
    embedding's ids, the final norm and the loss where the rank runs them."""
    queries = mb.local((mb.B, mb.S), ("batch", None))  # this rank's: every head shares a query's mask
    once = sum(nbytes * mb.local(shape, axes) for shape, axes, nbytes in mb.costs.per_sequence)
    masks = int(mb.c * mask_keys.keys * queries)
    once += masks + (lookup_ids(mb) if embedding else 0)
    loss = 0
    if head:
        once += norm_saved(mb) + mb.c * mb.x_res()
        loss = loss_saved(mb)
    return once, masks, loss


def lookup_ids(mb: MicroBatch) -> int:
    """What an embedding lookup keeps of its ids: the vocab-parallel lookup its clamped
    ids and in-slice mask; under cp, the ids (this rank's zigzag copy)."""
    if any(a for a in mb.plan.params["tok_emb"].layout.dim_axes[0] if a not in GATHERED_AXES):
        return mb.tokens() * (INT64 + BOOL)
    return mb.tokens() * INT64 if mb.plan.mesh.cp > 1 else 0


def loss_saved(mb: MicroBatch) -> int:
    """The loss (models.losses), which never gathers the vocab and makes no fp32 copy of
    the logits: the local logits slice, the fp32 log-sum-exp per token, and under cp the
    targets (int64; this rank's zigzag copy)."""
    return mb.c * mb.logits() + mb.tokens() * (FP32 + (INT64 if mb.plan.mesh.cp > 1 else 0))


def mtp_extras(mb: MicroBatch) -> int:
    """A multi-token prediction module beside its block (models/mtp.py): the lookup's ids,
    the embedding's norm, the hidden state's norm statistics (its input is the head
    norm's), the concatenation eh_proj reads (2 x dim), its own final norm and head input,
    and its loss."""
    rows = FP32 * mb.stats * mb.local((mb.B, mb.S, 1), RESIDUAL)
    return lookup_ids(mb) + norm_saved(mb) + rows + 2 * mb.c * mb.x_res() + norm_saved(mb) + mb.c * mb.x_res() \
        + loss_saved(mb)


def loss_transient(mb: MicroBatch) -> int:
    """The loss's working set at the turn: the local logits slice and its gradient (c
    bytes), and one fp32 chunk of rows."""
    logits, tokens = mb.logits(), mb.tokens()
    rows = min(tokens, CHUNK_ROWS)
    return 2 * mb.c * logits + FP32 * logits // tokens * rows
