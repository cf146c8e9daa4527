"""What an eager step on a sharded mesh costs the host per kernel, measured for
`meshtrain calibrate` (the Hardware's `sharded_launch_s`: DTensor's dispatch and the
runtime's hooks): a Llama so small that its kernels take next to nothing (`tiny_config`),
trained on fsdp over the calibrating ranks. `step_times` times its step in each rank;
`sharded_launch_seconds` finds the cost per kernel at which the step-time model, reading
everything else calibrate measured (its collectives among them), predicts that time."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..estimate.dryrun import dry_run
from ..estimate.hardware import Hardware
from ..parallel.init import init_params
from ..train.muon import optimizer_of
from ..train.step import TrainState, make_train_step
from .build import step_options

_ROWS, _SEQ = 2, 16  # per rank


def tiny_config(world: int) -> RunConfig:
    """The tiny step's run: fsdp over `world` ranks of one machine, one micro-batch, no
    clipping."""
    return RunConfig.from_dict({
        "model": {"arch": "llama", "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64,
                  "vocab_size": 64, "max_seq_len": _SEQ},
        "parallel": {"fsdp": world, "nproc_per_node": world},  # one machine: the link calibrate measured
        "train": {"global_batch": _ROWS * world, "micro_batch": _ROWS, "seq_len": _SEQ, "precision": "fp32",
                  "grad_clip": 0.0, "lr": 1e-4, "warmup_steps": 0}})


def tiny_step(device: torch.device):
    """The tiny step, built on this rank of an initialised process group: a callable that
    runs one step (`step_times` times it)."""
    world = dist.get_world_size()
    cfg = tiny_config(world)
    model, plan = cfg.model_def(), cfg.plan(world)
    mesh = plan.mesh.build(device.type)
    step = make_train_step(model, plan, mesh, **step_options(cfg), traffic=cfg.parallel.traffic())
    state = TrainState.create(init_params(plan, mesh, seed=0, device=device), optimizer_of(cfg.train))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, _ROWS * world, _SEQ + 1), generator=g).to(device)
    batch = {"tokens": tokens[..., :-1], "targets": tokens[..., 1:]}
    return lambda: step(state, batch)


def step_times(run, device: torch.device, repeats: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `repeats` calls of `run` (tiny_step's) after `warmup`, each
    started after a barrier."""
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def sharded_launch_seconds(hw: Hardware, measured: float, world: int, tolerance: float = 1e-3) -> float:
    """The sharded_launch_s at which the model's tiny step on `hw` takes `measured`
    seconds (0 if it takes that long without any): the model's step grows with it, so
    bisect, to `tolerance` of the measured step."""
    cfg = tiny_config(world)

    def modelled(launch: float) -> float:
        return dry_run(cfg, world, dataclasses.replace(hw, sharded_launch_s=launch)).time["step_s"]

    lo, hi = (0.0, modelled(0.0)), (measured, modelled(measured))
    if lo[1] >= measured:
        return 0.0
    while hi[1] < measured:  # a launch may hide behind the device's work: reach further
        lo, hi = hi, (2 * hi[0], modelled(2 * hi[0]))
    while hi[1] - lo[1] > tolerance * measured:
        mid = (lo[0] + hi[0]) / 2
        point = (mid, modelled(mid))
        lo, hi = (point, hi) if point[1] < measured else (lo, point)
    return (lo[0] + hi[0]) / 2
