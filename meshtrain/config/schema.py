"""The run configuration: what `meshtrain fit` reads from YAML and the command line.

Every field has an attribute docstring (jsonargparse shows it in --help). `validate()`
raises ConfigError naming the key and the fix for any value that cannot work, and for
any feature the keys already name but that is not implemented yet: nothing is accepted
and then silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError
from ..checkpoint.config import CheckpointConfig
from ..data.config import DataConfig
from ..layout.config import ParallelConfig
from ..models.config import ModelConfig
from ..train.config import TrainConfig


@dataclass
class RunConfig:
    """A training run."""

    run_dir: str = "runs/tiny"
    """Directory for config.yaml, plan.json, metrics.jsonl and checkpoints/."""
    seed: int = 0
    """Seed of the parameter initialisation and of the data sampler."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimisation loop."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""

    # --- conversion --------------------------------------------------------------

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "RunConfig":
        """Build from nested mappings (a parsed YAML file); unknown keys are ConfigErrors."""
        sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in sections:
                raise ConfigError(f"unknown config key {key!r}; known keys are {', '.join(sections)}")
            if key in SECTIONS:
                kwargs[key] = _section_from_dict(SECTIONS[key], key, value)
            else:
                kwargs[key] = value
        return RunConfig(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    # --- validation --------------------------------------------------------------

    def validate(self) -> "RunConfig":
        """Raise ConfigError for the first value that cannot work (config/assemble.py). Needs
        no process group: checks that depend on the world size (fsdp=-1) are repeated once
        it is known."""
        return _assembler().validate(self)

    def plan(self, world: int | None, fill: int | None = None):
        """The Plan of this config for `world` ranks (None: the product of the fixed sizes,
        with a -1 axis taken as `fill`)."""
        return _assembler().plan(self, world, fill)

    def notes(self, mesh) -> list[str]:
        """One line per setting that does nothing on `mesh` (the resolved layout), said at
        the start of fit and in plan rather than refused: a preset's keys run at another
        size or with one axis overridden (a setting that can never act is a ConfigError)."""
        p, out = self.parallel, []
        default = ParallelConfig.__dataclass_fields__["pp_schedule"].default
        if p.pp == 1 and p.pp_schedule != default:
            out.append(f"note: parallel.pp_schedule={p.pp_schedule} does nothing with parallel.pp=1 (no pipeline "
                       "to schedule); set parallel.pp > 1 to run it")
        if p.zero != 3 and mesh.fsdp * mesh.cp == 1:
            out.append(f"note: parallel.zero={p.zero} does nothing at world size {mesh.world}: parallel.fsdp=-1 takes "
                       f"{mesh.fsdp} rank (parallel.cp={mesh.cp}), so no optimizer state is sharded")
        if p.pp_keep_gathered and p.pp > 1 and mesh.fsdp * mesh.cp == 1:
            out.append(f"note: parallel.pp_keep_gathered=true does nothing at world size {mesh.world}: "
                       f"parallel.fsdp=-1 takes {mesh.fsdp} rank (parallel.cp={mesh.cp}), so no stage weights are "
                       "sharded")
        return out

    # --- what the run is built from ----------------------------------------------

    def family_config(self):
        """The model family's own config (LlamaConfig, GPT2Config)."""
        return self.model.family_config()

    def model_def(self):
        return _assembler().model_def(self)

    def rules(self):
        return _assembler().rules(self)

    def mesh_spec(self, fill: int | None = None):
        """The MeshSpec of parallel.*; `fill` replaces a -1 axis (None keeps -1)."""
        return _assembler().mesh_spec(self, fill)

    def check_batch_at(self, mesh) -> None:
        """accumulation_steps for a resolved mesh, naming the -1 axis that took the world's ranks."""
        p, t = self.parallel, self.train
        dp_size = mesh.dp * mesh.fsdp
        filled = [a for a in ("dp", "fsdp") if getattr(p, a) == -1]
        if filled and t.global_batch % (t.micro_batch * dp_size):
            per = t.micro_batch * dp_size
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by train.micro_batch={t.micro_batch} x "
                f"data-parallel size {dp_size} (parallel.dp={mesh.dp} x parallel.fsdp={mesh.fsdp}, where "
                f"parallel.{filled[0]}=-1 takes the ranks left of world size {mesh.world}; "
                f"parallel.nproc_per_node={p.nproc_per_node}) = {per} sequences per micro-step: choose a "
                f"global_batch that is a multiple of {per}, a smaller micro_batch, or fewer ranks "
                "(parallel.nproc_per_node, the launcher's, or meshtrain plan --world)")
        self.accumulation_steps(dp_size)

    def accumulation_steps(self, dp_size: int) -> int:
        """Micro-steps per optimizer step for `dp_size` data-parallel ranks (dp * fsdp)."""
        t = self.train
        if t.global_batch % (t.micro_batch * dp_size):
            raise ConfigError(batch_message(t, self.parallel.dp, dp_size // max(self.parallel.dp, 1), dp_size))
        m = t.global_batch // (t.micro_batch * dp_size)
        if self.parallel.pp > 1:
            check_micro_batches(self.parallel, m, t, dp_size)
        return m


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig}


def _section_from_dict(cls, key: str, value: Any):
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a mapping of its fields, got {value!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in value if k not in names]
    if unknown:
        raise ConfigError(f"unknown config key {key}.{unknown[0]}; {key} has {', '.join(names)}")
    value = dict(value)
    if cls is ModelConfig and value.get("moe") is not None:
        from ..models.moe import MoeConfig

        value["moe"] = _section_from_dict(MoeConfig, "model.moe", value["moe"])
    return cls(**value)


def batch_message(t: TrainConfig, dp: int, fsdp: int, dp_size: int) -> str:
    per_micro = t.micro_batch * dp_size
    return (f"train.global_batch={t.global_batch} is not divisible by train.micro_batch={t.micro_batch} x "
            f"data-parallel size {dp_size} (parallel.dp={dp} x parallel.fsdp={fsdp}) = {per_micro} sequences "
            f"per micro-step: choose a global_batch that is a multiple of {per_micro}, or a smaller micro_batch")


def check_micro_batches(p: ParallelConfig, m: int, t: TrainConfig, dp_size: int) -> None:
    """The micro-batch count m = global_batch / (micro_batch x dp x fsdp) against the schedule."""
    if p.pp_schedule == "interleaved" and m % p.pp:
        good = t.micro_batch * dp_size * p.pp * -(-m // p.pp)
        raise ConfigError(f"parallel.pp_schedule=interleaved needs the micro-batch count (train.global_batch="
                          f"{t.global_batch} / (train.micro_batch={t.micro_batch} x data-parallel size {dp_size}) = "
                          f"{m}) to be a multiple of parallel.pp={p.pp}: change global_batch (e.g. {good}) or "
                          "micro_batch so that it is")



def _assembler():
    # The assembler imports the model, layout and pipeline code (torch); importing the
    # config, to parse or print one, must not.
    from . import assemble

    return assemble
