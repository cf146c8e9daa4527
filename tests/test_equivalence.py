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
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from meshtrain import AdamW, LRSchedule, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.models import llama
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks
from meshtrain.train.step import full_value, make_update

# GQA (6 query heads over 2 kv heads), an ffn and vocab that are not powers of two.
CFG = llama.LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=100, vocab_size=130, max_seq_len=32)
# 6 steps: past the 3 warm-up steps of the schedule into its decay; each step checked.
STEPS, BATCH, SEQ = 6, 8, 16
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5
# The gradient norm per step, against one process: as the loss.
NORM_RTOL = 1e-5
# Below the natural gradient norm of every step (the reference's are 0.95-1.003; asserted
# in test_clipping_engages_on_every_step), so every update is scaled by clip / norm.
GRAD_CLIP = 0.5
# The first step's whole gradients, against one process. Measured (torch 2.13, CPU): at
# most 1.86e-8 for every layout here, eager, aot_eager and inductor, and for 4 micro-steps
# on one process (the 2-micro-step accumulation order alone gives it); 10x that, rounded
# up. The smallest tensor's largest gradient is 1.3e-4, 600x this (checked below).
GRAD_ATOL = 2e-7

# Uneven fsdp shards: the embedding tables split 130 rows over 4 ranks.
UNEVEN = {"tok_emb": {"vocab": ("fsdp",), "embed": ()}, "output": {"vocab": ("fsdp",), "embed": ()}}
# name: (mesh sizes, sequence parallel, rule overrides[, cp_comm]). Context-parallel
# layouts shard parameters over fsdp x cp (the default rules).
LAYOUTS = {
    2: {"dp2": ({"dp": 2}, False, None), "fsdp2": ({"fsdp": 2}, False, None),
        "tp2": ({"tp": 2}, False, None), "tp2_sp": ({"tp": 2}, True, None),
        "cp2_allgather": ({"cp": 2}, False, None, "allgather"), "cp2_ring": ({"cp": 2}, False, None, "ring"),
        "cp2_a2a": ({"cp": 2}, False, None, "a2a")},
    4: {"dp2_fsdp2": ({"dp": 2, "fsdp": 2}, False, None), "fsdp2_tp2": ({"fsdp": 2, "tp": 2}, False, None),
        "fsdp2_tp2_sp": ({"fsdp": 2, "tp": 2}, True, None), "dp2_tp2_sp": ({"dp": 2, "tp": 2}, True, None),
        "fsdp4_uneven": ({"fsdp": 4}, False, UNEVEN), "cp4_ring": ({"cp": 4}, False, None, "ring"),
        "cp2_tp2_sp_ring": ({"cp": 2, "tp": 2}, True, None, "ring"),
        "fsdp2_cp2_a2a": ({"fsdp": 2, "cp": 2}, False, None, "a2a")},
}


def batches(micro_steps: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        t = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
        t = t.reshape(micro_steps, BATCH // micro_steps, SEQ + 1)
        yield {"tokens": t[..., :-1], "targets": t[..., 1:]}


def _optimizer():
    return dict(optimizer=AdamW(lr=3e-4, weight_decay=0.1),
                lr_schedule=LRSchedule(lr=3e-4, min_lr=3e-5, warmup_steps=3, total_steps=STEPS), grad_clip=GRAD_CLIP)


class GradRecorder:
    """An inspect_grads callback: whole copies (gathered: a collective every rank holding
    the parameter reaches) of the gradients of the steps numbered in `steps` (1-based)."""

    def __init__(self, steps=(1,)):
        self.steps, self.seen, self.grads = set(steps), 0, {}

    def __call__(self, grads: dict) -> None:
        self.seen += 1
        if self.seen in self.steps:
            self.grads[self.seen] = {n: full_value(g).detach().clone() for n, g in grads.items()}


class Run(NamedTuple):
    losses: list[float]
    params: dict  # final, whole
    norms: list[float]  # metrics["grad_norm"] per step
    grads: dict  # step (1-based) -> {name: whole gradient before clipping}
    moments: dict | None = None  # final {"exp_avg": {name: whole}, "exp_avg_sq": ...}, when asked for
    graphs: int | None = None  # compiled: dynamo graphs traced over every step


# A compiled step's graphs, whatever the layout and the steps: the loss (forward and
# backward) and the update. Traced under error_on_recompile: a recompile fails the run.
COMPILED_GRAPHS = 2


def _whole(tensors: dict) -> dict:
    return {n: full_value(t).detach().clone() for n, t in tensors.items()}


def single_process(micro_steps: int = 1, compile=False, grad_steps=(1,)) -> Run:
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    recorder = GradRecorder(grad_steps)
    step = make_train_step(model, compile=compile, inspect_grads=recorder, **_optimizer())
    state = TrainState.create(params)
    metrics = [step(state, b) for b in batches(micro_steps)]
    return Run([m["loss"] for m in metrics], _whole(params), [m["grad_norm"] for m in metrics], recorder.grads,
               {k: _whole(v) for k, v in state.optimizer.items()})


# The layouts the compiled runs cover: each graph shape once (fsdp2 and tp2_sp also run
# under inductor below): the traced bucket gathers plain (fsdp2), with a replica
# all-reduce (dp2 alone; dp2_fsdp2, HSDP), padded (fsdp4_uneven), with the tp all-reduce
# of norms under sp (fsdp2_tp2_sp) and over the flattened fsdp x cp group
# (fsdp2_cp2_a2a); tp and cp without buckets, and cp beside tp + sp (cp2_tp2_sp_ring).
COMPILED = {"dp2", "fsdp2", "tp2", "cp2_ring", "cp2_a2a", "dp2_fsdp2", "fsdp2_tp2_sp", "fsdp4_uneven",
            "cp2_tp2_sp_ring", "fsdp2_cp2_a2a"}
# The sharded layout whose every step's gradients (and final Adam moments) are kept, for
# the check of the clipped update against torch (test_clipped_update_equals_torch_sharded).
TORCH_CHECKED = "fsdp2_tp2"


def train_layouts(world: int, compile, names=None, traffic=None):
    """Runs on every rank: each layout of this world size in turn (or those named), with
    make_train_step's parameter-traffic options `traffic`."""
    import torch.distributed as dist

    names = names or [n for n in LAYOUTS[world] if not compile or n in COMPILED]
    model = build("llama", CFG)
    out = {}
    for name in names:
        sizes, sp, overrides, *cp_comm = LAYOUTS[world][name]
        rules = Rules(Rules.default(sp=sp).mapping, overrides or {})
        plan = make_plan(model.specs, rules, MeshSpec(**sizes), world=dist.get_world_size(), cp_comm=cp_comm[0]
                         if cp_comm else "allgather")
        mesh = plan.mesh.build()
        params = init_params(plan, mesh, seed=0)
        initial = _whole(params)
        every_step = name == TORCH_CHECKED and not compile
        recorder = GradRecorder(range(1, STEPS + 1) if every_step else (1,))
        step = make_train_step(model, plan, mesh, compile=compile, inspect_grads=recorder, **_optimizer(),
                               **(traffic or {}))
        state = TrainState.create(params)
        torch._dynamo.reset()  # each layout's step traces afresh: no recompile of the last one's
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            metrics = [step(state, b) for b in batches(micro_steps=2)]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before if compile else None
        # Every eager layout's final Adam moments, against one process's in _check.
        moments = {k: _whole(v) for k, v in state.optimizer.items()} if not compile else None
        out[name] = initial, Run([m["loss"] for m in metrics], _whole(params), [m["grad_norm"] for m in metrics],
                                 recorder.grads, moments, graphs)
    return out


@pytest.fixture(scope="module")
def reference() -> Run:
    return single_process(grad_steps=range(1, STEPS + 1))


def check_run(run: Run, ref: Run, what: str, grad_atol: float = GRAD_ATOL, param_atol: float = PARAM_ATOL) -> None:
    """Losses and gradient norms on every step, the first step's whole gradients (of the
    parameters `run` holds), the final parameters. (The clipped update's own arithmetic is
    checked against torch below.)"""
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(torch.tensor(run.norms), torch.tensor(ref.norms), rtol=NORM_RTOL, atol=0,
                               msg=lambda m: f"{what} gradient norms: {m}")
    assert set(run.grads[1]) <= set(ref.grads[1]), what
    for n, g in run.grads[1].items():
        torch.testing.assert_close(g, ref.grads[1][n], rtol=0, atol=grad_atol,
                                   msg=lambda m: f"{what} step-1 gradient of {n}: {m}")
    for n, p in run.params.items():
        torch.testing.assert_close(p, ref.params[n], rtol=0, atol=param_atol, msg=lambda m: f"{what} {n}: {m}")


# The final Adam moments of an eager layout against one process's, each tensor's
# difference over its largest |moment| (an elementwise relative bound does not work:
# exp_avg has entries that cancel to ~0). Measured at most 5.2e-6 (cp2_tp2_sp_ring's
# exp_avg; every eager layout, torch 2.13 CPU); 10x that. The moments hold the clipped
# gradients themselves, so they see what the loss, the norm and the parameters barely
# do: a gradient scale error, which AdamW's update divides out. Planted (scratch copy):
# every 1-D (norm weight) gradient halved in the bucket reduce-scatter failed first on
# the norms at 7.6 tolerances, now on the moments at 1.5e4; clipping left out when
# sharded (tests/mutants.py clip_off_sharded) at 1.9 on the norms, now 5.9e4.
MOMENT_TOL = 5e-5


def check_moments(run: Run, ref: Run, what: str) -> None:
    """Every moment tensor within MOMENT_TOL of its largest |moment|; a failure names the
    tensor furthest off (an indirect difference elsewhere would hide the direct one)."""
    ratios = {}
    for k in ("exp_avg", "exp_avg_sq"):
        assert sorted(run.moments[k]) == sorted(ref.moments[k]), (what, k)
        for n, want in ref.moments[k].items():
            ratios[k, n] = ((run.moments[k][n] - want).abs().max() / want.abs().max()).item()
    k, n = max(ratios, key=ratios.get)
    want = ref.moments[k][n]
    torch.testing.assert_close(run.moments[k][n], want, rtol=0, atol=MOMENT_TOL * want.abs().max().item(),
                               msg=lambda m: f"{what} {k} of {n}: {m}")


def _check(reference: Run, results):
    initial_values = {n: init_slice(s, n, seed=0) for n, s in build("llama", CFG).specs.items()}
    for name, (initial, run) in results.items():
        for n in initial_values:  # layout-invariant init: bitwise
            assert torch.equal(initial[n], initial_values[n]), f"{name}: initial {n} differs"
        assert sorted(run.grads[1]) == sorted(reference.grads[1]), name
        assert run.graphs in (None, COMPILED_GRAPHS), (name, run.graphs)
        if run.moments is not None:  # eager layouts
            check_moments(run, reference, name)
        check_run(run, reference, name)


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
        _check(reference, rank_result)


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, "aot_eager"], ids=["eager", "compiled"])
def test_unsharded_accumulation_matches_single_process(reference, compile):
    """parallel.fsdp_accumulate unsharded: the first micro-step's gradients held whole and
    reduce-scattered with the second's (HSDP's dp all-reduce once too; uneven shards).
    Compiled, the graphs hand each bucket's whole gradient to a leaf of its own whose .grad
    sums the micro-steps, reduce-scattered after the last backward."""
    results = run_ranks(train_layouts, 4, 4, compile, ["dp2_fsdp2", "fsdp2_tp2_sp", "fsdp4_uneven"],
                        {"fsdp_accumulate": "unsharded"})
    _check(reference, results[0])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_compiled_layouts_match_single_process(reference, world):
    """fullgraph=True and error_on_recompile: any graph break or recompile over the 6 steps
    fails, and each layout traces COMPILED_GRAPHS graphs. aot_eager traces forward and backward the way
    inductor does without paying for C++ code generation on every layout; inductor
    itself is exercised below and in bench/."""
    results = run_ranks(train_layouts, world, world, "aot_eager")
    _check(reference, results[0])


@pytest.mark.slow
def test_inductor_single_process_matches_eager(reference):
    check_run(single_process(compile=True), reference, "inductor")


def test_a_compiled_step_takes_another_sequence_length():
    """Shapes are static: a second length recompiles (dynamo would otherwise make it
    symbolic, which the RoPE table's constant-folded builder refused)."""
    torch._dynamo.reset()  # the compiled tests before this one in the process count towards the recompile limit
    model = build("llama", CFG)
    steps = {c: make_train_step(model, compile=c, **_optimizer()) for c in (False, "aot_eager")}
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
    _check(reference, results[0])


# --- the clipped update against torch ------------------------------------------------------

def torch_update(initial: dict, grads: dict, opt: dict | None = None) -> Run:
    """torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW from `initial`, step t taking
    grads[t] (1-based) and the schedule's learning rate for step t: what our update should
    do with the same gradients. Weight decay on >= 2-D parameters only, as AdamW() decays."""
    opt = opt or _optimizer()
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
    opt = {**_optimizer(), "grad_clip": 1e-6}
    params = {n: p.clone().requires_grad_() for n, p in initial.items()}
    state = TrainState.create(params)
    apply = make_update(opt["optimizer"], opt["lr_schedule"], opt["grad_clip"])
    norms = []
    for t in (1, 2, 3):
        for n, p in params.items():
            p.grad = grads[t][n].clone()
        norms.append(float(apply(state)[0]))
    ours = Run([], _whole(params), norms, grads, {k: _whole(v) for k, v in state.optimizer.items()})
    expected = torch_update(initial, grads, opt)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected.norms), rtol=1e-6, atol=0)
    for n in initial:
        torch.testing.assert_close(ours.params[n], expected.params[n], rtol=0, atol=1e-7)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.moments[k][n], expected.moments[k][n], rtol=1e-6, atol=0)
