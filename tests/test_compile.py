"""The compiled step is one graph per function (the loss, the update),
compiled once: no graph breaks (fullgraph) and no recompilation as the learning rate, the
step count and the batches change from step to step. Dynamo's own counters are read, so a
recompile or an extra graph anywhere in the step fails the test. Recompilation is decided
by dynamo's guards, before any backend: aot_eager (AOTAutograd, no code generation) keeps
it quick; inductor's step is compared with eager in test_equivalence."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from meshtrain.models import build
from meshtrain.models.spec import init_slice
from meshtrain.train.optim import AdamW
from meshtrain.train.lr_schedule import LRSchedule
from meshtrain.train.step import TrainState, make_train_step
from support.equivalence import CFG, batches


def _compiled_run(steps: int, smaller_from: int | None = None, **options):
    """Unique graphs after each step; from step `smaller_from` (0-based) on, each micro-batch
    holds 2 sequences instead of 4."""
    torch._dynamo.reset()
    counters.clear()
    model = build("llama", CFG)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, optimizer=AdamW(lr=3e-4),
                           lr_schedule=LRSchedule(lr=3e-4, min_lr=3e-5, warmup_steps=2, total_steps=steps),
                           compile="aot_eager", **options)
    state = TrainState.create(params)
    graphs = []
    for i, batch in enumerate(batches(micro_steps=2, steps=steps)):
        if smaller_from is not None and i >= smaller_from:
            batch = {k: v[:, :2] for k, v in batch.items()}
        step(state, batch)
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def test_compiled_step_compiles_once():
    """fp8 (rowwise) GEMMs, bf16 casts and selective checkpointing: the step with the most
    traced Python (the plain fp32 step compiles in every compiled equivalence run)."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        graphs = _compiled_run(4, precision="fp8", fp8_recipe="rowwise", activation_checkpointing="selective")
    assert graphs == [2] * 4, f"graphs after each step: {graphs} (the loss and the update, once each)"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_counter_sees_a_recompile_of_the_step():
    """Guards the test above with the step itself: smaller batches from the third step on
    make dynamo compile the loss again, which the counter read after each step sees (a
    planted float learning rate in the update fails the test above the same way)."""
    graphs = _compiled_run(3, smaller_from=2)
    assert graphs == [2, 2, 3], graphs  # the loss again; the update is unchanged


def test_rope_tables_are_a_graph_constant():
    """layers.rope_cos_sin is marked the way torch._dynamo.assume_constant_result marks a
    function, without importing dynamo at start (see its comment)."""
    from meshtrain.models.layers import rope_cos_sin

    def probe():
        pass

    marked = torch._dynamo.assume_constant_result(probe)
    flags = dict(vars(marked))
    assert flags == {"_dynamo_marked_constant": True}, flags
    assert all(getattr(rope_cos_sin, k) == v for k, v in flags.items())
