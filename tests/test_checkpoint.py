"""Checkpoints: bitwise round trips (one process, fsdp=2 gloo ranks, across layouts),
the complete / incomplete rules, pruning, crash safety and the load errors."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan
from meshtrain.models.llama import LlamaConfig
from meshtrain.models.spec import init_slice
from meshtrain.testing import run_ranks
from meshtrain import checkpoint as ckpt
from meshtrain import files
from meshtrain.checkpoint import CheckpointError
from meshtrain.layout.placements import local_tensor
from meshtrain.train.optim import init_state

CFG = LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
MODEL = build("llama", CFG)


def _fill_optimizer(state: TrainState) -> None:
    """Distinct values in every optimizer tensor, the same full values in every layout."""
    for k_i, k in enumerate(sorted(state.optimizer)):
        for n_i, (n, t) in enumerate(state.optimizer[k].items()):
            full = torch.randn(tuple(t.shape), generator=torch.Generator().manual_seed(1000 * (k_i + 1) + n_i))
            if isinstance(t, DTensor):
                local_tensor(t).copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local())
            else:
                t.copy_(full)


def _single_state(seed: int, filled: bool, step: int = 0, model=MODEL) -> TrainState:
    params = {n: init_slice(s, n, seed=seed).requires_grad_() for n, s in model.specs.items()}
    state = TrainState(params, init_state(params), step)
    if filled:
        _fill_optimizer(state)
    return state


def _sharded_state(sizes: dict, seed: int, filled: bool, step: int = 0) -> TrainState:
    import torch.distributed as dist

    plan = make_plan(MODEL.specs, Rules.default(), MeshSpec(**sizes), world=dist.get_world_size())
    params = init_params(plan, plan.mesh.build(), seed=seed)
    state = TrainState(params, init_state(params), step)
    if filled:
        _fill_optimizer(state)
    return state


def _full(state: TrainState) -> dict:
    def f(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    return {"params": {n: f(t) for n, t in state.params.items()},
            "optimizer": {k: {n: f(t) for n, t in g.items()} for k, g in state.optimizer.items()}}


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), f"{what}: params {n}"
    for k in a["optimizer"]:
        for n in a["optimizer"][k]:
            assert torch.equal(a["optimizer"][k][n], b["optimizer"][k][n]), f"{what}: {k} {n}"


def test_single_process_roundtrip_is_bitwise(tmp_path):
    state = _single_state(seed=0, filled=True, step=7)
    saved = _full(state)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    path = ckpt.save(tmp_path, 7, state, {"consumed_samples": 56, "config": {"lr": 3e-4}}, keep_last=2)
    assert path == tmp_path / "step_00000007"
    torch.rand(100)  # the RNG moves on after the save

    fresh = _single_state(seed=1, filled=False)
    before = {n: t for n, t in fresh.params.items()}
    assert not torch.equal(fresh.params["tok_emb"], saved["params"]["tok_emb"])
    meta = ckpt.load(path, fresh)

    _assert_equal(_full(fresh), saved, "single process")
    assert all(fresh.params[n] is before[n] and fresh.params[n].requires_grad for n in before)  # in place
    assert fresh.step == 7 and meta["step"] == 7 and meta["world"] == 1
    assert meta["extra"] == {"consumed_samples": 56, "config": {"lr": 3e-4}}
    assert torch.equal(torch.get_rng_state(), rng)
    on_disk = json.loads((path / "meta.json").read_text())
    assert base64.b64decode(on_disk["rng"][0]["cpu"]) == rng.numpy().tobytes()


def test_save_rejects_bad_arguments(tmp_path):
    state = _single_state(seed=0, filled=False)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        ckpt.save(tmp_path, 1, state, {"bad": object()}, keep_last=1)
    with pytest.raises(CheckpointError, match="keep_last"):
        ckpt.save(tmp_path, 1, state, {}, keep_last=0)
    assert ckpt.latest(tmp_path) is None


def test_latest_picks_highest_complete_and_cleanup_removes_the_rest(tmp_path):
    state = _single_state(seed=0, filled=False)
    for step in (1, 3):
        ckpt.save(tmp_path, step, state, {}, keep_last=5)
    meta = (tmp_path / "step_00000003" / "meta.json").read_text()
    # A temporary dir (even one that got as far as meta.json), a final name without
    # meta.json and one with a corrupt meta.json: none of them count.
    shutil.copytree(tmp_path / "step_00000003", tmp_path / ".tmp-step_00000009")
    shutil.copytree(tmp_path / "step_00000003", tmp_path / "step_00000007")
    (tmp_path / "step_00000007" / "meta.json").unlink()
    shutil.copytree(tmp_path / "step_00000003", tmp_path / "step_00000008")
    (tmp_path / "step_00000008" / "meta.json").write_text(meta[:10])
    (tmp_path / "notes").mkdir()
    assert ckpt.latest(tmp_path) == tmp_path / "step_00000003"

    ckpt.cleanup_incomplete(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_00000001", "step_00000003"]
    assert ckpt.latest(tmp_path / "missing") is None


def test_keep_last_prunes_the_oldest(tmp_path):
    state = _single_state(seed=0, filled=False)
    for step in (4, 1, 2, 3):  # pruning goes by step, not by save order...
        ckpt.save(tmp_path, step, state, {}, keep_last=2)
    # ...but never deletes the checkpoint it has just written.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    ckpt.save(tmp_path, 5, state, {}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]


def _crash_on_rename(monkeypatch, nth: int):
    calls = []
    real = files.rename

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == nth:
            raise KeyboardInterrupt("simulated crash")
        real(src, dst)

    monkeypatch.setattr(files, "rename", rename)


def test_crash_before_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    state = _single_state(seed=0, filled=True)
    ckpt.save(tmp_path, 1, state, {"n": 1}, keep_last=1)
    _crash_on_rename(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 2, state, {"n": 2}, keep_last=1)
    monkeypatch.undo()
    assert (tmp_path / ".tmp-step_00000002" / "meta.json").exists()  # written, never renamed
    assert ckpt.latest(tmp_path) == tmp_path / "step_00000001"
    assert ckpt.load(ckpt.latest(tmp_path), _single_state(seed=1, filled=False))["extra"] == {"n": 1}

    ckpt.cleanup_incomplete(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    ckpt.save(tmp_path, 2, state, {"n": 2}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


@pytest.mark.parametrize("exchange", [True, False])
def test_replacing_a_step_is_safe(tmp_path, monkeypatch, exchange):
    state = _single_state(seed=0, filled=False)
    if not exchange:
        monkeypatch.setattr(files, "exchange", lambda a, b: False)
    ckpt.save(tmp_path, 5, state, {"v": 1}, keep_last=1)
    ckpt.save(tmp_path, 5, state, {"v": 2}, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]
    assert ckpt.load(tmp_path / "step_00000005", state)["extra"] == {"v": 2}
    if exchange:
        return
    # Without an atomic swap, die after moving the old one aside: cleanup puts it back.
    _crash_on_rename(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 5, state, {"v": 3}, keep_last=1)
    assert (tmp_path / ".old-step_00000005" / "meta.json").exists()
    ckpt.cleanup_incomplete(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]
    assert ckpt.load(ckpt.latest(tmp_path), state)["extra"] == {"v": 2}


def test_load_errors_name_the_path_and_the_parameter(tmp_path):
    state = _single_state(seed=0, filled=True, step=3)
    path = ckpt.save(tmp_path, 3, state, {}, keep_last=1)

    with pytest.raises(CheckpointError, match="step_00000099 does not exist"):
        ckpt.load(tmp_path / "step_00000099", state)

    wide = build("llama", LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=72,
                                      max_seq_len=16))
    other = _single_state(seed=1, filled=False, model=wide)
    untouched = other.params["layers.0.attn.wq"].detach().clone()
    with pytest.raises(CheckpointError) as e:
        ckpt.load(path, other)
    assert str(path) in str(e.value)
    assert "parameter tok_emb has shape (64, 32) in the checkpoint but (72, 32) in the model" in str(e.value)
    assert torch.equal(other.params["layers.0.attn.wq"], untouched) and other.step == 0  # nothing loaded

    fewer = _single_state(seed=1, filled=False)
    del fewer.params["norm"]
    with pytest.raises(CheckpointError, match="parameter norm .* in the checkpoint but not in the model"):
        ckpt.load(path, fewer)

    (path / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{path}: meta.json is corrupt"):
        ckpt.load(path, state)
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=f"{path} has no meta.json"):
        ckpt.load(path, state)


class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return os.mkdir, (str(self.target),)


def test_metadata_is_never_unpickled_into_code(tmp_path):
    state = _single_state(seed=0, filled=False)
    path = ckpt.save(tmp_path, 1, state, {}, keep_last=1)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="not DCP metadata"):
        ckpt.load(path, state)
    assert not marker.exists()


def _fsdp_ranks(root: str):
    """On each of 2 ranks: save an fsdp=2 state, reload it bitwise into a fresh one, load
    it again under tp=2, and load a checkpoint written by one process."""
    import torch.distributed as dist

    rank = dist.get_rank()
    root = Path(root)
    state = _sharded_state({"fsdp": 2}, seed=0, filled=True, step=11)
    saved_local = {n: local_tensor(t).clone() for n, t in state.params.items()}
    saved_exp_avg = {n: local_tensor(t).clone() for n, t in state.optimizer["exp_avg"].items()}
    torch.manual_seed(100 + rank)
    rng = torch.get_rng_state()
    path = ckpt.save(root / "fsdp", 11, state, {"consumed_samples": 88}, keep_last=2)
    files = sorted(os.listdir(path))  # final on every rank when save returns
    torch.rand(100)

    fresh = _sharded_state({"fsdp": 2}, seed=1, filled=False)
    meta = ckpt.load(path, fresh)
    same_layout = (all(torch.equal(local_tensor(fresh.params[n]), saved_local[n]) for n in saved_local)
                   and all(torch.equal(local_tensor(fresh.optimizer["exp_avg"][n]), saved_exp_avg[n]) for n in saved_local))
    rng_restored = torch.equal(torch.get_rng_state(), rng)

    tp = _sharded_state({"tp": 2}, seed=1, filled=False)
    ckpt.load(path, tp)
    from_single = _sharded_state({"fsdp": 2}, seed=1, filled=False)
    single_meta = ckpt.load(root / "single" / "step_00000004", from_single)
    return {"full": _full(state), "same_layout": same_layout, "step": fresh.step, "meta": meta, "files": files,
            "rng": rng, "rng_restored": rng_restored, "tp_full": _full(tp), "tp_step": tp.step,
            "from_single": _full(from_single), "single_step": from_single.step, "single_meta": single_meta}


def test_fsdp2_checkpoint_roundtrips_across_layouts_and_into_one_process(tmp_path):
    single = _single_state(seed=2, filled=True, step=4)
    ckpt.save(tmp_path / "single", 4, single, {}, keep_last=1)

    results = run_ranks(_fsdp_ranks, 2, str(tmp_path), timeout=180)
    full = results[0]["full"]
    for rank, r in enumerate(results):
        assert r["same_layout"], f"rank {rank}: fsdp=2 -> fsdp=2 reload differs"
        assert r["rng_restored"], f"rank {rank}: RNG state not restored"
        assert r["step"] == 11 and r["meta"]["extra"] == {"consumed_samples": 88} and r["meta"]["world"] == 2
        assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
        _assert_equal(r["tp_full"], full, f"rank {rank}: fsdp=2 -> tp=2")
        assert r["tp_step"] == 11
        _assert_equal(r["from_single"], _full(single), f"rank {rank}: one process -> fsdp=2")
        assert r["single_step"] == 4 and r["single_meta"]["world"] == 1
    # meta.json holds each rank's own RNG state, gathered to rank 0.
    meta = json.loads((tmp_path / "fsdp" / "step_00000011" / "meta.json").read_text())
    assert [base64.b64decode(e["cpu"]) for e in meta["rng"]] == [r["rng"].numpy().tobytes() for r in results]
    assert results[0]["rng"].numpy().tobytes() != results[1]["rng"].numpy().tobytes()

    # The same checkpoint in one process, into plain tensors: the gathered values. The
    # world size differs, so the RNG is left alone.
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    plain = _single_state(seed=1, filled=False)
    meta = ckpt.load(ckpt.latest(tmp_path / "fsdp"), plain)
    _assert_equal(_full(plain), full, "fsdp=2 -> one process")
    assert plain.step == 11 and meta["world"] == 2
    assert torch.equal(torch.get_rng_state(), rng)
