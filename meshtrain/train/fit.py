"""`fit(cfg)`: train a model from a RunConfig, in one process or under a launcher.

One process: no process group; the model runs on one device with plain tensors (the
reference path every layout is tested against). Under torchrun, or any launcher that sets
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, every rank joins one process group (gloo on
CPU, nccl on CUDA) and the parameters are DTensors laid out by the plan. Every rank
builds the same global batch from (seed, step); the layout keeps each rank's part.

Rank 0 writes `<run_dir>/config.yaml` (the merged config), `<run_dir>/plan.json` and
`<run_dir>/metrics.jsonl` (one JSON object per logged step).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..errors import ConfigError
from ..models.spec import init_slice
from ..parallel.plan import make_plan
from .optim import AdamW
from .schedule import LRSchedule
from .step import TrainState, make_train_step

# Seconds a collective may wait for a peer before the run fails instead of hanging.
DEFAULT_DIST_TIMEOUT_S = 600


@dataclass(frozen=True)
class _Ranks:
    rank: int
    world: int
    local_rank: int
    launched: bool  # started by a launcher (env) or inside an existing process group


def _ranks(cfg: RunConfig) -> _Ranks:
    env = os.environ
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return _Ranks(rank, world, int(env.get("LOCAL_RANK", rank)), True)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_world = env.get("LOCAL_WORLD_SIZE")
        nproc = cfg.parallel.nproc_per_node
        if nproc > 1 and local_world is not None and int(local_world) != nproc:
            raise ConfigError(f"parallel.nproc_per_node={nproc}, but the launcher started {local_world} "
                              f"processes on this node: under a launcher its --nproc_per_node decides; set "
                              f"parallel.nproc_per_node to {local_world} (or 1) to match")
        if world > 1 and not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
            raise ConfigError(f"WORLD_SIZE={world} is set but MASTER_ADDR/MASTER_PORT are not: start the "
                              "ranks with torchrun (or set all four variables)")
        return _Ranks(rank, world, int(env.get("LOCAL_RANK", 0)), True)
    nproc = cfg.parallel.nproc_per_node
    if nproc > 1:
        raise ConfigError(f"parallel.nproc_per_node={nproc}, but this is a single process and launching "
                          f"the other ranks itself is not implemented yet: run it under torchrun for now, "
                          f"e.g. `torchrun --standalone --nproc_per_node {nproc} -m meshtrain.cli fit ...`, "
                          f"or set parallel.nproc_per_node to 1")
    return _Ranks(0, 1, 0, False)


def _dist_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("MESHTRAIN_DIST_TIMEOUT", DEFAULT_DIST_TIMEOUT_S)))


class _Log:
    """Rank 0's console and metrics file; every other rank's is silent."""

    def __init__(self, enabled: bool, run_dir: Path | None):
        self.enabled = enabled
        self.console = None
        self.metrics_path = None
        if enabled:
            from rich.console import Console

            self.console = Console(highlight=False, soft_wrap=True)
            self.metrics_path = run_dir / "metrics.jsonl"

    def print(self, *args, **kwargs) -> None:
        if self.console is not None:
            self.console.print(*args, **kwargs)

    def metrics(self, record: dict) -> None:
        if self.metrics_path is not None:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _format(record: dict, steps: int) -> str:
    width = len(str(steps))
    return (f"step {record['step']:>{width}}/{steps}  loss {record['loss']:.4f}  lr {record['lr']:.3e}  "
            f"grad_norm {record['grad_norm']:.3f}  tokens/s {record['tokens_per_s']:,.0f}")


def fit(cfg: RunConfig) -> list[dict]:
    """Train for cfg.train.steps steps. Returns the logged metrics (on every rank)."""
    cfg.validate()
    ranks = _ranks(cfg)
    model = cfg.model_def()
    # The plan and every layout error come before any process group exists.
    plan = make_plan(model.specs, cfg.rules(), cfg.mesh_spec(), world=ranks.world)
    dp_size = plan.mesh.dp * plan.mesh.fsdp
    accumulation = cfg.accumulation_steps(dp_size)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", ranks.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    created_group = False
    if ranks.world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=_dist_timeout(),
                                **({"device_id": device} if cuda else {}))
        created_group = True
    try:
        return _train(cfg, ranks, model, plan, accumulation, dp_size, device)
    finally:
        if created_group:
            dist.destroy_process_group()


def _train(cfg: RunConfig, ranks: _Ranks, model, plan, accumulation: int, dp_size: int,
           device: torch.device) -> list[dict]:
    t = cfg.train
    run_dir = Path(cfg.run_dir)
    log = _Log(ranks.rank == 0, run_dir)
    if ranks.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        (run_dir / "plan.json").write_text(plan.to_json() + "\n")
        metrics_path = run_dir / "metrics.jsonl"
        if metrics_path.exists():
            log.print(f"[yellow]{metrics_path} exists: starting over from step 0 (checkpoints are not "
                      f"implemented yet, so there is nothing to resume), the old metrics are replaced[/]")
        metrics_path.write_text("")

    if ranks.world == 1:
        params = {n: init_slice(s, n, cfg.seed, device=device).requires_grad_() for n, s in model.specs.items()}
        step = make_train_step(model, **_step_options(cfg))
    else:
        from ..parallel.init import init_params

        mesh = plan.mesh.build(device.type)
        params = init_params(plan, mesh, cfg.seed, device=device)
        step = make_train_step(model, plan, mesh, **_step_options(cfg))
    state = TrainState.create(params)

    from ..data import BuiltinData

    data = BuiltinData(t.global_batch, t.seq_len, cfg.seed)
    n_params = sum(s.numel for s in model.specs.values())
    mesh_desc = " x ".join(f"{a}={plan.mesh.size(a)}" for a in plan.mesh.axes)
    log.print(f"[bold]meshtrain fit[/] {cfg.model.arch} {n_params / 1e6:.2f}M params | world {ranks.world} "
              f"({mesh_desc}) on {device.type} | batch {t.global_batch} x {t.seq_len} tokens = "
              f"{accumulation} micro-step(s) of {t.micro_batch} per data-parallel rank x {dp_size} | "
              f"{t.precision}{', compiled' if t.compile else ''} | {run_dir}")

    tokens_per_step = t.global_batch * t.seq_len
    history: list[dict] = []
    start = last_time = time.perf_counter()
    last_step = 0
    for i in range(t.steps):
        window = data.batch(i).to(device)
        shape = (accumulation, t.global_batch // accumulation, t.seq_len)
        batch = {"tokens": window[:, :-1].reshape(shape), "targets": window[:, 1:].reshape(shape)}
        metrics = step(state, batch)
        done = i + 1
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(f"the loss is {metrics['loss']} at step {done}: training diverged; "
                                     f"try a lower train.lr or train.precision fp32")
        if done % t.log_every == 0 or done == t.steps:
            now = time.perf_counter()
            record = {"step": done, "loss": metrics["loss"], "lr": metrics["lr"],
                      "grad_norm": metrics["grad_norm"],
                      "tokens_per_s": tokens_per_step * (done - last_step) / (now - last_time),
                      "elapsed_s": now - start}
            last_time, last_step = now, done
            history.append(record)
            log.metrics(record)
            log.print(_format(record, t.steps))
    if history:
        log.print(f"done: {t.steps} steps in {time.perf_counter() - start:.1f} s, final loss "
                  f"{history[-1]['loss']:.4f}; metrics in {run_dir / 'metrics.jsonl'}")
    return history


def _step_options(cfg: RunConfig) -> dict:
    t = cfg.train
    return dict(optimizer=AdamW(lr=t.lr, weight_decay=t.weight_decay),
                schedule=LRSchedule(lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.steps,
                                    kind=t.lr_schedule),
                precision=t.precision, grad_clip=t.grad_clip or None, compile=t.compile)
