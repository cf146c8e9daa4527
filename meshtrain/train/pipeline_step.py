"""Run a pipeline PipelineSchedule: each pp rank walks its own action list with real tensors.

The world is the mesh pp x (dp, fsdp, tp): every pp rank is a group of ranks that runs its
stages with the same ShardedContext a non-pipelined step uses, on the sub-mesh of the other
axes (pp alone: plain tensors and the LocalContext). Between stages, each rank exchanges
its own shard of the activation (the residual stream in its ("batch", "seq_sp", None)
layout) with the rank of the neighbouring stage that has the same coordinates on the other
axes, so point-to-point traffic is one shard per rank, never a gathered tensor.

The semantics are the IR's (pipeline/schedule.py): sends are posted without waiting (isend), recvs
block, and between two ranks sends and recvs match in posting order.

Backward: B runs the stage's full backward. The zero-bubble split runs BI as the input
gradient only, keeping the gradients that flow into the weight-consuming nodes, and BW as
the weight gradients from those (eager: torch.distributed.pipelining's split of the
autograd graph; compiled: the stage's backward graph split in two, train/split_backward.py);
on the first stage, whose input (token ids) needs no gradient, the whole backward is
weight work: BI does nothing and BW runs it, where the schedule put it to fill a bubble.

Loss and gradients are those of the non-pipelined step: every micro-batch's loss sum is
divided by the number of target tokens of the whole global batch, so gradients accumulate
over micro-batches exactly as `make_train_step` accumulates them. The gradient norm is one
all-reduce over the world (each parameter lives on one pp rank). A tied embedding is held
by the first and the last stage's ranks: their two gradient contributions are exchanged
and summed (in the same order on both, so the copies stay bit-identical), both apply the
same update, and the norm counts it once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from typing import Callable

import torch
import torch.distributed as dist
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import ConfigError
from ..models import ModelDef
from ..models.context import LocalContext
from ..models.family import RESIDUAL
from ..models.policy import Policy
from ..parallel.context import ShardedContext
from ..parallel.keep_gathered import KeptWeights
from ..layout.mesh import sub_mesh
from ..layout.placements import local_tensor
from ..layout.traffic import Traffic
from ..layout.plan import without_pp
from ..pipeline.partition import Stage
from ..pipeline.schedule import B, BI, BW, F, RECV_B, RECV_F, SEND_B, SEND_F, PipelineSchedule, forward_only
from .optim import AdamW
from .lr_schedule import LRSchedule
from .split_backward import SplitBackward
from .loss_scale import LossScaleConfig
from .scaled_step import loss_seed, scale_config, scale_metrics
from .mtp_terms import MtpTerms
from .pipeline_terms import moe_metrics, pp_sum
from .step import (InspectGrads, MoeTerms, TrainState, check_compile, check_split, compiled, count_targets, documents,
                   make_update)

_TIED_TAG = 7  # the tied-embedding gradient exchange, apart from the schedule's traffic


def stage_param_names(stages: list[Stage], pp_rank: int) -> list[str]:
    """The parameters pp rank `pp_rank` holds: its stages' own, plus a tied table it shares."""
    names = []
    for st in stages:
        if st.rank == pp_rank:
            names += [n for n in st.params + st.shared if n not in names]
    return names


def local_stage_layout(plan, device_mesh, stages: list[Stage]):
    """This rank's part of a pipelined layout: (the parameter names it holds, the plan of
    the non-pp axes, the sub-mesh of those axes); the last two are None with pp alone
    (the stages then run on plain tensors)."""
    names = stage_param_names(stages, device_mesh.get_local_rank("pp"))
    rest = tuple(a for a in device_mesh.mesh_dim_names if a != "pp")
    if not rest:
        return names, None, None
    return names, without_pp(plan), sub_mesh(device_mesh, rest)


class _Pipe:
    """This rank's place in the pipeline: its context, pp peers and the boundary layout."""

    def __init__(self, model: ModelDef, stages: list[Stage], pp: int, plan, device_mesh, policy: Policy,
                 compile: bool | str = False, split_backward: bool = False, traffic: Traffic = Traffic()):
        self.model, self.stages = model, stages
        if plan is None or device_mesh is None or plan.mesh.pp != pp or pp < 2:
            raise ConfigError(f"a pipeline step needs the plan and device mesh of a layout with parallel.pp={pp} "
                              ">= 2 (parallel.pp 1 runs make_train_step)")
        self.rank, self.group = device_mesh.get_local_rank("pp"), device_mesh.get_group("pp")
        names, self.plan, self.mesh = local_stage_layout(plan, device_mesh, stages)
        # parallel.pp_keep_gathered: the stages run on weights gathered once per step.
        self.kept = None
        if self.mesh is None:
            self.ctx = LocalContext(policy)
        elif traffic.keep_gathered:
            self.kept = KeptWeights(self.plan, self.mesh, names, policy, traffic)
            self.ctx = self.kept.context
        else:
            self.ctx = ShardedContext(self.plan, self.mesh, policy, traffic)
        self.dtype = policy.dtype or torch.float32
        # Traced gathers leave partial sums for reduce_held (kept weights: for KeptWeights.release).
        self.holds_partials = bool(compile) and self.mesh is not None and self.kept is None
        # One function per stage: compiled, each is traced once (micro-batches and steps
        # share its graphs); the last stage's takes the loss in its graph too.
        prefetch = traffic.prefetch if self.mesh is not None else 0
        # Compiled with the zero-bubble schedule, each stage's backward graph is split in
        # its input and weight halves, which BI and BW run.
        self.split = SplitBackward() if compile and split_backward else None
        self._stage_fns = {stage.index: self._compiled(self._stage_fn(stage), compile, prefetch)
                           for stage in stages if stage.rank == self.rank}

    def _compiled(self, fn, compile: bool | str, prefetch: int):
        if not compile:
            return fn
        if self.split is None:
            return compiled(fn, compile, prefetch)
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=self.split.backend(compile, prefetch))

    def peer(self, pp_rank: int) -> int:
        """The global rank of pp rank `pp_rank` at this rank's coordinates on the other axes."""
        return dist.get_global_rank(self.group, pp_rank)

    def _stage_fn(self, stage: Stage):
        cfg, ctx, family = self.model.cfg, self.ctx, self.model.family

        def run(params, x, targets, docs, ahead=None, wanted=None):
            if ahead is not None:  # the last stage with multi-token prediction: (loss, each depth's)
                logits, depths = family.forward_mtp(cfg, params, x, ctx, stage.layers, stage.has_embedding, ahead,
                                                    docs)
                sums = [ctx.cross_entropy_sum(d, t) for d, t in zip(depths, wanted)]
                return (ctx.cross_entropy_sum(logits, targets), sums), ctx.moe_aux()
            out = family.forward_stage(cfg, params, x, ctx, stage.layers, stage.has_embedding, stage.has_head,
                                       **({} if docs is None else {"docs": docs}))
            out = ctx.cross_entropy_sum(out, targets) if stage.has_head else ctx.constrain(out, RESIDUAL)
            return out, ctx.moe_aux()

        # A code object of its own per stage: dynamo caches graphs per code object, so
        # stages sharing `run`'s would count as recompiles of one another (and past
        # dynamo's cache size limit, fall back to eager).
        code = run.__code__.replace(co_name=f"stage_{stage.index}")
        return types.FunctionType(code, run.__globals__, code.co_name, run.__defaults__, run.__closure__)

    def forward(self, stage: Stage, params, x, targets=None, docs=None, ahead=None, wanted=None):
        """(the stage's output, or the last stage's summed token loss on `targets`; its MoE
        blocks' terms, or None). `docs`: the micro-batch's packed documents, which every
        stage reads from the batch (they do not travel between stages). With multi-token
        prediction's `ahead` and `wanted` (the last stage): the loss is (the loss, each
        depth's summed loss)."""
        return self._stage_fns[stage.index](params, x, targets, docs, ahead, wanted)

    def scope(self):
        return getattr(self.ctx, "regather_in_backward", contextlib.nullcontext)()

    # ---- the stage boundary: (rows, seq, dim) activations and their gradients
    def boundary(self, rows: int, seq: int):
        shape = (rows, seq, self.model.cfg.dim)
        if self.mesh is None:
            return shape, None
        placements = self.plan.activation(RESIDUAL).placements
        local_shape, _ = compute_local_shape_and_global_offset(shape, self.mesh, placements)
        return tuple(local_shape), (shape, placements)

    def wrap(self, buf: torch.Tensor, spec) -> torch.Tensor:
        if spec is None:
            return buf
        shape, placements = spec
        return DTensor.from_local(buf, self.mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=make_contiguous_strides_for(shape))


def _backward_roots(out: torch.Tensor, grad, extra, seed: float | None = None):
    """The tensors a stage's backward starts from and their gradients: its output (the
    last stage's loss when `grad` is None, seeded with fp16's loss scale `seed`) and its
    MoE blocks' objective term, if any (seeded alike)."""
    ones = 1.0 if seed is None else seed
    grad = torch.full_like(out, ones) if grad is None else grad
    if extra is None:
        return [out], [grad]
    return [out, extra], [grad, torch.full_like(extra, ones)]


def _run(pipe: _Pipe, actions, params: dict, tokens, targets, n_tokens: int, *, train: bool,
         timings: list | None = None, moe: MoeTerms | None = None, docs=None, mtp: MtpTerms | None = None,
         seed: float | None = None, weights_done: Callable[[], None] | None = None) -> torch.Tensor:
    """Walk this rank's actions; returns the loss (this rank's share: zero off the last stage).
    `timings`: append (kind, stage, seconds) for every compute action (host time: exact on
    CPU, launch time only on an asynchronous device). `moe` collects MoE blocks' terms,
    `mtp` multi-token prediction's (the last stage adds them to its objective). `seed`:
    fp16's loss scale, which the backward starts from (the gradients that cross stages
    carry it). `weights_done`: called after every action that completes a micro-batch's
    weight gradients of a stage (B, BW; kept weights collect them there, ZeRO-2 reduces them)."""
    stages, last = pipe.stages, len(pipe.stages) - 1
    rows, seq = tokens[0].shape
    local_shape, spec = pipe.boundary(rows, seq)
    inputs, outputs, out_grads, in_grads, split, pending = {}, {}, {}, {}, {}, []
    loss = torch.zeros((), dtype=torch.float32, device=tokens[0].device)
    moe = moe or MoeTerms(1, 1)  # forward-only: the MoE records are drained, not used
    extras = {}  # (stage, micro-batch) -> its MoE objective term

    def weights(stage: Stage):  # what a weight-gradient pass differentiates: not the aux-free bias
        return [params[n] for n in stage.params + stage.shared if params[n].requires_grad]

    for a in actions:
        s, j, key = a.stage, a.micro, (a.stage, a.micro)
        start = time.perf_counter() if timings is not None else 0.0
        if a.kind in (RECV_F, RECV_B):
            buf = torch.empty(local_shape, dtype=pipe.dtype, device=tokens[0].device)
            dist.recv(buf, src=pipe.peer(a.peer))
            if a.kind == RECV_F:  # the plain buffer is the leaf whose .grad goes back
                inputs[key] = buf.requires_grad_(train)
            else:
                out_grads[key] = pipe.wrap(buf, spec)
        elif a.kind in (SEND_F, SEND_B):
            value = outputs[key] if a.kind == SEND_F else in_grads.pop(key)
            value = local_tensor(value.detach()).contiguous()
            pending.append((dist.isend(value, dst=pipe.peer(a.peer)), value))
        elif a.kind == F:
            ahead = (mtp.inputs[j], mtp.targets[j]) if mtp is not None and s == last else ()
            with pipe.scope():
                out, aux = pipe.forward(stages[s], params, tokens[j] if s == 0 else pipe.wrap(inputs[key], spec),
                                        targets[j] if s == last else None, None if docs is None else docs[j], *ahead)
                if s == last:
                    out, sums = out if ahead else (out, None)
                    out = out / n_tokens
                    loss += local_tensor(out.detach())
                    if ahead:
                        out = out + mtp.add(sums)  # the objective; `loss` stays the next-token loss
                extra = moe.add(aux, s)
                if extra is not None and train:
                    extras[key] = extra
            if train or s != last:
                outputs[key] = out
            if not train:
                inputs.pop(key, None)
        elif a.kind == B:
            outs, grads = _backward_roots(outputs.pop(key), None if s == last else out_grads.pop(key),
                                          extras.pop(key, None), seed)
            torch.autograd.backward(outs, grads)
            if s > 0:
                in_grads[key] = inputs.pop(key).grad
        elif a.kind == BI:
            outs, grads = _backward_roots(outputs.pop(key), None if s == last else out_grads.pop(key),
                                          extras.pop(key, None), seed)
            if s == 0:  # no input gradient: the whole backward is weight work, deferred to BW
                split[key] = (outs, grads)
            elif pipe.split is not None:  # compiled: the node keeps what its weight half needs
                x = inputs.pop(key)
                with pipe.split.input_half(key):
                    torch.autograd.backward(outs, grads, inputs=[x], retain_graph=True)
                split[key] = (outs, grads)
                in_grads[key] = x.grad
            else:
                x = inputs.pop(key)
                _, split[key] = stage_backward_input(outs, grads, [x], iter(weights(stages[s])))
                in_grads[key] = x.grad
        elif a.kind == BW:
            if s == 0:
                torch.autograd.backward(*split.pop(key))
            elif pipe.split is not None:
                with pipe.split.weight_half(key):
                    torch.autograd.backward(*split.pop(key), inputs=weights(stages[s]))
            else:
                stage_backward_weight(iter(weights(stages[s])), split.pop(key))
        if weights_done is not None and a.kind in (B, BW):
            weights_done()
        if a.kind == SEND_F and not train:
            outputs.pop(key)
        if timings is not None and a.kind in (F, B, BI, BW):
            timings.append((a.kind, s, time.perf_counter() - start))
    for work, _ in pending:
        work.wait()
    return loss


def make_pipeline_step(model: ModelDef, stages: list[Stage], pipeline_schedule: PipelineSchedule, plan,
                       device_mesh, *,
                       optimizer: AdamW = AdamW(), lr_schedule: LRSchedule | None = None,
                       precision: str = "fp32", grad_clip: float | None = 1.0, fp8_recipe: str = "tensorwise",
                       activation_checkpointing: str = "none",
                       record_timings: bool = False, inspect_grads: InspectGrads | None = None,
                       bucket: str | float = Traffic.bucket, prefetch: int = Traffic.prefetch,
                       reshard_after_forward: bool = Traffic.reshard_after_forward,
                       fsdp_accumulate: str = Traffic.fsdp_accumulate, keep_gathered: bool = Traffic.keep_gathered,
                       traffic: Traffic | None = None, compile: bool | str = False,
                       loss_scale: LossScaleConfig | None = None) -> Callable[[TrainState, dict], dict]:
    """`step(state, batch) -> metrics` for this rank; `plan` and `device_mesh` are the whole
    layout's, pp included. record_timings: metrics["timings"] lists (kind, stage, seconds)
    of this rank's compute actions, then ("update", -1, seconds) for the gradient
    exchange, norm and optimizer step (for the bench; host time). state.params holds `stage_param_names(stages, pp_rank)` (DTensors on the
    non-pp sub-mesh when there is one); batch as for make_train_step (full
    (micro_steps, batch, seq) tensors on every rank). `inspect_grads` sees this rank's
    gradients before clipping, a tied table's copies already summed (see make_update).
    bucket, prefetch, reshard_after_forward: the stages' parameter traffic, as for
    make_train_step; fsdp_accumulate must be "sharded" (each micro-batch is reduced as
    its backward ends). `compile` as for make_train_step: each stage's forward (the last
    one's with its loss) and its backward are compiled graphs, traced once per stage
    (zero-bubble: the backward as two, its input and its weight half); what they leave
    partial over the data-parallel replicas is reduced once per step, after the last
    backward. `keep_gathered` (parallel.pp_keep_gathered): the rank's weights are
    gathered once per step and their gradients reduced once (parallel/keep_gathered.py).
    `traffic` (layout/traffic.py), when given, replaces those five. `loss_scale`: fp16's,
    as for make_train_step."""
    traffic = (traffic or Traffic(bucket, prefetch, reshard_after_forward, fsdp_accumulate, keep_gathered)).check()
    if traffic.fsdp_accumulate != "sharded":
        raise ConfigError(f"fsdp_accumulate={traffic.fsdp_accumulate!r}: a pipeline step reduces every micro-batch; "
                          "use sharded")
    split_backward = any(a.kind == BI for rank in pipeline_schedule.ranks for a in rank)
    # Eager selective checkpoints serve two backwards through a block (input, then weight
    # gradients); a compiled stage's recompute is in its backward graph, split with it.
    policy = dataclasses.replace(Policy.of(precision, fp8_recipe, activation_checkpointing),
                                 backward_twice=split_backward and not compile)
    if compile:
        check_compile(policy.checkpointing, sharded=plan is not None and plan.mesh.world > plan.mesh.pp)
    pipe = _Pipe(model, stages, pipeline_schedule.pp, plan, device_mesh, policy, compile, split_backward, traffic)
    scaling = scale_config(policy, loss_scale)
    apply_update = make_update(optimizer, lr_schedule or LRSchedule(lr=optimizer.lr, kind="constant"), grad_clip,
                               inspect_grads=inspect_grads, loss_scale=scaling)
    actions = pipeline_schedule.ranks[pipe.rank]
    per_micro_batch = pipe.kept is not None and traffic.zero == 2  # ZeRO-2: each micro-batch's gradients reduced
    data_ranks = pipe.plan.mesh.dp * pipe.plan.mesh.fsdp if pipe.plan is not None else 1
    tied = [n for st in stages if st.rank == pipe.rank for n in st.shared]  # held here, owned on rank 0
    tied_peer = pipe.peer(stages[-1].rank if pipe.rank == 0 else 0)
    tied_here = [n for n in stages[-1].shared if pipe.rank in (0, stages[-1].rank)]
    moe_layers = getattr(model.cfg, "moe_layers", ())
    depth = model.cfg.mtp.depth if getattr(model.cfg, "mtp", None) is not None else 0

    def step(state: TrainState, batch: dict) -> dict:
        tokens, targets = batch["tokens"], batch["targets"]
        if len(tokens) != pipeline_schedule.m:
            raise ConfigError(f"pipeline schedule {pipeline_schedule.name} is built for {pipeline_schedule.m} "
                              f"micro-batches per step but the batch has {len(tokens)}")
        check_split(tokens, data_ranks)
        n_tokens = batch.get("num_targets") or count_targets(targets)
        timings = [] if record_timings else None
        moe = MoeTerms.of(tokens)
        ahead = MtpTerms(batch, depth, model.cfg.mtp.loss_coef, count_targets) if depth else None
        params = state.params if pipe.kept is None else pipe.kept.gather(state.params)
        loss = _run(pipe, actions, params, tokens, targets, n_tokens, train=True, timings=timings, moe=moe,
                    docs=documents(batch), mtp=ahead, seed=loss_seed(state, scaling),
                    weights_done=None if pipe.kept is None else
                    pipe.kept.release if per_micro_batch else pipe.kept.collect)
        update_start = time.perf_counter()
        if pipe.kept is not None:  # the step's summed gradients, reduced once (ZeRO-2: done; the gathers dropped)
            pipe.kept.release()
            pipe.kept.end_step()
            del params
        if pipe.holds_partials:  # what the graphs left partial (dp replicas, sp norms), reduced once
            pipe.ctx.reduce_held(state.params)
        for n in tied_here:  # both copies get the sum of both contributions, in one order
            g = local_tensor(state.params[n].grad)
            other = torch.empty_like(g)
            work = dist.isend(g.contiguous(), dst=tied_peer, tag=_TIED_TAG)
            dist.recv(other, src=tied_peer, tag=_TIED_TAG)
            work.wait()
            g.copy_(g + other if pipe.rank == 0 else other + g)
        dist.all_reduce(loss, group=pipe.group)  # only the last stage's rank holds a non-zero loss
        with torch.profiler.record_function("optimizer"):  # a named region in profiles
            norm, lr, updated = apply_update(state, uncounted=tied, loss=float(loss))
        metrics = {"loss": float(loss), "grad_norm": float(norm), "lr": lr, "skipped": not updated,
                   **scale_metrics(state, scaling)}
        if moe_layers:
            metrics.update(moe_metrics(state, pipe, moe, moe_layers, updated))
        if ahead is not None:
            metrics["mtp_loss"] = ahead.mtp_loss(lambda t: pp_sum(t, depth, pipe))
        if record_timings:
            metrics["timings"] = timings + [("update", -1, time.perf_counter() - update_start)]
        return metrics

    return step


def make_pipeline_eval(model: ModelDef, stages: list[Stage], pp: int, micro_steps: int, plan, device_mesh, *,
                       precision: str = "fp32", fp8_recipe: str = "tensorwise") -> Callable[[dict, dict], float]:
    """`evaluate(params, batch) -> mean loss per target token`, forwards only, the same on
    every rank."""
    pipe = _Pipe(model, stages, pp, plan, device_mesh, Policy.of(precision, fp8_recipe))
    actions = forward_only(pp, len(stages) // pp, micro_steps).ranks[pipe.rank]

    @torch.no_grad()
    def evaluate(params: dict, batch: dict) -> float:
        tokens, targets = batch["tokens"], batch["targets"]
        n_tokens = batch.get("num_targets") or count_targets(targets)
        loss = _run(pipe, actions, params, tokens, targets, n_tokens, train=False, docs=documents(batch))
        dist.all_reduce(loss, group=pipe.group)
        return float(loss)

    return evaluate
