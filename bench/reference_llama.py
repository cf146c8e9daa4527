"""A plain eager PyTorch nn.Module Llama, written independently of meshtrain, for benchmarks.

Same architecture as `meshtrain.models.llama` with untied embeddings and no RoPE scaling:
nn.Embedding, RMSNorm (normalised in fp32), causal GQA attention through
F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) with half-split RoPE,
SwiGLU MLP, final RMSNorm, untied output projection. Weights are nn.Linear (out, in), so
meshtrain's flat parameter dict maps onto it one to one (`load_meshtrain_params`).

Trained the ordinary way: `torch.optim.AdamW(foreach=True)` with weight decay only on
>= 2-D parameters, `torch.nn.utils.clip_grad_norm_`, mean cross-entropy loss.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (batch, heads, seq, head_dim), the layout SDPA wants.
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w_gate = nn.Linear(dim, ffn_dim, bias=False)
        self.w_up = nn.Linear(dim, ffn_dim, bias=False)
        self.w_down = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn_dim, eps):
        super().__init__()
        self.attn_norm = RMSNorm(dim, eps)
        self.attn = Attention(dim, n_heads, n_kv_heads)
        self.mlp_norm = RMSNorm(dim, eps)
        self.mlp = MLP(dim, ffn_dim)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class ReferenceLlama(nn.Module):
    def __init__(self, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int,
                 vocab_size: int, max_seq_len: int, rope_theta: float = 10000.0, norm_eps: float = 1e-5):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, ffn_dim, norm_eps) for _ in range(n_layers))
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        head_dim = dim // n_heads
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq.float())
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @classmethod
    def from_config(cls, cfg) -> "ReferenceLlama":
        """From a meshtrain LlamaConfig (only the fields this module supports)."""
        if cfg.tie_embeddings or cfg.rope_scaling:
            raise ValueError("the reference supports untied embeddings and unscaled RoPE only")
        return cls(cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size,
                   cfg.max_seq_len, cfg.rope_theta, cfg.norm_eps)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def meshtrain_name(module_name: str) -> str:
    """nn.Module parameter name -> meshtrain flat-dict name."""
    return {"tok_emb.weight": "tok_emb", "norm.weight": "norm", "output.weight": "output"}.get(
        module_name, module_name.removesuffix(".weight"))


@torch.no_grad()
def load_meshtrain_params(model: ReferenceLlama, params: Mapping[str, torch.Tensor]) -> None:
    """Copy meshtrain's flat parameter dict into the module (every parameter, strictly)."""
    own = dict(model.named_parameters())
    mapped = {meshtrain_name(n): n for n in own}
    if set(mapped) != set(params):
        raise ValueError(f"parameter names differ: only reference {sorted(set(mapped) - set(params))}, "
                         f"only meshtrain {sorted(set(params) - set(mapped))}")
    for mt_name, mod_name in mapped.items():
        own[mod_name].copy_(params[mt_name])


def make_optimizer(model: nn.Module, lr: float, betas, eps: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=betas, eps=eps, foreach=True)


def make_reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None,
                        forward=None):
    """step(batch) -> metrics, batch as meshtrain's: tokens/targets (micro, B, S). `forward`
    (default `model`) may be a compiled wrapper of the same module."""
    forward = model if forward is None else forward
    params = [p for p in model.parameters()]

    def step(batch: dict) -> dict:
        tokens, targets = batch["tokens"], batch["targets"]
        micro = tokens.shape[0]
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(micro):
            # Mean over each micro-batch, averaged over equal-sized micro-batches.
            loss = forward(tokens[m], targets[m]) / micro
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else float("inf"),
                                              foreach=True)
        optimizer.step()
        return {"loss": float(total), "grad_norm": float(norm)}

    return step
