"""meshtrain: a model is a pure function of a flat parameter dict; a parallel layout is a plan."""

from .errors import ConfigError
from .models import ModelDef, ParamSpec, build
from .parallel.mesh import MeshSpec
from .parallel.init import init_params
from .parallel.plan import Plan, make_plan
from .parallel.rules import Rules
from .train.optim import AdamW
from .train.schedule import LRSchedule
from .train.step import TrainState, make_train_step

__all__ = ["AdamW", "ConfigError", "LRSchedule", "MeshSpec", "ModelDef", "ParamSpec", "Plan", "Rules",
           "TrainState", "build", "init_params", "make_plan", "make_train_step"]
