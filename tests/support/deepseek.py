"""A tiny DeepSeek-V3 shared by tests/test_deepseek_v3.py and tests/test_deepseek_layouts.py:
transformers' DeepseekV3Config and ours for the same model (query and key/value latents,
value heads narrower than query/key heads, interleaved RoPE with YaRN, 8 experts in 4
groups of which a token's best 2 are eligible, a shared expert, block 0 dense), its
batches and optimizer, and one process's run from the same weights."""

from __future__ import annotations

import dataclasses

import torch

from meshtrain import AdamW, LRSchedule, TrainState, build, make_train_step
from meshtrain.data.documents import document_positions, document_segments, mask_after_eod
from meshtrain.models.deepseek_v3 import DeepseekV3Config
from meshtrain.models.mla import MlaConfig
from meshtrain.models.moe import MoeConfig
from meshtrain.models.mtp import MtpConfig
from meshtrain.models.spec import init_slice

YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}
MOE = MoeConfig(num_experts=8, top_k=2, expert_ffn_dim=32, shared_experts=1, router="sigmoid", balance="aux_free",
                aux_coef=0.0, layers="1:", route_scale=2.5, groups=4, group_top_k=2, bias_update_rate=1e-2)
MLA = MlaConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
CFG = DeepseekV3Config(dim=48, n_layers=2, n_heads=4, ffn_dim=96, vocab_size=130, max_seq_len=32, moe=MOE, mla=MLA,
                       rope_scaling=YARN)
STEPS, BATCH, SEQ = 4, 8, 16
# lr as tests/support/equivalence.py's: Adam divides out a gradient's scale, so an entry whose
# gradient is noise-sized moves by up to lr in a direction the reduction order picks;
# at 1e-3 that reached the 1e-5 parameter tolerance after 4 steps (fsdp2, 1.07e-5).
LR, MIN_LR, WARMUP, CLIP = 3e-4, 3e-5, 2, 0.5


EOD = 3


def batches(micro_steps: int = 1, documents: bool = False):
    """STEPS random batches; with `documents`, rows packing documents (an EOD about one
    token in 5): their segments and restarting positions, targets after an EOD ignored."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        t = torch.randint(4 if documents else 0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
        if documents:
            t[torch.rand(t.shape, generator=g) < 0.2] = EOD
        t = t.reshape(micro_steps, BATCH // micro_steps, SEQ + 1)
        tokens, targets = t[..., :-1], t[..., 1:]
        if not documents:
            yield {"tokens": tokens, "targets": targets}
            continue
        yield {"tokens": tokens, "targets": mask_after_eod(tokens, targets, EOD),
               "positions": document_positions(tokens, EOD), "segments": document_segments(tokens, EOD)}


def train_reference(params: list, gates: list, steps: int, objective, *, lr=LR, min_lr=MIN_LR, warmup=WARMUP,
                    clip=CLIP, weight_decay=0.1, rate=MOE.bias_update_rate) -> list[tuple]:
    """transformers' modules trained as meshtrain's step trains: per step t,
    `objective(t)` gives (the loss to differentiate, the numbers to report); then
    clip_grad_norm_, torch.optim.AdamW (decay on >= 2-D) at the schedule's lr, and each
    gate's aux-free bias moved by rate x sign(mean load - load) over the step's tokens.
    Returns (*numbers, grad norm) per step."""
    schedule = LRSchedule(lr=lr, min_lr=min_lr, warmup_steps=warmup, total_steps=steps)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    loads = {}
    for gate in gates:
        gate.register_forward_hook(lambda m, _, out: loads.__setitem__(m, torch.bincount(
            out[2].flatten(), minlength=MOE.num_experts).float()))
    out = []
    for t in range(steps):
        loss, numbers = objective(t)
        opt.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        for group in opt.param_groups:
            group["lr"] = schedule(t)
        opt.step()
        with torch.no_grad():
            for gate in gates:
                gate.e_score_correction_bias.add_(rate * torch.sign(loads[gate].mean() - loads[gate]))
        out.append((*numbers, norm))
    return out


def moe_gates(layers) -> list:
    """The MoE gates of transformers' decoder layers (the dense ones have none)."""
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]


def optimizer_args() -> dict:
    return dict(optimizer=AdamW(lr=LR, weight_decay=0.1),
                lr_schedule=LRSchedule(lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP, total_steps=STEPS), grad_clip=CLIP)


def initial_params(cfg=CFG) -> dict[str, torch.Tensor]:
    return {n: init_slice(s, n, seed=0) for n, s in build("deepseek_v3", cfg).specs.items()}


MTP_CFG = dataclasses.replace(CFG, mtp=MtpConfig(depth=1, loss_coef=0.3))  # one multi-token prediction module


def single_process(params: dict | None = None, compile=False, documents: bool = False, cfg=None):
    """(metrics per step, final params) of one process of `cfg` (default: CFG) from
    `params` (default: seed 0)."""
    cfg = cfg or CFG
    model = build("deepseek_v3", cfg)
    params = {n: p.clone().requires_grad_(model.specs[n].trainable)
              for n, p in (params if params is not None else initial_params(cfg)).items()}
    step = make_train_step(model, compile=compile, **optimizer_args())
    state = TrainState.create(params)
    metrics = [step(state, b) for b in batches(documents=documents)]
    return metrics, {n: p.detach().clone() for n, p in params.items()}


def hf_config(transformers, **changes):
    """transformers' DeepseekV3Config of CFG."""
    keys = dict(vocab_size=CFG.vocab_size, hidden_size=CFG.dim, intermediate_size=CFG.ffn_dim,
                moe_intermediate_size=MOE.expert_ffn_dim, num_hidden_layers=CFG.n_layers,
                num_attention_heads=CFG.n_heads, num_key_value_heads=CFG.n_heads, n_shared_experts=1,
                n_routed_experts=MOE.num_experts, routed_scaling_factor=MOE.route_scale,
                kv_lora_rank=MLA.kv_lora_rank, q_lora_rank=MLA.q_lora_rank, qk_rope_head_dim=MLA.qk_rope_head_dim,
                v_head_dim=MLA.v_head_dim, qk_nope_head_dim=MLA.qk_nope_head_dim, n_group=MOE.groups,
                topk_group=MOE.group_top_k, num_experts_per_tok=MOE.top_k, first_k_dense_replace=1,
                norm_topk_prob=True, max_position_embeddings=CFG.max_seq_len, rms_norm_eps=CFG.norm_eps,
                rope_interleave=True, tie_word_embeddings=False, num_mtp_layers=0,
                rope_parameters={"rope_type": "yarn", "rope_theta": CFG.rope_theta,
                                 **{k: v for k, v in YARN.items() if k != "type"}})
    return transformers.DeepseekV3Config(**{**keys, **changes})


def hf_model(transformers, seed: int = 0, **changes):
    """A random transformers DeepseekV3ForCausalLM of CFG: norms off their ones, routers
    scaled up so the choice of experts is decisive, a non-zero aux-free bias."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config(transformers, **changes)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model
