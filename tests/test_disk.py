"""A disk that fills up, or a run_dir that is read-only, while a checkpoint is written:
the previous checkpoints stay intact and loadable, and the save fails with one
CheckpointError that says what could not be written, why, what is intact and the fix.

We run as root, where chmod does not make a directory read-only, so the failures are
injected: the OS call at one point of the save (the temporary directory, the first tensor
file, a write half-way through it, DCP's .metadata, an fsync, meta.json, the rename, the
swap of a replaced step, pruning) raises OSError(ENOSPC) or OSError(EROFS), as the kernel
would.
Every case runs twice: with the synchronous save, and with the background writer
(checkpoint.async_save, `BackgroundSaver`), whose failure surfaces at its wait as the
same CheckpointError.
"""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.distributed.checkpoint import filesystem as dcp_fs

from meshtrain import TrainState
from meshtrain.cli import main
from meshtrain.testing import run_ranks
from meshtrain import checkpoint as ckpt
from meshtrain import files
from meshtrain.checkpoint import CheckpointError
from meshtrain.train.optim import init_state
from support.checkpoints import MODEL, assert_loads_as, tensors_of, train_state
from support.cli import SMALL, TINY, read_metrics

REASONS = {errno.ENOSPC: ("No space left on device", "free space on the disk of"),
           errno.EROFS: ("Read-only file system", "writable")}


def _save(kind: str, root, step: int, state, extra: dict, keep_last: int) -> Path:
    """ckpt.save, or a BackgroundSaver's save and wait (kind "async")."""
    if kind == "sync":
        return ckpt.save(root, step, state, extra, keep_last=keep_last)
    saver = ckpt.BackgroundSaver()
    final = saver.save(root, step, state, extra, keep_last=keep_last)
    assert saver.wait()[0] == final
    return final


KINDS = ["sync", "async"]


def _oserror(code: int, path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


class _FillingStream(io.RawIOBase):
    """A file that takes `room` bytes, then fails as a full (or read-only) disk does."""

    def __init__(self, inner, room: int, code: int):
        self.inner, self.room, self.code = inner, room, code

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = memoryview(b).cast("B")
        if len(b) > self.room:
            self.inner.write(b[:self.room])
            self.room = 0
            raise _oserror(self.code, self.inner.name)
        self.room -= len(b)
        return self.inner.write(b)

    def fileno(self) -> int:
        return self.inner.fileno()

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def flush(self) -> None:
        if not self.inner.closed:
            self.inner.flush()

    def close(self) -> None:
        super().close()
        self.inner.close()


def _inject(monkeypatch, point: str, code: int) -> None:
    """Make the save fail at `point` with OSError(code)."""
    if point == "tmp_dir":  # the temporary directory cannot be created
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if Path(path).name.startswith(".tmp-"):
                raise _oserror(code, path)
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
    elif point in ("first_tensor_file", "tensor_half_written", "dcp_metadata"):
        real_stream = dcp_fs.FileSystem.create_stream
        suffix = ".metadata.tmp" if point == "dcp_metadata" else ".distcp"

        def create_stream(self, path, mode):
            if not str(path).endswith(suffix):
                return real_stream(self, path, mode)
            if point != "tensor_half_written":
                raise _oserror(code, path)
            return _FillingStream(open(path, mode), room=4096, code=code)

        monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)
    elif point == "first_fsync":  # write-back of the first tensor file fails
        def fsync(fd):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "fsync", fsync)
    elif point == "meta_json":  # meta.json fills the disk half-way through
        def open_meta(path, mode="r", *args, **kwargs):
            if Path(path).name != "meta.json" or "w" not in mode:
                return open(path, mode, *args, **kwargs)
            return io.TextIOWrapper(io.BufferedWriter(_FillingStream(open(path, "wb"), room=100, code=code)),
                                    encoding="utf-8")

        monkeypatch.setattr(files, "open", open_meta, raising=False)
    elif point in ("rename", "replace_rename", "prune"):
        # rename(s): the directory cannot be renamed into place; prune: the oldest
        # checkpoint cannot be moved aside to be deleted
        real_rename = os.rename

        def rename(src, dst):
            refused = Path(dst).name.startswith(".del-") if point == "prune" else Path(src).name.startswith(".tmp-")
            if refused:
                raise _oserror(code, src)
            return real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)
        if point == "replace_rename":  # no atomic swap: the old one is moved aside first
            monkeypatch.setattr(files, "exchange", lambda a, b: False)
    else:
        raise AssertionError(point)


POINTS = ["tmp_dir", "first_tensor_file", "tensor_half_written", "dcp_metadata", "first_fsync", "meta_json",
          "rename", "replace_rename", "prune"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk_full", "read_only"])
@pytest.mark.parametrize("point", POINTS)
def test_a_failed_write_leaves_the_previous_checkpoints_intact_and_says_so(tmp_path, monkeypatch, point, code, kind):
    root = tmp_path / "checkpoints"
    first, second = train_state(seed=1, step=1), train_state(seed=2, step=2)
    ckpt.save(root, 1, first, {"n": 1}, keep_last=2)
    ckpt.save(root, 2, second, {"n": 2}, keep_last=2)
    saved = {1: tensors_of(first), 2: tensors_of(second)}
    new_step = 2 if point == "replace_rename" else 3  # replace_rename saves step 2 again
    _inject(monkeypatch, point, code)

    if point == "prune":  # the new checkpoint is final before pruning: a warning, not a failed save
        with pytest.warns(UserWarning, match="could not delete it"):
            assert _save(kind, root, 3, train_state(seed=3, step=3), {"n": 3}, keep_last=2) == root / "step_00000003"
        monkeypatch.undo()
        assert ckpt.latest(root) == root / "step_00000003"
        assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002", "step_00000003"]
        assert_loads_as(root / "step_00000002", saved[2], 2)
        assert_loads_as(root / "step_00000001", saved[1], 1)
        return

    with pytest.raises(CheckpointError) as e:
        _save(kind, root, new_step, train_state(seed=3, step=new_step), {"n": 3}, keep_last=2)
    monkeypatch.undo()
    message = str(e.value)
    reason, fix = REASONS[code]
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"checkpoint step_{new_step:08d} could not be written under {root}: {reason} ")
    assert f"the previous checkpoints are intact, the latest complete one is {root / 'step_00000002'}" in message
    assert fix in message and "run the command again to resume from step_00000002" in message
    # Nothing older was touched, the partial directory is gone, and both still load.
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    assert ckpt.latest(root) == root / "step_00000002"
    assert_loads_as(root / "step_00000002", saved[2], 2)
    assert_loads_as(root / "step_00000001", saved[1], 1)
    ckpt.cleanup_incomplete(root)  # and the next start finds nothing to repair
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]


def test_the_first_checkpoint_failing_says_that_none_is_lost(tmp_path, monkeypatch):
    _inject(monkeypatch, "first_tensor_file", errno.ENOSPC)
    with pytest.raises(CheckpointError, match="no complete checkpoint exists there, so none is lost") as e:
        ckpt.save(tmp_path / "checkpoints", 2, train_state(seed=1), {}, keep_last=2)
    assert "starts from the beginning" in str(e.value)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_leftovers_that_cannot_be_removed_stop_the_start_with_the_reason(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    ckpt.save(root, 1, train_state(seed=1), {}, keep_last=2)
    (root / ".tmp-step_00000002").mkdir()

    def rmtree(path, *args, **kwargs):
        raise _oserror(errno.EROFS, path)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(CheckpointError, match="Read-only file system") as e:
        ckpt.cleanup_incomplete(root)
    assert f"the latest complete one is {root / 'step_00000001'}" in str(e.value)
    assert "writable" in str(e.value)


def _two_ranks(root: str, point: str, kind: str = "sync"):
    """Both ranks save step 1, then step 2 fails at `point` (on rank 1's tensor file, or
    on rank 0's meta.json): every rank raises the same CheckpointError."""
    import torch.distributed as dist

    from meshtrain import MeshSpec, Rules, init_params, make_plan

    plan = make_plan(MODEL.specs, Rules.default(), MeshSpec(fsdp=2), world=2)
    params = init_params(plan, plan.mesh.build(), seed=0)
    state = TrainState(params, init_state(params), 1)
    ckpt.save(root, 1, state, {}, keep_last=2)
    real_stream, real_open = dcp_fs.FileSystem.create_stream, open

    def create_stream(self, path, mode):
        if dist.get_rank() == 1 and str(path).endswith(".distcp"):
            raise _oserror(errno.ENOSPC, path)
        return real_stream(self, path, mode)

    def open_meta(path, mode="r", *args, **kwargs):
        if Path(path).name == "meta.json" and "w" in mode:
            raise _oserror(errno.EROFS, path)
        return real_open(path, mode, *args, **kwargs)

    if point == "rank1_tensor_file":
        dcp_fs.FileSystem.create_stream = create_stream
    else:
        files.open = open_meta
    try:
        _save(kind, root, 2, state, {}, keep_last=2)
    except CheckpointError as e:
        return {"message": str(e)}
    finally:
        dcp_fs.FileSystem.create_stream = real_stream
        vars(files).pop("open", None)
    return {"message": None}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("point", ["rank1_tensor_file", "rank0_meta_json"])
def test_two_ranks_fail_alike_with_the_same_message(tmp_path, point, kind):
    results = run_ranks(_two_ranks, 2, str(tmp_path), point, kind, timeout=180)
    messages = [r["message"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    reason = "No space left on device" if point == "rank1_tensor_file" else "Read-only file system"
    assert messages[0].startswith(f"checkpoint step_00000002 could not be written under {tmp_path}: {reason}")
    assert f"the latest complete one is {tmp_path / 'step_00000001'}" in messages[0]
    assert ckpt.latest(tmp_path) == tmp_path / "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def _fit_args(run_dir: Path, kind: str = "sync") -> list[str]:
    return ["fit", "--config", str(TINY), *SMALL, "--train.steps", "6", "--checkpoint.every", "2",
            "--run_dir", str(run_dir), "--checkpoint.async_save", str(kind == "async").lower()]


@pytest.mark.parametrize("kind", KINDS)
def test_fit_stops_with_exit_2_when_the_disk_fills_and_resumes_once_freed(tmp_path, monkeypatch, capsys, one_thread,
                                                                          kind):
    """Written in the background, the failure of step 4's save stops the run at a later
    step (the next agreed check), with the same message."""
    whole = tmp_path / "whole"
    assert main(_fit_args(whole)) == 0
    capsys.readouterr()

    run_dir = tmp_path / "run"
    _inject_at_step(monkeypatch, 4)
    assert main(_fit_args(run_dir, kind)) == 2
    err = capsys.readouterr().err
    monkeypatch.undo()
    root = run_dir / "checkpoints"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"meshtrain: checkpoint error: checkpoint step_00000004 could not be written under {root}: "
                          "No space left on device"), err
    assert f"the previous checkpoints are intact, the latest complete one is {root / 'step_00000002'}" in err
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]

    # Space freed: the same command resumes from step 2 and ends on the uninterrupted curve.
    assert main(_fit_args(run_dir, kind)) == 0
    out = capsys.readouterr().out
    assert re.search(rf"resumed from {re.escape(str(root / 'step_00000002'))} at step 2 ", out), out
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))
    assert [r["loss"] for r in read_metrics(run_dir)] == [r["loss"] for r in read_metrics(whole)]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]


def _inject_at_step(monkeypatch, step: int) -> None:
    """The disk is full from the first tensor file of the checkpoint of `step` on."""
    real_stream = dcp_fs.FileSystem.create_stream

    def create_stream(self, path, mode):
        if f".tmp-step_{step:08d}" in str(path):
            raise _oserror(errno.ENOSPC, path)
        return real_stream(self, path, mode)

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", create_stream)


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of `size` KiB at tmp_path/disk (needs root and mount; skipped without)."""
    mounted = []

    def mount(size_kib: int) -> Path:
        disk = tmp_path / "disk"
        disk.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(disk)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="mounting a small tmpfs needs root")
def test_a_real_full_disk_and_a_real_read_only_remount(tmp_path, small_disk):
    """No injection: a tmpfs too small for a second checkpoint (torch.save reports the
    failed write as "RuntimeError: unexpected pos", the save still names the OS reason),
    then the same tmpfs remounted read-only."""
    probe = ckpt.save(tmp_path / "probe", 1, train_state(seed=1), {}, keep_last=1)
    size = sum(p.stat().st_size for p in probe.iterdir())
    disk = small_disk(int(size * 1.5) // 1024 + 8)
    root = disk / "checkpoints"
    first = train_state(seed=1, step=1)
    ckpt.save(root, 1, first, {}, keep_last=2)
    with pytest.raises(CheckpointError, match=r"step_00000002 could not be written .*: No space left on device .*"
                                              r"__0_0.distcp.*the latest complete one is .*step_00000001"):
        ckpt.save(root, 2, train_state(seed=2, step=2), {}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]
    assert_loads_as(root / "step_00000001", tensors_of(first), 1)

    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(CheckpointError, match=r"step_00000002 could not be written .*: Read-only file system .*"
                                              r"the latest complete one is .*step_00000001.*writable"):
        ckpt.save(root, 2, train_state(seed=2, step=2), {}, keep_last=2)
    assert_loads_as(root / "step_00000001", tensors_of(first), 1)
    assert ckpt.latest(root) == root / "step_00000001"
