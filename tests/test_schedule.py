"""LR schedules against their closed forms, and AdamW against torch.optim.AdamW."""

from __future__ import annotations

import math

import pytest
import torch

from meshtrain import LRSchedule
from meshtrain.train.optim import AdamW, adamw_update, grad_norm_squared_local


def test_warmup_is_linear_to_peak():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=20)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_closed_form():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=20, kind="cosine")
    for step in range(4, 25):
        t = min((step - 4) / 16, 1.0)
        assert s(step) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
    assert s(20) == pytest.approx(0.1)


def test_linear_closed_form():
    s = LRSchedule(lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=10, kind="linear")
    assert [s(i) for i in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])


def test_wsd_holds_then_decays():
    s = LRSchedule(lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=100, kind="wsd", decay_fraction=0.2)
    assert s(0) == s(80) == 1.0
    assert s(90) == pytest.approx(0.5)
    assert s(100) == pytest.approx(0.0)


def test_adamw_matches_torch():
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7)]
    reference = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW([{"params": [reference[0]], "weight_decay": 0.1},
                             {"params": [reference[1]], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    cfg = AdamW(lr=1e-2, weight_decay=0.1)
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    decay = [cfg.decays("w", p.ndim) for p in params]
    assert decay == [True, False]
    for step in range(1, 6):
        grads = [torch.randn_like(p) for p in params]
        for r, g in zip(reference, grads):
            r.grad = g.clone()
        opt.step()
        adamw_update(params, grads, exp_avg, exp_avg_sq, decay, torch.tensor(1e-2), torch.tensor(float(step)),
                     cfg.betas, cfg.eps, cfg.weight_decay)
        for p, r in zip(params, reference):
            torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)


def test_grad_norm_counts_replicated_shards_once():
    # Two ranks each hold the same copy (replicas=2): the shares add up to one copy's norm.
    g = [torch.tensor([3.0, 4.0])]
    assert grad_norm_squared_local(g, [2.0]) * 2 == pytest.approx(25.0)
