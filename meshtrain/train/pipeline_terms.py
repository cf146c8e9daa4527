"""The pipeline step's per-step terms beyond the loss, gathered from the ranks that hold
them: MoE blocks' bias updates and load imbalance, and multi-token prediction's loss
(held by the last stage's rank), each over the pp group. `pipe` is the step's _Pipe
(train/pipeline_step.py): its stages, pp group and model."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout.placements import local_tensor
from ..pipeline.partition import Stage
from .step import MoeTerms, TrainState, full_value, moe_step


def moe_blocks(pipe, stage: Stage, moe_layers) -> list[str]:
    """The prefixes of a stage's MoE blocks in the order it runs them (the last stage's
    multi-token prediction modules after its layers)."""
    blocks = [f"layers.{i}." for i in range(*stage.layers) if i in moe_layers]
    if stage.has_head:
        blocks += [b for b in pipe.model.family.moe_blocks(pipe.model.cfg) if not b.startswith("layers.")]
    return blocks


def pp_sum(total, depth: int, pipe) -> torch.Tensor:
    """Each depth's loss, held by the last stage's rank, summed over the pp group."""
    out = torch.zeros(depth) if total is None else local_tensor(total).detach().float().cpu().clone()
    dist.all_reduce(out, group=pipe.group)
    return out


def moe_metrics(state: TrainState, pipe, moe: MoeTerms, moe_layers, updated: bool) -> dict:
    """Bias updates and load imbalance of this rank's MoE blocks; the metrics of all of
    them (max imbalance, summed terms) over the pp group."""
    stats = torch.zeros(2)  # (worst imbalance, objective terms) of this rank's stages
    if moe.load:
        order = sorted(moe.load)
        layers = [b for s in order for b in moe_blocks(pipe, pipe.stages[s], moe_layers)]
        load = torch.cat([full_value(moe.load[s]) for s in order])
        stats[0] = moe_step(state, pipe.model.cfg.moe, layers, load, updated).max()
    if moe.total is not None:
        stats[1] = full_value(moe.total)
    imbalance = stats[:1].clone()
    dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=pipe.group)
    dist.all_reduce(stats, group=pipe.group)
    out = {"expert_imbalance": float(imbalance)}
    if pipe.model.cfg.moe.balance == "aux" or pipe.model.cfg.moe.z_loss_coef:
        out["aux_loss"] = float(stats[1])
    return out
