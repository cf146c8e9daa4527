"""A small model's training state to save and load: the checkpoint tests' states
(tests/test_disk.py, tests/test_async_checkpoint.py) and the check that a checkpoint
loads as the state it saved, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshtrain import TrainState, build
from meshtrain import checkpoint as ckpt
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.spec import init_slice
from meshtrain.train.optim import init_state

MODEL = build("llama", LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                   max_seq_len=16))


def train_state(seed: int, step: int = 0) -> TrainState:
    """MODEL's parameters and AdamW state, every tensor filled from `seed`."""
    params = {n: init_slice(s, n, seed=seed).requires_grad_() for n, s in MODEL.specs.items()}
    state = TrainState(params, init_state(params), step)
    for k_i, group in enumerate(state.optimizer.values()):
        for n_i, t in enumerate(group.values()):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed * 1000 + k_i * 100 + n_i)))
    return state


def tensors_of(state: TrainState) -> dict:
    """Copies of a state's parameters and optimizer tensors, to compare a load with."""
    return {"params": {n: t.detach().clone() for n, t in state.params.items()},
            "optimizer": {k: {n: t.clone() for n, t in g.items()} for k, g in state.optimizer.items()}}


def assert_loads_as(path: Path, expected: dict, step: int) -> None:
    """The checkpoint at `path` loads as step `step` with exactly the tensors `expected`."""
    fresh = train_state(seed=99)
    meta = ckpt.load(path, fresh)
    assert fresh.step == step and meta["step"] == step
    got = tensors_of(fresh)
    for n, t in expected["params"].items():
        assert torch.equal(got["params"][n], t), f"{path}: params {n}"
    for k, group in expected["optimizer"].items():
        for n, t in group.items():
            assert torch.equal(got["optimizer"][k][n], t), f"{path}: {k} {n}"
