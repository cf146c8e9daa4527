"""Muon (train.optimizer muon) against torch.optim.Muon (fp32, gloo CPU ranks).

- The update's arithmetic: make_update with given gradients equals torch.optim.Muon (the
  blocks' matrices, each expert's matrix of a 3-D tensor on its own) + torch.optim.AdamW
  (the rest) + clip_grad_norm_ bit for bit, for both adjust_lr modes, with and without
  Nesterov.
- Training: transformers' LlamaForCausalLM trained that way from the same weights equals
  meshtrain's step: loss and gradient norm per step (rtol 1e-5) in one process (eager and
  inductor) and on fsdp2 x tp2+sp (eager and aot_eager), for both adjust_lr modes.
- The layout suite against one process: DeepSeek-V3's experts (3-D, ep2 x tp2+sp, with
  MLA and an MTP module) and a pipeline (pp2 x fsdp2 x ep2).
The 4-rank cases share one launch.

Newton-Schulz runs in bf16 (as torch's): a gradient that differs in its last fp32 bit
(another reduction order: transformers' modules, a sharded reduction) can round to
another bf16 value, and the iteration carries that on. So the runs train at lr 3e-4 (as
tests/support/equivalence.py's AdamW), where the largest differences measured (torch
2.13 CPU) stay below a third of the tolerances.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain import AdamW, LRSchedule, MeshSpec, Muon, Rules, TrainState, build, make_plan, make_train_step
from meshtrain.interop.hf import load_hf_params
from meshtrain.models.spec import init_slice
from meshtrain.parallel.init import init_params
from meshtrain.pipeline.partition import partition
from meshtrain.pipeline.schedule import build_pipeline_schedule
from meshtrain.testing import run_ranks
from meshtrain.train.muon import is_muon
from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step
from meshtrain.train.step import make_update
from support import deepseek
from support.equivalence import BATCH, CFG, GRAD_CLIP, SEQ, STEPS, batches

transformers = pytest.importorskip("transformers")

LR, WEIGHT_DECAY, RTOL = 3e-4, 0.1, 1e-5
ADJUST = ("original", "match_rms_adamw")


def muon_args(adjust: str, lr: float = LR, steps: int = STEPS, warmup: int = 3, clip: float = GRAD_CLIP) -> dict:
    return dict(optimizer=Muon(AdamW(lr=lr, weight_decay=WEIGHT_DECAY), adjust_lr=adjust),
                lr_schedule=LRSchedule(lr=lr, min_lr=lr / 10, warmup_steps=warmup, total_steps=steps), grad_clip=clip)


def torch_optimizers(named: dict, adjust: str, nesterov: bool = True):
    """torch.optim.Muon for the blocks' matrices (a 3-D tensor's matrices given as views
    of their own), torch.optim.AdamW for the rest (decay on >= 2-D): their (matrices,
    optimizers)."""
    mine = {n: p for n, p in named.items() if is_muon(n.removeprefix("model."), p)}
    rest = [p for n, p in named.items() if n not in mine]
    muon = torch.optim.Muon(list(mine.values()), lr=LR, weight_decay=WEIGHT_DECAY, adjust_lr_fn=adjust,
                            nesterov=nesterov)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=LR, betas=(0.9, 0.95), eps=1e-8)
    return mine, (muon, adamw)


# --------------------------------------------------------------------------- the update itself

SHAPES = {"tok_emb": (11, 8), "layers.0.attn_norm": (8,), "layers.0.attn.wq": (8, 8), "layers.0.mlp.w_up": (20, 8),
          "layers.0.mlp.w_down": (8, 20), "layers.0.moe.router": (3, 8), "layers.0.moe.w_gate": (3, 6, 8),
          "mtp.0.eh_proj": (8, 16), "output": (11, 8)}


@pytest.mark.parametrize("adjust", ADJUST)
@pytest.mark.parametrize("nesterov", [True, False])
def test_update_equals_torch_bitwise(adjust, nesterov):
    g = torch.Generator().manual_seed(0)
    initial = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(3)]
    opt = Muon(AdamW(lr=LR, weight_decay=WEIGHT_DECAY), adjust_lr=adjust, nesterov=nesterov)
    params = {n: p.clone().requires_grad_() for n, p in initial.items()}
    state = TrainState.create(params, opt)
    assert set(state.optimizer["momentum"]) == {n for n in SHAPES if n.startswith(("layers.", "mtp.")) and
                                                len(SHAPES[n]) >= 2 and not n.endswith("router")}
    assert set(state.optimizer["exp_avg"]) == set(SHAPES) - set(state.optimizer["momentum"])
    schedule = LRSchedule(lr=LR, min_lr=LR / 10, warmup_steps=1, total_steps=3)
    apply = make_update(opt, schedule, None)  # clipping's factor is rounded after another norm: see below
    # torch's: each expert of the 3-D tensor a matrix of its own
    theirs = {n: p.clone() for n, p in initial.items() if len(SHAPES[n]) < 3}
    theirs.update({f"layers.0.moe.w_gate.{e}": initial["layers.0.moe.w_gate"][e].clone() for e in range(3)})
    theirs = {n: p.requires_grad_() for n, p in theirs.items()}
    _, optimizers = torch_optimizers(theirs, adjust, nesterov)
    for t, step_grads in enumerate(grads):
        for n, p in params.items():
            p.grad = step_grads[n].clone()
        for n, p in theirs.items():
            base, _, e = n.rpartition(".") if n.startswith("layers.0.moe.w_gate.") else (n, "", "")
            p.grad = step_grads[base][int(e)].clone() if e else step_grads[n].clone()
        norm = float(apply(state)[0])
        assert norm == pytest.approx(float(torch.nn.utils.get_total_norm([p.grad for p in theirs.values()])), rel=1e-6)
        for o in optimizers:
            for group in o.param_groups:
                group["lr"] = schedule(t)
            o.step()
    for n, p in params.items():
        want = torch.stack([theirs[f"{n}.{e}"] for e in range(3)]) if p.ndim == 3 else theirs[n]
        if n in state.optimizer["momentum"]:  # Muon's: bit for bit
            assert torch.equal(p.detach(), want.detach()), n
        else:  # AdamW's, as tests/test_equivalence.py's test_clipped_update_equals_torch
            torch.testing.assert_close(p.detach(), want.detach(), rtol=0, atol=1e-7, msg=lambda m: f"{n}: {m}")
        assert not torch.equal(p.detach(), initial[n]), n


def test_adamw_state_is_made_over_before_the_first_step_and_refused_after():
    from meshtrain.errors import ConfigError

    params = {n: torch.randn(s).requires_grad_() for n, s in SHAPES.items()}
    opt = Muon(AdamW(lr=LR))
    apply = make_update(opt, LRSchedule(lr=LR, kind="constant"), None)
    state = TrainState.create(params)  # AdamW's moments, as before train.optimizer existed
    for p in params.values():
        p.grad = torch.ones_like(p)
    apply(state)
    assert "momentum" in state.optimizer and "layers.0.attn.wq" not in state.optimizer["exp_avg"]
    late = TrainState.create(params)
    late.step = 5
    for p in params.values():
        p.grad = torch.ones_like(p)
    with pytest.raises(ConfigError, match="train.optimizer=muon: this state holds AdamW's moments"):
        apply(late)
