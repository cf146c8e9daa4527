"""The checkpoint.* section of a run config, checked here."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, check_bool, check_int


@dataclass
class CheckpointConfig:
    """Checkpoints: torch.distributed.checkpoint directories <run_dir>/checkpoints/step_XXXXXXXX/ with parameters, optimizer state, step, data position and RNG states."""

    every: int = 0
    """Save a checkpoint every this many steps; 0: only at the end. A run always saves when it ends (train.steps or train.stop_at) or is stopped by SIGINT/SIGTERM, so the same command resumes it."""
    keep_last: int = 2
    """How many of the newest complete checkpoints to keep."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in <run_dir>/checkpoints if there is one; none: start at step 0 in a run_dir that holds no run (refused where one has checkpoints or metrics); restart: first move the run in run_dir into <run_dir>/previous/<UTC time>/, then start at step 0; or the path of a checkpoint directory to continue from."""
    async_save: bool = False
    """Write checkpoints in the background: the step waits only while the state is copied to host memory (reused buffers, pinned on GPUs), then a thread writes and commits the checkpoint while training goes on; it becomes the latest only once every rank has written and the atomic rename is done. At most one save in flight: the next save, the end of the run, a stop signal, an error and the export wait for it (and report its failure as a synchronous save would). Off by default on CPU, where the writer shares the cores training uses and the copy costs as much memory as the state; the GPU presets turn it on."""
    export: bool = False
    """At the end of fit, write the weights as a Hugging Face model directory (safetensors, config.json, generation_config.json, tokenizer files) into <run_dir>/export/, in fp32 for fp32 runs and bf16 otherwise."""

    def check(self) -> "CheckpointConfig":
        """Raise ConfigError naming the checkpoint.* key and the fix for a value that cannot work."""
        check_int(self.every, "checkpoint.every", 0)
        check_int(self.keep_last, "checkpoint.keep_last", 1)
        check_bool(self.export, "checkpoint.export")
        check_bool(self.async_save, "checkpoint.async_save")
        if not isinstance(self.resume, str) or not self.resume:
            raise ConfigError(f"checkpoint.resume={self.resume!r}: give auto, none, restart, or a checkpoint directory")
        return self

