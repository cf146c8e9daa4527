"""What an eager step on a sharded mesh costs the host per kernel, measured for
`meshtrain calibrate` (the Hardware's `sharded_launch_s`): a Llama so small that its
kernels take next to nothing, trained on fsdp over the calibrating ranks; its median step
over the kernels the step-time model counts for it (estimate/step_work.py: each forward
kernel, and two per backward)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..estimate.hardware_builtins import BUILTINS
from ..estimate.step_work import WorkWalk, stretch_work
from ..estimate.walker import Walker
from ..layout.mesh import MeshSpec
from ..layout.plan import make_plan
from ..layout.rules import Rules
from ..models.family import build
from ..models.llama import LlamaConfig
from ..models.policy import Policy
from ..parallel.init import init_params
from ..train.optim import AdamW
from ..train.step import TrainState, make_train_step

_MODEL = LlamaConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16)
_ROWS, _SEQ = 2, 16  # per rank


def sharded_launch_seconds(device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Seconds per counted kernel of the tiny model's eager step on fsdp over every rank
    (call on each rank of an initialised process group)."""
    world = dist.get_world_size()
    model = build("llama", _MODEL)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=world), world=world)
    mesh = plan.mesh.build(device.type)
    optimizer = AdamW(lr=1e-4)
    step = make_train_step(model, plan, mesh, optimizer=optimizer)
    state = TrainState.create(init_params(plan, mesh, seed=0, device=device), optimizer)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, _MODEL.vocab_size, (1, _ROWS * world, _SEQ + 1), generator=g).to(device)
    batch = {"tokens": tokens[..., :-1], "targets": tokens[..., 1:]}
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        step(state, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / _kernels(plan, model)


def _kernels(plan, model) -> int:
    """Kernels the step-time model counts for the tiny step: 3 per forward kernel."""
    rules = Walker(plan, _ROWS * plan.mesh.world, _SEQ, 4, eager=False)
    walk = WorkWalk(rules, BUILTINS["h100"], "fp32", _SEQ, False, Policy.of("fp32"))
    blocks, ends = stretch_work(walk, model, list(range(_MODEL.n_layers)), True, True)
    return 3 * (blocks + ends).kernels
