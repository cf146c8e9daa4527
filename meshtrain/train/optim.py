"""AdamW over sharded parameters, and the global gradient norm.

Both work on each rank's local shards: optimizer state lives with the shard it updates
(ZeRO), and the update is elementwise so it needs no communication. The norm needs one
scalar all-reduce over the whole world.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..layout.placements import local_tensor


@dataclass(frozen=True)
class AdamW:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    # Parameters that are never decayed: 1-D tensors (norm scales, biases) by rule, plus
    # any name matching these globs.
    no_decay: tuple[str, ...] = field(default_factory=tuple)
    # train.optimizer_offload: the moments in host memory (pinned on CUDA), the clip and
    # the update run there on copies of the shards (host_update).
    offload: bool = False

    def decays(self, name: str, ndim: int) -> bool:
        return ndim >= 2 and not any(fnmatch.fnmatchcase(name, g) for g in self.no_decay)

    def init_state(self, params: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        return init_state(params, self.offload)

    def updater(self, grad_clip: float | None, wrap=None):
        """`update(state, names, grads, lr, norm)`: clip the local gradients `grads` of the
        trainable parameters `names` by the global `norm`, then AdamW at `lr` (state.step
        already counts this step). `wrap` (torch.compile's) wraps the tensor arithmetic."""
        arithmetic = clipped_adamw(self)
        if wrap is not None:
            arithmetic = wrap(arithmetic)

        def update(state, names: list[str], grads: list[torch.Tensor], lr: float, norm: torch.Tensor) -> None:
            params = [local_tensor(state.params[n]).data for n in names]
            exp_avg = [local_tensor(state.optimizer["exp_avg"][n]) for n in names]
            exp_avg_sq = [local_tensor(state.optimizer["exp_avg_sq"][n]) for n in names]
            decay = [self.decays(n, state.params[n].ndim) for n in names]
            args = (params, grads, exp_avg, exp_avg_sq, decay, torch.tensor(lr, dtype=torch.float32),
                    torch.tensor(float(state.step)), norm, grad_clip)
            if self.offload:
                host_update(arithmetic, *args)
            else:
                arithmetic(*args)

        return update


def clipped_adamw(optimizer: AdamW):
    """The clip and the AdamW update on local tensors, as one function to compile."""

    def update(params, grads, exp_avg, exp_avg_sq, decay, lr, step, norm, clip):
        if clip is not None:
            torch._foreach_mul_(grads, torch.clamp(clip / (norm + 1e-6), max=1.0))
        adamw_update(params, grads, exp_avg, exp_avg_sq, decay, lr, step,
                     optimizer.betas, optimizer.eps, optimizer.weight_decay)

    return update


def init_state(params: dict[str, torch.Tensor], offload: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """exp_avg and exp_avg_sq with the same layout as each parameter; `offload`
    (train.optimizer_offload): their local shards in host memory (pinned when the
    parameters are on CUDA), a DTensor keeping the parameter's mesh and placements."""
    zeros = _host_zeros if offload else (lambda p: torch.zeros_like(p, requires_grad=False))
    return {"exp_avg": {n: zeros(p) for n, p in params.items()},
            "exp_avg_sq": {n: zeros(p) for n, p in params.items()}}


def _host_zeros(p: torch.Tensor) -> torch.Tensor:
    local = p._local_tensor if isinstance(p, DTensor) else p
    host = torch.zeros(local.shape, dtype=local.dtype, pin_memory=local.device.type == "cuda")
    if not isinstance(p, DTensor):
        return host
    return DTensor.from_local(host, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def host_update(update, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                *args) -> None:
    """update(params, grads, exp_avg, *args) run where the moments live (host memory,
    train.optimizer_offload): the gradients and parameter shards copied there (a copy on
    CPU, where host and device are one memory), updated with the same ops, and the
    parameters copied back."""
    host = exp_avg[0].device if exp_avg else torch.device("cpu")
    on_host = [p.to(host, copy=True) for p in params]
    update(on_host, [g.to(host, copy=True) for g in grads], exp_avg,
           *(a.to(host) if isinstance(a, torch.Tensor) else a for a in args))
    torch._foreach_copy_(params, on_host)


def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
                 exp_avg_sq: list[torch.Tensor], decay: list[bool], lr: torch.Tensor, step: torch.Tensor,
                 betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """In-place AdamW on local tensors (decoupled weight decay, bias correction)."""
    beta1, beta2 = betas
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    decayed = [p for p, d in zip(params, decay) if d]
    if decayed and weight_decay:
        torch._foreach_mul_(decayed, 1 - lr * weight_decay)
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denom, bias2.sqrt())
    torch._foreach_add_(denom, eps)
    updates = torch._foreach_div(exp_avg, denom)
    torch._foreach_mul_(updates, -lr / bias1)
    torch._foreach_add_(params, updates)


def grad_norm_squared_local(grads: list[torch.Tensor], replicas: list[float]) -> torch.Tensor:
    """This rank's share of the squared global norm: each local shard's sum of squares,
    divided by how many ranks hold an identical copy of it, so that summing the shares
    over all ranks counts every element once. A few kernels whatever the parameter count
    (it runs eager: see make_update)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    squares = torch.stack(torch._foreach_norm(grads, 2)).float().pow(2)
    return (squares / torch.tensor(replicas, dtype=torch.float32, device=squares.device)).sum()


def replica_count(p: torch.Tensor) -> float:
    """Ranks holding identical copies of this tensor's local shard."""
    if not isinstance(p, DTensor):
        return 1.0
    sharded = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if isinstance(pl, (Shard, _StridedShard)))
    return p.device_mesh.size() / sharded


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(x, "sum", dist.group.WORLD)
    return x
