"""Expert parallelism: routed token rows travel to the ranks holding their experts by one
all-to-all with uneven splits, and come back by another (autograd mirrors both).

The ep group is drawn from the fsdp x cp ranks (the expert mesh refolds them), so the
tokens an ep group exchanges are those its ranks already hold for the dense layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class AllToAllExchange:
    """One MoE call's dispatch and combine over `group` (ep ranks, each holding
    num_experts / ep consecutive experts)."""

    def __init__(self, group, ep: int, num_experts: int):
        self.group, self.ep, self.local_experts = group, ep, num_experts // ep

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every rank first learns how many rows each peer sends to each of its experts.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.ep, self.local_experts)
        self.send = counts.view(self.ep, self.local_experts).sum(1).tolist()
        self.recv = received.sum(1).tolist()
        arrived = funcol.all_to_all_single_autograd(rows, self.recv, self.send, self.group)
        # Rows arrive by source rank, then expert; the grouped GEMM wants them by expert.
        expert = torch.arange(self.local_experts, device=counts.device).repeat(self.ep)
        self.order = expert.repeat_interleave(received.flatten()).argsort(stable=True)
        return arrived[self.order], received.sum(0)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        back = rows[self.order.argsort()]
        return funcol.all_to_all_single_autograd(back, self.send, self.recv, self.group)


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over `group` backward. Applied where
    replicated inputs meet tp-split expert weights, so each tp rank's partial gradient is
    summed before it meets the replicated router path (Megatron's f operator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
