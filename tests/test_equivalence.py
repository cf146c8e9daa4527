"""Every layout trains to the numbers of one process (fp32, gloo CPU ranks).

The reference is a single-process run with no plan; each layout runs 10 steps with
gradient accumulation (2 micro-steps) against a reference that takes the whole batch
in one step, so accumulation is checked at the same time.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain import AdamW, LRSchedule, MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.models import llama
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks

# GQA (6 query heads over 2 kv heads), an ffn and vocab that are not powers of two.
CFG = llama.LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=100, vocab_size=130, max_seq_len=32)
# 6 steps: past the 3 warm-up steps of the schedule into its decay; each step checked.
STEPS, BATCH, SEQ = 6, 8, 16
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5

# Uneven fsdp shards: the embedding tables split 130 rows over 4 ranks.
UNEVEN = {"tok_emb": {"vocab": ("fsdp",), "embed": ()}, "output": {"vocab": ("fsdp",), "embed": ()}}
# name: (mesh sizes, sequence parallel, rule overrides[, cp_comm]). Context-parallel
# layouts shard parameters over fsdp x cp (the default rules).
LAYOUTS = {
    2: {"dp2": ({"dp": 2}, False, None), "fsdp2": ({"fsdp": 2}, False, None),
        "tp2": ({"tp": 2}, False, None), "tp2_sp": ({"tp": 2}, True, None),
        "cp2_allgather": ({"cp": 2}, False, None, "allgather"), "cp2_ring": ({"cp": 2}, False, None, "ring"),
        "cp2_a2a": ({"cp": 2}, False, None, "a2a")},
    # fsdp x tp without sp is covered by tp2 and fsdp2_tp2_sp (its gathers and tp collectives).
    4: {"dp2_fsdp2": ({"dp": 2, "fsdp": 2}, False, None),
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
                schedule=LRSchedule(lr=3e-4, min_lr=3e-5, warmup_steps=3, total_steps=STEPS), grad_clip=1.0)


def single_process(micro_steps: int = 1, compile=False):
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, compile=compile, **_optimizer())
    state = TrainState.create(params)
    losses = [step(state, b)["loss"] for b in batches(micro_steps)]
    return losses, {n: p.detach().clone() for n, p in params.items()}


# The layouts the compiled runs cover: each graph shape once (fsdp2 and tp2_sp run under
# inductor below; fsdp2_tp2_sp holds the gathers, the tp collectives and sp together; dp's
# only collectives, the gradient all-reduces, are fsdp2's reductions without the gathers).
COMPILED = {"tp2", "fsdp2_tp2_sp", "cp2_ring", "cp2_a2a"}


def train_layouts(world: int, compile, names=None):
    """Runs on every rank: each layout of this world size in turn (or those named)."""
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
        initial = {n: p.full_tensor().detach().clone() for n, p in params.items()}
        step = make_train_step(model, plan, mesh, compile=compile, **_optimizer())
        state = TrainState.create(params)
        losses = [step(state, b)["loss"] for b in batches(micro_steps=2)]
        final = {n: p.full_tensor().detach().clone() for n, p in params.items()}
        out[name] = (losses, initial, final)
    return out


@pytest.fixture(scope="module")
def reference():
    return single_process()


def _check(reference, results):
    ref_losses, ref_params = reference
    initial_values = {n: init_slice(s, n, seed=0) for n, s in build("llama", CFG).specs.items()}
    for name, (losses, initial, final) in results.items():
        for n in initial_values:  # layout-invariant init: bitwise
            assert torch.equal(initial[n], initial_values[n]), f"{name}: initial {n} differs"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0,
                                   msg=lambda m: f"{name} losses: {m}")
        for n, ref in ref_params.items():
            torch.testing.assert_close(final[n], ref, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name} {n}: {m}")


def test_gradient_accumulation_equals_large_batch(reference):
    losses, params = single_process(micro_steps=4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=LOSS_RTOL, atol=0)
    for n, ref in reference[1].items():
        torch.testing.assert_close(params[n], ref, rtol=0, atol=PARAM_ATOL)


def test_training_moves_the_parameters(reference):
    """Guards the equivalence tests against a run that changes nothing."""
    _, params = reference
    initial = {n: init_slice(s, n, seed=0) for n, s in build("llama", CFG).specs.items()}
    for n in params:  # every tensor moves by far more than the tolerance
        assert (params[n] - initial[n]).abs().max().item() > 100 * PARAM_ATOL, n


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(reference, world):
    results = run_ranks(train_layouts, world, world, False)
    for rank_result in results:  # every rank sees the same replicated numbers
        _check(reference, rank_result)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_compiled_layouts_match_single_process(reference, world):
    """fullgraph=True: any graph break fails. aot_eager traces forward and backward the way
    inductor does without paying for C++ code generation on every layout; inductor
    itself is exercised below and in bench/."""
    results = run_ranks(train_layouts, world, world, "aot_eager")
    _check(reference, results[0])


@pytest.mark.slow
def test_inductor_single_process_matches_eager(reference):
    losses, params = single_process(compile=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=LOSS_RTOL, atol=0)
    for n, ref in reference[1].items():
        torch.testing.assert_close(params[n], ref, rtol=0, atol=PARAM_ATOL)



@pytest.mark.slow
def test_inductor_sharded_layouts_match_single_process(reference):
    """Inductor's generated code on DTensor layouts: fsdp (gathers) and tp+sp (sequence
    all-gather / reduce-scatter, vocab-parallel loss)."""
    results = run_ranks(train_layouts, 2, 2, True, ["fsdp2", "tp2_sp"], start="spawn")
    _check(reference, results[0])
