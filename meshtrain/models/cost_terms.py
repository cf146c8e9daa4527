"""What a family's forward keeps for backward, read from its recording (recording.py)
rather than declared by the family: the memory estimators' per-family terms.

The estimators' formulas (estimate/activation_memory.py, pipeline/partition.py) count a
block as a norm, attention and a norm with its feed-forward; the terms that differ from
family to family are counted here from the tensors autograd keeps in the recorded
forward (saved-tensor hooks on the meta device):

  mlp_saved    ffn-wide tensors a dense block keeps (SwiGLU: gate pre-activation, its
               silu, up, their product = 4; GELU: pre-activation and output = 2): kept
               tensors whose layout comes from a linear onto the "mlp" axis
  mlp_matmuls  the ctx.linear outputs onto the "mlp" axis (kept by selective
               checkpointing: SwiGLU gate and up = 2, GELU up = 1)
  norm_stats   fp32 values per row the final norm keeps besides its input (RMSNorm its
               rsqrt = 1; LayerNorm its mean and rsqrt = 2)
  per_sequence tables the forward builds and keeps once per micro-batch (RoPE's cos and
               sin, learned positions' ids): (shape, logical axes, bytes per element)
  weight_saved does an op keep this parameter for backward (a matmul or a norm scale
               does; a lookup keeps its ids, a bias addition nothing)?
  attention    a block's attention half (attention_terms): what it keeps beside the
               kernel, the kernel's shapes, and the matmul outputs selective
               checkpointing keeps
  mtp_depth    multi-token prediction modules run after the head, `mtp_moe` of them
               with an MoE block (the head's recording with the modules)"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .family import ModelDef
from .recorded import mtp_depth, record_block, record_ends
from .recording import Attend, Experts, Product, Saved, cached

MLP = "mlp"


@dataclass(frozen=True)
class AttentionTerms:
    """A block's attention half, from its recording at batch 1 (the estimators put their
    batch in the first dim): `kept`, the tensors autograd keeps other than the kernel's
    (the norm's input and statistics, the matmuls' inputs, MLA's latents and their norms,
    qk norms); `attend`, the kernel's q, k, v shapes; `projections`, the ctx.linear
    outputs before the kernel (selective checkpointing keeps them)."""

    kept: tuple[Saved, ...]
    attend: Attend
    projections: tuple[Product, ...]

    def unsharded_bytes(self, c: int) -> int:
        """What the half keeps at batch 1 with a fused kernel, nothing split, the kernel's
        tensors c bytes an element (the others in their recorded dtype)."""
        q, k, v = (math.prod(s) for s in (self.attend.q, self.attend.k, self.attend.v))
        out = q // self.attend.q[-1] * self.attend.v[-1]
        lse = q // self.attend.q[-1]
        return sum(s.dtype.itemsize * math.prod(s.shape) for s in self.kept) + c * (q + k + v + out) + 4 * lse


@dataclass(frozen=True)
class CostTerms:
    mlp_saved: int
    mlp_matmuls: int
    norm_stats: int
    per_sequence: tuple
    saved_weights: frozenset
    attention: AttentionTerms | None  # None: a model without blocks
    mtp_depth: int = 0  # multi-token prediction modules after the head
    mtp_moe: int = 0  # of them, those whose block is an MoE block
    block_tables: tuple = ()  # of per_sequence, those the blocks keep (activation offload moves them)

    def weight_saved(self, name: str) -> bool:
        return name in self.saved_weights


def _onto_mlp(layout, specs) -> bool:
    """Does this layout expression come from a linear onto the mlp axis?"""
    if not isinstance(layout, tuple) or not layout:
        return False
    if layout[0] == "linear" and specs[layout[2]].axes[0] == MLP:
        return True
    return any(_onto_mlp(part, specs) for part in layout[1:] if isinstance(part, tuple))


def cost_terms(model: ModelDef, seq_len: int, dtype: torch.dtype) -> CostTerms:
    """The terms of `model` at `seq_len` positions, compute dtype `dtype` (module docstring)."""
    return cached((model.family.name, model.cfg, "terms", seq_len, dtype), lambda: _terms(model, seq_len, dtype))


def _terms(model: ModelDef, seq_len: int, dtype: torch.dtype) -> CostTerms:
    cfg, specs = model.cfg, model.specs
    moe = set(getattr(cfg, "moe_layers", ()) or ())
    front, back = record_ends(model, True, True, 1, seq_len, dtype)
    blocks = {}  # the first layer of each kind: recorded once, its names stand for the kind's
    for i in range(cfg.n_layers):
        blocks.setdefault(i in moe, i)
    recorded = {i: record_block(model, i, 1, seq_len, dtype) for i in blocks.values()}
    dense = recorded.get(blocks.get(False))
    mlp_saved = mlp_matmuls = 0
    if dense is not None:
        mlp_saved = sum(1 for s in dense.saved if _onto_mlp(s.layout, specs))
        mlp_matmuls = sum(1 for lin in dense.linears if specs[lin.name].axes[0] == MLP)
    norm_stats = sum(1 for s in back.saved if s.dtype == torch.float32 and s.shape[-1:] == (1,) and len(s.shape) == 3)
    first = recorded[min(blocks.values())] if recorded else None
    tables = list(front.saved) + (list(first.saved) if first is not None else [])
    per_sequence = tuple((s.shape, s.const, s.dtype.itemsize) for s in tables if s.const is not None)
    saved = set()
    for layer, rec in recorded.items():
        kept = {e.name for e in rec.events if getattr(e, "saves", 0)}
        prefix = f"layers.{layer}."
        for i in range(cfg.n_layers):
            if (i in moe) == (layer in moe):
                saved |= {f"layers.{i}." + n[len(prefix):] for n in kept if n.startswith(prefix)}
    _, modules = record_ends(model, True, True, 1, seq_len, dtype, mtp=True)  # the head and MTP's modules
    saved |= {e.name for rec in (front, back, modules) for e in rec.events if getattr(e, "saves", 0)}
    attention = attention_terms(first) if first is not None else None
    mtp_moe = sum(isinstance(e, Experts) for e in modules.events)
    block_tables = tuple((s.shape, s.const, s.dtype.itemsize) for s in (first.saved if first is not None else ())
                         if s.const is not None)
    return CostTerms(mlp_saved, mlp_matmuls, norm_stats, per_sequence, frozenset(saved), attention,
                     mtp_depth(model), mtp_moe, block_tables)


def attention_terms(block) -> AttentionTerms:
    """The attention half of a recorded block: what it keeps up to the kernel's output
    (kept by the output projection), the kernel's own tensors set apart."""
    attends = [e for e in block.events if isinstance(e, Attend)]
    if len(attends) != 1:
        raise NotImplementedError(f"the estimators count one ctx.attention per block; this one makes {len(attends)}")
    end = next(i for i, s in enumerate(block.saved) if s.kernel == "output")
    kept = tuple(s for s in block.saved[:end] if s.kernel is None and s.const is None)
    projections = tuple(lin for lin in block.linears if not lin.after_attention)
    return AttentionTerms(kept, attends[0], projections)


def attention_flops(model: ModelDef, seq_len: int) -> float:
    """One block's attention FLOPs per token, forward, over `seq_len` keys: 2 x keys x
    query heads x (query/key head dim + value head dim), from the shapes the family's
    forward gives ctx.attention (4 x keys x dim for Llama; MLA's own head dims)."""
    events = record_block(model, 0, 1, seq_len, torch.float32).events
    return sum(2.0 * seq_len * e.q[2] * (e.q[3] + e.v[3]) for e in events if isinstance(e, Attend))
