"""The collectives of one real training step, recorded as rank 0 issues them on torch's
fake process group: bench/comm.py's measured side (its docstring gives the convention)."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from meshtrain.models import build  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.parallel.bucket_groups import GROUP_AXES  # noqa: E402
from meshtrain.parallel.init import init_params  # noqa: E402
from meshtrain.layout.mesh import MeshSpec, device_mesh_for  # noqa: E402
from meshtrain.layout.plan import make_plan  # noqa: E402
from meshtrain.layout.rules import Rules  # noqa: E402
from meshtrain.train.optim import AdamW  # noqa: E402
from meshtrain.train.step import TrainState, make_train_step  # noqa: E402


# ---------------------------------------------------------------------------- wire bytes

def ring_bytes(op: str, ranks: int, nbytes) -> Fraction:
    """Bytes one rank sends for a collective of `nbytes` (the module docstring's X)."""
    share = Fraction(ranks - 1, ranks)
    factor = {"all_reduce": 2 * share, "all_gather": share, "reduce_scatter": share, "all_to_all": share,
              "send": Fraction(1), "recv": Fraction(0)}[op]
    return factor * nbytes


# ---------------------------------------------------------------------------- measured

@dataclass(frozen=True)
class Collective:
    """One collective as issued: X bytes (module docstring) over a group of `ranks`."""

    phase: str  # "bwd" inside autograd's backward, else "fwd" (the update's scalar included)
    op: str
    axis: str
    ranks: int
    nbytes: int
    numel: int

    @property
    def wire(self) -> Fraction:
        return ring_bytes(self.op, self.ranks, self.nbytes)


_FUNCTIONAL = {"_c10d_functional", "_c10d_functional_autograd"}
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}
# name -> (op, the argument holding the tensor X): functional ops take the group by name last;
# c10d ops (what plain torch.distributed calls dispatch to) take it as a ScriptObject.
_FUNCTIONAL_OPS = {"all_gather_into_tensor": ("all_gather", 0), "reduce_scatter_tensor": ("reduce_scatter", 0),
                   "all_reduce": ("all_reduce", 0), "all_to_all_single": ("all_to_all", 0)}
_C10D_OPS = {"_allgather_base_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
             "allreduce_": ("all_reduce", 0), "alltoall_base_": ("all_to_all", 1), "send": ("send", 0),
             "recv_": ("recv", 0)}


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective dispatched while active; any collective it cannot size
    raises (nothing is silently left out)."""

    def __init__(self, axis_of_group: dict[str, str]):
        super().__init__()
        self.axis_of_group = axis_of_group
        self.log: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func.overloadpacket.__name__
        if ns == "meshtrain":  # an opaque custom op (CP attention): run its body under this mode
            from torch._library.custom_ops import OPDEFS

            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        if ns in _FUNCTIONAL and name not in _NOT_COLLECTIVES:
            self._record(_FUNCTIONAL_OPS, name, args, _resolve_process_group(args[-1]))
        elif ns == "c10d":
            group = next(dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject))
            self._record(_C10D_OPS, name, args, group)
        return func(*args, **kwargs)

    def _record(self, table, name, args, group):
        if name not in table:
            raise RuntimeError(f"bench/comm_record.py: collective {name} is not sized by the recorder; add it")
        op, where = table[name]
        tensor = args[where][0] if isinstance(args[where], (list, tuple)) else args[where]
        nbytes, numel = tensor.numel() * tensor.element_size(), tensor.numel()
        if name == "all_gather_into_tensor":  # X is the gathered output
            nbytes, numel = nbytes * group.size(), numel * group.size()
        phase = "bwd" if torch._C._current_autograd_node() is not None else "fwd"
        axis = self.axis_of_group.get(group.group_name, f"group{group.size()}")
        self.log.append(Collective(phase, op, axis, group.size(), nbytes, numel))


@contextlib.contextmanager
def _peers_route_like_us():
    """The fake group leaves a received buffer as it was; the MoE counts exchange (plain
    dist.all_to_all_single, int64 counts) gets this rank's own counts instead."""
    real = dist.all_to_all_single

    def exchange(out, inp, *args, **kwargs):
        work = real(out, inp, *args, **kwargs)
        if out.shape == inp.shape and not out.is_floating_point():
            out.copy_(inp)
        return work

    dist.all_to_all_single = exchange
    try:
        yield
    finally:
        dist.all_to_all_single = real


def record_step(cfg: LlamaConfig, layout, batch: int, seq: int, bucket="block") -> list[Collective]:
    """The collectives of one training step of `cfg` under `layout`, as rank 0 issues them,
    with parameters moved per `bucket` (make_train_step's)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world)
    try:
        model = build("llama", cfg)
        plan = make_plan(model.specs, Rules.default(sp=layout.sp), MeshSpec(**layout.mesh), world=layout.world,
                         cp_comm=layout.cp_comm)
        mesh = plan.mesh.build()
        axis_of_group = {dist.group.WORLD.group_name: "world"}
        axis_of_group.update({mesh.get_group(i).group_name: a for i, a in enumerate(mesh.mesh_dim_names)})
        experts = device_mesh_for(mesh, plan.mesh.experts())
        for i, a in enumerate(experts.mesh_dim_names):  # folded: ep may be the fsdp group itself
            name = experts.get_group(i).group_name
            axis_of_group[name] = a if axis_of_group.get(name, a) == a else f"{axis_of_group[name]}={a}"
        step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=3e-4), precision="fp32", bucket=bucket)
        for name, axes in GROUP_AXES.items():  # the buckets' (and the loss's) groups: "fsdp", "dp+fsdp", ...
            axis_of_group.setdefault(name, axes)
        state = TrainState.create(init_params(plan, mesh, seed=0))
        t = torch.randint(0, cfg.vocab_size, (1, batch, seq + 1), generator=torch.Generator().manual_seed(0))
        recorder = CollectiveRecorder(axis_of_group)
        with _peers_route_like_us() if layout.moe else contextlib.nullcontext(), recorder:
            step(state, {"tokens": t[..., :-1], "targets": t[..., 1:]})
        return recorder.log
    finally:
        dist.destroy_process_group()
