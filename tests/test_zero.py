"""parallel.zero 1 and 2 (Megatron's distributed optimizer; parallel/keep_gathered.py):
the weights gathered once per step and kept over the micro-batches, the gradients
reduce-scattered once per step (1) or after every micro-batch (2), the fp32 shards and
AdamW's moments sharded as under ZeRO-3.

Each layout trains 6 steps of 2 micro-batches (4 on the pipeline) at zero 1 and 2, eager
and compiled (aot_eager), against one process: loss and gradient norm per step (rtol
1e-5, clipping engaged on every step), the first step's whole gradients, the final
parameters. The recorded collectives of a step are the planner's; the planner's state
bytes at each stage are the tensors a step holds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.layout.traffic import Traffic
from meshtrain.models.moe import MoeConfig
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks

from support.equivalence import (CFG, GRAD_ATOL, LOSS_RTOL, NORM_RTOL, PARAM_ATOL, GradRecorder, batches,
                                 optimizer_args, whole)

# Block 1 of 2 with 4 experts (top 2), on ep2 of the fsdp ranks.
MOE_CFG = dataclasses.replace(CFG, moe=MoeConfig(num_experts=4, top_k=2, expert_ffn_dim=32, layers="1:", aux_coef=0.1))
LLAMA4 = dataclasses.replace(CFG, n_layers=4)
# name: (config, mesh sizes, sequence parallel)
LAYOUTS = {
    2: {"fsdp2": (CFG, {"fsdp": 2}, False)},
    4: {"dp2_fsdp2": (CFG, {"dp": 2, "fsdp": 2}, False), "fsdp2_tp2_sp": (CFG, {"fsdp": 2, "tp": 2}, True),
        "ep2_fsdp4": (MOE_CFG, {"fsdp": 4, "ep": 2}, False), "pp2_fsdp2": (LLAMA4, {"pp": 2, "fsdp": 2}, False)},
}
MODES = [(zero, compile) for zero in (1, 2) for compile in (False, "aot_eager")]
# bf16 against ZeRO-3's bf16 step: the same bf16 weights (cast, then gathered), the same
# bf16 gradients, summed in fp32 over micro-batches and ranks in another order.
BF16_MODES = [(3, False), (1, False), (2, "aot_eager")]


def _zero(stage: int) -> Traffic:
    return Traffic(keep_gathered=True, zero=stage)


def single_process(cfg, micro_steps: int):
    model = build("llama", cfg)
    params = {n: init_slice(s, n, seed=0).requires_grad_(s.trainable) for n, s in model.specs.items()}
    recorder = GradRecorder()
    step = make_train_step(model, inspect_grads=recorder, **optimizer_args())
    state = TrainState.create(params)
    metrics = [step(state, b) for b in batches(micro_steps)]
    return [(m["loss"], m["grad_norm"]) for m in metrics], whole(params), recorder.grads[1]


def _layout(cfg, sizes, sp, zero, compile, precision="fp32"):
    import torch.distributed as dist

    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=dist.get_world_size())
    mesh = plan.mesh.build()
    params = init_params(plan, mesh, seed=0)
    recorder = GradRecorder()
    step = make_train_step(model, plan, mesh, inspect_grads=recorder, compile=compile,
                           traffic=_zero(zero) if zero < 3 else Traffic(), precision=precision, **optimizer_args())
    state = TrainState.create(params)
    metrics = [step(state, b) for b in batches(2)]
    return [(m["loss"], m["grad_norm"]) for m in metrics], whole(params), recorder.grads[1]


def _pipelined(cfg, sizes, zero, compile):
    """This rank's stages of pp 2 (1F1B, 4 micro-batches): metrics and what it holds."""
    import torch.distributed as dist

    from meshtrain.pipeline.partition import partition
    from meshtrain.pipeline.schedule import build_pipeline_schedule
    from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step

    model = build("llama", cfg)
    plan = make_plan(model.specs, Rules.default(), MeshSpec(**sizes), world=dist.get_world_size())
    mesh = plan.mesh.build()
    rows = batches(4).__next__()["tokens"].shape[1]
    stages = partition(model, 2, seq_len=16, micro_batch=rows)
    mine, sub_plan, sub_mesh = local_stage_layout(plan, mesh, stages)
    params = init_params(sub_plan, sub_mesh, seed=0, names=mine)
    recorder, opt = GradRecorder(), optimizer_args()
    step = make_pipeline_step(model, stages, build_pipeline_schedule("1f1b", 2, 4), plan, mesh, inspect_grads=recorder,
                              compile=compile, traffic=_zero(zero), optimizer=opt["optimizer"],
                              lr_schedule=opt["lr_schedule"], grad_clip=opt["grad_clip"])
    state = TrainState.create(params)
    metrics = [step(state, b) for b in batches(4)]
    return [(m["loss"], m["grad_norm"]) for m in metrics], whole(params), recorder.grads[1]


def train_layouts(world: int):
    """Runs on every rank: each layout of this world at each zero stage, eager and compiled
    (world 2: and fsdp2 under bf16, BF16_MODES)."""
    torch.set_num_threads(1)
    out = {}
    for name, (cfg, sizes, sp) in LAYOUTS[world].items():
        for zero, compile in MODES:
            torch._dynamo.reset()
            with torch._dynamo.config.patch(error_on_recompile=True):
                if "pp" in sizes:
                    out[name, zero, compile] = _pipelined(cfg, sizes, zero, compile)
                else:
                    out[name, zero, compile] = _layout(cfg, sizes, sp, zero, compile)
    if world == 2:  # bf16: the weights kept in bf16, their gradients summed in fp32
        for zero, compile in BF16_MODES:
            torch._dynamo.reset()
            out["fsdp2 bf16", zero, compile] = _layout(CFG, {"fsdp": 2}, False, zero, compile, "bf16")
    return out


@pytest.fixture(scope="module")
def references():
    return {"dense": single_process(CFG, 2), "moe": single_process(MOE_CFG, 2), "llama4": single_process(LLAMA4, 4)}


def _reference(references, cfg):
    return references["moe" if cfg is MOE_CFG else "llama4" if cfg is LLAMA4 else "dense"]


def _assert_bf16_equals_zero_3(results):
    """fsdp2 under bf16: zero 1 and 2 against zero 3, at the fp32 suite's tolerances."""
    for rank_out in results:
        ref_metrics, ref_params, ref_grads = rank_out.pop(("fsdp2 bf16", 3, False))
        for zero, compile in BF16_MODES[1:]:
            metrics, params, grads = rank_out.pop(("fsdp2 bf16", zero, compile))
            what = f"bf16 zero {zero}{' compiled' if compile else ''}"
            torch.testing.assert_close(torch.tensor(metrics), torch.tensor(ref_metrics), rtol=LOSS_RTOL, atol=0,
                                       msg=lambda m: f"{what} against zero 3: {m}")
            for n, g in grads.items():
                torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=GRAD_ATOL, msg=lambda m: f"{what} {n}: {m}")
            for n, p in params.items():
                torch.testing.assert_close(p, ref_params[n], rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{what} {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero_1_and_2_equal_one_process(references, world):
    results = run_ranks(train_layouts, world, world)
    if world == 2:
        _assert_bf16_equals_zero_3(results)
    held: dict = {}
    for rank_out in results:
        for (name, zero, compile), (metrics, params, grads) in rank_out.items():
            what = f"{name} zero {zero}{' compiled' if compile else ''}"
            ref_metrics, ref_params, ref_grads = _reference(references, LAYOUTS[world][name][0])
            assert all(norm > 1.5 * optimizer_args()["grad_clip"] for _, norm in ref_metrics)  # clipping engages
            torch.testing.assert_close(torch.tensor([m[0] for m in metrics]), torch.tensor([m[0] for m in ref_metrics]),
                                       rtol=LOSS_RTOL, atol=0, msg=lambda m: f"{what} losses: {m}")
            torch.testing.assert_close(torch.tensor([m[1] for m in metrics]), torch.tensor([m[1] for m in ref_metrics]),
                                       rtol=NORM_RTOL, atol=0, msg=lambda m: f"{what} gradient norms: {m}")
            assert sorted(grads) == sorted(n for n in params if n in ref_grads), what
            for n, g in grads.items():
                torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=GRAD_ATOL,
                                           msg=lambda m: f"{what} step-1 gradient of {n}: {m}")
            for n, p in params.items():
                torch.testing.assert_close(p, ref_params[n], rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{what} {n}: {m}")
                held.setdefault((name, zero, compile), set()).add(n)
    for (name, zero, compile), names in held.items():  # every parameter lives on some rank
        assert names == set(_reference(references, LAYOUTS[world][name][0])[1]), (name, zero, compile)


# --- the planner: collectives and state bytes -----------------------------------------------

# name: (mesh sizes, sequence parallel, world); fake process group, rank 0
PLANNED = {"fsdp2": ({"fsdp": 2}, False, 2), "dp2_fsdp2": ({"dp": 2, "fsdp": 2}, False, 4),
           "fsdp2_tp2_sp": ({"fsdp": 2, "tp": 2}, True, 4)}
MICRO = 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("name", list(PLANNED))
def test_recorded_collectives_are_the_planners(name, zero, precision):
    """A step of 2 micro-batches: each bucket all-gathered once, in the first, and
    reduce-scattered once in and after the last backward (zero 1) or each (zero 2): no
    gather in backward, none per micro-batch; equal to `meshtrain plan`'s, bytes included
    (under bf16 the gathers move bf16, the reductions fp32)."""
    from support.collectives import CFG as SMALL, run_model_step
    from support.comms import assert_same, estimate, totals

    sizes, sp, world = PLANNED[name]
    model = build("llama", SMALL)
    step = dict(bucket="block", sp=sp, batch=4, seq=8, micro=MICRO, world=world, precision=precision)
    recorded = totals(run_model_step(model, sizes, **step, traffic=dataclasses.replace(_zero(zero), bucket="block")))
    assert_same(estimate(model, sizes, **step, keep_gathered=True, zero=zero), recorded)
    buckets = SMALL.n_layers + 2  # a bucket per block, before the blocks and after them
    assert recorded[("fwd", "all_gather", "fsdp")][0] == buckets
    assert not any(op == "all_gather" and axis == "fsdp" for phase, op, axis in recorded if phase == "bwd")
    reductions = MICRO if zero == 2 else 1
    assert recorded[("bwd", "reduce_scatter_sum", "fsdp")][0] == buckets * reductions
    # the weights gathered in the compute dtype, their gradients reduced in fp32
    width = 2 if precision == "bf16" else 1
    assert recorded[("fwd", "all_gather", "fsdp")][1] * width * reductions == \
        recorded[("bwd", "reduce_scatter_sum", "fsdp")][1]


def _measured_state(sizes: dict, sp: bool, world: int, zero: int, precision: str) -> dict:
    """Rank 0's tensors at each stage of a kept step: the gathered weights, the whole
    gradients' fp32 sums at the last backward's end (zero 1: summed over the
    micro-batches; zero 2: that micro-batch's), then the shards' gradients and AdamW's
    moments."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.estimate.weight_memory import is_gathered
    from meshtrain.layout.placements import local_tensor
    from meshtrain.models.policy import Policy
    from meshtrain.parallel.keep_gathered import KeptWeights
    from meshtrain.train.optim import init_state

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model = build("llama", CFG)
        plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=world)
        mesh = plan.mesh.build()
        params = init_params(plan, mesh, seed=0)
        kept = KeptWeights(plan, mesh, list(plan.params), Policy.of(precision), _zero(zero))
        leaves = kept.gather(params)
        assert all(is_gathered(plan, n) for n in plan.params)  # so every kept weight is new memory
        out = {"kept_weights": sum(local_tensor(leaves[n]).nbytes for n in plan.params)}
        for micro, b in enumerate(next(batches(MICRO))["tokens"]):
            logits = model.forward(leaves, b, kept.context)
            kept.context.cross_entropy_sum(logits, b, reduce=False).to_local().float().backward()
            whole_grads = sum(t.nbytes for t in kept.sums().values())
            if zero == 2:
                kept.release()
        if zero == 1:
            kept.release()
        out["kept_grads" if zero == 1 else "micro_grads"] = whole_grads
        out["grads"] = sum(local_tensor(p.grad).nbytes for p in params.values() if p.grad is not None)
        out["params"] = sum(local_tensor(p).nbytes for p in params.values())
        out["optimizer"] = sum(local_tensor(t).nbytes for g in init_state(params).values() for t in g.values())
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("name", list(PLANNED))
def test_planned_state_bytes_are_the_steps(name, zero, precision):
    from meshtrain.estimate.memory import per_rank_memory

    sizes, sp, world = PLANNED[name]
    measured = _measured_state(sizes, sp, world, zero, precision)
    model = build("llama", CFG)
    plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=world)
    est = per_rank_memory(plan, model, micro_batch=2, seq_len=16, traffic=_zero(zero), precision=precision)
    for key, value in measured.items():
        assert est[key] == value, (key, est[key], value)
    assert est["kept_grads" if zero == 2 else "micro_grads"] == 0
    # ZeRO-3's own state: the same shards and moments, no kept weights.
    three = per_rank_memory(plan, model, micro_batch=2, seq_len=16)
    assert (three["params"], three["grads"], three["optimizer"]) == (est["params"], est["grads"], est["optimizer"])
    # Every parameter here is fsdp-sharded evenly: kept whole over fsdp, fsdp times its shard.
    # held in the compute dtype: bf16 halves them
    width = 2 if precision == "bf16" else 1
    assert three["kept_weights"] == 0 and est["kept_weights"] * width == sizes["fsdp"] * est["params"]


@pytest.mark.parametrize("zero", [1, 2])
def test_an_eager_step_overlaps_gathers_with_forward_and_reductions_with_backward(zero):
    """Eager, on the fake process group: no bucket is gathered before the first
    micro-batch's forward asks for it (Megatron's --overlap-param-gather: each gather
    issued where it is first used, the next ones ahead), and every bucket's gradients are
    reduced inside the backward that completes them (--overlap-grad-reduce: zero 1 the
    last micro-batch's, zero 2 each one's), none left for after it. The kept weights go
    with the step (the step drops them before the update)."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.parallel.keep_gathered import KeptWeights

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    calls, gathered_before, kept_weight = [], [], []
    reduce, gather = KeptWeights._reduce, KeptWeights.gather

    def recorded_reduce(self, b):
        calls.append((b, torch._C._current_autograd_node() is not None, bool(self.sums())))
        kept_weight.extend(weakref.ref(leaf) for leaf in self._leaves.values())
        return reduce(self, b)

    def recorded_gather(self, params, lazy=False):
        view = gather(self, params, lazy)
        gathered_before.append(len(self._leaves))
        return view

    try:
        model = build("llama", CFG)
        plan = make_plan(model.specs, Rules.default(), MeshSpec(fsdp=2), world=2)
        mesh = plan.mesh.build()
        step = make_train_step(model, plan, mesh, traffic=_zero(zero), **optimizer_args())
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(KeptWeights, "_reduce", recorded_reduce)
            patch.setattr(KeptWeights, "gather", recorded_gather)
            step(TrainState.create(init_params(plan, mesh, seed=0)), next(batches(MICRO)))
    finally:
        dist.destroy_process_group()
    assert gathered_before == [0]
    buckets = CFG.n_layers + 2
    in_backward = [b for b, inside, _ in calls if inside]
    assert len(in_backward) == buckets * (MICRO if zero == 2 else 1)
    # after the backward, release finds every bucket reduced already
    assert all(inside or not pending for _, inside, pending in calls)
    gc.collect()
    assert kept_weight and all(ref() is None for ref in kept_weight)  # freed with the step, not held to the next


def test_the_plan_shows_each_stage_as_its_own_dry_run_would():
    """`meshtrain plan`'s zero_stages (console and JSON): each stage's peak and collective
    bytes are those of the dry run of that stage; ZeRO-1 holds the most and moves the
    least, ZeRO-3 the reverse."""
    import yaml

    from meshtrain.config import RunConfig
    from meshtrain.estimate.dryrun import dry_run
    from support.cli import TINY

    base = yaml.safe_load(TINY.read_text())
    base["train"]["micro_batch"] = 2  # 16 sequences over 4 ranks: 2 micro-steps, which zero 1 and 2 tell apart
    runs = {}
    for zero in (1, 2, 3):
        base["parallel"]["zero"] = zero
        runs[zero] = dry_run(RunConfig.from_dict(base).validate(), world=4)
    for zero, run in runs.items():
        stages = run.to_dict()["zero_stages"]
        assert stages["configured"] == zero
        for other in (1, 2, 3):
            want = runs[other]
            assert stages[str(other)] == {"peak_bytes": int(want.memory["peak"]),
                                          "collective_bytes": sum(e["bytes"] for e in want.collectives)}
        assert f"{zero} (set)" in run.render(120)
    peaks = [runs[z].memory["peak"] for z in (1, 2, 3)]
    moved = [sum(e["bytes"] for e in runs[z].collectives) for z in (1, 2, 3)]
    assert peaks[0] > peaks[1] > peaks[2] and moved[0] < moved[1] < moved[2], (peaks, moved)


@pytest.mark.slow
def test_a_run_resumes_at_another_stage_and_back(tmp_path):
    """Checkpoints are layout-free: 2 ranks at zero 1 to step 2, zero 3 to step 3, zero 2
    to step 4, in one run_dir, follow one process's uninterrupted run."""
    from meshtrain.cli import main
    from support.cli import SMALL, TINY, losses, run_cli

    args = ["fit", "--config", str(TINY), *SMALL, "--train.log_every", "1", "--train.steps", "4",
            "--checkpoint.every", "1"]
    assert main([*args, "--run_dir", str(tmp_path / "one")]) == 0
    run = tmp_path / "zero"
    for zero, stop in ((1, 2), (3, 3), (2, 4)):
        done = run_cli(*args, "--parallel.nproc_per_node", "2", "--parallel.zero", str(zero), "--train.stop_at",
                       str(stop), "--run_dir", str(run))
        assert done.returncode == 0, done.stderr
    torch.testing.assert_close(losses(run), losses(tmp_path / "one"), rtol=1e-5, atol=0)
