"""Run configuration for `meshtrain fit`: dataclasses, YAML round trip, eager validation."""

from .schema import RunConfig
from .sections import PRECISIONS, CheckpointConfig, DataConfig, ModelConfig, ParallelConfig, TrainConfig

# MoeSection stays out: jsonargparse names it by its shortest import path, and the CLI
# allows exactly meshtrain.config.sections.MoeSection (cli.py, docs/reliability.md).
__all__ = ["CheckpointConfig", "DataConfig", "ModelConfig", "ParallelConfig", "PRECISIONS", "RunConfig",
           "TrainConfig"]
