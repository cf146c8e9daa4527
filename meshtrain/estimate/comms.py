"""Every collective of one training step, predicted from the plan alone (`meshtrain plan`).

`step_collectives` plays the family's own forward, recorded once on the meta device
(models/recording.py: every parameter lookup, constrain, attention and MoE call, in
logical axes), on the plan: the `Walker` (walker.py) says what `ShardedContext`
(parallel/) and `step` (train/step.py) issue for each call, with placements as plain
data and no process group, so it works on a pure plan at any world size. One dense block
and one MoE block are each recorded once and multiplied by how many of them the model
has. The recording is of the model; the table below, of the runtime:
`tests/test_comms_estimate.py` runs real steps on the fake process group and checks that
this table and the runtime issue the same collectives (count and bytes per axis, op and
phase), so a change to one without the other fails there.

What each runtime call issues (one micro-step unless said; `redistribute` below is the
DTensor rule per mesh dim: P->R all-reduce, P->S reduce-scatter, S->R all-gather, R->S
and equal placements nothing, S(i)->S(j) all-to-all):

| call | forward | backward |
|---|---|---|
| parameter lookup, bucket="param" (`_UseParam`; with buckets too: strided or nested shards, frozen tensors, a bucket this rank does not hold whole) | stored -> compute placements (all-gather over fsdp), compute dtype | gradient, in the parameter dtype, redistributed to the stored dims first (reduce-scatter), then to the replicated ones (all-reduce of the shard) |
| the same, eager with reshard_after_forward | | the gather again for every tensor autograd saved of it (`saves` below) |
| the same, compiled with reshard_after_forward | | the gather again once, where backward first needs it, for a lookup autograd saved (the gather is recomputed, not kept) |
| parameter lookup, bucket="block" or MB (`_BoundParams`, `BucketGather`; buckets of layout/buckets.py `plan_buckets`, each on one mesh: expert weights' on the expert mesh, over its groups) | the first lookup of a bucket, unless it is the bucket gathered last, gathers all of it: one all-gather per gather set (members with the same gathered mesh dims and compute dtype), over those dims as one group, of the shards padded to the largest rank's in one buffer (ways x padded shards x c bytes); and issues the next `prefetch` buckets' gathers (taken by their first lookup). A `reused` table is kept from its first lookup | per gather of a bucket with a trainable member used: one reduce-scatter per gather set (parameter dtype), then one all-reduce of what is still partial (dp replicas; tp, for weights used whole under sequence parallelism), one per distinct set of mesh dims, over them as one group; a member without gradient counts as Partial over the data dims |
| the same, eager with reshard_after_forward | | the bucket gathered again (every set) once per run of saved uses of its gathered members, in the order autograd saved them |
| the same, compiled (`traced_gather`) | the same gathers (issued `prefetch` gathers ahead by a pass on the compiled graph, parallel/overlap.py) | the same reductions: the reduce-scatters in the graph on every micro-step, the all-reduces once per step after the last backward (`ShardedContext.reduce_held`, the same calls as the eager step's last micro-step); with reshard_after_forward each bucket with a saved gathered member gathered again once (recomputed) |
| the same, kept gathered: parallel.zero 1 and 2, or a pp rank under parallel.pp_keep_gathered (parallel/keep_gathered.py; eager or compiled) | once per step, at the bucket's first lookup in the first micro-batch (compiled: all before it): each bucket gathered once, one all-gather per gather set (compute dtype; the router fp32); a parameter in no bucket by its own redistribute, once; nothing per micro-batch | the step's fp32 gradient sums, once per step (zero 2: per micro-batch), each bucket's in the last backward once its gradients are complete (eager) or after it: per bucket one reduce-scatter per gather set (fp32), then one all-reduce per distinct set of dims still partial; none gathered again (`parameters="kept"`) |
| `constrain(x)` | source -> target placements | incoming gradient -> source, its Partials taken as Replicate |
| `embedding` (vocab split) | output Partial over the table's vocab dims | none (the table gradient is Partial over token-sharding dims) |
| `attention` (sequence split over cp) | allgather: one all-gather of K/V; a2a: two all-to-alls; ring: cp-1 sends (and receives) of a K/V block | allgather: one fp32 reduce-scatter of dK/dV; a2a: two all-to-alls; ring: cp-1 K/V blocks and cp fp32 dK/dV blocks sent |
| `cross_entropy_sum` | all-reduce max (rows) and sum (2 x rows) per vocab dim, fp32; the loss left a partial sum over the token-sharding dims | none |
| the step's loss (`reduce_sum`, once per step) | the micro-steps' sum: one fp32 scalar all-reduce over the token-sharding dims as one group (a pipeline step instead reduces each micro-step's, one all-reduce per dim: `loss_once` False) | |
| `moe` (MoE block, sharded_moe.py) | router and expert weights gathered (experts over the expert mesh's fsdp); balance == "aux": the per-sequence sums (prob, counts; fp32, (batch, E)) all-reduced over cp, then the scalar loss over each batch dim; z_loss_coef > 0: the scalar over each token-splitting dim; ep > 1: one all-to-all of the per-expert counts (int64, E), then the routed rows out (dispatch) and back (combine) | gradients back as for any lookup, and eager re-gathers of what autograd keeps (the experts; the router in fp32 only, bf16 keeps its fp32 copy); experts Partial over the expert mesh's dp/fsdp; experts split over tp: rows (c) and gates (fp32) all-reduced over tp; ep > 1: the two row all-to-alls mirrored |
| `update` | | one fp32 scalar all-reduce over the world (optimizer phase, once per step) |
| the step's MoE load | the per-expert load (MoE layers x E, fp32), summed over micro-steps, all-reduced over each token-splitting dim once per step, after `update` (so forward by the recorder's phases) | |

A parameter's gradient is Partial on a mesh dim where it is used Replicated on an
activation sharded on that dim (batch, or the sequence under SP), Shard where it is used
sharded. A linear's output is Shard(last) where its weight splits dim 0, Partial where
it splits dim 1 against a Shard(last) input; its input gradient is Partial where the
weight splits dim 0. Assumptions: the batch is given as full tensors (counting targets
and the logged loss need no collective); activations and their gradients move in the
compute dtype; uneven shards are padded to a multiple of the group (as DTensor does);
when one redistribute changes several mesh dims, the all-gathers go first, innermost
mesh dim first, and the rest follow in mesh order (as DTensor does).

Bytes are per rank, as tests/test_collectives.py records them: all_gather the gathered
output, reduce_scatter the input, all_reduce the tensor, all_to_all_single the input
(the part a rank sends to itself included). Ops are named as it names them
(`all_gather`, `reduce_scatter_sum`, `all_reduce_sum`, `all_reduce_max`,
`all_to_all_single`); an all-reduce over the whole world of a mesh with several dims has
axis "world". Bucket traffic and the step's loss run on process groups of their own
(parallel/bucket_groups.py `Groups`), one per set of mesh dims, named as GROUP_AXES names
them: their axes joined by "+" ("fsdp", "dp+fsdp", "fsdp+cp"). Expert weights live on
the expert mesh (`plan.mesh.experts()`, fsdp x cp refolded as fsdp x ep): their
collectives are named by its axes (its "fsdp" is the refolded group, counted under
"fsdp" with the dense one).

Activation checkpointing: full recomputes each block in backward, issuing its
activation collectives again up to the last (its output's reduction: the recompute stops
when backward has what it needs); selective changes no count. Not modelled: an MoE
block's recompute (its all-to-alls under full checkpointing, the ones selective
recomputes), and the zero-bubble schedule's split backward (on stages after the first,
both halves gather saved weights again).

Expert all-to-alls (axis "ep", MoE blocks with ep > 1) are routing-dependent; everything
else in an MoE block is sized by the plan and counted exactly. Their count is exact: per
MoE block per micro-step, forward: one of the counts (int64, E elements) and two of token
rows (dispatch, combine); backward: two (autograd mirrors dispatch and combine). Their
bytes are the uniform-routing expectation: each rank routes its T local tokens x top_k
rows of `dim` elements in the compute dtype (with a capacity factor, at most E x the
capacity of them are kept), and receives as many as it sends, so each of the four row
all-to-alls has T x top_k x dim x c bytes of input. Dropless, the forward dispatch and
the backward of the combine are exactly that whatever the routing; the other two move
the rows that this rank's experts received. Of these bytes, the fraction (ep - 1) / ep
is expected to leave the rank (the rest are rows for its own experts, which the
collective copies locally): `expert_exchange` gives both per MoE layer per micro-step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import torch
from torch.distributed.tensor import Replicate, Shard

from ..errors import ConfigError
from ..models import ModelDef
from ..models.family import BLOCK_IN
from ..models.policy import Policy
from ..models.recorded import record_block, record_ends
from ..layout.buckets import group_dims, plan_buckets
from ..layout.traffic import Traffic, check_bucket
from ..layout.plan import Plan
from ..train.muon import muon_name
from .bucket_replay import bucket_traffic
from .collective_tally import CollectiveTally
from .dtype_bytes import BF16, FP32, INT64
from .placement_rules import P, PlacementRules, R
from .walker import Walker, routed_rows

PHASES = {"fwd": "forward", "bwd": "backward", "opt": "optimizer"}


def _block_kinds(model: ModelDef, layers) -> dict[str, list[int]]:
    """The layer indices a rank runs, by kind ("dense", "moe"). `layers`: None (all), a
    count (the first that many; only without MoE blocks) or the indices themselves."""
    cfg = model.cfg
    moe = set(getattr(cfg, "moe_layers", ()) or ())
    if layers is None:
        ids = list(range(cfg.n_layers))
    elif isinstance(layers, int):
        if moe:
            raise ConfigError("collective estimate: a layer count cannot say which blocks are MoE; give the "
                              "layer indices (as the pipeline estimate does)")
        ids = list(range(layers))
    else:
        ids = list(layers)
    return {"dense": [i for i in ids if i not in moe], "moe": [i for i in ids if i in moe]}


def step_collectives(plan: Plan, model: ModelDef, *, micro_batch_rows: int, seq_len: int, micro_steps: int,
                     precision: str = "fp32", compiled: bool = False, layers=None,
                     embedding: bool = True, head: bool = True, traffic: Traffic = Traffic(), names=None,
                     loss_once: bool = True, activation_checkpointing: str = "none", parameters: str | None = None,
                     activations: bool = True, optimizer: str = "adamw") -> list[dict]:
    """The collectives of one optimizer step: dicts {axis, op, phase, count, bytes}, one per
    (axis, op, phase); bytes are the total per rank over the step. `micro_batch_rows` is
    the sequences of one micro-step over all data-parallel ranks (micro_batch x dp x fsdp).
    `traffic`: the step's parameter traffic, as make_train_step takes it (bucket "param":
    one collective per parameter; fsdp_accumulate "unsharded": a plain bucketed step
    reduce-scatters once per step; keep_gathered, parallel.zero 1 and 2: `parameters` "kept"
    unless `parameters` says otherwise). A pipeline rank (plan: the stage plan without pp) runs `layers`
    layers (a count, or their indices) and the embedding and head only where it holds
    them, and holds `names` (default: those); its point-to-point traffic is counted by
    meshtrain/estimate/pipeline.py, and its loss is reduced in every micro-step
    (`loss_once` False), not once per step. Dense and MoE blocks' activations are each
    recorded once (their first layer) and multiplied by how many of them run; every
    layer's parameter lookups are replayed over the plan's buckets (with bucket "param",
    none: each lookup is its own collectives).
    `activation_checkpointing` "full": each block's recompute issues its activation
    collectives again in backward, but for the last (the block output's reduction);
    "selective" changes no count (the sp gathers it recomputes replace the re-gathers of
    kept shards; reductions and attention are kept).

    `parameters`: the parameters' traffic "each" micro-step, as above; "kept", as a step
    under parallel.zero 1 (or a pp rank under parallel.pp_keep_gathered) issues it, once
    per step: each bucket gathered once before the first micro-batch, in the parameters'
    dtype (fp32: gather sets by it, whatever the compute dtype), nothing gathered again
    in backward, and after the last backward the gradients reduced once (per bucket one
    reduce-scatter per gather set, then one all-reduce per set of dims still partial); a
    parameter in no bucket redistributed there and back once, fp32; under zero 2 the
    reductions after every micro-batch's backward; "none": left out; None: "kept" when
    `traffic` keeps the weights gathered, else "each". `activations` False leaves out
    everything else (activations, loss, MoE load, grad norm, Muon's exchanges).
    `optimizer` muon: each Muon matrix's fp32 update assembled whole once per step
    (train/muon.py), counted as the runtime exchanges it."""
    parameters = parameters or ("kept" if traffic.keep_gathered else "each")
    _check_step(precision, parameters)
    unit = check_bucket(traffic.bucket)
    c = _check_batch(plan, micro_batch_rows, precision)
    kinds = _block_kinds(model, layers)
    reshard = traffic.reshard_after_forward

    def walker(c=c, eager=not compiled and reshard, recompute=compiled and reshard):
        return Walker(plan, micro_batch_rows, seq_len, c, eager=eager, defer=True, recompute=recompute,
                      keep_shards=True)

    parts, rest, events = _play_model(model, kinds, walker, embedding, head, recompute=activation_checkpointing == "full")
    held = set(names) if names is not None else _held(plan, model, kinds, embedding, head)
    tallies = _parameter_tallies(plan, walker, events, held, parameters, precision, traffic, compiled, loss_once,
                                 micro_steps)
    if activations:
        tallies += [(part.tally, times * micro_steps) for part, times in parts]
        tallies.append((_once_per_step(plan, model, kinds, rest, unit, loss_once, micro_steps), 1))
        if optimizer == "muon":
            tallies.append((_muon_traffic(plan, held), 1))
    total = _summed(tallies)
    if activations and plan.mesh.world > 1:  # the squared grad norm, fp32, over the world
        axis = plan.mesh.axes[0] if len(plan.mesh.axes) == 1 else "world"
        total[("opt", "all_reduce_sum", axis)] = [1, 4]
    return _entries(total)


def _muon_traffic(plan: Plan, held: set[str]) -> CollectiveTally:
    """Muon's whole matrices (train/muon.py, assemble "owner"), on each parameter's own
    mesh (the expert mesh for experts): the held Muon matrices of one shape and layout
    stacked, their fp32 updates redistributed so that each rank holds whole ones, the
    bf16 results back; a strided parameter's update gathered whole (full_tensor)."""
    tally, rules, groups = CollectiveTally(plan.mesh), PlacementRules(plan), {}
    for name in sorted(held):
        p = plan.params[name]
        if not (p.spec.trainable and muon_name(name, len(p.spec.shape))):
            continue
        stored = rules.stored(name)
        if any(type(x) not in (Shard, Replicate) for x in p.placements):
            tally.redistribute("opt", p.spec.shape, stored, (R,) * len(stored), FP32, mesh=p.mesh)
        elif any(x != R for x in stored):
            groups.setdefault((tuple(p.spec.shape), stored, p.mesh), []).append(name)
    for (shape, stored, mesh), names in groups.items():
        stacked = (len(names),) + shape
        source = tuple(("S", x[1] + 1) if x != R else x for x in stored)
        owned = tuple(("S", 0) if x != R else x for x in stored)
        for order, start, end, itemsize in ((range(len(stored)), source, owned, FP32),
                                            (reversed(range(len(stored))), owned, source, BF16)):
            cur = list(start)  # one mesh dim at a time, as train/muon.py's stepwise
            for i in order:
                if cur[i] != end[i]:
                    step = cur[:i] + [end[i]] + cur[i + 1:]
                    tally.redistribute("opt", stacked, tuple(cur), tuple(step), itemsize, mesh=mesh)
                    cur = step
    return tally


def _check_step(precision: str, parameters: str):
    if precision not in ("fp32", "bf16", "fp16", "fp8"):
        raise ConfigError(f"train.precision={precision!r}: choose fp32, bf16, fp16 or fp8")
    if parameters not in ("each", "kept", "none"):
        raise ValueError(f"parameters={parameters!r}: choose each, kept or none")


def _parameter_tallies(plan: Plan, walker, events, held: set[str], parameters: str, precision: str,
                       traffic: Traffic, compiled: bool, loss_once: bool,
                       micro_steps: int) -> list[tuple[CollectiveTally, int]]:
    """The parameters' traffic as (tally, times per step): `parameters` "kept" once per
    step; "each" per micro-step, with what a plain step reduces once per step apart;
    "none" nothing."""
    if parameters == "kept":  # in the compute dtype, gathered once: none again
        params = walker(eager=False, recompute=False)
        # Each bucket gathered once, at its first lookup in the first micro-batch.
        bucket_traffic(params, events, held, Policy.of(precision), replace(traffic, prefetch=0), keep=True)
        if traffic.zero != 2:
            return [(params.tally, 1)]
        # ZeRO-2: the reductions after every micro-batch's backward.
        gathers, reductions = CollectiveTally(plan.mesh), CollectiveTally(plan.mesh)
        for key, entry in params.tally.out.items():
            (reductions if key[0] == "bwd" else gathers).out[key] = list(entry)
        return [(gathers, 1), (reductions, micro_steps)]
    if parameters != "each":
        return []
    # A plain step (eager or compiled) reduces what is left partial after the
    # reduce-scatters once per step (held over micro-steps); a pipeline rank on every
    # micro-step. A compiled step gathers each bucket where it is first looked up.
    params, per_step = walker(), CollectiveTally(plan.mesh) if loss_once else None
    bucket_traffic(params, events, held, Policy.of(precision), replace(traffic, prefetch=0) if compiled else traffic,
                   per_step)
    return [(params.tally, micro_steps)] + ([(per_step, 1)] if per_step is not None else [])


def _once_per_step(plan: Plan, model: ModelDef, kinds: dict, rest: Walker, unit, loss_once: bool,
                   micro_steps: int) -> CollectiveTally:
    """The loss's reduction (`rest`: the walker of the head and the multi-token prediction
    modules after it, whose per-depth losses are reduced once more, as one tensor) and the
    MoE load's (the blocks' and the modules')."""
    once, n = CollectiveTally(plan.mesh), len(plan.mesh.axes)
    if rest.loss_dims:  # the loss, a partial sum over the token-splitting dims (fp32 scalar)
        dims = rest.loss_dims
        partial = tuple(P if i in dims else R for i in range(n))
        depths = rest.losses - 1  # the multi-token prediction modules' losses, reduced as one tensor
        for shape in [()] + ([(depths,)] if depths else []):
            if not loss_once:  # every micro-step: DTensor's all-reduce per dim
                once.redistribute("fwd", shape, partial, (R,) * n, FP32, n=micro_steps)
            elif dims in group_dims(plan_buckets(plan, unit)[0], plan):  # once per step, one group
                once.add_group("fwd", "all_reduce_sum", dims, FP32 * math.prod(shape))
            else:  # once per step, with no group over these dims: dim by dim
                once.redistribute("fwd", shape, partial, (R,) * n, FP32)
    moe_blocks = len(kinds["moe"]) + rest.moe_calls
    if moe_blocks:  # the per-expert load (MoE blocks x E, fp32), summed over micro-steps, all-reduced
        # once per step, after the update (outside it: counted as forward, as recorded)
        tokens = rest.act(BLOCK_IN)
        once.redistribute("fwd", (moe_blocks, model.cfg.moe.num_experts),
                          tuple(P if q[0] == "S" else R for q in tokens), (R,) * len(tokens), FP32)
    return once


def _summed(tallies: list[tuple[CollectiveTally, int]]) -> dict[tuple, list[int]]:
    """(phase, op, axis) -> [count, bytes] over the tallies, each counted `times`."""
    total: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for tally, times in tallies:
        for key, (n, nbytes) in tally.out.items():
            total[key][0] += n * times
            total[key][1] += nbytes * times
    return total


def _entries(total: dict[tuple, list[int]]) -> list[dict]:
    """(phase, op, axis) -> [count, bytes] as step_collectives' dicts, in phase order."""
    return [{"axis": axis, "op": op, "phase": PHASES[phase], "count": n, "bytes": nbytes}
            for (phase, op, axis), (n, nbytes) in sorted(total.items(), key=lambda kv: (list(PHASES).index(kv[0][0]), kv[0]))]


def _play_model(model: ModelDef, kinds: dict, walker, embedding: bool, head: bool, recompute: bool = False):
    """The recorded forward (models/recording.py) played on walkers: ([(walker, times per
    micro-step)], the walker of the embedding and head, every parameter lookup in order).
    Dense and MoE blocks are each recorded once (their first layer); the lookups of the
    others are that recording's, renamed. `recompute`: the ctx.remat regions (blocks, an
    MTP module's too) recomputed whole in backward (full checkpointing)."""
    probe = walker()
    B, S, dtype = probe.B, probe.S, torch.float32 if probe.c is None else torch.bfloat16
    parts, first = [], {}  # (walker, times per micro-step); kind -> (walker, the layer it played)
    for kind in ("dense", "moe"):
        if kinds[kind]:
            block = walker()
            block.full_checkpointing = recompute
            block.play(record_block(model, kinds[kind][0], B, S, dtype).events)
            parts.append((block, len(kinds[kind])))
            first[kind] = (block, kinds[kind][0])
    rest = probe
    rest.full_checkpointing = recompute  # the multi-token prediction modules' blocks
    front, back = record_ends(model, embedding, head, B, S, dtype, mtp=True)
    rest.play(front.events)
    split = len(rest.events)
    rest.play(back.events)
    if head:
        for logits in (back.out, *back.outs):
            rest.loss(rest.layout(logits))
    parts.append((rest, 1))
    events = rest.events[:split]
    for i in sorted(i for ids in kinds.values() for i in ids):
        block, j = first["moe" if i in kinds["moe"] else "dense"]
        was, now = f"layers.{j}.", f"layers.{i}."
        events += [(e[0], now + e[1][len(was):] if e[1].startswith(was) else e[1], *e[2:]) for e in block.events]
    events += rest.events[split:]
    return parts, rest, events


def backward_regathers(plan: Plan, model: ModelDef, *, micro_batch_rows: int, seq_len: int, layers, names,
                       embedding: bool = True, head: bool = True, precision: str = "fp32",
                       traffic: Traffic = Traffic()) -> list[tuple[int, dict]]:
    """What the eager backward of one micro-batch of these layers (a pipeline stage, on a
    rank holding `names`) gathers again with `traffic`'s buckets and prefetch, in the
    order it does: (bucket index, {(phase, op, axis): [count, bytes]}) each. The runtime
    keeps the bucket gathered last until the next forward, so a backward that starts
    with it gathers it once fewer (pipeline.py counts that from the schedule)."""
    if check_bucket(traffic.bucket) == "param":
        return []
    c = _check_batch(plan, micro_batch_rows, precision)
    kinds = _block_kinds(model, layers)
    walker = lambda: Walker(plan, micro_batch_rows, seq_len, c, eager=True, defer=True)  # noqa: E731
    _, _, events = _play_model(model, kinds, walker, embedding, head)
    return bucket_traffic(walker(), events, set(names), Policy.of(precision), traffic)


def _held(plan: Plan, model: ModelDef, kinds: dict, embedding: bool, head: bool) -> set[str]:
    """The parameters a rank holds that runs these layers, and the embedding and head
    where it holds them: the blocks' own, those before the first block (embedding) and
    after the last (head), and a tied table beside the head."""
    ids = {i for v in kinds.values() for i in v}
    out, seen_block = set(), False
    for name in plan.params:
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1:
            seen_block = True
            if int(parts[1]) in ids:
                out.add(name)
        elif (head if seen_block else embedding):
            out.add(name)
    if head and model.cfg.tie_embeddings:
        out.add("tok_emb")
    return out


def _check_batch(plan: Plan, micro_batch_rows: int, precision: str):
    """The compute dtype's bytes (None: each parameter's own) after checking the batch splits."""
    data = plan.mesh.dp * plan.mesh.fsdp
    if micro_batch_rows % data:
        raise ConfigError(f"{micro_batch_rows} sequences per micro-step cannot be split over {data} "
                          "data-parallel ranks (dp x fsdp)")
    return 2 if precision in ("bf16", "fp16", "fp8") else None  # fp8: bf16 gathers and activations


def expert_exchange(plan: Plan, model: ModelDef, *, micro_batch_rows: int, seq_len: int,
                    precision: str = "fp32") -> dict | None:
    """The expert all-to-alls over ep of one MoE layer in one micro-step, per rank, at the
    uniform-routing expectation (module docstring); None without MoE blocks or with ep 1.
    rows: routing slots the rank sends (T local tokens x top_k); bytes: the four token
    all-to-alls (dispatch and combine, forward and backward) as step_collectives counts
    them (the whole input, the rows that stay on the rank included) plus the counts
    exchange; leaving_bytes: the expected share that leaves the rank, (ep - 1) / ep."""
    cfg = model.cfg
    moe_layers = getattr(cfg, "moe_layers", ()) or ()
    if not moe_layers or plan.mesh.experts().ep == 1:
        return None
    if precision not in ("fp32", "bf16", "fp16", "fp8"):
        raise ConfigError(f"train.precision={precision!r}: choose fp32, bf16, fp16 or fp8")
    c = _check_batch(plan, micro_batch_rows, precision) or 4
    w = Walker(plan, micro_batch_rows, seq_len, c, eager=True)
    ep, m = plan.mesh.experts().ep, cfg.moe
    rows = routed_rows(w, m)
    tokens = 4 * c * rows * cfg.dim
    counts = INT64 * m.num_experts
    return {"ep": ep, "moe_layers": len(moe_layers), "rows": rows, "row_bytes": c * cfg.dim,
            "all_to_alls": 5, "token_bytes": tokens, "counts_bytes": counts, "bytes": tokens + counts,
            "leaving_bytes": (tokens + counts) * (ep - 1) // ep}

