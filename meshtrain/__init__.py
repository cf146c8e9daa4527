"""meshtrain: a model is a pure function of a flat parameter dict; a parallel layout is a plan.

The Python API (docs/architecture.md walks through it): build a model, make a plan, init
its parameters, make a step (plain, pipelined, eval), run it, save and load checkpoints,
export to Hugging Face; or give a RunConfig to `fit`, as `meshtrain fit` does.

The names below load on first use, so that `meshtrain preprocess` and the data workers do
not import torch's distributed and model code they never run."""

import importlib

_EXPORTS = {  # name -> (module, attribute)
    "ConfigError": (".errors", "ConfigError"), "TrainingError": (".errors", "TrainingError"),
    "ModelDef": (".models", "ModelDef"), "ParamSpec": (".models", "ParamSpec"), "build": (".models", "build"),
    "MeshSpec": (".layout.mesh", "MeshSpec"), "Rules": (".layout.rules", "Rules"),
    "Plan": (".layout.plan", "Plan"), "make_plan": (".layout.plan", "make_plan"),
    "init_params": (".parallel.init", "init_params"),
    "partition": (".pipeline", "partition"), "build_pipeline_schedule": (".pipeline", "build_pipeline_schedule"),
    "AdamW": (".train.optim", "AdamW"), "Muon": (".train.muon", "Muon"), "LRSchedule": (".train.lr_schedule", "LRSchedule"),
    "TrainState": (".train.step", "TrainState"), "make_train_step": (".train.step", "make_train_step"),
    "make_eval_step": (".train.step", "make_eval_step"),
    "make_pipeline_step": (".train.pipeline_step", "make_pipeline_step"),
    "make_pipeline_eval": (".train.pipeline_step", "make_pipeline_eval"),
    "save_checkpoint": (".checkpoint", "save"), "load_checkpoint": (".checkpoint", "load"),
    "latest_checkpoint": (".checkpoint", "latest"), "CheckpointError": (".checkpoint", "CheckpointError"),
    "save_hf": (".interop.hf", "save_hf"), "export_checkpoint": (".run.export", "export_checkpoint"),
    "load_hf_params": (".interop.hf", "load_hf_params"),
    "RunConfig": (".config", "RunConfig"), "fit": (".run.fit", "fit"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    return getattr(importlib.import_module(module, __name__), attribute)
