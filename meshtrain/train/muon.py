"""Muon for the blocks' weight matrices, AdamW for the rest, over sharded parameters.

Computed as torch.optim.Muon computes it (torch 2.13, torch/optim/_muon.py), per matrix in
torch's (out_features, in_features) layout: the momentum buffer lerps toward the
(clipped) gradient, Nesterov's update lerps the gradient toward the buffer, Newton-Schulz
orthogonalises that update in bf16, and the weight decays by lr x weight_decay before it
moves by -adjusted_lr x the orthogonal update. A 3-D expert tensor (E, out, in) is E
matrices, each orthogonalised and its lr adjusted on its own (out, in).

Which parameters: every >= 2-D trainable tensor of the blocks (`layers.*`) and of the
multi-token prediction modules (`mtp.*`) but the MoE routers; the embeddings, the output
head, norms, biases and routers stay on AdamW with its rules (train/optim.py). The state
keeps Muon's buffer in its own group, "momentum", and AdamW's moments only for the rest.

Sharded: Newton-Schulz needs the whole matrix. By default (`assemble="owner"`) the
updates of the matrices of one shape, layout and mesh (one per block) are stacked and
redistributed so that each rank of the group holds whole ones (one all-to-all per mesh
dim that shards them), orthogonalised there and sent back in bf16 (as many all-to-alls):
each matrix is orthogonalised on one rank of its group, round-robin. `assemble="gather"`
gathers each matrix whole on every rank (`full_tensor`), orthogonalises it there and
takes this rank's slice (as `distribute_tensor` slices, without communication); a
strided or unsharded parameter always takes that path. Both give the same bits. This part
runs eager, also under train.compile: the exchanges are collectives on DTensors, and
eager bf16 matmuls are the reference's own rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..errors import ConfigError
from ..layout.placements import local_tensor
from .optim import AdamW, adamw_update, init_state

# torch.optim.Muon's (Keller Jordan's) quintic Newton-Schulz coefficients and epsilon.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
MUON_PREFIXES = ("layers.", "mtp.")  # the blocks and the multi-token prediction modules
ADAMW_SUFFIXES = (".router", ".expert_bias")  # MoE routers and the aux-free bias: AdamW's (or none)


@dataclass(frozen=True)
class Muon:
    """Muon for the blocks' matrices (see the module docstring), `adamw` for the rest.

    `lr` is the run's (AdamW's) peak lr, which the LR schedule scales; Muon's lr at step t
    is the schedule's lr x matrix_lr / lr (matrix_lr None: the schedule's lr itself).
    `weight_decay` None: AdamW's. `adjust_lr`: torch.optim.Muon's adjust_lr_fn."""

    adamw: AdamW = AdamW()
    matrix_lr: float | None = None
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: str = "original"
    weight_decay: float | None = None
    # Newton-Schulz's dtype: torch.optim.Muon's bf16; float32 (the API only) takes the
    # bf16 rounding out, which tests use to compare layouts' parameters closely.
    ns_dtype: torch.dtype = torch.bfloat16
    # How a sharded matrix is made whole: "owner" (the matrices of one shape and layout
    # stacked, each rank given whole ones by all-to-alls, orthogonalised there and sent
    # back) or "gather" (every rank of its mesh gathers it and runs Newton-Schulz).
    # bench/muon_cpu.py: owner's step 0.74 of gather's on fsdp2 x tp2+sp (CPU).
    assemble: str = "owner"

    @property
    def lr(self) -> float:
        return self.adamw.lr

    def lr_at(self, lr: float) -> float:
        """Muon's lr when the schedule gives AdamW `lr`."""
        return lr if self.matrix_lr is None else lr * (self.matrix_lr / self.adamw.lr)

    def decay(self) -> float:
        return self.adamw.weight_decay if self.weight_decay is None else self.weight_decay

    def init_state(self, params: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's moments for the parameters Muon leaves, Muon's buffer for its own."""
        rest = {n: p for n, p in params.items() if not is_muon(n, p)}
        state = init_state(rest)
        state["momentum"] = {n: torch.zeros_like(p, requires_grad=False) for n, p in params.items() if is_muon(n, p)}
        return state

    def updater(self, grad_clip: float | None, wrap=None):
        """`update(state, names, grads, lr, norm)` as AdamW.updater's: clip, AdamW for the
        rest and Muon's buffers (`wrap`ped: torch.compile), then Muon's orthogonal steps."""
        arithmetic = clipped_momentum(self)
        if wrap is not None:
            arithmetic = wrap(arithmetic)

        def update(state, names: list[str], grads: list[torch.Tensor], lr: float, norm: torch.Tensor) -> None:
            held = muon_state(self, state)
            rest = [i for i, n in enumerate(names) if n not in held]
            mine = [i for i, n in enumerate(names) if n in held]
            params = [local_tensor(state.params[names[i]]).data for i in rest]
            exp_avg = [local_tensor(state.optimizer["exp_avg"][names[i]]) for i in rest]
            exp_avg_sq = [local_tensor(state.optimizer["exp_avg_sq"][names[i]]) for i in rest]
            decay = [self.adamw.decays(names[i], state.params[names[i]].ndim) for i in rest]
            bufs = [local_tensor(held[names[i]]) for i in mine]
            updates = arithmetic(params, [grads[i] for i in rest], exp_avg, exp_avg_sq, decay,
                                 torch.tensor(lr, dtype=torch.float32), torch.tensor(float(state.step)), norm,
                                 grad_clip, [grads[i] for i in mine], bufs)
            step = owner_steps if self.assemble == "owner" else orthogonal_steps
            step(self, state.params, [names[i] for i in mine], updates or bufs, self.lr_at(lr))

        return update


def is_muon(name: str, p: torch.Tensor) -> bool:
    """Whether Muon updates the parameter `name` (see the module docstring)."""
    return p.is_floating_point() and muon_name(name, p.ndim)


def muon_name(name: str, ndim: int) -> bool:
    """Whether Muon updates a floating-point parameter `name` of `ndim` dims (the planner's
    question, from shapes alone)."""
    return name.startswith(MUON_PREFIXES) and ndim >= 2 and not name.endswith(ADAMW_SUFFIXES)


def muon_state(opt: Muon, state) -> dict[str, torch.Tensor]:
    """state.optimizer's Muon buffers. A state made for AdamW (TrainState.create without
    the optimizer) is made over for Muon before its first update; one that AdamW has
    already updated is refused: its moments are not Muon's."""
    if "momentum" not in state.optimizer:
        if state.step > 1:
            raise ConfigError("train.optimizer=muon: this state holds AdamW's moments after "
                              f"{state.step - 1} steps (a run or checkpoint of train.optimizer adamw), not Muon's "
                              "momentum: resume it with train.optimizer adamw, or start a fresh run")
        state.optimizer = opt.init_state(state.params)
    return state.optimizer["momentum"]


def clipped_momentum(opt: Muon):
    """The clip, AdamW on the rest and Muon's buffer update on local tensors, as one
    function to compile: returns the Nesterov updates (None without Nesterov: the
    buffers are the updates)."""
    beta = opt.momentum

    def update(params, grads, exp_avg, exp_avg_sq, decay, lr, step, norm, clip, muon_grads, bufs):
        if clip is not None:
            torch._foreach_mul_(grads + muon_grads, torch.clamp(clip / (norm + 1e-6), max=1.0))
        if params:
            a = opt.adamw
            adamw_update(params, grads, exp_avg, exp_avg_sq, decay, lr, step, a.betas, a.eps, a.weight_decay)
        if not bufs:
            return None
        torch._foreach_lerp_(bufs, muon_grads, 1 - beta)
        return torch._foreach_lerp(muon_grads, bufs, beta) if opt.nesterov else None

    return update


def orthogonal_steps(opt: Muon, params: dict, names: list[str], updates: list[torch.Tensor], lr: float) -> None:
    """Each matrix's decoupled decay and its step along its orthogonalised update, on this
    rank's shard (eager; the gathers are collectives in `names`' order, the same on
    every rank holding the parameters)."""
    decay = 1 - lr * opt.decay()
    for name, update in zip(names, updates):
        p = params[name]
        ortho = local_slice(p, orthogonalise(whole(p, update), opt.ns_steps, opt.ns_dtype))
        local = local_tensor(p).data
        local.mul_(decay)
        local.add_(ortho, alpha=-adjusted_lr(lr, opt.adjust_lr, tuple(p.shape[-2:])))


def owner_steps(opt: Muon, params: dict, names: list[str], updates: list[torch.Tensor], lr: float) -> None:
    """orthogonal_steps with each matrix orthogonalised on one rank of its group: the
    matrices of one shape, layout and mesh stacked, redistributed so that each rank holds
    whole ones (all-to-alls), orthogonalised, and sent back (in bf16). A strided or
    unsharded parameter takes orthogonal_steps."""
    groups: dict[tuple, list[int]] = {}
    rest = []
    for i, name in enumerate(names):
        p = params[name]
        if isinstance(p, DTensor) and all(type(x) in (Shard, Replicate) for x in p.placements) and \
                any(isinstance(x, Shard) for x in p.placements):
            groups.setdefault((tuple(p.shape), tuple(p.placements), p.device_mesh), []).append(i)
        else:
            rest.append(i)
    orthogonal_steps(opt, params, [names[i] for i in rest], [updates[i] for i in rest], lr)
    decay = 1 - lr * opt.decay()
    for (shape, placements, mesh), members in groups.items():
        stacked = (len(members),) + shape
        source = tuple(Shard(x.dim + 1) if isinstance(x, Shard) else x for x in placements)
        owned = tuple(Shard(0) if isinstance(x, Shard) else x for x in placements)
        mine = DTensor.from_local(torch.stack([updates[i] for i in members]), mesh, source, run_check=False,
                                  shape=torch.Size(stacked), stride=make_contiguous_strides_for(stacked))
        whole_local = stepwise(mine, owned, range(mesh.ndim)).to_local()
        ortho = orthogonalise(whole_local, opt.ns_steps, opt.ns_dtype) if whole_local.numel() else \
            whole_local.to(opt.ns_dtype)
        back = stepwise(DTensor.from_local(ortho, mesh, owned, run_check=False, shape=torch.Size(stacked),
                                           stride=make_contiguous_strides_for(stacked)),
                        source, reversed(range(mesh.ndim))).to_local()
        adjusted = adjusted_lr(lr, opt.adjust_lr, shape[-2:])
        for j, i in enumerate(members):
            local = local_tensor(params[names[i]]).data
            local.mul_(decay)
            local.add_(back[j], alpha=-adjusted)


def stepwise(dt: DTensor, target: tuple, order) -> DTensor:
    """`dt` redistributed to `target` one mesh dim at a time in `order`: one all-to-all
    each (the stacked dim split outer mesh dim first, as nested shards are), the steps
    the planner counts (estimate/comms.py)."""
    placements = list(dt.placements)
    for i in order:
        if placements[i] != target[i]:
            placements[i] = target[i]
            dt = dt.redistribute(dt.device_mesh, tuple(placements))
    return dt


def whole(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `local` is this rank's shard, laid out as `p`."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride()).full_tensor()


def local_slice(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `full`, laid out as `p` (no communication)."""
    if not isinstance(p, DTensor):
        return full
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()


def orthogonalise(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Newton-Schulz of each matrix of `update` (its last two dims), in `dtype`."""
    if update.ndim == 2:
        return zeropower_via_newtonschulz(update, steps, dtype)
    mats = update.reshape(-1, *update.shape[-2:])
    return torch.stack([zeropower_via_newtonschulz(m, steps, dtype) for m in mats]).reshape(update.shape)


def zeropower_via_newtonschulz(grad: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16,
                               coefficients=NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz (in bf16), the same operations in the
    same order."""
    a, b, c = coefficients
    ortho = grad.to(dtype, copy=True)
    tall = grad.size(0) > grad.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust: str, shape: tuple[int, int]) -> float:
    """torch.optim._muon._adjust_lr for a matrix of `shape` (A, B)."""
    rows, cols = shape
    if adjust == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))


def optimizer_of(t) -> AdamW | Muon:
    """The optimizer of a run's train.* section (train/config.py TrainConfig)."""
    adamw = AdamW(lr=t.lr, weight_decay=t.weight_decay, offload=t.optimizer_offload)
    if t.optimizer != "muon":
        return adamw
    m = t.muon
    return Muon(adamw, m.lr, m.momentum, m.nesterov, m.ns_steps, m.adjust_lr, m.weight_decay)
