"""The pipeline estimate's activations per pp rank (estimate/pipeline.py): each in-flight
micro-batch counted at its own stage, at the moment the rank holds the most bytes; against
a hand count and against what a real interleaved step (pp 2, v 2, gloo CPU ranks) keeps
for backward over time."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from meshtrain import MeshSpec, Rules, TrainState, build, make_plan
from meshtrain.estimate.memory import per_rank_memory
from meshtrain.estimate.pipeline import pipeline_estimate
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.spec import init_slice
from meshtrain.layout.plan import without_pp
from meshtrain.testing import run_ranks

# A large vocabulary makes the head's stage the heavier one; a small one with a 1/4/2/1
# layout makes stage 1 the heavier: the peak moments of pp rank 1 differ (below).
CFG = LlamaConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=4096, max_seq_len=64)
CASES = {"even_big_vocab": (CFG, [2, 2, 2, 2]),
         "uneven_small_vocab": (dataclasses.replace(CFG, vocab_size=128), [1, 4, 2, 1])}
MICRO, SEQ, M = 2, 16, 4  # sequences per micro-batch, tokens, micro-batches per step


def _plan(model):
    return make_plan(model.specs, Rules.default(), MeshSpec(pp=2), world=2)


def _estimate(name):
    cfg, layout = CASES[name]
    model = build("llama", cfg)
    return model, pipeline_estimate(_plan(model), model, pp_schedule="interleaved", virtual=2, layout=layout,
                                    micro_batch=MICRO, seq_len=SEQ, micro_steps=M, device="cpu")


@pytest.mark.parametrize("name", CASES)
def test_last_rank_counts_each_micro_batch_at_its_stage(name):
    """pp rank 1 runs F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 ...: at most two micro-batches on
    stage 1 and one on stage 3 (the head), or three on stage 1. Only stage 3's carry the
    head and loss; each carries its own stage's layers and the RoPE tables."""
    model, est = _estimate(name)
    cfg, layout = CASES[name]
    assert est.schedule.timeline().splitlines()[1].startswith("rank 1: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2")
    sub = without_pp(_plan(model))

    def memory(**kw):
        return per_rank_memory(sub, model, micro_batch=MICRO, seq_len=SEQ, device="cpu", embedding=False, **kw)

    plain = memory(layers=[0], head=False)
    layer, rope = plain["activations_per_layer"], plain["activations_once"]
    assert rope == 2 * 4 * SEQ * cfg.head_dim  # cos and sin, fp32
    with_head = memory(layers=[0], head=True)
    head = with_head["activations_once"] - rope + with_head["loss_saved"]
    assert with_head["loss_saved"] == 4 * MICRO * SEQ * (cfg.vocab_size + 1)  # fp32 logits, log-sum-exp
    stage1, stage3 = layout[1] * layer + rope, layout[3] * layer + rope + head
    # rank 1 saves no weights (fp32, nothing gathered): its activations are the micro-batches'
    expected = max(2 * stage1 + stage3, 3 * stage1)
    assert est.ranks[1]["memory"]["activations"] == expected
    if name == "even_big_vocab":
        assert expected == 2 * stage1 + stage3 > 3 * stage1
    else:
        assert expected == 3 * stage1 > 2 * stage1 + stage3
    assert est.timing.peak_in_flight[1] == 3
    # what was counted before: 3 micro-batches, each at the largest stage and with the head
    assert expected < 3 * (max(layout[1], layout[3]) * layer + rope + head)


class _Saved:
    """What autograd holds for a saved tensor; freed when the graph releases it."""

    def __init__(self, tensor):
        self.tensor = tensor


def _held_for_backward(names):
    """On each rank, per case: the most bytes of saved activations alive at once during
    one pipelined step (unique storages, not parameters or the batch's token ids)."""
    from meshtrain.pipeline.partition import partition
    from meshtrain.pipeline.schedule import build_pipeline_schedule
    from meshtrain.train.optim import AdamW
    from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step

    out = {}
    for name in names:
        cfg, layout = CASES[name]
        model = build("llama", cfg)
        plan = _plan(model)
        mesh = plan.mesh.build()
        stages = partition(model, 2, 2, layout, seq_len=SEQ, micro_batch=MICRO)
        mine, _, _ = local_stage_layout(plan, mesh, stages)
        params = {n: init_slice(model.specs[n], n, seed=0).requires_grad_() for n in mine}
        step = make_pipeline_step(model, stages, build_pipeline_schedule("interleaved", 2, M, 2), plan, mesh,
                                  optimizer=AdamW(lr=3e-4))
        # Contiguous, as the runner's batches are (a strided slice is copied by the loss).
        batch = {k: torch.randint(0, cfg.vocab_size, (M, MICRO, SEQ), generator=torch.Generator().manual_seed(i))
                 for i, k in enumerate(("tokens", "targets"))}
        outside = {x.untyped_storage().data_ptr() for x in [*params.values(), *batch.values()]}
        live: dict[int, list[int]] = {}  # storage -> [holders, bytes]
        total, peak = [0], [0]

        def release(ptr):
            entry = live[ptr]
            entry[0] -= 1
            if not entry[0]:
                total[0] -= live.pop(ptr)[1]

        def pack(x):
            s = x.untyped_storage()
            if s.data_ptr() in outside:
                return x
            entry = live.setdefault(s.data_ptr(), [0, s.nbytes()])
            if not entry[0]:
                total[0] += entry[1]
                peak[0] = max(peak[0], total[0])
            entry[0] += 1
            saved = _Saved(x)
            weakref.finalize(saved, release, s.data_ptr())
            return saved

        def unpack(saved):
            return saved.tensor if isinstance(saved, _Saved) else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            step(TrainState.create(params), batch)
        out[name] = peak[0], total[0]
    return out


@pytest.mark.slow
def test_estimate_equals_the_bytes_a_pipelined_step_holds():
    """Per pp rank, the estimate's activations = the most saved-for-backward bytes alive
    at once in a real step (eager, fp32: no weights saved as copies). Counted per saved
    tensor from the same shapes, so exact; and all are released by the step's end."""
    results = run_ranks(_held_for_backward, 2, list(CASES))
    for name in CASES:
        _, est = _estimate(name)
        for rank, measured in enumerate(results):
            peak, left = measured[name]
            assert left == 0, (name, rank, left)
            assert peak == est.ranks[rank]["memory"]["activations"], (name, rank, peak, est.ranks[rank]["memory"])
