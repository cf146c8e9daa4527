"""Models as pure functions of a flat parameter dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import gpt2, llama
from .context import LocalContext, ModelContext
from .spec import ParamSpec

FAMILIES = {"llama": llama, "gpt2": gpt2}


@dataclass(frozen=True)
class ModelDef:
    """A model family bound to its config: `specs` and `forward(params, tokens, ctx)`."""

    family: Any
    cfg: Any

    @property
    def specs(self) -> dict[str, ParamSpec]:
        return self.family.param_specs(self.cfg)

    def forward(self, params, tokens, ctx):
        return self.family.forward(self.cfg, params, tokens, ctx)


def build(arch: str, cfg) -> ModelDef:
    return ModelDef(FAMILIES[arch], cfg)


__all__ = ["ModelDef", "ParamSpec", "LocalContext", "ModelContext", "build", "llama"]
