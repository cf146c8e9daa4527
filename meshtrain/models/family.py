"""A model family is one registry entry: its config, its parameters and its forward (the
estimators read its costs from the forward itself: recording.py). Everything above `models` (the step factories, the
partitioner, the estimators, generation, the config) reaches a family through here, by
its name (`model.arch`); adding a family is a folder under models/ with its `FAMILY`,
plus its name in models/__init__.py's FAMILY_FOLDERS (docs/architecture.md walks through
one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..errors import ConfigError
from .decode import KVCache, decode
from .hf import HFFormat
from .spec import ParamSpec

# Logical layouts of the activations every family's blocks pass around: the residual stream between blocks (also what crosses a pipeline stage
# boundary), a block's normed input, the token ids.
RESIDUAL = ("batch", "seq_sp", None)
BLOCK_IN = ("batch", "seq", None)
TOKENS = ("batch", "seq")


@dataclass(frozen=True)
class Family:
    """One model family. `config` is its frozen config dataclass; `from_fields` builds it
    from the run config's model.* section; `forward_stage(cfg, params, x, ctx, layers,
    first, last)` runs layers [start, stop) (after the embedding when `first`, ending with
    `head(cfg, params, x, ctx)` when `last`); `kv_heads(cfg)` is the number of key/value
    heads a KV cache holds; `check_fields(model_section)` checks the model.* keys only
    some families read (RoPE, GQA, ...), with messages that name the key and the fix
    (ModelConfig.check, models/config.py, calls it; the config dataclass checks its own invariants too); `hf`
    is its Hugging Face format (models/hf.py), None for a family that trains, plans and
    generates but does not export or import; `forward_mtp(cfg, params, x, ctx, layers,
    first, ahead, docs)` a last stage's (or the whole model's) logits and those of its
    multi-token prediction depths (models/mtp.py), None for a family without;
    `cache_dims(cfg)` the (heads, k width, v width) a decoding cache holds per position
    when not (kv_heads, head_dim, head_dim): MLA's latent and rotary key."""

    name: str
    config: type
    from_fields: Callable[[Any], Any]
    param_specs: Callable[[Any], dict[str, ParamSpec]]
    forward_stage: Callable
    head: Callable
    kv_heads: Callable[[Any], int]
    presets: Mapping[str, Any]
    check_fields: Callable[[Any], None] = lambda m: None
    hf: HFFormat | None = None
    forward_mtp: Callable | None = None
    cache_dims: Callable[[Any], tuple[int, int, int]] | None = None

    def moe_blocks(self, cfg) -> list[str]:
        """The prefixes ("layers.3.") of the MoE blocks in the order a forward runs them:
        the layers', then multi-token prediction's."""
        blocks = [f"layers.{i}." for i in getattr(cfg, "moe_layers", ())]
        mtp = getattr(cfg, "mtp", None)
        if mtp is not None and getattr(cfg, "moe", None) is not None:
            blocks += [f"mtp.{k}." for k in range(mtp.depth)]
        return blocks

    def forward(self, cfg, params, tokens, ctx, docs=None):
        """Logits (batch, seq, vocab) for `tokens` (batch, seq); `docs` (a models.context
        Documents) when the rows pack documents that must stay apart."""
        if docs is None:  # a family registered before documents needs no new argument
            return self.forward_stage(cfg, params, tokens, ctx, (0, cfg.n_layers), first=True, last=True)
        return self.forward_stage(cfg, params, tokens, ctx, (0, cfg.n_layers), first=True, last=True, docs=docs)

    def init_cache(self, cfg, batch: int, max_len: int, dtype=torch.float32, device="cpu") -> KVCache:
        """An empty KV cache for `max_len` positions (at most cfg.max_seq_len is meaningful);
        MLA's holds each position's latent and rotary key (models/decode.py)."""
        heads, k_width, v_width = self.cache_dims(cfg) if self.cache_dims else (self.kv_heads(cfg), cfg.head_dim, None)
        return KVCache.empty(cfg.n_layers, batch, max_len, heads, k_width, dtype, device, v_width)

    def decode(self, cfg, params, tokens, cache, start_pos: int, last_only: bool = False):
        """Logits (batch, t, vocab) for `tokens` (batch, t) at positions start_pos.., given
        that `cache` holds the positions before; stores theirs. The same block code as
        training (models/decode.py); last_only: the last position's logits only."""
        return decode(self, cfg, params, tokens, cache, start_pos, last_only)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make `family` available as model.arch=<family.name>."""
    if family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def get_family(arch: str) -> Family:
    if arch not in FAMILIES:
        raise ConfigError(f"model.arch={arch!r}: choose one of {', '.join(FAMILIES)}")
    return FAMILIES[arch]


@dataclass(frozen=True)
class ModelDef:
    """A model family bound to its config: `specs` and `forward(params, tokens, ctx)`."""

    family: Family
    cfg: object

    @property
    def specs(self) -> dict[str, ParamSpec]:
        return self.family.param_specs(self.cfg)

    def forward(self, params, tokens, ctx, docs=None):
        return self.family.forward(self.cfg, params, tokens, ctx, docs)


def build(arch: str, cfg) -> ModelDef:
    return ModelDef(get_family(arch), cfg)
