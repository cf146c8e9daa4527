"""Mixture-of-experts feed-forward: configuration, the router, the balancing terms and the
routed expert computation on local tensors.

MoeConfig is the model.moe section of a run config itself: the CLI parses it from YAML and
flags (its attribute docstrings are the --help of model.moe.*), and it checks its own
fields when built. Only what crosses into the rest of the model (model.moe.layers against
model.n_layers) is config/'s to check.

The layer is written once, for local tensors; the context decides where experts live.
`routed_experts` takes an optional `exchange` (expert parallelism: tokens travel to the
ranks that hold their experts and back); without one every expert is local. Balancing
statistics are per-sequence sums, so the contexts only add them up over the ranks that
split a sequence, and the step divides by the global batch: the result does not depend on
how the batch is laid out or split into micro-steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import ConfigError, check_bool, check_choice, check_float, check_int
from .experts import capacity_keep, expert_capacity, expert_swiglu, sort_by_expert

ROUTERS = ("softmax", "sigmoid")  # model.moe.router
BALANCES = ("aux", "aux_free", "none")  # model.moe.balance

# Upper bounds of the expert sizes, as models/config.py's MAX_SIZES for the rest of the
# model: far above any real model (DeepSeek-V3: 256 experts), low enough that a typo fails
# here, not as an allocation or an endless planning loop after the ranks have started.
MAX_SIZES = {"num_experts": 2**16, "shared_experts": 2**16, "expert_ffn_dim": 2**22}


@dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts feed-forward blocks (llama and deepseek_v3 families): a router picks top_k of num_experts SwiGLU experts per token."""

    num_experts: int = 8
    """Routed experts per MoE block."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_ffn_dim: int = 128
    """Hidden size of each expert's SwiGLU."""
    shared_experts: int = 0
    """Experts every token also passes through (DeepSeek-style), run as one SwiGLU of shared_experts x expert_ffn_dim; 0: none."""
    router: str = "softmax"
    """softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3: independent scores, the chosen ones normalised). Computed in fp32."""
    balance: str = "aux"
    """aux: a balance loss aux_coef x E/k x sum_i f_i P_i, taken within each sequence and averaged over the global batch | aux_free: a per-expert bias shifts the choice of experts toward balance, updated after each step by bias_update_rate x sign(mean load - load) over the global batch's tokens | none."""
    aux_coef: float = 0.01
    """Weight of the balance loss (balance aux)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (mean over tokens of logsumexp(logits)^2); 0: off."""
    capacity_factor: float | None = None
    """null: dropless (every routed token is computed). A number: each expert takes at most ceil(capacity_factor x tokens x top_k / E) of each rank's routed tokens per micro-step, those with the highest gates; the rest are dropped (they add nothing; the residual carries them)."""
    layers: str | list[int] = field(default="all", hash=False)
    """Which blocks are MoE: all; a slice such as '1:' (all but the first, dense, block) or '::2'; or a list of indices. Dense blocks keep model.ffn_dim."""
    norm_topk: bool = True
    """Normalise the top_k gates of a token to sum to 1."""
    route_scale: float = 1.0
    """Multiplier of the gates (DeepSeek-V3: 2.5)."""
    bias_update_rate: float = 0.001
    """Step of the aux-free bias update (balance aux_free)."""
    groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts form this many equal groups of consecutive ids, a group scores the sum of its two best (biased) expert scores, and a token chooses its top_k among the best group_top_k groups only. 1: no groups. With expert parallelism, groups = nodes bounds the nodes a token travels to."""
    group_top_k: int = 1
    """Groups a token may choose experts from (DeepSeek-V3's topk_group); at most groups, and group_top_k x experts per group at least top_k."""

    def __post_init__(self) -> None:
        # `--model.moe.layers "'1:'"`: the command line keeps a quoted string's quotes.
        v = self.layers
        if isinstance(v, str) and len(v) > 1 and v[0] == v[-1] and v[0] in "'\"":
            object.__setattr__(self, "layers", v[1:-1])
        for key, minimum in (("num_experts", 1), ("top_k", 1), ("expert_ffn_dim", 1), ("shared_experts", 0)):
            check_int(getattr(self, key), f"model.moe.{key}", minimum, MAX_SIZES.get(key))
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts={self.num_experts}: a "
                              "token cannot go to more experts than there are")
        check_choice(self.router, "model.moe.router", ROUTERS)
        check_choice(self.balance, "model.moe.balance", BALANCES)
        for key in ("aux_coef", "z_loss_coef", "bias_update_rate"):
            check_float(getattr(self, key), f"model.moe.{key}", minimum=0.0)
        check_float(self.route_scale, "model.moe.route_scale", positive=True)
        check_bool(self.norm_topk, "model.moe.norm_topk")
        if self.capacity_factor is not None:
            check_float(self.capacity_factor, "model.moe.capacity_factor", positive=True)
        self._check_groups()

    def _check_groups(self) -> None:
        check_int(self.groups, "model.moe.groups", 1)
        check_int(self.group_top_k, "model.moe.group_top_k", 1)
        if self.group_top_k > self.groups:
            raise ConfigError(f"model.moe.group_top_k={self.group_top_k} exceeds model.moe.groups={self.groups}: "
                              "a token cannot choose more groups than there are")
        if self.groups == 1:
            return
        per_group = self.num_experts // self.groups
        if self.num_experts % self.groups or per_group < 2:
            raise ConfigError(f"model.moe.groups={self.groups} must split model.moe.num_experts={self.num_experts} "
                              "into equal groups of at least 2 experts (a group scores its two best): choose a "
                              "divisor of num_experts at most num_experts / 2, or 1")
        if self.group_top_k * per_group < self.top_k:
            raise ConfigError(f"model.moe.group_top_k={self.group_top_k} groups of {per_group} experts hold fewer "
                              f"than model.moe.top_k={self.top_k} experts: raise group_top_k to at least "
                              f"{-(-self.top_k // per_group)}")

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
    # Which experts is a discrete choice: no gradient flows through it, so autograd keeps
    # none of the group ranking's tensors (84 bytes a token at 8 experts, 4 groups).
    choice = (scores if bias is None else scores + bias.float()).detach()
    if cfg.groups > 1:
        choice = _best_groups(choice, cfg.groups, cfg.group_top_k)
    idx = choice.topk(cfg.top_k, dim=-1).indices
    gates = scores.gather(-1, idx)
    if cfg.norm_topk and cfg.top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    return idx, gates * cfg.route_scale, probs


def _best_groups(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """`choice` (T, E) with the experts outside each token's `keep` best groups at -inf; a
    group scores the sum of its two best choices (DeepSeek-V3)."""
    grouped = choice.unflatten(-1, (groups, -1))
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(keep, dim=-1).indices  # (T, keep)
    eligible = torch.zeros(grouped.shape[:-1], dtype=torch.bool, device=choice.device).scatter(-1, best, True)
    return grouped.masked_fill(~eligible.unsqueeze(-1), float("-inf")).flatten(-2)


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
