"""transformers' LlamaForCausalLM trained with torch.optim.Muon (the blocks' matrices) +
torch.optim.AdamW (the rest) + clip_grad_norm_: the reference of tests/test_muon.py (the
step API) and tests/test_muon_fit.py (`meshtrain fit`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.train.muon import is_muon

LR, WEIGHT_DECAY = 3e-4, 0.1


def hf_llama(transformers, cfg, seed: int = 0):
    """transformers' LlamaForCausalLM of our llama config `cfg`, perturbed (norms off their
    ones: a norm read into the wrong place shows in the loss)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
        rope_theta=cfg.rope_theta)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def torch_optimizers(named: dict, adjust: str, nesterov: bool = True, lr: float = LR,
                     weight_decay: float = WEIGHT_DECAY, muon_lr: float | None = None,
                     muon_decay: float | None = None):
    """torch.optim.Muon for the blocks' matrices (a 3-D tensor's matrices given as views
    of their own), torch.optim.AdamW for the rest (decay on >= 2-D): their (matrices,
    optimizers). `muon_lr`, `muon_decay` None: AdamW's (train.muon.lr, weight_decay null)."""
    mine = {n: p for n, p in named.items() if is_muon(n.removeprefix("model."), p)}
    rest = [p for n, p in named.items() if n not in mine]
    muon = torch.optim.Muon(list(mine.values()), lr=muon_lr or lr,
                            weight_decay=weight_decay if muon_decay is None else muon_decay,
                            adjust_lr_fn=adjust, nesterov=nesterov)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": weight_decay},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95), eps=1e-8)
    return mine, (muon, adamw)


def train_reference(model, adjust: str, windows, schedule, clip: float, **optimizers) -> list[tuple[float, float]]:
    """(loss, grad norm) per step of `model` on `windows` (each step's (tokens, targets)):
    clip_grad_norm_, then torch's Muon and AdamW (torch_optimizers' keywords), AdamW at
    the schedule's lr and Muon at the schedule's lr x muon_lr / lr, as train.muon.lr."""
    model.train()
    named = dict(model.named_parameters())
    _, (muon, adamw) = torch_optimizers(named, adjust, **optimizers)
    lr = optimizers.get("lr", LR)
    scales = ((muon, (optimizers.get("muon_lr") or lr) / lr), (adamw, 1.0))
    out = []
    for t, (tokens, targets) in enumerate(windows):
        loss = F.cross_entropy(model(tokens).logits.flatten(0, 1), targets.flatten())
        for o, _ in scales:
            o.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(named.values()), clip))
        for o, scale in scales:
            for group in o.param_groups:
                group["lr"] = schedule(t) * scale
            o.step()
        out.append((loss.item(), norm))
    return out
