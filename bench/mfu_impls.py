"""The implementations bench/mfu.py times: meshtrain's training step and Hugging Face
transformers' LlamaForCausalLM with torch's AdamW, built from the same initial parameters
(bench/mfu.py's docstring says how each is configured)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain import AdamW, TrainState, make_train_step  # noqa: E402
from meshtrain.interop.hf import hf_layout, to_hf_config  # noqa: E402

OPTIMIZER = AdamW(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Impl:
    """One implementation: step(batch) -> {"loss", "grad_norm"}; params() in meshtrain names."""

    def __init__(self, name, step, params, release):
        self.name, self.step, self.params, self.release = name, step, params, release


def build_ours(args, model, init, device) -> Impl:
    params = {n: v.to(device, copy=True).requires_grad_() for n, v in init.items()}  # init stays untouched
    state = TrainState.create(params)
    step = make_train_step(model, optimizer=OPTIMIZER, precision=args.precision, fp8_recipe=args.fp8_recipe,
                           grad_clip=args.grad_clip, compile=args.compile)
    name = "ours" if args.compile else "ours-eager"
    return Impl(name, lambda b: step(state, b), lambda: state.params, lambda: None)


def _register_causal_sdpa() -> str:
    """An attention implementation for transformers' AttentionInterface: no mask built,
    F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), as meshtrain's. Stock
    "sdpa" does the same when eager, but under torch.compile transformers may build the
    causal mask as a tensor and pass it to SDPA (no causal block skipping). Every sequence
    here is full length with no padding, so the two compute the same attention."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    def causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("sdpa_causal", causal_sdpa)
    AttentionMaskInterface.register("sdpa_causal", lambda *args, **kwargs: None)
    return "sdpa_causal"


def build_hf(args, cfg, init, device, compiled: bool) -> Impl:
    import transformers

    hf_cfg = transformers.LlamaConfig.from_dict(to_hf_config("llama", cfg, dtype="fp32"))
    hf_cfg._attn_implementation = _register_causal_sdpa() if args.hf_attn == "sdpa-causal" else "sdpa"
    hf_cfg.use_cache = False
    with torch.device(device):
        module = transformers.LlamaForCausalLM(hf_cfg)
    module.train()
    ours_name = {t.name: t.pieces[0].ours for t in hf_layout("llama", cfg)}
    own = dict(module.named_parameters())  # a tied lm_head is the embedding itself: listed once
    if set(own) != set(ours_name):
        raise RuntimeError(f"HF parameter names differ from the layout: only HF {sorted(set(own) - set(ours_name))}, "
                           f"only layout {sorted(set(ours_name) - set(own))}")
    if cfg.tie_embeddings and module.lm_head.weight is not module.model.embed_tokens.weight:
        raise RuntimeError("tie_word_embeddings is set but lm_head.weight is not the embedding table")
    with torch.no_grad():
        for hf_name, p in own.items():
            p.copy_(init[ours_name[hf_name]])
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIMIZER.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=OPTIMIZER.lr, betas=OPTIMIZER.betas, eps=OPTIMIZER.eps, **kind)
    plist = list(module.parameters())
    amp = args.precision in ("bf16", "fp8")

    def loss_fn(tokens, targets):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = module(input_ids=tokens, use_cache=False).logits
        # Mean over the micro-batch's tokens, on fp32 logits (as HF's own ForCausalLMLoss does).
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    forward = torch.compile(loss_fn) if compiled else loss_fn

    def step(batch):
        tokens, targets = batch["tokens"], batch["targets"]
        micro = tokens.shape[0]
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(micro):
            loss = forward(tokens[m], targets[m]) / micro  # equal-sized micro-batches, every target valid
            loss.backward()
            total = total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(plist, args.grad_clip, foreach=True)
        opt.step()
        return {"loss": float(total), "grad_norm": float(norm)}

    def params():
        return {ours_name[n]: p for n, p in own.items()}

    def release():
        own.clear()
        plist.clear()
        opt.state.clear()

    return Impl("hf-compiled" if compiled else "hf-eager", step, params, release)
