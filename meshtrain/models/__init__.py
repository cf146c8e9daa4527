"""Models as pure functions of a flat parameter dict, one registered family per folder."""

from __future__ import annotations

from dataclasses import dataclass

from . import gpt2, llama
from .context import LocalContext, ModelContext
from .family import FAMILIES, Costs, Family, get_family, register
from .spec import ParamSpec

# The model families, by model.arch: one line per family.
register(llama.FAMILY)
register(gpt2.FAMILY)


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


__all__ = ["FAMILIES", "Costs", "Family", "ModelDef", "ParamSpec", "LocalContext", "ModelContext", "build",
           "get_family", "gpt2", "llama", "register"]
