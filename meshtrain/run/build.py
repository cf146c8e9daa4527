"""One builder for every layout of a run: from the config, the plan and this rank, the
mesh, this rank's parameters, the training step, the evaluation step and the batch
layout (one process, sharded, or pipelined)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import RunConfig
from ..interop.hf import load_hf_params
from ..models.spec import init_slice
from ..parallel.init import init_params
from ..pipeline import partition
from ..pipeline.schedule import build_pipeline_schedule
from ..train import pipeline_step
from ..train.optim import AdamW
from ..train.lr_schedule import LRSchedule
from ..train.step import make_eval_step, make_train_step
from .rows import RowSlice


@dataclass
class Built:
    mesh: object | None  # the DeviceMesh; None in one process
    params: dict[str, torch.Tensor]  # this rank's parameters (DTensors under a mesh), requiring grad where trainable
    step_fn: Callable  # (TrainState, batch) -> metrics
    eval_fn: Callable  # (params, batch) -> mean loss per token
    rows: RowSlice  # which rows and columns of each micro-batch this rank reads
    notes: list[str]  # what the start did that the run's opening lines should say


def build_run(cfg: RunConfig, model, plan, world: int, device: torch.device, accumulation: int, micro_rows: int,
              init_from: str | None) -> Built:
    """`init_from`: a Hugging Face directory to start from (None: random initialisation
    from cfg.seed); each rank reads only the slices of its own shards."""
    t = cfg.train
    if plan.mesh.pp > 1:
        return _pipelined(cfg, model, plan, device, accumulation, micro_rows, init_from)
    options = dict(precision=t.precision, compile=t.compile, fp8_recipe=t.fp8_recipe)
    notes: list[str] = []
    if world == 1:
        if init_from:
            params = _start_from(init_from, cfg, model, notes, device=device)
            params = {n: x.requires_grad_(model.specs[n].trainable) for n, x in params.items()}
        else:
            params = {n: init_slice(s, n, cfg.seed, device=device).requires_grad_(s.trainable)
                      for n, s in model.specs.items()}
        return Built(None, params, make_train_step(model, **step_options(cfg)), make_eval_step(model, **options),
                     RowSlice(plan, None, micro_rows, t.seq_len, _mtp_depth(cfg)), notes)
    mesh = plan.mesh.build(device.type)
    if init_from:
        params = _start_from(init_from, cfg, model, notes, plan, mesh, device)
    else:
        params = init_params(plan, mesh, cfg.seed, device=device)
    return Built(mesh, params, make_train_step(model, plan, mesh, **step_options(cfg), traffic=cfg.parallel.traffic()),
                 make_eval_step(model, plan, mesh, **options), RowSlice(plan, mesh, micro_rows, t.seq_len, _mtp_depth(cfg)), notes)


def _start_from(init_from: str, cfg: RunConfig, model, notes: list[str], plan=None, mesh=None, device=None,
                names=None) -> dict:
    """The parameters read from a Hugging Face directory; those of a group its files hold
    no tensor of (interop's `seeded`: DeepSeek-V3's MTP modules) from cfg.seed, said in
    `notes`."""
    params = load_hf_params(init_from, cfg.model.arch, cfg.family_config(), plan, mesh, device, names=names)
    missing = [n for n in (model.specs if names is None else names) if n not in params]
    if missing:
        if plan is None:
            params.update({n: init_slice(model.specs[n], n, cfg.seed, device=device) for n in missing})
        else:
            params.update(init_params(plan, mesh, cfg.seed, device=device, names=missing))
        groups = sorted({".".join(n.split(".")[:2]) for n in missing})
        notes.append(f"model.init_from={init_from}: its files hold no weights for {', '.join(groups)} (which "
                     f"config.json announces): these {len(missing)} parameters start from seed {cfg.seed}")
    return params


def _pipelined(cfg: RunConfig, model, plan, device, accumulation: int, micro_rows: int, init_from) -> Built:
    """parallel.pp > 1: this rank's stages, their parameters (sharded on the non-pp
    sub-mesh, if any), the schedule's step and the forward-only evaluation."""
    t, p = cfg.train, cfg.parallel
    mesh = plan.mesh.build(device.type)
    stages = partition(model, plan.mesh.pp, p.pp_virtual, p.pp_layout, seq_len=t.seq_len, micro_batch=t.micro_batch)
    names, sub_plan, sub_mesh = pipeline_step.local_stage_layout(plan, mesh, stages)
    notes: list[str] = []
    if init_from:
        params = _start_from(init_from, cfg, model, notes, sub_plan, sub_mesh, device, names)
    elif sub_plan is not None:
        params = init_params(sub_plan, sub_mesh, cfg.seed, device=device, names=names)
    else:
        params = {n: init_slice(model.specs[n], n, cfg.seed, device=device) for n in names}
    params = {n: x.requires_grad_(model.specs[n].trainable) for n, x in params.items()}
    options = step_options(cfg)
    pipeline_schedule = build_pipeline_schedule(p.pp_schedule, plan.mesh.pp, accumulation, p.pp_virtual)
    step_fn = pipeline_step.make_pipeline_step(model, stages, pipeline_schedule, plan, mesh,
                                               optimizer=options["optimizer"],
                                               lr_schedule=options["lr_schedule"], precision=t.precision,
                                               grad_clip=options["grad_clip"], fp8_recipe=t.fp8_recipe,
                                               activation_checkpointing=t.activation_checkpointing,
                                               compile=t.compile, traffic=cfg.parallel.traffic(),
                                               loss_scale=t.loss_scale, optimizer_offload=t.optimizer_offload)
    eval_fn = pipeline_step.make_pipeline_eval(model, stages, plan.mesh.pp, accumulation, plan, mesh,
                                               precision=t.precision, fp8_recipe=t.fp8_recipe)
    return Built(mesh, params, step_fn, eval_fn, RowSlice(sub_plan, sub_mesh, micro_rows, t.seq_len, _mtp_depth(cfg)), notes)


def _mtp_depth(cfg: RunConfig) -> int:
    return cfg.model.mtp.depth if cfg.model.mtp is not None else 0


def step_options(cfg: RunConfig) -> dict:
    t = cfg.train
    return dict(optimizer=AdamW(lr=t.lr, weight_decay=t.weight_decay),
                lr_schedule=LRSchedule(lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.steps,
                                       kind=t.lr_schedule),
                precision=t.precision, grad_clip=t.grad_clip or None, compile=t.compile, fp8_recipe=t.fp8_recipe,
                activation_checkpointing=t.activation_checkpointing, loss_scale=t.loss_scale,
                optimizer_offload=t.optimizer_offload)
