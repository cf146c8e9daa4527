"""The pipeline executor on CPU gloo ranks against one process: the same loss per step
(rtol 1e-5) and the same parameters after training (atol 1e-5), fp32, for each schedule,
pp 2 and pp 4, and an uneven split (5 layers on 2 stages)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError
from meshtrain.models import build
from meshtrain.models.spec import init_slice
from meshtrain.pipeline.execute import make_pipeline_step
from meshtrain.pipeline.partition import partition
from meshtrain.pipeline.schedule import build as build_schedule
from meshtrain.testing import run_ranks
from meshtrain.train.optim import AdamW
from meshtrain.train.schedule import LRSchedule
from meshtrain.train.step import TrainState, make_train_step
from test_equivalence import CFG, SEQ

STEPS, BATCH = 4, 8
LLAMA4 = dataclasses.replace(CFG, n_layers=4)


def _batches(cfg, micro_steps):
    g = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        t = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
        t = t.reshape(micro_steps, BATCH // micro_steps, SEQ + 1)
        yield {"tokens": t[..., :-1], "targets": t[..., 1:]}


def _options():
    return dict(optimizer=AdamW(lr=3e-4, weight_decay=0.1), grad_clip=1.0)


def _lr():
    return LRSchedule(lr=3e-4, min_lr=3e-5, warmup_steps=2, total_steps=STEPS)


def single(cfg, micro_steps):
    model = build("llama", cfg)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    step = make_train_step(model, schedule=_lr(), **_options())
    state = TrainState.create(params)
    return [step(state, b)["loss"] for b in _batches(cfg, micro_steps)], {n: p.detach() for n, p in params.items()}


def _pipelined(cfg, name, pp, v, micro_steps, layout):
    torch.set_num_threads(1)
    model = build("llama", cfg)
    stages = partition(model, pp, v, layout, seq_len=SEQ, micro_batch=BATCH // micro_steps)
    rank = dist.get_rank()
    mine = [n for st in stages if st.rank == rank for n in st.params]
    params = {n: init_slice(model.specs[n], n, seed=0).requires_grad_() for n in mine}
    step = make_pipeline_step(model, stages, build_schedule(name, pp, micro_steps, v), lr_schedule=_lr(),
                              **_options())
    state = TrainState.create(params)
    losses = [step(state, b)["loss"] for b in _batches(cfg, micro_steps)]
    return losses, {n: p.detach() for n, p in params.items()}


CASES = {  # name: (config, schedule, pp, virtual stages per rank, micro-steps, explicit layout)
    "gpipe_pp2": (CFG, "gpipe", 2, 1, 4, None),
    "1f1b_pp2": (CFG, "1f1b", 2, 1, 4, None),
    "interleaved_pp2_v2": (LLAMA4, "interleaved", 2, 2, 4, None),
    "1f1b_pp2_uneven_5_layers": (dataclasses.replace(CFG, n_layers=5), "1f1b", 2, 1, 4, [3, 2]),
    "1f1b_pp4": (LLAMA4, "1f1b", 4, 1, 8, None),
    "gpipe_pp4": (LLAMA4, "gpipe", 4, 1, 4, None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_equals_one_process(case):
    cfg, name, pp, v, micro_steps, layout = CASES[case]
    ref_losses, ref_params = single(cfg, micro_steps)
    results = run_ranks(_pipelined, pp, cfg, name, pp, v, micro_steps, layout)
    for losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    gathered = {n: p for _, params in results for n, p in params.items()}
    assert sorted(gathered) == sorted(ref_params)  # every parameter lives on exactly one rank
    for n, p in gathered.items():
        torch.testing.assert_close(p, ref_params[n], rtol=0, atol=1e-5, msg=n)
    assert not torch.equal(ref_params["layers.0.attn.wq"], init_slice(build("llama", cfg).specs["layers.0.attn.wq"],
                                                                      "layers.0.attn.wq", seed=0))


def test_zero_bubble_is_not_executed_yet():
    model = build("llama", CFG)
    stages = partition(model, 2, seq_len=SEQ, micro_batch=2)
    with pytest.raises(ConfigError, match="zero bubble"):
        make_pipeline_step(model, stages, build_schedule("zbh1", 2, 4))
