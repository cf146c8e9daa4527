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
and the checkpoint to resume from have been checked, nor by a run already at its end.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import sys
import time
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
from .report import Reporter
from .start import check_init_from, check_writable, config_changes, finished, open_data, resume_path
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
    if ranks is None:  # launch the ranks ourselves, once everything they read is known good
        nproc = cfg.parallel.nproc_per_node
        cfg.plan(world=nproc)
        open_data(cfg)
        if resume_path(cfg) is None and cfg.model.init_from:  # also checks checkpoint.resume
            check_init_from(cfg)
        check_writable(Path(cfg.run_dir))
        if stopping.REQUEST.name:
            name = stopping.REQUEST.name
            raise stopping.Interrupted(f"stopped by {name} before the ranks started: nothing was written", name)
        if finished(cfg, print_it=True):
            return []
        results = launch.launch(_fit_rank, (cfg.to_dict(),), nproc)
        return [] if results is None else results[0]  # None: stopped by a signal, checkpointed
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
    try:
        history = _Run(cfg, ranks, model, plan, device, watchdog).train()
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

    def __init__(self, cfg: RunConfig, ranks: launch.Ranks, model, plan, device: torch.device,
                 watchdog: Watchdog | None = None):
        self.cfg, self.ranks, self.model, self.plan, self.device = cfg, ranks, model, plan, device
        self.watchdog, self.faults = watchdog, Faults(ranks.rank)
        t = cfg.train
        _mark(watchdog, 0, "opening the data")
        self.data = open_data(cfg)  # before anything is written: bad data costs nothing
        self.run_dir = Path(cfg.run_dir)
        # Bad input (checkpoint.resume, model.init_from) fails before run_dir is created.
        if resume_path(cfg) is None and cfg.model.init_from:
            check_init_from(cfg)
        check_writable(self.run_dir)  # before the leftovers of a crashed save are cleared
        _mark(watchdog, 0, "finding the checkpoint to resume from")
        self.resume = resume_path(cfg, repair=True)
        _mark(watchdog, 0, "building the parameters")
        self.dp_size = plan.mesh.dp * plan.mesh.fsdp
        self.accumulation = cfg.accumulation_steps(self.dp_size)
        self.micro_rows = t.global_batch // self.accumulation  # sequences per micro-step, all ranks
        init_from = cfg.model.init_from if self.resume is None else None  # a checkpoint wins
        built = build_run(cfg, model, plan, ranks.world, device, self.accumulation, self.micro_rows, init_from)
        self.mesh, self.step_fn, self.eval_fn, self.rows = built.mesh, built.step_fn, built.eval_fn, built.rows
        self.state = TrainState.create(built.params)
        self.consumed = 0  # global training samples consumed: the data position
        self.saver = None
        if cfg.checkpoint.async_save:
            self.saver = checkpoint.BackgroundSaver()
            self.saver.reserve(self.state)  # the staging buffers, before the first step
        self._saves_done = True  # every rank's background save had finished at the last step's end

    # --- the loop ----------------------------------------------------------------------

    def train(self) -> list[dict]:
        cfg, t = self.cfg, self.cfg.train
        _mark(self.watchdog, self.state.step, "loading the checkpoint")
        skipped = self._load_resume() if self.resume is not None else []
        stop = min(t.stop_at or t.steps, t.steps)
        rep = Reporter(self.ranks.rank == 0, self.run_dir, t.steps,
                       mfu=device_peak_tflops(self.device, t.precision) is not None)
        if self.ranks.rank == 0:
            self._write_run_files()
        rep.start(self._kept_metrics())
        rep.print(self._banner())
        rep.print(f"  {rep.tensorboard_line()}")
        for note in [*self.data.notes, *skipped]:
            rep.print(f"[yellow]{note}[/]")
        if self.resume is not None:
            rep.print(f"resumed from {self.resume} at step {self.state.step} "
                      f"({self.consumed:,} samples consumed)")
            changes = config_changes(self.resumed_config, cfg.to_dict())
            if changes:
                rep.print(f"[yellow]config changed since {self.resume.name}: {'; '.join(changes)}[/]")
        peak = device_peak_tflops(self.device, t.precision)
        m = cfg.model
        flops = flops_per_token(self.model.specs, m.n_layers, m.dim, t.seq_len, m.tie_embeddings, m.moe)
        tokens_per_step = t.global_batch * t.seq_len
        history: list[dict] = []
        first_step, start = self.state.step, time.perf_counter()
        # The first step of each start (compile, allocator and first-collective warm-up) is
        # left out of tokens/s and the ETA: its time is its own (warmup_s).
        warm, warmup_s = start, None
        last_time, last_step = start, first_step
        stopping.REQUEST.after = self._on_disk
        guard = LossGuard(t)
        if t.compile and self.state.step < stop:
            rep.compiling()
        try:
            while self.state.step < stop:
                current = self.state.step + 1
                _mark(self.watchdog, current, "reading the batch")
                self.faults.before_batch(current)
                batch = self._batch(self.data.train, self.consumed)
                _mark(self.watchdog, current, TRAIN_STEP)
                self.faults.poison_gradients(current, self.state.params)
                metrics = self.step_fn(self.state, batch)
                self.consumed += t.global_batch
                done = self.state.step
                if warmup_s is None:
                    warm = time.perf_counter()
                    warmup_s = warm - start
                    if t.compile:
                        rep.compiled(warmup_s)
                note = guard.check(done, metrics)
                if note:
                    rep.print(f"[yellow]{note}[/]")
                evaluate = t.eval_every and (done % t.eval_every == 0 or done == t.steps)
                every = self.cfg.checkpoint.every
                saving = done == stop or bool(every and done % every == 0)  # the last step always saves
                # ckpt_stall_s: what this step waited for its save; ckpt_write_s: a write
                # that finished (this step's when synchronous, or one in the background).
                written = {} if saving else self._written()
                record = None
                if done % t.log_every == 0 or done == stop or evaluate or saving or written:
                    now = time.perf_counter()
                    if last_step == first_step:  # the window starts after the warm-up step
                        last_time, last_step = warm, first_step + 1
                    steps = done - last_step
                    step_time = (now - last_time) / steps if steps else warmup_s
                    # A compiled run's first step is mostly compiling: no rate, no ETA from it.
                    known = steps or not t.compile
                    tokens_per_s = tokens_per_step / step_time if known else None
                    after_warmup = done - first_step - 1
                    eta = (now - warm) / after_warmup if after_warmup else step_time if known else None
                    record = {"step": done, "loss": metrics["loss"], "lr": metrics["lr"],
                              "grad_norm": metrics["grad_norm"], "tokens_per_s": tokens_per_s,
                              "step_time_s": step_time,
                              "mfu": flops * tokens_per_s / self.ranks.world / (peak * 1e12)
                              if peak and tokens_per_s else None,
                              "memory_gib": memory_gib(self.device), "elapsed_s": now - start,
                              "eta_s": eta * (stop - done) if eta is not None else None,
                              **{k: metrics[k] for k in ("aux_loss", "expert_imbalance") if k in metrics}}
                    if not history:
                        record["warmup_s"] = warmup_s
                    if guard.skipped:
                        record["skipped_steps"] = guard.skipped
                    if evaluate:
                        _mark(self.watchdog, done, "evaluation")
                        record["val_loss"] = self._evaluate()
                        record["val_ppl"] = math.exp(min(record["val_loss"], 700.0))
                    last_time, last_step = time.perf_counter(), done  # evaluation time is not training time
                    history.append(record)

                def log(fields: dict, record=record) -> None:
                    """This step's record, with its save's metrics (before its checkpoint commits)."""
                    if record is not None:
                        record.update(fields)
                        rep.log(record)

                ckpt = self._checkpoint(done, stop, log) if saving else {}
                if not saving:
                    log(written)
                if "path" in ckpt:
                    rep.print(f"checkpoint {ckpt['path']}" + (" (writing in the background)" if ckpt.get("background")
                                                            else ""))
                _mark(self.watchdog, done, "agreeing on stop signals (a two-element all-reduce)")
                received = self._stop_agreed()
                if received and done < stop:
                    # Preemption: a checkpoint at this step boundary, committed, then a clean exit.
                    path = ckpt["path"] if saving else self._save()
                    self._wait_save(done)
                    rep.print(f"stopped by {received} after step {done}: checkpoint {path}; run the same command "
                              "to resume")
                    return history
            self._wait_save(self.state.step)
            if self.cfg.checkpoint.export and self.state.step >= stop:
                _mark(self.watchdog, self.state.step, "export")
                rep.print(f"exported to {self._export()}")
        except BaseException:
            # A save in the background finishes (or fails) before the error is reported;
            # its own failure is printed, the error that stopped the loop is raised.
            if self.saver is not None and self.saver.in_flight:
                try:
                    self._wait_save(self.state.step)
                except checkpoint.CheckpointError as e:
                    rep.print(f"[red]{e}[/]")
            raise
        finally:
            rep.close()
        if history:
            rep.print(f"done: step {self.state.step}/{t.steps} in {time.perf_counter() - start:.1f} s, loss "
                      f"{history[-1]['loss']:.4f}; metrics in {self.run_dir / 'metrics.jsonl'}")
        return history

    def _stop_agreed(self) -> str | None:
        """The stop signal's name when any rank received one, else None. Every rank must agree
        on the step and on the name: a signal may reach only some ranks, and one sent to the
        whole group reaches them at different moments, so the all-reduce carries the number
        (SIGTERM outranks SIGINT where ranks got different ones). The same all-reduce
        agrees whether every rank's background save has finished (`_written`), so that
        all join it, or learn its failure, at the same step."""
        name = stopping.REQUEST.name
        writing = self.saver is not None and not self.saver.done()
        if self.ranks.world == 1:
            self._saves_done = not writing
            return name
        number = torch.tensor([float(signal.Signals[name].value if name else 0), float(writing)], device=self.device)
        dist.all_reduce(number, dist.ReduceOp.MAX)
        self._saves_done = not number[1].item()
        return signal.Signals(int(number[0].item())).name if number[0].item() else None

    def _on_disk(self) -> str:
        """What a run stopped at once leaves: its latest complete checkpoint."""
        latest = checkpoint.latest(self.run_dir / "checkpoints")
        return f"{latest} is the latest checkpoint, intact" if latest else "no checkpoint was written"

    def _load_resume(self) -> list[str]:
        """Load the checkpoint to resume from. With resume auto, a damaged newest checkpoint
        (missing or truncated files, bad metadata, shapes that do not fit) is skipped for the
        one before it; returns a one-line note per skipped checkpoint."""
        auto = self.cfg.checkpoint.resume == "auto"
        candidates = [p for p in reversed(checkpoint.complete(self.resume.parent))] if auto else [self.resume]
        notes, first_error = [], None
        for path in candidates:
            try:
                meta = checkpoint.load(path, self.state, self.model.specs)
            except checkpoint.CheckpointError as e:
                first_error = first_error or e
                notes.append(f"skipping {path.name}: {e}")
                continue
            self.resume, self.consumed = path, int(meta["extra"]["consumed_samples"])
            self.resumed_config = meta["extra"].get("config", {})
            return notes
        raise checkpoint.CheckpointError(f"{first_error}; no earlier checkpoint in {self.resume.parent} loads either "
                                         "(set checkpoint.resume none to start over)" if auto else str(first_error))

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

    def _save(self, before_commit=None) -> Path:
        """This step's checkpoint: written and committed, or with checkpoint.async_save
        begun and writing in the background (the directory it will have)."""
        _mark(self.watchdog, self.state.step, "checkpoint save")
        extra = {"consumed_samples": self.consumed, "config": self.cfg.to_dict()}
        step = self.state.step
        save = checkpoint.save if self.saver is None else self.saver.save
        return save(self.run_dir / "checkpoints", step, self.state, extra, self.cfg.checkpoint.keep_last,
                    on_write=lambda: self.faults.in_save(step), before_commit=before_commit)

    def _checkpoint(self, done: int, stop: int, log) -> dict:
        """Save at step `done`, and `log` the step with the save's metrics (ckpt_stall_s:
        what the step waited, including for the save before it; ckpt_write_s: a write's
        seconds) before the checkpoint commits: a checkpoint on disk always has its step's
        metrics line. A synchronous save, and the run's last (nothing is left to overlap it
        with), log once written, just before the rename; a background one once staged."""
        start = time.perf_counter()
        finished = self._wait_save(done)
        background = self.saver is not None and done != stop

        def written() -> None:
            now = time.perf_counter() - start
            log({"ckpt_stall_s": now, "ckpt_write_s": now})

        path = self._save(before_commit=None if background else written)
        if background:
            log({"ckpt_stall_s": time.perf_counter() - start,
                 **({"ckpt_write_s": finished[1]} if finished is not None else {})})
        else:
            self._wait_save(done)
        return {"path": path, "background": background}

    def _written(self) -> dict:
        """ckpt_write_s of a background write that every rank had finished by the end of
        the last step (`_stop_agreed`), if one had."""
        if self.saver is None or not self._saves_done:
            return {}
        finished = self.saver.wait()
        return {} if finished is None else {"ckpt_write_s": finished[1]}

    def _wait_save(self, step: int):
        """Join the background save in flight, if any: (its checkpoint, write seconds)."""
        if self.saver is None or not self.saver.in_flight:
            return None
        _mark(self.watchdog, step, "waiting for the checkpoint written in the background")
        return self.saver.wait()

    def _export(self) -> Path:
        def save() -> Path:
            path = self._save()
            self._wait_save(self.state.step)
            return path

        return export_run(self.cfg, self.run_dir, self.state.params, self.state.step, self.plan.mesh.pp > 1,
                          self.ranks.rank, self.ranks.world, save)

    # --- files ---------------------------------------------------------------------------

    def _write_run_files(self) -> None:
        """config.yaml and plan.json of this start, and the config again under
        configs/step_XXXXXXXX.yaml (the step it starts from): the history of a run's configs."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        text = self.cfg.to_yaml()
        (self.run_dir / "config.yaml").write_text(text)
        (self.run_dir / "plan.json").write_text(self.plan.to_json() + "\n")
        history = self.run_dir / "configs"
        history.mkdir(exist_ok=True)
        name, n = f"step_{self.state.step:08d}", 1
        while (history / f"{name}.yaml").exists() and (history / f"{name}.yaml").read_text() != text:
            name, n = f"step_{self.state.step:08d}.{n}", n + 1
        (history / f"{name}.yaml").write_text(text)

    def _kept_metrics(self) -> list[dict]:
        """A resumed run keeps the records up to its checkpoint; a new run starts empty."""
        path = self.run_dir / "metrics.jsonl"
        if self.resume is None or not path.exists():
            return []
        kept = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if record.get("step", math.inf) <= self.state.step:
                kept.append(record)
        return kept

    def _banner(self) -> str:
        """Three short lines: the model and run_dir, the layout, the batch."""
        cfg, t, plan = self.cfg, self.cfg.train, self.plan
        n_params = sum(s.numel for s in self.model.specs.values())
        mesh = " x ".join(f"{a}={plan.mesh.size(a)}" for a in plan.mesh.axes)
        if plan.mesh.ep > 1:
            mesh += f", experts ep={plan.mesh.ep}"
        options = [t.precision + (f" {t.fp8_recipe}" if t.precision == "fp8" else "")]
        options += ["compiled"] * bool(t.compile)
        options += [f"{t.activation_checkpointing} recompute"] * (t.activation_checkpointing != "none")
        masks = sum(p.has_loss_mask for p in self.data.train.parts)
        return (f"[bold]meshtrain fit[/] {cfg.model.arch} {_count(n_params)} params -> {self.run_dir}\n"
                f"  world {self.ranks.world} ({mesh}) on {self.device.type}, {', '.join(options)}\n"
                f"  batch {t.global_batch} x {t.seq_len} tokens: {self.accumulation} micro-step(s) of "
                f"{t.micro_batch} x {self.dp_size} data-parallel rank(s)"
                + (f"; loss masks from {masks} of {len(self.data.names)} dataset(s)" if masks else ""))


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


