"""The gpt2 family: config.py, model.py (parameters and forward), hf.py (the Hugging Face
format)."""

from ..family import Family
from .config import PRESETS, GPT2Config, check_fields, from_fields
from .hf import HF
from .model import forward_stage, head, param_specs

FAMILY = Family(name="gpt2", config=GPT2Config, from_fields=from_fields, param_specs=param_specs,
                forward_stage=forward_stage, head=head, kv_heads=lambda cfg: cfg.n_heads,
                presets=PRESETS, check_fields=check_fields, hf=HF)

forward, decode, init_cache = FAMILY.forward, FAMILY.decode, FAMILY.init_cache

__all__ = ["FAMILY", "PRESETS", "GPT2Config", "decode", "forward", "forward_stage", "init_cache", "param_specs"]
