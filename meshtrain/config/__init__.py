"""Run configuration for `meshtrain fit`: dataclasses, YAML round trip, eager validation."""

from .schema import (CheckpointConfig, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig,
                     PRECISIONS)

__all__ = ["CheckpointConfig", "DataConfig", "ModelConfig", "ParallelConfig", "PRECISIONS", "RunConfig",
           "TrainConfig"]
