"""Run configs as RunConfig objects: the tiny config shrunk for one process, the presets."""

from __future__ import annotations

import dataclasses

import yaml

from meshtrain.config import RunConfig

from .cli import ROOT, TINY


def small_cfg(tmp_path, **train) -> RunConfig:
    """configs/tiny.yaml shrunk (2 layers, dim 64, 16 x 64 tokens) to train in this
    process, its run_dir under tmp_path; `train` overrides train.*."""
    cfg = RunConfig.from_dict(yaml.safe_load(TINY.read_text()))
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "run"))
    cfg.model = dataclasses.replace(cfg.model, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176,
                                    vocab_size=264, max_seq_len=64)
    cfg.train = dataclasses.replace(cfg.train, seq_len=64, global_batch=16, micro_batch=8, **train)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=0)  # as SMALL: none unless asked for
    return cfg


def preset(name: str, **train) -> RunConfig:
    """configs/<name>.yaml, validated; `train` overrides train.*."""
    cfg = RunConfig.from_dict(yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text()))
    if train:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
    return cfg.validate()
