"""bf16 compute with fp32 master weights: the GEMMs and attention run on bf16 operands (fp8
ones for the block linears under fp8), parameters gather in bf16, gradients reduce in
fp32, master weights stay fp32, and the loss follows the fp32 curve of a run that learns.

The runs learn something (each sequence counts up by one, so the next token is a function
of the current one): on test_equivalence's random tokens the 6-step curve moves by 2.2e-4
relative, less than a bf16 run's distance from fp32 would need as a tolerance, so a run
that never updated would pass. Here the curve falls by 14% and every tolerance is a
fraction of a percent.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain import AdamW, LRSchedule, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks

from support.equivalence import CFG
from support.precision import BF16_RTOL, ComputeDtypes, counting_batches

STEPS, LR = 6, 3e-3
FP8_RTOL = 1.5e-3
# The fp32 curve's fall over the 6 steps (measured 0.70, 14% of the first loss) must be far
# beyond any tolerance here.
MIN_FALL = 0.5
# Per Llama block: wq, wk, wv, wo, w_gate, w_up, w_down; plus the head outside the blocks.
BLOCK_LINEARS = 7


def _optimizer(lr: float = LR):
    return dict(optimizer=AdamW(lr=lr, weight_decay=0.1),
                lr_schedule=LRSchedule(lr=lr, min_lr=lr / 10, warmup_steps=2, total_steps=STEPS), grad_clip=1.0)


def one_process(precision: str, fp8_recipe: str = "tensorwise", lr: float = LR):
    """(losses, ops of the first step, parameters after training) of one process."""
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, precision=precision, fp8_recipe=fp8_recipe, **_optimizer(lr))
    state = TrainState.create(params)
    recorder = ComputeDtypes()
    losses = []
    for i, b in enumerate(counting_batches(steps=STEPS)):
        if i == 0:
            with recorder:
                losses.append(step(state, b)["loss"])
        else:
            losses.append(step(state, b)["loss"])
    return torch.tensor(losses), recorder.ops, params


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These runs are tiny: on a shared 2-core box a second intra-op thread only contends
    (measured 0.3 s for a 6-step run on one thread, 2.5-7 s on two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fp32_curve():
    losses, ops, _ = one_process("fp32")
    # The reference itself learns, and the recorder sees fp32 where nothing casts.
    assert losses[0] - losses[-1] > MIN_FALL, losses
    assert {dt for (_, dts) in ops for dt in dts} <= {"float32", "int64"}, ops
    return losses


@pytest.fixture(scope="module")
def bf16_run():
    return one_process("bf16")


@pytest.fixture(scope="module")
def bf16_curve(bf16_run):
    return bf16_run[0]


def _close_and_not_equal(losses, reference, rtol, what):
    torch.testing.assert_close(losses, reference, rtol=rtol, atol=0, msg=lambda m: f"{what}: {m}")
    # A run that silently computed in fp32 would equal the reference bit for bit.
    assert not torch.equal(losses, reference), f"{what}: bitwise equal to the fp32 run"


def test_bf16_single_process_computes_in_bf16_and_tracks_fp32(fp32_curve, bf16_run):
    losses, ops, params = bf16_run
    per_step = 3 * (BLOCK_LINEARS * CFG.n_layers + 1)  # forward, input gradient, weight gradient
    assert ops[("mm", ("bfloat16", "bfloat16"))] == per_step, ops
    assert ops[("_scaled_dot_product_flash_attention_for_cpu", ("bfloat16",) * 3)] == CFG.n_layers, ops
    assert ops[("embedding", ("bfloat16", "int64"))] == 1, ops
    # Nothing but the attention backward's saved log-sum-exp (fp32 by design) is fp32.
    fp32 = {k: v for k, v in ops.items() if "float32" in k[1]}
    assert set(fp32) == {("_scaled_dot_product_flash_attention_for_cpu_backward", ("bfloat16",) * 5 + ("float32",))}, fp32
    assert all(p.dtype == torch.float32 for p in params.values())  # fp32 master weights
    _close_and_not_equal(losses, fp32_curve, BF16_RTOL, "bf16")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_runs_the_block_linears_on_scaled_mm_and_tracks_fp32(fp32_curve, recipe):
    losses, ops, params = one_process("fp8", recipe)
    block = BLOCK_LINEARS * CFG.n_layers
    # Forward: input and weight in e4m3; backward: the e5m2 gradient against an e4m3 operand,
    # once for the input gradient and once for the weight gradient.
    scaled = {k: v for k, v in ops.items() if k[0] == "_scaled_mm"}
    assert scaled == {("_scaled_mm", ("float8_e4m3fn", "float8_e4m3fn", "float32", "float32")): block,
                      ("_scaled_mm", ("float8_e5m2", "float8_e4m3fn", "float32", "float32")): 2 * block}, scaled
    # The head alone stays on a bf16 GEMM (forward and two gradients); the embedding a lookup.
    assert ops[("mm", ("bfloat16", "bfloat16"))] == 3, ops
    assert ops[("embedding", ("bfloat16", "int64"))] == 1, ops
    assert all(p.dtype == torch.float32 for p in params.values())
    _close_and_not_equal(losses, fp32_curve, FP8_RTOL, f"fp8 {recipe}")


def test_the_tolerances_catch_a_run_that_does_not_train(fp32_curve, bf16_curve):
    """The bf16 curve learns like the fp32 one; one at lr 0 (it computes, it never updates)
    sits hundreds of tolerances away."""
    assert bf16_curve[0] - bf16_curve[-1] > MIN_FALL, bf16_curve
    frozen = one_process("bf16", lr=0.0)[0]
    assert ((frozen - fp32_curve).abs() / fp32_curve).max() > 100 * BF16_RTOL, frozen


def sharded_bf16_runs():
    """fsdp 2 (recording compute and collective dtypes), then cp 2 with each exchange (the
    bytes on the wire: test_comms_estimate), all in bf16: one launch for both."""
    import torch.distributed as dist

    model = build("llama", CFG)
    out = {}
    for name, sizes, comm in [("fsdp2", {"fsdp": 2}, "allgather"), ("cp2_allgather", {"cp": 2}, "allgather"),
                              ("cp2_ring", {"cp": 2}, "ring"), ("cp2_a2a", {"cp": 2}, "a2a")]:
        plan = make_plan(model.specs, Rules.default(), MeshSpec(**sizes), world=dist.get_world_size(), cp_comm=comm)
        mesh = plan.mesh.build()
        params = init_params(plan, mesh, seed=0)
        step = make_train_step(model, plan, mesh, precision="bf16", **_optimizer())
        state = TrainState.create(params)
        recorder = ComputeDtypes()
        losses = []
        for i, b in enumerate(counting_batches(steps=STEPS)):
            if i == 0 and name == "fsdp2":
                with recorder:
                    losses.append(step(state, b)["loss"])
            else:
                losses.append(step(state, b)["loss"])
        out[name] = (torch.tensor(losses), recorder.ops, sorted(recorder.collectives),
                     {p.dtype for p in params.values()})
    return out


@pytest.fixture(scope="module")
def sharded():
    return run_ranks(sharded_bf16_runs, 2)[0]


@pytest.mark.slow
def test_bf16_fsdp_gathers_in_bf16_and_reduces_in_fp32(sharded, fp32_curve, bf16_curve):
    losses, ops, collectives, dtypes = sharded["fsdp2"]
    assert ("all_gather_into_tensor", "torch.bfloat16") in collectives
    assert ("all_gather_into_tensor", "torch.float32") not in collectives
    assert ("reduce_scatter_tensor", "torch.float32") in collectives
    assert ("reduce_scatter_tensor", "torch.bfloat16") not in collectives
    assert dtypes == {torch.float32}
    # The gathered weights reach the GEMMs as bf16: no GEMM sees an fp32 operand.
    gemms = {k: v for k, v in ops.items() if k[0] == "mm"}
    assert gemms == {("mm", ("bfloat16", "bfloat16")): 3 * (BLOCK_LINEARS * CFG.n_layers + 1)}, gemms
    _close_and_not_equal(losses, fp32_curve, BF16_RTOL, "fsdp2 bf16")
    torch.testing.assert_close(losses, bf16_curve, rtol=SHARDED_RTOL, atol=0)


# Measured against one bf16 process: fsdp2 3.7e-5 (each rank's half-batch weight gradient
# rounds to bf16 before the fp32 sum), cp2 2.8e-5 with each exchange (the attention sums in
# another order); about 3x.
SHARDED_RTOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["allgather", "ring", "a2a"])
def test_bf16_context_parallel_tracks_one_bf16_process(sharded, bf16_curve, comm):
    losses = sharded[f"cp2_{comm}"][0]
    torch.testing.assert_close(losses, bf16_curve, rtol=SHARDED_RTOL, atol=0, msg=lambda m: f"{comm}: {m}")
