"""The collectives of one real training step, recorded in this process on the fake
process group (every collective issued with its real shape; the values are garbage, which
does not matter here): `CollectiveRecorder`, a TorchDispatchMode that records every c10d /
functional collective with its phase (forward, backward, optimizer), the mesh axis it runs
over and its bytes, and `run_step` / `run_model_step`, one step under it.

Bytes are defined as in docs/parallelism.md:

    all_gather      bytes of the gathered output on one rank (= input x group size)
    reduce_scatter  bytes of the input on one rank (= output x group size)
    all_reduce      bytes of the tensor
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.models import build
from meshtrain.models.llama import LlamaConfig
from meshtrain.parallel.bucket_groups import GROUP_AXES
from meshtrain.parallel.init import init_params
from meshtrain.layout.mesh import MeshSpec, device_mesh_for
from meshtrain.layout.plan import make_plan
from meshtrain.layout.rules import Rules
from meshtrain.train.optim import AdamW
from meshtrain.train.step import TrainState, make_train_step

# Tiny, odd-sized: vocab 130 and ffn 100 are not powers of two, head_dim 8, GQA 6:2.
CFG = LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=100, vocab_size=130, max_seq_len=64)


# ----------------------------------------------------------------------------------------
# Recording

@dataclass(frozen=True)
class Msg:
    """One collective: phase (fwd / bwd / opt), op (all_gather, reduce_scatter,
    all_reduce_sum, all_reduce_max, ...), axis (mesh axis name, or "world") and bytes."""

    phase: str
    op: str
    axis: str
    nbytes: int


_FUNCOL = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _in_release() -> bool:
    """True inside KeptWeights.release (parallel.zero 1/2, pp_keep_gathered): the gradient
    reductions of backward, called after it."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "release" and \
                Path(f.f_code.co_filename).as_posix().endswith("meshtrain/parallel/keep_gathered.py"):
            return True
        f = f.f_back
    return False


def _in_optimizer() -> bool:
    """True inside the step's `norm_of`, `update` or `apply` (grad norm, the optimizer's
    update: AdamW, Muon's gathers), found on the Python stack."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name in ("norm_of", "update", "apply") and \
                Path(f.f_code.co_filename).as_posix().endswith("meshtrain/train/step.py"):
            return True
        f = f.f_back
    return False


# c10d ops that parallel/cp_collectives.py calls (and the MoE's tp copy, an all-reduce in
# backward): name, and the argument whose bytes count (the gathered output; the input of a
# reduce-scatter, all-reduce or all-to-all; the tensor sent).
_C10D = {"_allgather_base_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter_sum", 1),
         "alltoall_base_": ("all_to_all_single", 1), "send": ("send", 0), "recv_": ("recv", 0),
         "allreduce_": ("all_reduce_sum", 0)}


class CollectiveRecorder(TorchDispatchMode):
    """Every c10d / functional collective dispatched under it, as a Msg: its phase, op,
    mesh axis (by `axis_of_group`: process group name -> axis) and bytes. The opaque ops
    of the meshtrain namespace (context-parallel attention) run their Python body under
    it, so their own collectives are seen too."""

    def __init__(self, axis_of_group: dict[str, str]):
        super().__init__()
        self.axis_of_group = axis_of_group
        self.msgs: list[Msg] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func.overloadpacket.__name__
        if ns == "meshtrain":  # an opaque op (context-parallel attention): record what it calls
            from torch._library.custom_ops import OPDEFS

            with self:  # its Python body, under this mode again
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        if ns in _FUNCOL and name not in _NOT_COLLECTIVES or ns == "c10d":
            self.msgs.append(self._describe(ns, name, args))
        return func(*args, **kwargs)

    def _describe(self, ns: str, name: str, args) -> Msg:
        if torch._C._current_autograd_node() is not None or _in_release():
            phase = "bwd"
        elif _in_optimizer():
            phase = "opt"
        else:
            phase = "fwd"
        if ns == "c10d" and name in _C10D:  # context-parallel attention's own calls
            op, where = _C10D[name]
            group = next(dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject))
            tensor = args[where][0] if isinstance(args[where], list) else args[where]
            return Msg(phase, op, self.axis_of_group.get(group.group_name, "?"), _nbytes(tensor))
        if ns == "c10d":  # any other non-functional c10d call: never expected, recorded as is
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            return Msg(phase, f"c10d.{name}", "?", sum(_nbytes(t) for t in tensors))
        group = args[-1]
        axis = self.axis_of_group.get(group, f"group:{group}")
        if name == "all_gather_into_tensor":
            inp, group_size = args[0], args[1]
            return Msg(phase, "all_gather", axis, _nbytes(inp) * group_size)
        if name == "reduce_scatter_tensor":
            inp, op = args[0], args[1]
            return Msg(phase, f"reduce_scatter_{op}", axis, _nbytes(inp))
        if name == "all_reduce":
            inp, op = args[0], args[1]
            return Msg(phase, f"all_reduce_{op}", axis, _nbytes(inp))
        # all_to_all_single, broadcast, coalesced variants...: unexpected, still recorded
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        return Msg(phase, name, axis, sum(_nbytes(t) for t in tensors))


@dataclass
class Observed:
    msgs: list[Msg]
    comm_counts: dict[str, int]  # CommDebugMode: op name -> count
    tied: bool = False  # the step's model tied its embeddings
    bucket: str = "param"  # the step's unit of parameter traffic


def axis_names(mesh) -> dict[str, str]:
    """Process group name -> the axis a recorded collective is labelled with: the mesh's
    groups by their axis (the whole world of a mesh of several dims "world"), the
    parameter buckets' groups (parallel/bucket_groups.py `Groups`) by their axes joined by "+"
    (GROUP_AXES: call after the step is built, which makes them)."""
    names = dict(GROUP_AXES)
    if mesh.ndim > 1:
        names[dist.group.WORLD.group_name] = "world"
    for i, axis in enumerate(mesh.mesh_dim_names):
        names[mesh.get_group(i).group_name] = axis
    return names


def run_step(layout: dict, *, bucket: str | float, sp: bool = False, tied: bool = False, batch: int, seq: int,
             micro: int = 1, world: int = 2, precision: str = "fp32", cfg: LlamaConfig = CFG,
             cp_comm: str = "allgather") -> Observed:
    """One real optimizer step on the fake process group, with both counters on. `bucket`
    (make_train_step's: "param", "block" or a size in MB) is always given: a case says
    which parameter traffic it checks."""
    cfg = LlamaConfig(**{**cfg.__dict__, "tie_embeddings": tied})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model = build("llama", cfg)
        plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**layout), world=world, cp_comm=cp_comm)
        mesh = plan.mesh.build()
        params = init_params(plan, mesh, seed=0)
        step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=3e-4), precision=precision, bucket=bucket)
        axis_of_group = axis_names(mesh)
        state = TrainState.create(params)
        t = torch.randint(0, cfg.vocab_size, (micro, batch, seq + 1), generator=torch.Generator().manual_seed(0))
        recorder = CollectiveRecorder(axis_of_group)
        with CommDebugMode() as comm, recorder:
            step(state, {"tokens": t[..., :-1], "targets": t[..., 1:]})
        counts = {k.__name__: v for k, v in comm.get_comm_counts().items() if v}
        return Observed(recorder.msgs, counts, tied, bucket)
    finally:
        dist.destroy_process_group()


def run_model_step(model, layout, *, bucket, sp, batch, seq, micro=1, world=2, precision="fp32",
                   cp_comm="allgather", optimizer=None, **traffic) -> list[Msg]:
    """run_step for any ModelDef (run_step is fixed to a Llama config); the messages only.
    traffic: make_train_step's prefetch, reshard_after_forward; optimizer: AdamW's unless given."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**layout), world=world, cp_comm=cp_comm)
        mesh = plan.mesh.build()
        optimizer = optimizer or AdamW(lr=3e-4)
        step = make_train_step(model, plan, mesh, optimizer=optimizer, precision=precision, bucket=bucket,
                               **traffic)
        groups = axis_names(mesh)
        if plan.mesh.ep > 1:  # the expert mesh's groups by their axes
            experts = device_mesh_for(mesh, plan.mesh.experts())
            for i, axis in enumerate(experts.mesh_dim_names):
                groups.setdefault(experts.get_group(i).group_name, axis)
        state = TrainState.create(init_params(plan, mesh, seed=0), optimizer)
        t = torch.randint(0, model.cfg.vocab_size, (micro, batch, seq + 1), generator=torch.Generator().manual_seed(0))
        recorder = CollectiveRecorder(groups)
        with recorder:
            step(state, {"tokens": t[..., :-1], "targets": t[..., 1:]})
        return recorder.msgs
    finally:
        dist.destroy_process_group()
