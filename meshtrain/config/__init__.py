"""Run configuration for `meshtrain fit`: dataclasses, YAML round trip, eager validation."""

from .schema import RunConfig
from .sections import CheckpointConfig, DataConfig, ModelConfig, ParallelConfig, TrainConfig

__all__ = ["CheckpointConfig", "DataConfig", "ModelConfig", "ParallelConfig", "RunConfig", "TrainConfig"]
