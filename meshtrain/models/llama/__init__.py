"""The llama family (Llama 3, Qwen3, Mixtral / Qwen3-MoE / DeepSeek-style MoE): config.py,
model.py (parameters and forward), hf.py (the Hugging Face format)."""

from ..family import Family
from .config import PRESETS, LlamaConfig, check_fields, from_fields
from .hf import HF
from .model import forward_stage, head, param_specs

FAMILY = Family(name="llama", config=LlamaConfig, from_fields=from_fields, param_specs=param_specs,
                forward_stage=forward_stage, head=head, kv_heads=lambda cfg: cfg.n_kv_heads,
                presets=PRESETS, check_fields=check_fields, hf=HF)

forward, decode, init_cache = FAMILY.forward, FAMILY.decode, FAMILY.init_cache

__all__ = ["FAMILY", "PRESETS", "LlamaConfig", "decode", "forward", "forward_stage", "init_cache", "param_specs"]
