"""Split a pure model into pipeline stages.

A stage owns a contiguous range of transformer layers; stage 0 also owns the embedding
(tok_emb, and pos_emb for GPT-2), the last stage the final norm, the output head and the
loss. S = pp x v stages; stage s lives on pp rank s % pp (interleaved: rank r holds
stages r, r + pp, ...).

Tied embeddings: `tok_emb` is *owned* by stage 0 (it is in stage 0's `params` and nowhere
else's) and listed in the last stage's `shared`, as it is when multi-token prediction's
modules (on the last stage, with the head) embed the tokens ahead. The executor gives the last stage a
replica of the table and all-reduces the two gradient contributions between the owning
and sharing ranks before the optimizer step (Megatron's "embedding group"); the optimizer
updates only the owner's copy and re-broadcasts it. With pp x v == 1 the same stage owns
and uses it, and `shared` is empty.

Cost model (FLOPs of one micro-batch of `micro_batch` sequences of `seq_len` tokens,
forward + backward, backward = 2 x forward):
  layer      2 T x (weight-matrix elements of the layer) + QK^T and PV over the full
             square (4 T S D for Llama; the family's attention shapes, MLA's head dims)
  embedding  T D            (a row gather; small)
  head       2 T D V + 5 T V + final norm  (the output matmul and the vocab-wide loss);
             with multi-token prediction, per depth a block, eh_proj and the head again
with T = micro_batch x seq_len. Activation memory per stage (`act_bytes`, fp32, no
checkpointing, unsharded) follows the per-token counts of `meshtrain/estimate/activation_memory.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..models.cost_terms import attention_flops, cost_terms
from ..models.recording import cached

FP32 = 4


@dataclass(frozen=True)
class Stage:
    index: int
    rank: int
    layers: tuple[int, int]  # [start, stop)
    has_embedding: bool
    has_head: bool  # final norm, output projection and loss
    params: tuple[str, ...]  # owned: a subset of model.specs, disjoint across stages
    shared: tuple[str, ...] = ()  # used but owned by another stage (tied tok_emb)
    flops: float = 0.0  # forward + backward of one micro-batch
    act_bytes: int = 0  # kept for backward, one micro-batch

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def __str__(self) -> str:
        parts = [f"stage {self.index} (rank {self.rank}): layers {self.layers[0]}..{self.layers[1] - 1}"
                 if self.n_layers else f"stage {self.index} (rank {self.rank}): no layers"]
        if self.has_embedding:
            parts.append("+embedding")
        if self.has_head:
            parts.append("+head/loss")
        if self.shared:
            parts.append("shares " + ",".join(self.shared))
        parts.append(f"{self.flops / 1e9:.3g} GFLOP")
        return " ".join(parts)


def _layer_of(name: str) -> int | None:
    if name.startswith("layers."):
        return int(name.split(".")[1])
    return None


def costs(model, *, seq_len: int, micro_batch: int) -> tuple[list[float], float, float]:
    """(per-layer FLOPs, embedding FLOPs, head+loss FLOPs), forward + backward."""
    cfg, specs = model.cfg, model.specs
    T, D, V = micro_batch * seq_len, cfg.dim, cfg.vocab_size
    mat = [0] * cfg.n_layers
    moe = getattr(cfg, "moe", None)
    for name, spec in specs.items():
        i = _layer_of(name)
        if i is not None and len(spec.shape) == 2:
            mat[i] += spec.shape[0] * spec.shape[1]
        elif i is not None and "experts" in spec.axes:  # a token uses top_k of the experts
            mat[i] += spec.numel * moe.top_k // moe.num_experts
    attention = T * attention_flops(model, seq_len)  # the family's own attention shapes
    layer = [3.0 * (2 * T * n + attention) for n in mat]
    emb = 3.0 * T * D
    head = 3.0 * (2 * T * D * V + 5 * T * V + 4 * T * D)
    mtp = getattr(cfg, "mtp", None)
    if mtp is not None and mtp.depth:  # the modules run on the last stage: a block, eh_proj, the head again
        head += mtp.depth * (layer[-1] + 3.0 * 2 * T * 2 * D * D + head)
    return layer, emb, head


def activation_bytes(model, *, seq_len: int, micro_batch: int) -> tuple[int, int, int]:
    """(per layer, embedding, head+loss) bytes kept for backward, fp32, unsharded."""
    cfg = model.cfg
    T, D, F, V = micro_batch * seq_len, cfg.dim, cfg.ffn_dim, cfg.vocab_size
    c = FP32
    terms = cost_terms(model, seq_len, torch.float32)
    norm = c * D + 4 * terms.norm_stats
    attn = micro_batch * terms.attention.unsharded_bytes(c) if terms.attention is not None else 0
    mlp = norm + c * D + terms.mlp_saved * c * F
    head = norm + c * D + 2 * FP32 * V + 8 + 1 + 8 + 1
    return attn + T * mlp, 0, T * head


def _check_counts(n_layers: int, pp: int, virtual: int) -> int:
    if pp < 1:
        raise ConfigError(f"parallel.pp={pp}: must be >= 1")
    if virtual < 1:
        raise ConfigError(f"parallel.pp_virtual={virtual}: must be >= 1")
    S = pp * virtual
    if n_layers < S:
        raise ConfigError(
            f"parallel.pp={pp} x parallel.pp_virtual={virtual} = {S} stages but the model has "
            f"{n_layers} layers (model.n_layers={n_layers}): every stage needs at least one layer; choose pp x "
            f"pp_virtual <= {n_layers}, or more layers")
    return S


def _balanced(weights: list[float], S: int) -> list[int]:
    """Layer counts of S contiguous non-empty groups minimising the heaviest group: exact
    (binary search over the candidate maxima, the sums of contiguous runs, with a greedy
    feasibility test; a greedy split into <= S groups can be refined to exactly S)."""
    n = len(weights)
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + w)
    cands = sorted({pre[j] - pre[i] for i in range(n) for j in range(i + 1, n + 1)})

    def greedy(limit: float) -> list[int] | None:
        groups, run, cnt = [], 0.0, 0
        for w in weights:
            if w > limit:
                return None
            if cnt and run + w > limit:
                groups.append(cnt)
                run, cnt = 0.0, 0
            run, cnt = run + w, cnt + 1
        groups.append(cnt)
        return groups if len(groups) <= S else None

    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(cands[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    groups = greedy(cands[lo])
    assert groups is not None
    while len(groups) < S:  # split the largest group: no group gets heavier
        k = max(range(len(groups)), key=lambda i: groups[i])
        a = groups[k] // 2
        groups[k:k + 1] = [groups[k] - a, a]
    return groups


def partition(model, pp: int, virtual: int = 1, layout: list[int] | None = None, *,
              seq_len: int, micro_batch: int) -> list[Stage]:
    """S = pp x virtual stages, balanced by the cost model (max stage FLOPs minimal over
    all contiguous splits) or by `layout`, a per-stage layer count list."""
    # Once per model and split: validation and the estimators ask again for every layout
    # the search tries on this pp (the stages are frozen; the list is a copy).
    key = (model.family.name, model.cfg, "partition", pp, virtual, None if layout is None else tuple(layout),
           seq_len, micro_batch)
    return list(cached(key, lambda: _partition(model, pp, virtual, layout, seq_len, micro_batch)))


def _partition(model, pp: int, virtual: int, layout: list[int] | None, seq_len: int, micro_batch: int) -> list[Stage]:
    cfg = model.cfg
    n = cfg.n_layers
    S = _check_counts(n, pp, virtual)
    layer_c, emb_c, head_c = costs(model, seq_len=seq_len, micro_batch=micro_batch)
    layer_a, emb_a, head_a = activation_bytes(model, seq_len=seq_len, micro_batch=micro_batch)
    if layout is not None:
        layout = list(layout)
        if len(layout) != S:
            raise ConfigError(
                f"parallel.pp_layout={layout} has {len(layout)} entries but parallel.pp={pp} x "
                f"parallel.pp_virtual={virtual} = {S} stages: give one layer count per stage, or null to "
                "balance by cost")
        if any(int(k) != k or k < 1 for k in layout):
            raise ConfigError(f"parallel.pp_layout={layout}: every stage needs a whole number >= 1 of layers")
        if sum(layout) != n:
            raise ConfigError(f"parallel.pp_layout={layout} sums to {sum(layout)} but the model has "
                              f"{n} layers (model.n_layers={n}): the counts must sum to {n}")
        counts = layout
    else:
        w = list(layer_c)
        w[0] += emb_c
        w[-1] += head_c
        counts = _balanced(w, S)

    specs = model.specs
    # The last stage reads the embedding table too: a tied head, or multi-token prediction.
    mtp = getattr(cfg, "mtp", None)
    tied = "tok_emb" in specs and ("output" not in specs or (mtp is not None and mtp.depth > 0))
    stages, start = [], 0
    for s, k in enumerate(counts):
        stop = start + k
        first, last = s == 0, s == S - 1
        owned = []
        for name in specs:
            i = _layer_of(name)
            if i is not None:
                if start <= i < stop:
                    owned.append(name)
            elif name in ("tok_emb", "pos_emb"):
                if first:
                    owned.append(name)
            elif last:  # norm, norm_bias, output, multi-token prediction's modules
                owned.append(name)
        shared = ("tok_emb",) if (tied and last and not first) else ()
        flops = sum(layer_c[start:stop]) + (emb_c if first else 0.0) + (head_c if last else 0.0)
        act = layer_a * (stop - start) + (emb_a if first else 0) + (head_a if last else 0)
        stages.append(Stage(s, s % pp, (start, stop), first, last, tuple(owned), shared, flops, act))
        start = stop
    return stages
