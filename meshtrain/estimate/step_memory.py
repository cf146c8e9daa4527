"""Per-rank memory of a run config's training step, and the devices it is checked against.

`step_memory` is what `meshtrain plan` reports and what its advice (`advice.py`) compares
against a device: the most loaded rank's bytes (`memory.py`), or under pp the most loaded
pp rank's (`estimate.pipeline`), with the config's micro-batch, precision, checkpointing
and compile setting, and its parameter traffic (`ParallelConfig.traffic`).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import RunConfig
from .compute import mask_keys
from .hardware_builtins import BUILTINS
from .memory import per_rank_memory
from .pipeline import pipeline_estimate

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "peak")  # what a plan reports per rank
# What offload moved to host memory (train.activation_checkpointing offload, train.optimizer_offload).
HOST_KEYS = ("host_activations", "host_saved_weights", "host_optimizer")
# Device memory in bytes of the built-in devices (hardware_builtins.py: data-sheet capacities).
GPU_MEMORY = {name: hw.memory_bytes for name, hw in BUILTINS.items()}


def step_memory(cfg: RunConfig, plan, model, keep_gathered: bool | None = None,
                memory_only: bool = False, collectives_only: bool = False) -> tuple[dict, object | None]:
    """(memory of the most loaded rank, PipelineEstimate or None) of `cfg` (validated) on
    `plan`; under pp the memory also names its `pp_rank`. `keep_gathered`: under pp, in
    place of parallel.pp_keep_gathered (the plan weighs both). `memory_only`: under pp, a
    PipelineEstimate without collectives (cheaper); `collectives_only`, without memory
    (the layout search's timing of a layout it planned)."""
    t, p, traffic = cfg.train, cfg.parallel, cfg.parallel.traffic()
    micro_steps = cfg.accumulation_steps(plan.mesh.dp * plan.mesh.fsdp)
    if plan.mesh.pp > 1:  # ranks differ by stage: report the most loaded
        if keep_gathered is not None:  # off: ZeRO-3 (parallel.zero 1 under pp is keep_gathered)
            traffic = replace(traffic, keep_gathered=keep_gathered, zero=traffic.zero if keep_gathered else 3)
        pipeline = pipeline_estimate(plan, model, pp_schedule=p.pp_schedule, virtual=p.pp_virtual, layout=p.pp_layout,
                                     micro_batch=t.micro_batch, seq_len=t.seq_len, micro_steps=micro_steps,
                                     precision=t.precision, compiled=bool(t.compile),
                                     activation_checkpointing=t.activation_checkpointing, traffic=traffic,
                                     mask_keys=mask_keys(cfg, plan.mesh.cp), memory_only=memory_only,
                                     collectives_only=collectives_only,
                                     optimizer=t.optimizer, optimizer_offload=t.optimizer_offload)
        return {**pipeline.most_loaded["memory"], "pp_rank": pipeline.most_loaded["pp_rank"]}, pipeline
    if micro_steps <= 1:  # one micro-step: no whole gradients to hold between micro-steps
        traffic = replace(traffic, fsdp_accumulate="sharded")
    memory = per_rank_memory(plan, model, micro_batch=t.micro_batch, seq_len=t.seq_len, precision=t.precision,
                             activation_checkpointing=t.activation_checkpointing, traffic=traffic, device="cuda",
                             mask_keys=mask_keys(cfg, plan.mesh.cp),  # a plan is for GPUs: fused attention kernels
                             optimizer=t.optimizer, optimizer_offload=t.optimizer_offload)
    return memory, None
