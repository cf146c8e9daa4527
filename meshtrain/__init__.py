"""meshtrain: a model is a pure function of a flat parameter dict; a parallel layout is a plan.

The names below load on first use, so that `meshtrain preprocess` and the data workers do
not import torch's distributed and model code they never run."""

import importlib

_EXPORTS = {"ConfigError": ".errors", "ModelDef": ".models", "ParamSpec": ".models", "build": ".models",
            "MeshSpec": ".parallel.mesh", "init_params": ".parallel.init", "Plan": ".parallel.plan",
            "make_plan": ".parallel.plan", "Rules": ".parallel.rules", "AdamW": ".train.optim",
            "LRSchedule": ".train.schedule", "TrainState": ".train.step", "make_train_step": ".train.step"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
