"""The equivalence harness of tests/test_equivalence.py, shared by the tests that train
other switches the same way: the config and its random batches, the optimizer, the
layouts, one process's run and each layout's (train_layouts runs on every rank), and the
checks of a run against one process's with their measured tolerances.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshtrain import AdamW, LRSchedule, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.models import llama
from meshtrain.models.spec import init_slice
from meshtrain.train.step import full_value

# GQA (6 query heads over 2 kv heads), an ffn and vocab that are not powers of two.
CFG = llama.LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=100, vocab_size=130, max_seq_len=32)
# 6 steps: past the 3 warm-up steps of the schedule into its decay; each step checked.
STEPS, BATCH, SEQ = 6, 8, 16
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5
# The gradient norm per step, against one process: as the loss.
NORM_RTOL = 1e-5
# Below the natural gradient norm of every step (the reference's are 0.95-1.003; asserted
# in tests/test_equivalence.py's test_clipping_engages_on_every_step), so every update is
# scaled by clip / norm.
GRAD_CLIP = 0.5
# The first step's whole gradients, against one process. Measured (torch 2.13, CPU): at
# most 1.86e-8 for every layout here, eager, aot_eager and inductor, and for 4 micro-steps
# on one process (the 2-micro-step accumulation order alone gives it); 10x that, rounded
# up. The smallest tensor's largest gradient is 1.3e-4, 600x this (checked in
# test_training_moves_the_parameters).
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


def optimizer_args():
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


def whole(tensors: dict) -> dict:
    return {n: full_value(t).detach().clone() for n, t in tensors.items()}


def single_process(micro_steps: int = 1, compile=False, grad_steps=(1,)) -> Run:
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    recorder = GradRecorder(grad_steps)
    step = make_train_step(model, compile=compile, inspect_grads=recorder, **optimizer_args())
    state = TrainState.create(params)
    metrics = [step(state, b) for b in batches(micro_steps)]
    return Run([m["loss"] for m in metrics], whole(params), [m["grad_norm"] for m in metrics], recorder.grads,
               {k: whole(v) for k, v in state.optimizer.items()})


# The layouts the compiled runs cover: each graph shape once (fsdp2 and tp2_sp also run
# under inductor in tests/test_equivalence.py): the traced bucket gathers plain (fsdp2), with a replica
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
    make_train_step's parameter-traffic options `traffic` (or any of its keyword
    arguments: an `optimizer` replaces optimizer_args()'s and makes the state)."""
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
        initial = whole(params)
        every_step = name == TORCH_CHECKED and not compile
        recorder = GradRecorder(range(1, STEPS + 1) if every_step else (1,))
        options = {**optimizer_args(), **(traffic or {})}  # `traffic` may name another optimizer too
        step = make_train_step(model, plan, mesh, compile=compile, inspect_grads=recorder, **options)
        state = TrainState.create(params, options["optimizer"])
        torch._dynamo.reset()  # each layout's step traces afresh: no recompile of the last one's
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            metrics = [step(state, b) for b in batches(micro_steps=2)]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before if compile else None
        # Every eager layout's final Adam moments, against one process's in check_layouts.
        moments = {k: whole(v) for k, v in state.optimizer.items()} if not compile else None
        out[name] = initial, Run([m["loss"] for m in metrics], whole(params), [m["grad_norm"] for m in metrics],
                                 recorder.grads, moments, graphs)
    return out


def check_run(run: Run, ref: Run, what: str, grad_atol: float = GRAD_ATOL, param_atol: float = PARAM_ATOL) -> None:
    """Losses and gradient norms on every step, the first step's whole gradients (of the
    parameters `run` holds), the final parameters. (The clipped update's own arithmetic is
    checked against torch in tests/test_equivalence.py.)"""
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


def check_layouts(reference: Run, results) -> None:
    """Each layout's run of `results` (train_layouts' on one rank) against one process's
    `reference`: the initial parameters bitwise, the compiled graphs, the Adam moments
    (eager) and check_run."""
    initial_values = {n: init_slice(s, n, seed=0) for n, s in build("llama", CFG).specs.items()}
    for name, (initial, run) in results.items():
        for n in initial_values:  # layout-invariant init: bitwise
            assert torch.equal(initial[n], initial_values[n]), f"{name}: initial {n} differs"
        assert sorted(run.grads[1]) == sorted(reference.grads[1]), name
        assert run.graphs in (None, COMPILED_GRAPHS), (name, run.graphs)
        if run.moments is not None:  # eager layouts
            check_moments(run, reference, name)
        check_run(run, reference, name)
