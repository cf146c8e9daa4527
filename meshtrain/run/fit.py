"""`fit(cfg)`: train a model from a RunConfig, in one process, under a launcher, or by
launching `parallel.nproc_per_node` ranks itself.

One process: no process group; the model runs on one device with plain tensors (the
reference path every layout is tested against). With more ranks every rank joins one
process group (gloo on CPU, nccl on CUDA) and the parameters are DTensors laid out by the
plan. Each rank reads only its own rows of each global batch; which rows form a step's
batch depends on the global sample count alone, so any layout trains on the same data.

Rank 0 writes `<run_dir>/config.yaml` (the merged config; `configs/step_XXXXXXXX.yaml`
keeps the config of every start), `<run_dir>/plan.json`, `<run_dir>/metrics.jsonl` (one
JSON object per logged step) and `<run_dir>/checkpoints/step_XXXXXXXX/` (every
`checkpoint.every` steps and at the end). Nothing is written before the config, the data
and the checkpoint to resume from have been checked, nor by a run already at its end; a
run holds its run_dir's lock from then on (run/rundir.py).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint
from ..config import RunConfig
from ..train.metrics import device_peak_tflops, flops_per_token, memory_gib
from ..train.step import TrainState
from . import launch, stopping
from .build import build_run
from .export import export_run
from .faults import Faults
from .guards import LossGuard
from .clock import StepClock
from .record import Due, evaluation, mfu, step_record
from .report import Reporter, banner
from .rundir import RunLock, claim, kept_metrics, write_run_files
from .saves import Saves
from .start import check_start, check_writable, config_changes, finished, load_resume, open_data, resume_path
from .watchdog import TRAIN_STEP, Watchdog


def fit(cfg: RunConfig) -> list[dict]:
    """Train to cfg.train.steps (or train.stop_at). Returns the metrics this run logged.
    SIGINT / SIGTERM stop it after a step, with a checkpoint (meshtrain.stopping)."""
    cfg.validate()
    installed = stopping.REQUEST.install()  # before the first slow step: a stop is never lost
    try:
        return _fit(cfg)
    finally:
        if installed:
            stopping.REQUEST.restore()


def _fit(cfg: RunConfig) -> list[dict]:
    ranks = launch.detect(cfg.parallel.nproc_per_node)
    if ranks is None or (ranks.rank == 0 and not launch.by_our_launcher()):
        RunLock(Path(cfg.run_dir)).check_free()  # a second job on the run_dir: refused in seconds
    if ranks is None:
        return _launch(cfg)
    if finished(cfg, print_it=ranks.rank == 0):
        return []
    model = cfg.model_def()
    # The plan and every layout error come before any process group exists.
    plan = cfg.plan(world=ranks.world)
    cfg.accumulation_steps(plan.mesh.dp * plan.mesh.fsdp)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", ranks.local_rank) if cuda else torch.device("cpu")
    if cuda:
        # Segments that grow instead of new fixed blocks: less fragmentation, the premise
        # of the planner's allocator_slack (estimate/memory.py). Set before the allocator
        # starts (set_device); the user's own setting wins.
        if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
            os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
        torch.cuda.set_device(device)
    created_group = False
    if ranks.world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.parallel.collective_timeout_s),
                                **({"device_id": device} if cuda else {}))
        created_group = True
    watchdog = None
    if cfg.parallel.watchdog_s:
        store = dist.distributed_c10d._get_default_store() if ranks.world > 1 else None
        watchdog = Watchdog(ranks.rank, ranks.world, cfg.parallel.watchdog_s, store)
    lock = None
    try:
        _mark(watchdog, 0, "opening the data")
        data = open_data(cfg)  # bad input (data, checkpoint, init_from) fails before anything is written
        check_start(cfg, data)
        check_writable(Path(cfg.run_dir))  # before the leftovers of a crashed save are cleared
        # Our launcher holds the lock for its ranks; otherwise rank 0 takes it for the job.
        lock = None if launch.by_our_launcher() else claim(cfg, ranks.rank, ranks.world)
        history = _Run(cfg, ranks, model, plan, device, data, watchdog).train()
        if created_group:
            # No rank tears its connections down while a peer still uses them: a gloo
            # rank torn down early intermittently aborted its peer at exit.
            _mark(watchdog, 0, "the final barrier (every rank finishing)")
            dist.barrier()
        return history
    finally:
        if watchdog is not None:
            watchdog.stop()
        if created_group:
            dist.destroy_process_group()
        if lock is not None:
            lock.release()


def _launch(cfg: RunConfig) -> list[dict]:
    """Launch the ranks ourselves, once everything they read is known good, holding the
    run's lock for all of them (they never contend)."""
    nproc = cfg.parallel.nproc_per_node
    cfg.plan(world=nproc)
    check_start(cfg, open_data(cfg))
    check_writable(Path(cfg.run_dir))
    if stopping.REQUEST.name:
        name = stopping.REQUEST.name
        raise stopping.Interrupted(f"stopped by {name} before the ranks started: nothing was written", name)
    if finished(cfg, print_it=True):
        return []
    lock = claim(cfg, rank=0, world=1)
    try:
        results = launch.launch(_fit_rank, (cfg.to_dict(),), nproc)
    finally:
        lock.release()
    return [] if results is None else results[0]  # None: stopped by a signal, checkpointed


def _mark(watchdog: Watchdog | None, step: int, op: str) -> None:
    stopping.REQUEST.doing = f"step {step}: {op}" if step else op
    if watchdog is not None:
        watchdog.mark(step, op)


def _fit_rank(cfg_dict: dict) -> list[dict]:
    history = fit(RunConfig.from_dict(cfg_dict))
    if stopping.REQUEST.name and stopping.relayed():
        # The elastic agent got the signal too and shuts down; it no longer collects
        # results, so a rank that returned would wait for it until killed. Leave now,
        # successfully. (A signal that reached only ranks: return as usual.)
        stopping.leave_note(stopping.REQUEST.name, at_once=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return history


class _Run:
    """One rank's training run: state, data, loop, evaluation, checkpoints, reports."""

    def __init__(self, cfg: RunConfig, ranks: launch.Ranks, model, plan, device: torch.device, data,
                 watchdog: Watchdog | None = None):
        """`data`: open_data's, checked with the run_dir by check_start."""
        self.cfg, self.ranks, self.model, self.plan, self.device = cfg, ranks, model, plan, device
        self.watchdog, self.faults, self.data = watchdog, Faults(ranks.rank), data
        t = cfg.train
        self.run_dir = Path(cfg.run_dir)
        _mark(watchdog, 0, "finding the checkpoint to resume from")
        self.resume = resume_path(cfg, repair=True)
        _mark(watchdog, 0, "building the parameters")
        self.dp_size = plan.mesh.dp * plan.mesh.fsdp
        self.accumulation = cfg.accumulation_steps(self.dp_size)
        self.micro_rows = t.global_batch // self.accumulation  # sequences per micro-step, all ranks
        init_from = cfg.model.init_from if self.resume is None else None  # a checkpoint wins
        built = build_run(cfg, model, plan, ranks.world, device, self.accumulation, self.micro_rows, init_from)
        self.mesh, self.step_fn, self.eval_fn, self.rows = built.mesh, built.step_fn, built.eval_fn, built.rows
        self.start_notes = built.notes
        self.state = TrainState.create(built.params, t.optimizer_offload)
        self.consumed = 0  # global training samples consumed: the data position
        self.flops = None  # per token, for the MFU: counted at the first record
        self.saves = Saves(self.run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.async_save, self._checkpoint_extra,
                           lambda step, what: _mark(watchdog, step, what), self.faults.in_save)
        self.saves.reserve(self.state)

    # --- the loop ----------------------------------------------------------------------

    def train(self) -> list[dict]:
        t = self.cfg.train
        _mark(self.watchdog, self.state.step, "loading the checkpoint")
        skipped = self._load_resume() if self.resume is not None else []
        stop = min(t.stop_at or t.steps, t.steps)
        rep = self._start_reports(skipped)
        clock = StepClock(self.state.step, stop, t.global_batch * t.seq_len, t.compile)
        history: list[dict] = []
        stopping.REQUEST.after = self._on_disk
        guard = LossGuard(t)
        if t.compile and self.state.step < stop:
            rep.compiling()
        try:
            while self.state.step < stop:
                metrics = self._step()
                self._check_step(metrics, clock, guard, rep)
                due = Due.at(self.state.step, t, self.cfg.checkpoint.every, stop)
                written = {} if due.save else self.saves.written()  # a background write that finished
                record = None
                if due.log or written:
                    record = self._record(metrics, clock, first=not history, skipped=guard.skipped,
                                          evaluate=due.evaluate)
                    history.append(record)
                ckpt = self._save_and_log(due.save, record, written, stop, rep)
                if self._stopped(due.save, ckpt, stop, rep):
                    return history
            self.saves.wait(self.state.step)
            if self.cfg.checkpoint.export and self.state.step >= stop:
                _mark(self.watchdog, self.state.step, "export")
                rep.print(f"exported to {self._export()}")
        except BaseException:
            self.saves.settle(self.state.step, lambda error: rep.print(f"[red]{error}[/]"))
            raise
        finally:
            rep.close()
        if history:
            rep.print(f"done: step {self.state.step}/{t.steps} in {clock.elapsed():.1f} s, loss "
                      f"{history[-1]['loss']:.4f}; metrics in {self.run_dir / 'metrics.jsonl'}")
        return history

    def _start_reports(self, skipped: list[str]) -> Reporter:
        """The run's files, metrics kept from before the checkpoint, and the opening lines."""
        cfg, t = self.cfg, self.cfg.train
        resumed = self.state.step if self.resume is not None else None
        rep = Reporter(self.ranks.rank == 0, self.run_dir, t.steps,
                       mfu=device_peak_tflops(self.device, t.precision) is not None, resumed_step=resumed)
        if self.ranks.rank == 0:
            write_run_files(self.run_dir, cfg.to_yaml(), self.plan.to_json(), self.state.step)
        rep.start(kept_metrics(self.run_dir, resumed))
        rep.print(banner(cfg, self.plan, self.model.specs, self.data, self.ranks.world, self.device,
                         self.accumulation, self.dp_size))
        rep.print(f"  {rep.tensorboard_line()}")
        for note in [*self.data.notes, *cfg.notes(self.plan.mesh), *self.start_notes, *skipped]:
            rep.print(f"[yellow]{note}[/]")
        if self.resume is not None:
            rep.print(f"resumed from {self.resume} at step {self.state.step} ({self.consumed:,} samples consumed)")
            changes = config_changes(self.resumed_config, cfg.to_dict())
            if changes:
                rep.print(f"[yellow]config changed since {self.resume.name}: {'; '.join(changes)}[/]")
        return rep

    def _step(self) -> dict:
        """One optimizer step on the next global batch: its metrics."""
        current = self.state.step + 1
        _mark(self.watchdog, current, "reading the batch")
        self.faults.before_batch(current)
        batch = self._batch(self.data.train, self.consumed)
        _mark(self.watchdog, current, TRAIN_STEP)
        self.faults.poison_gradients(current, self.state.params)
        metrics = self.step_fn(self.state, batch)
        self.consumed += self.cfg.train.global_batch
        return metrics

    def _check_step(self, metrics: dict, clock: StepClock, guard: LossGuard, rep: Reporter) -> None:
        """The step just done on the clock, and on the console: a compiled run's first-step
        (compile) time, and the loss guard's warning (it raises when the run must stop)."""
        warmup_s = clock.stepped()
        if warmup_s is not None and self.cfg.train.compile:
            rep.compiled(warmup_s)
        note = guard.check(self.state.step, metrics)
        if note:
            rep.print(f"[yellow]{note}[/]")

    def _record(self, metrics: dict, clock: StepClock, first: bool, skipped: int, evaluate: bool) -> dict:
        """The logged record of the step just done: losses, rates, memory, evaluation."""
        done, t = self.state.step, self.cfg.train
        timing = clock.fields(done)
        peak = device_peak_tflops(self.device, t.precision)
        if self.flops is None:
            self.flops = flops_per_token(self.model, t.seq_len)
        record = step_record(done, metrics, timing, mfu(self.flops, timing["tokens_per_s"], self.ranks.world, peak),
                             memory_gib(self.device))
        if first:
            record["warmup_s"] = clock.warmup_s
        if skipped:
            record["skipped_steps"] = skipped
        if evaluate:
            _mark(self.watchdog, done, "evaluation")
            record.update(evaluation(self._evaluate()))
        clock.window(done)  # evaluation time is not training time
        return record

    def _save_and_log(self, saving: bool, record: dict | None, written: dict, stop: int, rep: Reporter) -> dict:
        """Save when `saving`, and log the step's `record` (None: not a logged step) with the
        save's metrics, or with those of a background write that finished (`written`).
        Returns the save's {"path", "background"}, or {}."""
        def log(fields: dict) -> None:
            """This step's record, with its save's metrics (before its checkpoint commits)."""
            if record is not None:
                record.update(fields)
                rep.log(record)

        ckpt = self.saves.at_step(self.state, stop, log) if saving else {}
        if not saving:
            log(written)
        if "path" in ckpt:
            rep.print(f"checkpoint {ckpt['path']}" + (" (writing in the background)" if ckpt["background"] else ""))
        return ckpt

    def _stopped(self, saved: bool, ckpt: dict, stop: int, rep: Reporter) -> bool:
        """Whether a stop signal, agreed by every rank, ends the run after this step: then
        with a checkpoint of this step committed (`ckpt`, when `saved` already)."""
        done = self.state.step
        _mark(self.watchdog, done, "agreeing on stop signals (a two-element all-reduce)")
        received = self._stop_agreed()
        if not (received and done < stop):
            return False
        # Preemption: a checkpoint at this step boundary, committed, then a clean exit.
        path = ckpt["path"] if saved else self.saves.save(self.state)
        self.saves.wait(done)
        rep.print(f"stopped by {received} after step {done}: checkpoint {path}; run the same command to resume")
        return True

    def _stop_agreed(self) -> str | None:
        """The stop signal's name when any rank received one, else None. Every rank must agree
        on the step and on the name: a signal may reach only some ranks, and one sent to the
        whole group reaches them at different moments, so the all-reduce carries the number
        (SIGTERM outranks SIGINT where ranks got different ones). The same all-reduce
        agrees whether every rank's background save has finished (`Saves.written`), so
        that all join it, or learn its failure, at the same step."""
        name = stopping.REQUEST.name
        writing = self.saves.writing
        if self.ranks.world == 1:
            self.saves.finished_everywhere = not writing
            return name
        number = torch.tensor([float(signal.Signals[name].value if name else 0), float(writing)], device=self.device)
        dist.all_reduce(number, dist.ReduceOp.MAX)
        self.saves.finished_everywhere = not number[1].item()
        return signal.Signals(int(number[0].item())).name if number[0].item() else None

    def _on_disk(self) -> str:
        """What a run stopped at once leaves: its latest complete checkpoint."""
        latest = checkpoint.latest(checkpoint.in_run(self.run_dir))
        return f"{latest} is the latest checkpoint, intact" if latest else "no checkpoint was written"

    def _load_resume(self) -> list[str]:
        """Load the checkpoint to resume from (start.py:load_resume): the notes of the damaged ones skipped."""
        self.resume, extra, notes = load_resume(self.cfg, self.resume, self.state, self.model.specs)
        self.consumed, self.resumed_config = int(extra["consumed_samples"]), extra.get("config", {})
        return notes

    def _batch(self, source, start: int) -> dict:
        """This rank's rows of the global batch of samples [start, start + global_batch)."""
        d, t = self.cfg.data, self.cfg.train
        documents = tuple(key for key, on in (("segments", d.document_mask), ("positions", d.reset_positions),
                                              ("eod_mask_loss", d.eod_mask_loss),
                                              ("loss_mask", self.data.loss_mask)) if on)
        batch: dict = {}
        for micro in range(self.accumulation):
            part = self.rows.read(source, start + micro * self.micro_rows, self.data.eod, documents)
            for key, value in part.items():
                batch.setdefault(key, []).append(self.rows.wrap(value.to(self.device)))
        if not (d.eod_mask_loss or self.data.loss_mask):  # every target is a real token: no count needed
            batch["num_targets"] = t.global_batch * t.seq_len
        return batch

    def _evaluate(self) -> float:
        """Mean loss per token on the first eval_batches global batches of the validation split."""
        t = self.cfg.train
        losses = [self.eval_fn(self.state.params, self._batch(self.data.valid, i * t.global_batch))
                  for i in range(t.eval_batches)]
        return sum(losses) / len(losses)

    def _checkpoint_extra(self) -> dict:
        """What a checkpoint keeps beside the tensors: the data position, the config, the tokenizer."""
        return {"consumed_samples": self.consumed, "config": self.cfg.to_dict(), "tokenizer": self.data.tokenizer}

    def _export(self) -> Path:
        def save() -> Path:
            path = self.saves.save(self.state)
            self.saves.wait(self.state.step)
            return path

        return export_run(self.cfg, self.run_dir, self.state.params, self.state.step, self.plan.mesh.pp > 1,
                          self.ranks.rank, self.ranks.world, save)
