"""Every layout trains to the numbers of one process (fp32, gloo CPU ranks).

The reference is a single-process run with no plan; each layout runs STEPS steps with
gradient accumulation (2 micro-steps) against a reference that takes the whole batch
in one step, so accumulation is checked at the same time. Each layout must match the
reference's loss and gradient norm on every step, its whole gradients on the first step
(seen through make_train_step's inspect_grads), its final parameters and (eager) its final
Adam moments, which hold the clipped gradients whose scale AdamW's update divides out. The
clip is set below every step's natural gradient norm, so clipping engages on every step
and the norm scales every update. The clipped AdamW update itself is checked against
torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW, on one process and on fsdp x tp.

The config, the layouts, the runs and their checks with the measured tolerances are the
shared harness in support/equivalence.py.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain import TrainState, build, make_train_step
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks
from meshtrain.train.step import make_update
from support.equivalence import (BATCH, CFG, GRAD_ATOL, GRAD_CLIP, PARAM_ATOL, SEQ, STEPS, TORCH_CHECKED, Run,
                                 check_layouts, check_run, optimizer_args, single_process, train_layouts, whole)


@pytest.fixture(scope="module")
def reference() -> Run:
    return single_process(grad_steps=range(1, STEPS + 1))


def test_clipping_engages_on_every_step(reference):
    """Guards the norm checks: with the clip below every step's norm, a wrong norm scales
    every update, and a missing clip changes every update."""
    assert all(n > GRAD_CLIP * 1.5 for n in reference.norms), reference.norms


def test_gradient_accumulation_equals_large_batch(reference):
    check_run(single_process(micro_steps=4), reference, "4 micro-steps")


def test_training_moves_the_parameters(reference):
    """Guards the equivalence tests against a run that changes nothing."""
    initial = {n: init_slice(s, n, seed=0) for n, s in build("llama", CFG).specs.items()}
    for n, p in reference.params.items():  # every tensor moves by far more than the tolerance
        assert (p - initial[n]).abs().max().item() > 100 * PARAM_ATOL, n
    for n, g in reference.grads[1].items():  # and every gradient is far above its tolerance
        assert g.abs().max().item() > 100 * GRAD_ATOL, n


_RUNS = {}


def layout_runs(world: int, compile) -> list:
    """Each rank's results of train_layouts (one launch per world and mode, shared by tests)."""
    if (world, compile) not in _RUNS:
        _RUNS[world, compile] = run_ranks(train_layouts, world, world, compile)
    return _RUNS[world, compile]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(reference, world):
    for rank_result in layout_runs(world, False):  # every rank sees the same replicated numbers
        check_layouts(reference, rank_result)


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, "aot_eager"], ids=["eager", "compiled"])
def test_unsharded_accumulation_matches_single_process(reference, compile):
    """parallel.fsdp_accumulate unsharded: the first micro-step's gradients held whole and
    reduce-scattered with the second's (HSDP's dp all-reduce once too; uneven shards).
    Compiled, the graphs hand each bucket's whole gradient to a leaf of its own whose .grad
    sums the micro-steps, reduce-scattered after the last backward."""
    results = run_ranks(train_layouts, 4, 4, compile, ["dp2_fsdp2", "fsdp2_tp2_sp", "fsdp4_uneven"],
                        {"fsdp_accumulate": "unsharded"})
    check_layouts(reference, results[0])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_compiled_layouts_match_single_process(reference, world):
    """fullgraph=True and error_on_recompile: any graph break or recompile over the 6 steps
    fails, and each layout traces COMPILED_GRAPHS graphs. aot_eager traces forward and backward the way
    inductor does without paying for C++ code generation on every layout; inductor
    itself is exercised below and in bench/."""
    results = run_ranks(train_layouts, world, world, "aot_eager")
    check_layouts(reference, results[0])


@pytest.mark.slow
def test_inductor_single_process_matches_eager(reference):
    check_run(single_process(compile=True), reference, "inductor")


def test_a_compiled_step_takes_another_sequence_length():
    """Shapes are static: a second length recompiles (dynamo would otherwise make it
    symbolic, which the RoPE table's constant-folded builder refused)."""
    torch._dynamo.reset()  # the compiled tests before this one in the process count towards the recompile limit
    model = build("llama", CFG)
    steps = {c: make_train_step(model, compile=c, **optimizer_args()) for c in (False, "aot_eager")}
    states = {c: TrainState.create({n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()})
              for c in steps}
    g = torch.Generator().manual_seed(5)
    for seq in (SEQ, SEQ // 2, SEQ):
        t = torch.randint(0, CFG.vocab_size, (1, BATCH, seq + 1), generator=g)
        batch = {"tokens": t[..., :-1], "targets": t[..., 1:]}
        eager, compiled = (steps[c](states[c], batch) for c in steps)
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5)
        assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_inductor_sharded_layouts_match_single_process(reference):
    """Inductor's generated code on DTensor layouts: fsdp (gathers), tp+sp (sequence
    all-gather / reduce-scatter, vocab-parallel loss) and cp (ring attention's
    point-to-point exchange and its LSE merge)."""
    results = run_ranks(train_layouts, 2, 2, True, ["fsdp2", "tp2_sp", "cp2_ring"], start="spawn")
    check_layouts(reference, results[0])


# --- the clipped update against torch ------------------------------------------------------

def torch_update(initial: dict, grads: dict, opt: dict | None = None) -> Run:
    """torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW from `initial`, step t taking
    grads[t] (1-based) and the schedule's learning rate for step t: what our update should
    do with the same gradients. Weight decay on >= 2-D parameters only, as AdamW() decays."""
    opt = opt or optimizer_args()
    adamw, schedule = opt["optimizer"], opt["lr_schedule"]
    params = {n: p.clone().requires_grad_() for n, p in initial.items() if n in grads[1]}
    groups = [{"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": adamw.weight_decay},
              {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}]
    torch_adamw = torch.optim.AdamW(groups, lr=adamw.lr, betas=adamw.betas, eps=adamw.eps)
    norms = []
    for t in sorted(grads):
        for n, p in params.items():
            p.grad = grads[t][n].clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), opt["grad_clip"])))
        for group in torch_adamw.param_groups:
            group["lr"] = schedule(t - 1)
        torch_adamw.step()
    moments = {k: {n: torch_adamw.state[p][k] for n, p in params.items()} for k in ("exp_avg", "exp_avg_sq")}
    return Run([], {n: p.detach() for n, p in params.items()}, norms, grads, moments)


# Against clip_grad_norm_ + torch.optim.AdamW on the same gradients: the norm sums the
# same squares in another order, the update is the same arithmetic in another order.
# Measured on one process and on fsdp2 x tp2 (6 steps): norms <= 1.19e-7 relative,
# parameters <= 5.96e-8, Adam moments <= 3.0e-7 of each tensor's largest moment (an
# elementwise relative bound does not work: exp_avg has entries that cancel to ~0).
# Tolerances ~10x those. A skipped clip changes the moments by ~2x (clip / norm ~ 0.5).
TORCH_NORM_RTOL = 1.2e-6
TORCH_ATOL = 6e-7
TORCH_MOMENT_TOL = 3e-6  # times the tensor's largest |moment|


def check_against_torch(run: Run, initial: dict, what: str) -> None:
    expected = torch_update(initial, run.grads)
    torch.testing.assert_close(torch.tensor(run.norms), torch.tensor(expected.norms), rtol=TORCH_NORM_RTOL, atol=0,
                               msg=lambda m: f"{what} norms against clip_grad_norm_: {m}")
    for n, p in expected.params.items():
        torch.testing.assert_close(run.params[n], p, rtol=0, atol=TORCH_ATOL,
                                   msg=lambda m: f"{what} {n} against torch: {m}")
        for k in ("exp_avg", "exp_avg_sq"):
            want = expected.moments[k][n]
            torch.testing.assert_close(run.moments[k][n], want, rtol=0, atol=TORCH_MOMENT_TOL * want.abs().max().item(),
                                       msg=lambda m: f"{what} {k} of {n} against torch: {m}")


def test_clipped_update_equals_torch_one_process(reference):
    initial = {n: init_slice(s, n, seed=0) for n, s in build("llama", CFG).specs.items()}
    check_against_torch(reference, initial, "one process")


@pytest.mark.slow
def test_clipped_update_equals_torch_sharded():
    """fsdp x tp at world 4 (the run test_layouts_match_single_process[4] makes): the norm
    of sharded gradients and the update on each rank's shards."""
    initial, run = layout_runs(4, False)[0][TORCH_CHECKED]
    check_against_torch(run, initial, TORCH_CHECKED)


def test_update_equals_torch_where_the_clip_epsilon_and_adam_eps_matter():
    """clip / (norm + 1e-6), as torch's clip_grad_norm_: gradient norms of 2e-6 to 4e-6
    under a clip of 1e-6 give coefficients of 1/3 to 1/5 (clip / norm would give 1/2 to
    1/4), and clipped gradients near Adam's eps make the update itself depend on them."""
    g = torch.Generator().manual_seed(0)
    initial = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    grads = {}
    for t in (1, 2, 3):
        raw = {n: torch.randn(p.shape, generator=g) for n, p in initial.items()}
        total = torch.cat([r.flatten() for r in raw.values()]).norm()
        grads[t] = {n: r * (1e-6 * (t + 1) / total) for n, r in raw.items()}
    opt = {**optimizer_args(), "grad_clip": 1e-6}
    params = {n: p.clone().requires_grad_() for n, p in initial.items()}
    state = TrainState.create(params)
    apply = make_update(opt["optimizer"], opt["lr_schedule"], opt["grad_clip"])
    norms = []
    for t in (1, 2, 3):
        for n, p in params.items():
            p.grad = grads[t][n].clone()
        norms.append(float(apply(state)[0]))
    ours = Run([], whole(params), norms, grads, {k: whole(v) for k, v in state.optimizer.items()})
    expected = torch_update(initial, grads, opt)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected.norms), rtol=1e-6, atol=0)
    for n in initial:
        torch.testing.assert_close(ours.params[n], expected.params[n], rtol=0, atol=1e-7)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.moments[k][n], expected.moments[k][n], rtol=1e-6, atol=0)
