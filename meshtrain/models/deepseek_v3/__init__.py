"""The deepseek_v3 family (DeepSeek-V3, R1, Kimi K2's architecture): config.py, model.py
(parameters and forward), hf.py (the Hugging Face format)."""

from ..family import Family
from .config import PRESETS, DeepseekV3Config, check_fields, from_fields
from .hf import HF
from .model import forward_stage, head, forward_mtp, param_specs

FAMILY = Family(name="deepseek_v3", config=DeepseekV3Config, from_fields=from_fields, param_specs=param_specs,
                forward_stage=forward_stage, head=head, kv_heads=lambda cfg: cfg.n_heads,
                presets=PRESETS, check_fields=check_fields, hf=HF, forward_mtp=forward_mtp,
                cache_dims=lambda cfg: (1, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim))

forward, decode, init_cache = FAMILY.forward, FAMILY.decode, FAMILY.init_cache

__all__ = ["FAMILY", "PRESETS", "DeepseekV3Config", "decode", "forward", "forward_stage", "forward_mtp", "init_cache",
           "param_specs"]
