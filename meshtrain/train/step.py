"""The step factory: model + plan + optimizer + precision -> step(state, batch) -> metrics."""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError
from ..models import ModelDef
from ..models.attention import document_window
from ..models.context import Documents, LocalContext
from ..models.moe import expert_bias_step, imbalance
from ..models.offload import refuse_compiled
from ..models.policy import Policy
from ..parallel.context import ShardedContext
from ..parallel.gradient_schedule import GradientSchedule
from ..parallel.keep_gathered import KeptWeights
from ..parallel.overlap import aot_eager_overlapped, inductor_pass
from ..layout.placements import local_tensor
from ..layout.traffic import Traffic
from .optim import AdamW, all_reduce_sum, grad_norm_squared_local, replica_count
from .loss_scale import LossScaleConfig, ScaleState
from .scaled_step import loss_seed, scale_config, scale_metrics, seeded, unscale
from .lr_schedule import LRSchedule
from .mtp_terms import MtpTerms

# Called with {name: gradient} for every trainable parameter: see make_update.
InspectGrads = Callable[[dict[str, torch.Tensor]], None]


@dataclass
class TrainState:
    params: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, torch.Tensor]]
    step: int = 0
    loss_scale: ScaleState | None = None  # fp16's dynamic loss scale, set by its first step

    @staticmethod
    def create(params: dict[str, torch.Tensor], optimizer=None) -> "TrainState":
        """Step 0 of `params` with the state `optimizer` keeps (default AdamW's moments)."""
        return TrainState(params, (optimizer or AdamW()).init_state(params), 0)


def make_train_step(model: ModelDef, plan=None, device_mesh=None, *, optimizer: AdamW = AdamW(),
                    lr_schedule: LRSchedule | None = None, precision: str = "fp32", grad_clip: float | None = 1.0,
                    compile: bool | str = False, fp8_recipe: str = "tensorwise",
                    activation_checkpointing: str = "none", policy: Policy | None = None,
                    inspect_grads: InspectGrads | None = None, bucket: str | float = Traffic.bucket,
                    prefetch: int = Traffic.prefetch, reshard_after_forward: bool = Traffic.reshard_after_forward,
                    fsdp_accumulate: str = Traffic.fsdp_accumulate,
                    traffic: Traffic | None = None, schedule: LRSchedule | None = None,
                    loss_scale: LossScaleConfig | None = None) -> Callable[[TrainState, dict], dict]:
    """Build `step(state, batch) -> metrics`.

    batch["tokens"] and batch["targets"] are (micro_steps, batch, seq) tensors, or lists of
    (batch, seq) micro-batches: the global batch split into micro-batches, each given in
    full on every rank (the layout keeps each rank's part) or as DTensors laid out as the
    plan's ("batch", "seq") activation, each rank holding only its own rows. Optional
    batch["num_targets"]: the number of targets >= 0 in the whole global batch, when the
    caller knows it (otherwise it is counted, with a collective when ranks hold parts). Gradients accumulate over micro-steps; the loss
    is the mean over every target token of the global batch (targets < 0 are ignored).
    With no plan the step runs on one device. precision fp32, bf16 or fp8 (bf16 with fp8
    GEMMs of `fp8_recipe`), activation_checkpointing none, selective or full: see
    models.policy (`policy`, when given, replaces those three). `compile` True wraps the loss and the update in
    torch.compile(fullgraph=True) with inductor; a string names another backend.
    Metrics: loss, grad_norm, lr, skipped (True when the loss or the gradient norm was not
    finite and the update was left out, see make_update); with MoE blocks also expert_imbalance and (when a balance
    loss or z-loss is on) aux_loss, the terms added to the objective. precision fp16 scales
    the loss by state.loss_scale (train/loss_scale.py; `loss_scale` configures it, None:
    GradScaler's defaults) and adds loss_scale (the scale after this step) and overflow
    (True when the step was skipped for its gradients' overflow, which the scale answers).
    `inspect_grads`, when given, sees every step's accumulated gradients before they are
    clipped: see make_update.
    With a plan: `bucket` (block, param or a size in MB), `prefetch` (buckets gathered
    ahead of use) and `reshard_after_forward` (gather again in backward instead of keeping
    the gathered weights) shape the parameter traffic: see layout.buckets and
    parallel.bucket_run.
    `fsdp_accumulate` "unsharded" (with buckets) adds each micro-step's full
    gradients up locally and reduce-scatters once per step instead of every micro-step.
    `traffic` (layout/traffic.py), when given, replaces those four; its keep_gathered
    (parallel.zero 1 and 2) gathers the weights once per step and keeps them over the
    micro-batches, their gradients reduced once per step (zero 1) or per micro-batch (2).
    The loss is reduced once per step.
    """
    policy = policy or Policy.of(precision, fp8_recipe, activation_checkpointing)
    if compile:
        check_compile(policy.checkpointing, sharded=plan is not None)
    traffic = (traffic or Traffic(bucket, prefetch, reshard_after_forward, fsdp_accumulate)).check()
    ctx, reductions = _step_context(plan, device_mesh, policy, traffic, bool(compile))
    lr_schedule = _lr_schedule(lr_schedule, schedule, optimizer)
    scope = getattr(ctx, "regather_in_backward", contextlib.nullcontext)
    data_ranks = plan.mesh.dp * plan.mesh.fsdp if plan is not None else 1

    loss_sum = _loss_sum(model, ctx)
    moe_cfg = getattr(model.cfg, "moe", None)
    moe = (moe_cfg, model.family.moe_blocks(model.cfg)) if moe_cfg is not None else None
    mtp = getattr(model.cfg, "mtp", None)
    depth = mtp.depth if mtp is not None else 0

    if compile:
        loss_sum = compiled(loss_sum, compile, traffic.prefetch if plan is not None else 0)
    scaling = scale_config(policy, loss_scale)
    apply_update = make_update(optimizer, lr_schedule, grad_clip, compile, inspect_grads, scaling)

    def step(state: TrainState, batch: dict) -> dict:
        tokens, targets = batch["tokens"], batch["targets"]
        check_split(tokens, data_ranks)
        n_tokens = batch.get("num_targets") or count_targets(targets)
        docs = documents(batch)
        terms = MoeTerms.of(tokens)
        ahead = MtpTerms(batch, depth, mtp.loss_coef, count_targets) if depth else None
        seed = loss_seed(state, scaling)
        weights, total, last = reductions.weights(state.params), None, len(tokens) - 1
        for micro in range(len(tokens)):
            with scope():
                lm, aux, sums = loss_sum(weights, tokens[micro], targets[micro], docs[micro],
                                         *((ahead.inputs[micro], ahead.targets[micro]) if ahead else ()))
                loss = lm / n_tokens
                extra = [e for e in (terms.add(aux), ahead.add(sums) if ahead else None) if e is not None]
            # The loss is this rank's partial sum: its gradient is the step's gradient of
            # the tokens this rank holds (no all-reduce before backward).
            reductions.before_backward(micro, last)
            torch.autograd.backward([seeded(_local(loss), seed)] + [seeded(_local(e), seed) for e in extra])
            total = _add(total, loss.detach())
            reductions.after_backward(weights, micro, last)
        reductions.after_last(weights, state.params)
        del weights
        loss = float(ctx.reduce_sum(total))
        with torch.profiler.record_function("optimizer"):  # a named region in profiles
            norm, lr, updated = apply_update(state, loss=loss)
        metrics = {"loss": loss, "grad_norm": float(norm), "lr": lr, "skipped": not updated,
                   **scale_metrics(state, scaling)}
        if terms.load:
            metrics["expert_imbalance"] = float(moe_step(state, *moe, full_value(terms.load[0]), updated).max())
        if terms.total is not None:
            metrics["aux_loss"] = float(full_value(terms.total))
        if ahead is not None:
            metrics["mtp_loss"] = ahead.mtp_loss(ctx.reduce_sum)
        return metrics

    return step


def _add(a, b):
    return b if a is None else a + b


class MoeTerms:
    """One step's MoE terms: `add(ctx.moe_aux() output, key)` returns the objective term to
    differentiate with that micro-batch (the balance loss averaged over the global batch's
    sequences, the z-loss over its positions; None when neither is in use), and keeps
    tokens per expert by `key` (a pipeline's stage) and the total of the terms."""

    def __init__(self, n_sequences: int, n_positions: int):
        self.n_sequences, self.n_positions = n_sequences, n_positions
        self.load: dict[int, torch.Tensor] = {}
        self.total = None

    @staticmethod
    def of(tokens) -> "MoeTerms":
        """For a global batch given as micro-batches of (batch, seq) tokens."""
        n_sequences = sum(t.shape[0] for t in tokens)
        return MoeTerms(n_sequences, n_sequences * tokens[0].shape[1])

    def add(self, aux, key: int = 0):
        if aux is None:
            return None
        balance, z, load = aux
        self.load[key] = _add(self.load.get(key), load.detach())
        parts = ([balance / self.n_sequences] if balance is not None else []) + \
            ([z / self.n_positions] if z is not None else [])
        if not parts:
            return None
        extra = sum(parts)
        self.total = _add(self.total, extra.detach())
        return extra


def moe_step(state: TrainState, cfg, blocks, load: torch.Tensor, updated: bool = True) -> torch.Tensor:
    """After the update, for MoE blocks named by their prefixes `blocks` ("layers.3.")
    whose tokens per expert over the global batch are `load` (blocks x E, the same on
    every rank): the aux-free bias moves toward balance (unless the step's update was
    skipped); returns each block's load imbalance (max / mean)."""
    if cfg.balance == "aux_free" and updated:
        with torch.no_grad():
            for j, prefix in enumerate(blocks):
                bias = local_tensor(state.params[f"{prefix}moe.expert_bias"])
                bias.copy_(expert_bias_step(bias, load[j], cfg.bias_update_rate))
    return imbalance(load)


def check_compile(activation_checkpointing: str, sharded: bool) -> None:
    """What a compiled step on a device mesh (`sharded`) cannot take yet (torch 2.13): a
    block checkpointed whole saves the DeviceMesh for backward among its tensors, which
    AOTAutograd's forward refuses (docs/parallelism.md, Known gap 15). Nor activation
    offload, on any layout (models/offload.py refuse_compiled)."""
    refuse_compiled(activation_checkpointing)
    if sharded and activation_checkpointing == "full":
        raise ConfigError("train.compile true with train.activation_checkpointing=full is not supported on more than "
                          "one rank (torch 2.13 fails to save a whole checkpointed block's DeviceMesh): use "
                          "activation_checkpointing selective (it recomputes the gathers too), or train.compile false")


def make_update(optimizer: AdamW, lr_schedule: LRSchedule, grad_clip: float | None, compile: bool | str = False,
                inspect_grads: InspectGrads | None = None, loss_scale: LossScaleConfig | None = None):
    """The optimizer half of a step, shared by the plain and the pipelined step:
    `apply(state, uncounted=(), loss=None) -> (grad_norm, lr, updated)` takes the global
    gradient norm (each rank's share of the squared norm, one scalar all-reduce over the
    world), clips, runs AdamW on the local shards, advances state.step and clears the
    gradients (`optimizer`: AdamW, or train/muon.py's Muon). Parameters named in `uncounted` (a second copy of a tied table) stay out of
    the norm. When the norm (or the given `loss`) is not finite, the parameters and the
    optimizer state are left as they were and `updated` is False: the norm is global, so
    every rank decides the same.

    `inspect_grads(grads)` is called first, on every rank, with {name: gradient} of every
    trainable parameter this rank holds: the gradients accumulated over the step's
    micro-batches (a tied table's copies already summed), before the norm and clipping,
    as the parameters hold them (DTensors in the parameter's layout when sharded). Use it
    to log per-parameter gradient norms or to test gradients. The tensors are the live
    gradients, clipped in place and dropped right after: copy what you keep. Calling
    `.full_tensor()` on one is a collective, so every rank holding that parameter must
    make the same calls in the same order. None (the default) costs nothing.

    `loss_scale` (fp16): the gradients are first divided by state.loss_scale's scale, and
    after the verdict the scale is updated (train/loss_scale.py). AdamW(offload=True)
    (train.optimizer_offload) runs the clip and the update where its moments live, host
    memory (optim.host_update)."""

    def norm_of(grads, replicas):
        return all_reduce_sum(grad_norm_squared_local(grads, replicas)).sqrt()

    # The optimizer's arithmetic (AdamW's, or Muon's with AdamW's for the rest) is compiled;
    # the norm stays eager: it is a few kernels, and a third graph to compile.
    update = optimizer.updater(grad_clip, (lambda fn: compiled(fn, compile)) if compile else None)

    def apply(state: TrainState, uncounted=(), loss: float | None = None) -> tuple[torch.Tensor, float, bool]:
        names = [n for n, p in state.params.items() if p.requires_grad]
        grads = [local_tensor(state.params[n].grad) for n in names]
        replicas = [float("inf") if n in uncounted else replica_count(state.params[n]) for n in names]
        lr = lr_schedule(state.step)
        state.step += 1
        with torch.no_grad():
            if loss_scale is not None:
                unscale(state, grads)
            if inspect_grads is not None:
                inspect_grads({n: state.params[n].grad for n in names})
            norm = norm_of(grads, replicas)
            # One host read per step (the metrics read the norm anyway): a NaN or inf must
            # never reach the weights or the Adam moments.
            finite_loss, finite_grads = loss is None or math.isfinite(loss), math.isfinite(float(norm))
            updated = finite_loss and finite_grads
            if loss_scale is not None:
                state.loss_scale.update(loss_scale, finite_loss, finite_grads)
            if updated:
                update(state, names, grads, lr, norm)
        for n in names:
            state.params[n].grad = None
        return norm, lr, updated

    return apply


def make_eval_step(model: ModelDef, plan=None, device_mesh=None, *, precision: str = "fp32",
                   compile: bool | str = False, fp8_recipe: str = "tensorwise") -> Callable[[dict, dict], float]:
    """Build `evaluate(params, batch) -> mean loss per target token`, without gradients;
    the batch is given as for the train step (micro-steps bound the memory used)."""
    ctx = _context(plan, device_mesh, Policy.of(precision, fp8_recipe))
    loss_sum = _loss_sum(model, ctx)
    if compile:
        loss_sum = compiled(loss_sum, compile)

    @torch.no_grad()
    def evaluate(params: dict, batch: dict) -> float:
        tokens, targets = batch["tokens"], batch["targets"]
        docs = documents(batch)
        total = None
        for m in range(len(tokens)):
            total = _add(total, loss_sum(params, tokens[m], targets[m], docs[m])[0])
        return float(ctx.reduce_sum(total)) / (batch.get("num_targets") or count_targets(targets))

    return evaluate


def _step_context(plan, device_mesh, policy: Policy, traffic: Traffic, compiled: bool):
    """The train step's context and when it reduces gradients: under parallel.zero 1 and 2
    on weights gathered once per step and kept (parallel/keep_gathered.py)."""
    if plan is None or not traffic.keep_gathered:
        ctx = _context(plan, device_mesh, policy, traffic)
        return ctx, GradientSchedule(ctx if plan is not None else None, traffic, None, compiled)
    kept = KeptWeights(plan, device_mesh, list(plan.params), policy, traffic)
    return kept.context, GradientSchedule(kept.context, traffic, kept, compiled)


def _lr_schedule(lr_schedule: LRSchedule | None, schedule: LRSchedule | None, optimizer) -> LRSchedule:
    if schedule is not None:  # the name before 2026-11: "schedule" now means the pipeline's only
        warnings.warn("make_train_step(schedule=...) is now lr_schedule=...", FutureWarning, stacklevel=3)
        lr_schedule = lr_schedule or schedule
    return lr_schedule or LRSchedule(lr=optimizer.lr, kind="constant")


def _context(plan, device_mesh, policy: Policy, traffic: Traffic = Traffic()):
    if plan is None:
        return LocalContext(policy)
    return ShardedContext(plan, device_mesh, policy, traffic)


def _loss_sum(model: ModelDef, ctx):
    """(summed token loss, partial over the token-splitting ranks; the MoE blocks' terms
    or None; with multi-token prediction's inputs and targets per depth, each depth's
    summed loss, else [])."""

    def loss_sum(params, tokens, targets, docs=None, ahead=None, wanted=None):
        if ahead is None:
            logits = model.forward(params, tokens, ctx, docs)
            return ctx.cross_entropy_sum(logits, targets, reduce=False), ctx.moe_aux(), []
        cfg = model.cfg
        logits, depths = model.family.forward_mtp(cfg, params, tokens, ctx, (0, cfg.n_layers), True, ahead, docs)
        sums = [ctx.cross_entropy_sum(d, t, reduce=False) for d, t in zip(depths, wanted)]
        return ctx.cross_entropy_sum(logits, targets, reduce=False), ctx.moe_aux(), sums

    return loss_sum


def documents(batch: dict) -> list[Documents | None]:
    """Per micro-step, the batch's packed documents: its optional "segments" and
    "positions" (each a list like "tokens", laid out as they are), or None; with
    segments, the window a compiled attention looks back over (from this rank's rows)."""
    segments, positions = batch.get("segments"), batch.get("positions")
    n = len(batch["tokens"])
    if segments is None and positions is None:
        return [None] * n
    return [Documents(None if segments is None else segments[m], None if positions is None else positions[m],
                      None if segments is None else document_window(local_tensor(segments[m])))
            for m in range(n)]


def compiled(fn, compile: bool | str, prefetch: int = 0):
    """torch.compile(fn) with the backend `compile` names (True: inductor); `prefetch` > 0
    moves parameter all-gathers ahead and gradient reduce-scatter waits down in the
    compiled graphs (parallel/overlap.py), with inductor and aot_eager (another backend
    compiles the graphs as given). Inductor's peak-memory reordering is then off: it
    moves each gather back to its first use."""
    backend, options = "inductor" if compile is True else compile, None
    if prefetch and backend == "inductor":
        options = {"post_grad_custom_post_pass": inductor_pass(prefetch), "reorder_for_peak_memory": False}
    elif prefetch and backend == "aot_eager":
        backend = aot_eager_overlapped(prefetch)
    # Static shapes: another sequence length or batch recompiles. Dynamo would otherwise
    # make the second length it sees symbolic, which the RoPE table's constant-folded
    # builder cannot take (one process compiling two lengths failed).
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, options=options)


def _local(x: torch.Tensor) -> torch.Tensor:
    """This rank's local value, differentiable (its gradient keeps x's placements)."""
    return x.to_local() if hasattr(x, "to_local") else x


def check_split(tokens: list[torch.Tensor], data_ranks: int) -> None:
    """A micro-step's sequences must split evenly over the data-parallel ranks."""
    if tokens[0].shape[0] % data_ranks:
        raise ConfigError(f"batch: {tokens[0].shape[0]} sequences per micro-step cannot be split evenly over "
                          f"{data_ranks} data-parallel ranks (dp x fsdp); use a multiple of {data_ranks}")


def full_value(x: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor that may be a DTensor (gathered or reduced)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def count_targets(targets) -> int:
    """Target tokens (>= 0) in the whole global batch, also when each rank holds a part."""
    return int(sum(full_value((t >= 0).sum()).item() for t in targets))
