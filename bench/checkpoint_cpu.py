"""Checkpoint saves on CPU: how long a step waits for a synchronous save and for one
written in the background (checkpoint.async_save), in the same run.

One process trains a Llama large enough that a save takes seconds here (default: 109M
parameters, fp32 with AdamW's two moments: 1.3 GB of state) and saves it twice, the same
way meshtrain fit does (meshtrain.checkpoint):

  sync     checkpoint.save at step k: the step waits until the checkpoint is written,
           fsynced and renamed into place
  async    BackgroundSaver.save at step k + 3 (its staging buffers made beforehand, as
           fit makes them when it starts): the step waits while the state is copied
           into them (and the temporary directory is made); a thread
           writes and commits while the next steps train, and the run waits for it only
           if it has not finished when the measurement ends

Reported: the median step time without a save; the synchronous save's stall; the
background save's stall (and its ratio to the synchronous stall), its write time and
write bandwidth (state bytes / write time), the times of the 4 steps after it (they
share the CPU with the writer); and for both, the time lost over the save and the 4 steps
after it against 4 plain steps (the background one waits for its write at the end). The two checkpoints must hold the same bytes
as the state at their step: each is loaded back and compared, else the bench refuses to
report.

    python bench/checkpoint_cpu.py --json checkpoint.json        # ~1 min, 1.3 GB per save
    python bench/checkpoint_cpu.py --tiny --json out.json          # seconds, for CI
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtrain import build  # noqa: E402
from meshtrain import checkpoint as ckpt  # noqa: E402
from meshtrain.models.llama import LlamaConfig  # noqa: E402
from meshtrain.models.spec import init_slice  # noqa: E402
from meshtrain.train.optim import AdamW  # noqa: E402
from meshtrain.train.step import TrainState, make_train_step  # noqa: E402

SIZES = {
    "default": LlamaConfig(dim=1024, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=2816, vocab_size=16384,
                           max_seq_len=64),
    "tiny": LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=352, vocab_size=1024, max_seq_len=64),
}
SEQ, BATCH = 32, 1
AFTER = 4  # steps timed after each save (the background write runs beside them)


def _snapshot(state: TrainState) -> dict:
    return {"params": {n: t.detach().clone() for n, t in state.params.items()},
            "optimizer": {k: {n: t.clone() for n, t in g.items()} for k, g in state.optimizer.items()}}


def _check(path: Path, expected: dict, model) -> None:
    fresh = TrainState.create({n: torch.zeros(s.shape, dtype=s.dtype).requires_grad_() for n, s in model.specs.items()})
    ckpt.load(path, fresh)
    for n, t in expected["params"].items():
        if not torch.equal(fresh.params[n], t):
            raise SystemExit(f"REFUSING TO REPORT: {path} holds another {n} than the state at its step")
    for k, g in expected["optimizer"].items():
        for n, t in g.items():
            if not torch.equal(fresh.optimizer[k][n], t):
                raise SystemExit(f"REFUSING TO REPORT: {path} holds another {k} {n} than the state at its step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temporary directory)")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = SIZES["tiny" if a.tiny else "default"]
    model = build("llama", cfg)
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    n_params = sum(p.numel() for p in params.values())
    state = TrainState.create(params)
    state_bytes = 3 * 4 * n_params
    step = make_train_step(model, optimizer=AdamW(lr=1e-4))
    g = torch.Generator().manual_seed(0)

    def batch():
        t = torch.randint(0, cfg.vocab_size, (1, BATCH, SEQ + 1), generator=g)
        return {"tokens": t[..., :-1], "targets": t[..., 1:]}

    def timed_step() -> float:
        start = time.perf_counter()
        step(state, batch())
        return time.perf_counter() - start

    work = a.dir or Path(tempfile.mkdtemp(prefix="meshtrain-ckpt-bench-"))
    root = work / "checkpoints"
    print(f"model: Llama dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}: {n_params / 1e6:.1f}M "
          f"parameters, fp32 + AdamW = {state_bytes / 1e9:.2f} GB of state; {BATCH} x {SEQ} tokens per step; "
          f"checkpoints under {root} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})", flush=True)
    try:
        for _ in range(2):
            timed_step()  # warm
        plain = [timed_step() for _ in range(3)]

        # Synchronous: the step's save, then two steps.
        timed_step()
        expected_sync = _snapshot(state)
        start = time.perf_counter()
        sync_path = ckpt.save(root, state.step, state, {}, keep_last=3)
        sync_stall = time.perf_counter() - start
        after_sync = [timed_step() for _ in range(AFTER)]
        sync_total = time.perf_counter() - start

        # In the background: the step's save, then steps until the write has finished.
        timed_step()
        expected_async = _snapshot(state)
        saver = ckpt.BackgroundSaver()
        start = time.perf_counter()
        saver.reserve(state)  # as meshtrain fit does when it starts
        reserve_s = time.perf_counter() - start
        start = time.perf_counter()
        async_path = saver.save(root, state.step, state, {}, keep_last=3)
        async_stall = time.perf_counter() - start
        during = [timed_step() for _ in range(AFTER)]
        waited_start = time.perf_counter()
        _, write_s = saver.wait()
        waited = time.perf_counter() - waited_start
        async_total = time.perf_counter() - start
        # A second background save: the same buffers again.
        timed_step()
        start = time.perf_counter()
        saver.save(root, state.step, state, {}, keep_last=3)
        second_stall = time.perf_counter() - start
        saver.wait()

        _check(sync_path, expected_sync, model)
        _check(async_path, expected_async, model)
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    out = {"date": datetime.date.today().isoformat(), "params": n_params, "state_bytes": state_bytes,
           "step_s": statistics.median(plain), "sync_stall_s": sync_stall,
           "sync_bandwidth_gb_s": state_bytes / sync_stall / 1e9, "after_sync_step_s": after_sync,
           "sync_lost_s": sync_total - AFTER * statistics.median(plain),
           "reserve_s": reserve_s, "async_stall_s": async_stall, "async_second_stall_s": second_stall,
           "stall_ratio": async_stall / sync_stall, "second_stall_ratio": second_stall / sync_stall,
           "async_write_s": write_s, "async_bandwidth_gb_s": state_bytes / write_s / 1e9,
           "steps_after_async_s": during, "waited_after_s": waited,
           "async_lost_s": async_total - AFTER * statistics.median(plain),
           "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "torch": torch.__version__}
    print(f"step without a save: {out['step_s']:.3f} s (median of 3)")
    print(f"synchronous save: the step waits {sync_stall:.2f} s ({out['sync_bandwidth_gb_s']:.2f} GB/s)")
    print(f"background save: the staging buffers made at start in {reserve_s:.2f} s; the step waits "
          f"{async_stall:.2f} s ({out['stall_ratio']:.3f}x the synchronous stall; a second save "
          f"{second_stall:.2f} s, {out['second_stall_ratio']:.3f}x); written in "
          f"{write_s:.2f} s ({out['async_bandwidth_gb_s']:.2f} GB/s) beside the next steps "
          f"({', '.join(f'{t:.3f}' for t in during)} s; {waited:.2f} s more waited after them)")
    print(f"time lost over a save and the {AFTER} steps after it (against {AFTER} plain steps): synchronous "
          f"{out['sync_lost_s']:.2f} s, background {out['async_lost_s']:.2f} s")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
