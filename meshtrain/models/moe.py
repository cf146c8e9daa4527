"""Mixture-of-experts feed-forward: configuration, the router, the balancing terms and the
routed expert computation on local tensors.

The layer is written once, for local tensors; the context decides where experts live.
`routed_experts` takes an optional `exchange` (expert parallelism: tokens travel to the
ranks that hold their experts and back); without one every expert is local. Balancing
statistics are per-sequence sums, so the contexts only add them up over the ranks that
split a sequence, and the step divides by the global batch: the result does not depend on
how the batch is laid out or split into micro-steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import ConfigError
from .experts import capacity_keep, expert_capacity, expert_swiglu, sort_by_expert

ROUTERS = ("softmax", "sigmoid")
BALANCES = ("aux", "aux_free", "none")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 128
    shared_experts: int = 0
    router: str = "softmax"
    balance: str = "aux"
    aux_coef: float = 0.01
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    layers: tuple[int, ...] | str = "all"
    norm_topk: bool = True
    route_scale: float = 1.0
    bias_update_rate: float = 1e-3

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"model.moe.router={self.router!r}: choose one of {', '.join(ROUTERS)}")
        if self.balance not in BALANCES:
            raise ConfigError(f"model.moe.balance={self.balance!r}: choose one of {', '.join(BALANCES)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"model.moe.top_k={self.top_k} must be between 1 and model.moe.num_experts="
                              f"{self.num_experts}")
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))

    def moe_layers(self, n_layers: int) -> tuple[int, ...]:
        """The indices of the MoE blocks: 'all', a Python slice such as '3:' (all but the
        first three) or '::2' (every other), or a list of indices."""
        spec = self.layers
        if spec == "all":
            return tuple(range(n_layers))
        if isinstance(spec, str):
            try:
                parts = [int(s) if s.strip() else None for s in spec.split(":")]
                if len(parts) not in (2, 3):
                    raise ValueError
                return tuple(range(n_layers))[slice(*parts)]
            except ValueError:
                raise ConfigError(f"model.moe.layers={spec!r}: give all, a slice such as '1:' (all but the first "
                                  "layer) or '::2', or a list of layer indices") from None
        bad = [i for i in spec if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers]
        if bad or len(set(spec)) != len(spec):
            raise ConfigError(f"model.moe.layers={list(spec)}: layer indices must be distinct integers in "
                              f"0..{n_layers - 1} (model.n_layers={n_layers})")
        return tuple(sorted(spec))


def route(logits: torch.Tensor, cfg: MoeConfig, bias: torch.Tensor | None = None):
    """fp32 router logits (T, E) -> (expert ids (T, k), gates (T, k), probabilities (T, E)).
    The aux-free bias shifts which experts are chosen, never the gates."""
    scores = logits.softmax(-1) if cfg.router == "softmax" else logits.sigmoid()
    probs = scores if cfg.router == "softmax" else scores / scores.sum(-1, keepdim=True)
    choice = scores if bias is None else scores + bias.float()
    idx = choice.topk(cfg.top_k, dim=-1).indices
    gates = scores.gather(-1, idx)
    if cfg.norm_topk and cfg.top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    return idx, gates * cfg.route_scale, probs


class Exchange(Protocol):
    """Moves routed token rows to the ranks holding their experts and back (expert
    parallelism). `dispatch(rows, counts)` takes rows sorted by global expert id with
    per-expert counts (E,) and returns the rows this rank's experts must process, sorted
    by local expert, with their counts; `combine(rows)` sends the results back in the
    order dispatch received them."""

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def combine(self, rows: torch.Tensor) -> torch.Tensor: ...


def routed_experts(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, w_gate: torch.Tensor,
                   w_up: torch.Tensor, w_down: torch.Tensor, cfg: MoeConfig,
                   exchange: Exchange | None = None) -> torch.Tensor:
    """sum_k gate_k * expert_k(x) for tokens x (T, d); dropless unless cfg.capacity_factor
    is set (then each expert keeps at most its capacity of this rank's slots, the highest
    gates first, and a dropped slot adds nothing). Weights hold the local experts."""
    tokens, k = idx.shape
    n = cfg.num_experts
    if cfg.capacity_factor is not None:
        keep = capacity_keep(idx, gates.detach(), n, expert_capacity(tokens, k, n, cfg.capacity_factor))
        idx = torch.where(keep, idx, n)  # dropped slots sort after every expert's
    order, counts = sort_by_expert(idx, n + 1)
    counts = counts[:n]
    kept = order[:int(counts.sum())] if cfg.capacity_factor is not None else order
    token = kept // k
    rows = x[token]
    if exchange is not None:
        rows, local_counts = exchange.dispatch(rows, counts)
        out = exchange.combine(expert_swiglu(rows, w_gate, w_up, w_down, local_counts))
    else:
        out = expert_swiglu(rows, w_gate, w_up, w_down, counts)
    out = out * gates.flatten()[kept].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x).index_add(0, token, out)


def sequence_stats(probs: torch.Tensor, idx: torch.Tensor, num_experts: int):
    """Per sequence (batch, E): the summed router probabilities and the slots routed to
    each expert, over this rank's positions. probs (batch, seq, E), idx (batch, seq, k)."""
    slots = idx.flatten(1)
    counts = probs.new_zeros(probs.shape[0], num_experts).scatter_add_(1, slots, probs.new_ones(slots.shape))
    return probs.sum(1), counts


def balance_loss(prob_sum: torch.Tensor, counts: torch.Tensor, seq_len: int, cfg: MoeConfig) -> torch.Tensor:
    """Per-sequence balance loss (batch,): E/(k S^2) sum_i count_i prob_sum_i, the
    Switch/DeepSeek form f_i P_i computed within each sequence, times aux_coef."""
    scale = cfg.aux_coef * cfg.num_experts / (cfg.top_k * seq_len * seq_len)
    return (counts.detach() * prob_sum).sum(-1) * scale


def z_loss(logits: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """Sum over tokens of z_loss_coef * logsumexp(router logits)^2 (keeps logits small)."""
    return torch.logsumexp(logits, -1).pow(2).sum() * cfg.z_loss_coef


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """Max over mean of tokens per expert, per MoE layer (load: layers x E)."""
    return load.amax(-1) / load.float().mean(-1).clamp(min=1e-9)


def expert_bias_step(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """The aux-free update (DeepSeek-V3): raise the bias of experts below the mean load,
    lower it above, by `rate`."""
    return bias + rate * torch.sign(load.float().mean() - load.float())
