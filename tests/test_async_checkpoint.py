"""checkpoint.async_save (meshtrain/checkpoint/background.py): the checkpoint holds the
state of the step that saved while training goes on, is not the latest before its commit,
is byte for byte the synchronous one, reuses its staging buffers, and a run that writes
in the background trains, logs and resumes (under another layout too) exactly as one that
does not. Failures: tests/test_disk.py runs every failure point with the background writer
too; kill -9: tests/test_crash_safety.py; the stall: bench/checkpoint_cpu.py."""

from __future__ import annotations

import filecmp
import os
import threading
from pathlib import Path

import pytest
import torch

from meshtrain import checkpoint as ckpt
from meshtrain.cli import main
from support.checkpoints import assert_loads_as, tensors_of, train_state
from support.cli import SMALL, TINY, read_metrics


def test_the_checkpoint_holds_the_step_that_saved_and_is_latest_only_once_committed(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    saver = ckpt.BackgroundSaver()
    ckpt.save(root, 1, train_state(seed=1, step=1), {}, keep_last=2)
    # Hold the writer inside its first tensor file until the test has looked around.
    opened, go = threading.Event(), threading.Event()

    def on_write():
        opened.set()
        assert go.wait(60)

    state = train_state(seed=2, step=2)
    expected = tensors_of(state)
    final = saver.save(root, 2, state, {"n": 2}, keep_last=2, on_write=on_write)
    assert opened.wait(60) and saver.in_flight and not saver.done()
    for t in state.params.values():  # training goes on and changes the state
        t.data.add_(1.0)
    for group in state.optimizer.values():
        for t in group.values():
            t.mul_(3.0)
    assert ckpt.latest(root) == root / "step_00000001"  # the one being written is not the latest
    assert (root / ".tmp-step_00000002").is_dir() and not final.exists()
    go.set()
    path, seconds = saver.wait()
    assert path == final == root / "step_00000002" and seconds > 0 and not saver.in_flight
    assert ckpt.latest(root) == final
    assert_loads_as(final, expected, 2)  # the state when it was saved, not after
    assert saver.wait() is None  # nothing in flight


def test_the_files_are_the_synchronous_ones_and_the_buffers_are_reused(tmp_path):
    state = train_state(seed=3, step=3)
    ckpt.save(tmp_path / "sync", 3, state, {"n": 3}, keep_last=2)
    saver = ckpt.BackgroundSaver()
    saver.save(tmp_path / "async", 3, state, {"n": 3}, keep_last=2)
    saver.wait()
    a, b = tmp_path / "sync" / "step_00000003", tmp_path / "async" / "step_00000003"
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        if name.endswith(".distcp"):
            assert filecmp.cmp(a / name, b / name, shallow=False), name
    assert ckpt.read_meta(a) == ckpt.read_meta(b)
    buffers = {k: v.data_ptr() for k, v in saver._staging.items()}
    saver.save(tmp_path / "async", 4, train_state(seed=4, step=4), {"n": 4}, keep_last=2)
    saver.wait()
    assert {k: v.data_ptr() for k, v in saver._staging.items()} == buffers  # no new allocation


def test_one_save_in_flight_the_next_waits_for_it(tmp_path):
    root = tmp_path / "checkpoints"
    saver = ckpt.BackgroundSaver()
    release = threading.Event()
    saver.save(root, 1, train_state(seed=1, step=1), {}, keep_last=2, on_write=lambda: release.wait(60))
    timer = threading.Timer(0.3, release.set)
    timer.start()
    saver.save(root, 2, train_state(seed=2, step=2), {}, keep_last=2)  # returns once step 1 is committed
    assert ckpt.latest(root) == root / "step_00000001"
    saver.wait()
    assert [p.name for p in ckpt.complete(root)] == ["step_00000001", "step_00000002"]


def _fit(run_dir: Path, *extra: str) -> int:
    return main(["fit", "--config", str(TINY), *SMALL, "--checkpoint.every", "2", "--run_dir", str(run_dir), *extra])


@pytest.mark.slow
def test_a_run_writing_in_the_background_trains_and_resumes_as_a_synchronous_one(tmp_path, capsys, one_thread):
    """6 steps saving every 2, in the background and not: the same losses and norms, the
    same tensor files, ckpt_stall_s on each saving step and ckpt_write_s of every write in
    metrics.jsonl. Then both resume from step 4 under another layout (fsdp 2 x tp 2 on
    4 ranks) to step 8: bit for bit the same."""
    sync, bg = tmp_path / "sync", tmp_path / "async"
    assert _fit(sync, "--train.steps", "6") == 0
    assert _fit(bg, "--train.steps", "6", "--checkpoint.async_save", "true") == 0
    out = capsys.readouterr().out
    assert "(writing in the background)" in out and "checkpoint stall" in out and "checkpoint written in" in out
    a, b = read_metrics(sync), read_metrics(bg)
    keys = ("step", "loss", "grad_norm", "lr")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    saved = {r["step"] for r in b if "ckpt_stall_s" in r}
    assert saved == {2, 4, 6} == {r["step"] for r in a if "ckpt_stall_s" in r}
    assert all("ckpt_write_s" in r for r in a if r["step"] in saved)  # synchronous: on the step itself
    # Background: on the first step after every rank had finished the write (the step-2
    # one before step 4's save); the last save is waited for on its own step.
    assert "ckpt_write_s" in b[-1] and any("ckpt_write_s" in r for r in b if r["step"] in (3, 4))
    # ... naming the step it wrote, on the console too.
    assert [r["ckpt_write_step"] for r in b if r["step"] in (3, 4) and "ckpt_write_s" in r] == [2]
    assert "checkpoint of step 2 written in" in out
    for step in ("step_00000004", "step_00000006"):
        x, y = sync / "checkpoints" / step, bg / "checkpoints" / step
        assert filecmp.cmp(x / "__0_0.distcp", y / "__0_0.distcp", shallow=False)
    # Resume both from step 4, as 4 ranks of another layout.
    resumed = {}
    for name, run in (("sync", sync), ("async", bg)):
        again = tmp_path / f"{name}-resumed"
        (again / "checkpoints").mkdir(parents=True)
        os.symlink(run / "checkpoints" / "step_00000004", again / "checkpoints" / "step_00000004")
        assert _fit(again, "--train.steps", "8", "--parallel.nproc_per_node", "4", "--parallel.fsdp", "2",
                    "--parallel.tp", "2", "--checkpoint.keep_last", "5") == 0
        resumed[name] = [{k: r[k] for k in keys} for r in read_metrics(again)]
    assert resumed["sync"] == resumed["async"] and [r["step"] for r in resumed["sync"]] == [5, 6, 7, 8]
    assert torch.tensor([r["loss"] for r in resumed["sync"]]).isfinite().all()


def _agree_while_one_rank_writes() -> list[bool]:
    """Four step ends on 2 ranks whose background writes end at different steps: rank 0's
    is still writing at the ends of steps 1 and 2, rank 1's only at step 1's. What each
    rank takes as 'every rank's write has finished' after the stop agreement."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from meshtrain.run.fit import _Run

    rank, seen = dist.get_rank(), []
    for step in range(1, 5):
        writing = step <= (2 if rank == 0 else 1)
        run = SimpleNamespace(ranks=SimpleNamespace(world=2), device=torch.device("cpu"),
                              saves=SimpleNamespace(writing=writing, finished_everywhere=True))
        assert _Run._stop_agreed(run) is None  # no signal
        seen.append(run.saves.finished_everywhere)
    return seen


def test_every_rank_joins_a_background_write_at_the_same_step():
    """A rank whose own write has finished must not join it (and log or raise its result)
    before every rank's has: the all-reduce of the stop agreement carries the flag. Both
    ranks see it finished from step 3 on, not rank 1 from step 2 on."""
    from meshtrain.testing import run_ranks

    assert run_ranks(_agree_while_one_rank_writes, 2) == [[False, False, True, True]] * 2
