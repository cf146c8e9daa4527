"""Pipeline-stage compiler, pure half: partition, schedule IR, checker and simulator.

Everything here is data (no process groups): print it, check it, simulate it. The
executor runs exactly this IR.
"""

from .partition import Stage, partition
from .schedule import Action, PipelineSchedule, build_pipeline_schedule, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from .simulate import Result, ScheduleError, check, simulate

__all__ = ["Action", "Result", "PipelineSchedule", "ScheduleError", "Stage", "build_pipeline_schedule", "check", "gpipe",
           "interleaved_1f1b", "one_f_one_b", "partition", "simulate", "zb_h1"]
