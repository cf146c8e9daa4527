"""Run a pipeline Schedule: each pp rank walks its own action list with real tensors.

First cut: pipeline parallelism alone (every rank of the world is one pp rank, plain
tensors, the model's LocalContext), Llama, untied embeddings, full backward (B; the
zero-bubble split BI/BW is not executed yet). Composition with FSDP and TP is the next
step. The semantics are the IR's (schedule.py): sends are posted without waiting
(isend), recvs block, and between two ranks sends and recvs match in posting order.

Loss and gradients are those of the non-pipelined step: every micro-batch's loss sum is
divided by the number of target tokens of the whole global batch, so gradients
accumulate over micro-batches exactly as `make_train_step` accumulates them; the
gradient norm is one all-reduce over the pp ranks (each parameter lives on one rank).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..models import ModelDef
from ..models.context import LocalContext
from ..train.optim import AdamW, adamw_update, grad_norm_squared_local
from ..train.schedule import LRSchedule
from ..train.step import PRECISIONS, TrainState
from .partition import Stage
from .schedule import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Schedule


def make_pipeline_step(model: ModelDef, stages: list[Stage], schedule: Schedule, *, optimizer: AdamW = AdamW(),
                       lr_schedule: LRSchedule | None = None, precision: str = "fp32",
                       grad_clip: float | None = 1.0) -> Callable[[TrainState, dict], dict]:
    """`step(state, batch) -> metrics` for this rank (dist rank = pp rank). state.params
    holds this rank's stages' parameters only; batch as for make_train_step (full
    (micro_steps, batch, seq) tensors on every rank)."""
    if model.family.__name__.rsplit(".", 1)[-1] != "llama" or model.cfg.tie_embeddings:
        raise ConfigError("parallel.pp > 1 runs untied Llama models for now: set model.tie_embeddings false")
    if any(a.kind not in (F, B, SEND_F, RECV_F, SEND_B, RECV_B) for acts in schedule.ranks for a in acts):
        raise ConfigError(f"parallel.pp_schedule={schedule.name}: split backward (zero bubble) is not executed yet; "
                          "choose gpipe, 1f1b or interleaved")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != schedule.pp:
        raise ConfigError(f"parallel.pp={schedule.pp} must equal the world size ({world}) for now: "
                          "pipeline parallelism does not compose with other axes yet")
    cfg, family = model.cfg, model.family
    ctx = LocalContext(PRECISIONS[precision])
    last = len(stages) - 1
    lr_schedule = lr_schedule or LRSchedule(lr=optimizer.lr, kind="constant")
    actions = schedule.ranks[rank]

    def stage_forward(stage: Stage, params, x):
        return family.forward_stage(cfg, params, x, ctx, stage.layers, stage.has_embedding, stage.has_head)

    def step(state: TrainState, batch: dict) -> dict:
        tokens, targets = batch["tokens"], batch["targets"]
        n_tokens = batch.get("num_targets") or int(sum((t >= 0).sum() for t in targets))
        rows, seq = tokens[0].shape
        inputs, outputs, out_grads, in_grads, pending = {}, {}, {}, {}, []
        loss = torch.zeros((), dtype=torch.float32)
        for a in actions:
            s, j, key = a.stage, a.micro, (a.stage, a.micro)
            if a.kind == RECV_F:
                buf = torch.empty(rows, seq, cfg.dim, dtype=ctx.compute_dtype or torch.float32)
                dist.recv(buf, src=a.peer)
                inputs[key] = buf.requires_grad_()
            elif a.kind == F:
                out = stage_forward(stages[s], state.params, tokens[j] if s == 0 else inputs[key])
                if s == last:
                    out = ctx.cross_entropy_sum(out, targets[j]) / n_tokens
                    loss += out.detach()
                outputs[key] = out
            elif a.kind == SEND_F:
                value = outputs[key].detach().contiguous()
                pending.append((dist.isend(value, dst=a.peer), value))
            elif a.kind == RECV_B:
                buf = torch.empty(rows, seq, cfg.dim, dtype=ctx.compute_dtype or torch.float32)
                dist.recv(buf, src=a.peer)
                out_grads[key] = buf
            elif a.kind == B:
                out = outputs.pop(key)
                out.backward(None if s == last else out_grads.pop(key))
                if s > 0:
                    in_grads[key] = inputs.pop(key).grad
            elif a.kind == SEND_B:
                value = in_grads.pop(key).contiguous()
                pending.append((dist.isend(value, dst=a.peer), value))
        for work, _ in pending:
            work.wait()
        names = list(state.params)
        params = [state.params[n].data for n in names]
        grads = [state.params[n].grad for n in names]
        with torch.no_grad():
            norm_sq = grad_norm_squared_local(grads, [1.0] * len(grads))
            dist.all_reduce(norm_sq)
            norm = norm_sq.sqrt()
            if grad_clip is not None:
                torch._foreach_mul_(grads, torch.clamp(grad_clip / (norm + 1e-6), max=1.0))
            lr = lr_schedule(state.step)
            state.step += 1
            adamw_update(params, grads, [state.optimizer["exp_avg"][n] for n in names],
                         [state.optimizer["exp_avg_sq"][n] for n in names],
                         [optimizer.decays(n, state.params[n].ndim) for n in names],
                         torch.tensor(lr, dtype=torch.float32), torch.tensor(float(state.step)),
                         optimizer.betas, optimizer.eps, optimizer.weight_decay)
            dist.all_reduce(loss)  # only the last stage's rank holds a non-zero loss
        for n in names:
            state.params[n].grad = None
        return {"loss": float(loss), "grad_norm": float(norm), "lr": lr}

    return step
