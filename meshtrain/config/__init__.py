"""Run configuration for `meshtrain fit`: dataclasses, YAML round trip, eager validation."""

from .schema import RunConfig
from ..checkpoint.config import CheckpointConfig
from ..data.config import DataConfig
from ..layout.config import ParallelConfig
from ..models.config import ModelConfig
from ..train.config import TrainConfig

__all__ = ["CheckpointConfig", "DataConfig", "ModelConfig", "ParallelConfig", "RunConfig", "TrainConfig"]
