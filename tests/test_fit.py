"""`meshtrain fit` end to end: self-launched ranks, two "nodes" under torchrun, exact
resume, evaluation, real datasets through the CLI, and bad input that costs nothing.

Multi-process runs use the tiny model shrunk to seconds (support/cli.py's SMALL) and compare
with one process of the same config: fp32, rtol 1e-5 across layouts, bitwise for the
same layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from meshtrain.config import RunConfig
from meshtrain import checkpoint
from meshtrain.run.fit import fit
from meshtrain.train.metrics import flops_per_token
from meshtrain.train.step import TrainState
from support.cli import ROOT, SMALL, TINY, cli_env, losses, read_metrics, run_cli, step_rows
from support.configs import small_cfg

TINY4 = ROOT / "configs" / "tiny-4proc.yaml"
# 4 steps; 4 kv heads so that tp 4 is a valid layout to resume in, 2 layers for 2 stages.
STEPS4 = ["--train.steps", "4", "--model.n_kv_heads", "4", "--model.n_layers", "2"]


@pytest.fixture(scope="module")
def single4(tmp_path_factory):
    """The reference: the small config, 4 steps, one process."""
    run_dir = tmp_path_factory.mktemp("single4")
    proc = run_cli("fit", "--config", str(TINY), *SMALL, *STEPS4, "--run_dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """tiny-4proc (fsdp 2 x tp 2 + sp, 4 self-launched ranks): stopped after step 2 with a
    checkpoint, then resumed to step 4 by the same command without stop_at."""
    run_dir = tmp_path_factory.mktemp("four")
    common = ["fit", "--config", str(TINY4), *SMALL, *STEPS4, "--checkpoint.every", "2", "--run_dir", str(run_dir)]
    first = run_cli(*common, "--train.stop_at", "2", timeout=400)
    assert first.returncode == 0, first.stdout + first.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    second = run_cli(*common, timeout=400)
    assert second.returncode == 0, second.stdout + second.stderr
    return run_dir, first, second


@pytest.mark.slow
def test_four_self_launched_ranks_resume_and_match_one_process(four_ranks, single4):
    run_dir, first, second = four_ranks
    assert "resumed from" in second.stdout and "step_00000002" in second.stdout
    assert step_rows(second.stdout) == [3, 4]  # rank 0 reports, the others do not
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world"] == 4 and plan["mesh"] == {"fsdp": 2, "tp": 2}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    torch.testing.assert_close(losses(run_dir), losses(single4), rtol=1e-5, atol=0)


RESHARD = {  # layout to resume in: (processes, parallel.* overrides)
    "tp4": (4, ["--parallel.tp", "4", "--parallel.fsdp", "1"]),
    "dp2_fsdp2": (4, ["--parallel.dp", "2", "--parallel.fsdp", "2", "--parallel.tp", "1", "--parallel.sp", "false"]),
    "dp2_on_2": (2, ["--parallel.dp", "2", "--parallel.fsdp", "1", "--parallel.tp", "1", "--parallel.sp", "false"]),
    "one_process": (1, ["--parallel.fsdp", "1", "--parallel.tp", "1", "--parallel.sp", "false"]),
    "pp2_zb_tp2_sp": (4, ["--parallel.pp", "2", "--parallel.pp_schedule", "zb", "--parallel.fsdp", "1"]),
    "pp2_gpipe_on_2": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe", "--parallel.fsdp", "1",
                           "--parallel.tp", "1", "--parallel.sp", "false"]),
    "cp2_tp2_sp_a2a": (4, ["--parallel.cp", "2", "--parallel.cp_comm", "a2a", "--parallel.fsdp", "1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(RESHARD))
def test_resume_in_another_layout_continues_the_same_run(four_ranks, tmp_path, layout):
    """The step-2 checkpoint of fsdp 2 x tp 2 resumed in another layout and world size:
    parameters, optimizer state, schedule and data position carry over."""
    nproc, parallel = RESHARD[layout]
    run_dir = tmp_path / layout
    shutil.copytree(four_ranks[0] / "checkpoints" / "step_00000002", run_dir / "checkpoints" / "step_00000002")
    proc = run_cli("fit", "--config", str(TINY4), *SMALL, *STEPS4, "--parallel.nproc_per_node", str(nproc),
                   *parallel, "--run_dir", str(run_dir), timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == [3, 4]
    assert json.loads((run_dir / "plan.json").read_text())["world"] == nproc
    continued = torch.tensor([r["loss"] for r in read_metrics(four_ranks[0])[2:]], dtype=torch.float64)
    torch.testing.assert_close(losses(run_dir), continued, rtol=1e-5, atol=0)  # as if fsdp 2 x tp 2 went on


@pytest.mark.slow
def test_context_parallel_fit_through_the_cli_matches_one_process(tmp_path):
    """configs/tiny-cp2.yaml (cp 2, ring) shrunk like the reference: each of the 2
    self-launched ranks reads its zigzag half of every sequence, parameters are sharded
    over cp; the loss curve is one process's, and so is the exported model."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "cp2"
    proc = run_cli("fit", "--config", str(ROOT / "configs" / "tiny-cp2.yaml"), *SMALL, *STEPS4,
                   "--checkpoint.export", "true", "--run_dir", str(run_dir),
                   timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["mesh"] == {"cp": 2} and plan["cp_comm"] == "ring"
    reference = tmp_path / "one"
    ref = run_cli("fit", "--config", str(TINY), *SMALL, *STEPS4, "--checkpoint.export", "true",
                  "--run_dir", str(reference))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    torch.testing.assert_close(losses(run_dir), losses(reference), rtol=1e-5, atol=0)
    ours, theirs = load_file(run_dir / "export" / "model.safetensors"), load_file(reference / "export" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_expert_parallel_fit_through_the_cli_matches_one_process(tmp_path):
    """configs/tiny-moe.yaml (8 experts, top 2, a shared expert; ep 2 folded from fsdp 2)
    shrunk like the reference, balanced aux-free, with full activation checkpointing (the
    recomputed blocks redo their all-to-alls and must not count their load twice): the
    loss, the z-loss and the expert load imbalance of each step are one process's (no
    checkpointing); its step-2 checkpoint (expert shards, the experts' bias) resumes in
    one process on the same curve."""
    moe = ROOT / "configs" / "tiny-moe.yaml"
    common = [*SMALL, *STEPS4, "--model.moe.balance", "aux_free"]
    one = ["--parallel.nproc_per_node", "1", "--parallel.fsdp", "1", "--parallel.ep", "1"]
    run_dir = tmp_path / "ep2"
    proc = run_cli("fit", "--config", str(moe), *common, "--checkpoint.every", "2", "--run_dir", str(run_dir),
                   "--train.activation_checkpointing", "full", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "experts ep=2" in proc.stdout
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["mesh"] == {"fsdp": 2} and plan["expert_mesh"] == {"ep": 2}
    reference = tmp_path / "one"
    ref = run_cli("fit", "--config", str(moe), *common, *one, "--run_dir", str(reference))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    res = run_cli("fit", "--config", str(moe), *common, *one, "--run_dir", str(resumed))
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stdout + res.stderr
    for key in ("loss", "aux_loss", "expert_imbalance"):
        def curve(d, first=0):
            return torch.tensor([r[key] for r in read_metrics(d)][first:], dtype=torch.float64)

        torch.testing.assert_close(curve(run_dir), curve(reference), rtol=1e-5, atol=0, msg=lambda m: f"{key}: {m}")
        torch.testing.assert_close(curve(resumed), curve(reference, 2), rtol=1e-5, atol=0,
                                   msg=lambda m: f"resumed {key}: {m}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_pipeline_fit_through_the_cli_matches_one_process(tmp_path):
    """pp 2 x fsdp 2 on 4 self-launched ranks (1F1B, 4 micro-batches of 2 split over 2
    fsdp ranks, selective activation checkpointing): the loss curve and the validation
    loss of one process (no checkpointing), an export
    (through the final checkpoint, since no rank holds every stage) with its weights, and
    its step-2 checkpoint resumed by one process continuing the same curve."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "pp2"
    proc = run_cli("fit", "--config", str(TINY), *SMALL, *STEPS4, "--parallel.nproc_per_node", "4",
                   "--parallel.pp", "2", "--parallel.fsdp", "2", "--train.global_batch", "16",
                   "--train.micro_batch", "2", "--train.eval_every", "2", "--checkpoint.export", "true",
                   "--train.activation_checkpointing", "selective",
                   "--checkpoint.every", "2", "--run_dir", str(run_dir),
                   timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((run_dir / "plan.json").read_text())["mesh"] == {"pp": 2, "fsdp": 2}
    reference = tmp_path / "one"
    ref = run_cli("fit", "--config", str(TINY), *SMALL, *STEPS4, "--train.global_batch", "16",
                  "--train.micro_batch", "2", "--train.eval_every", "2", "--checkpoint.export", "true",
                  "--run_dir", str(reference))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    torch.testing.assert_close(losses(run_dir), losses(reference), rtol=1e-5, atol=0)
    val = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    ref_val = [r["val_loss"] for r in read_metrics(reference) if "val_loss" in r]
    assert len(val) == 2 and val == pytest.approx(ref_val, rel=1e-5)
    ours, theirs = load_file(run_dir / "export" / "model.safetensors"), load_file(reference / "export" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    proc = run_cli("fit", "--config", str(TINY), *SMALL, *STEPS4, "--train.global_batch", "16",
                   "--train.micro_batch", "2", "--run_dir", str(resumed))
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stdout + proc.stderr
    torch.testing.assert_close(losses(resumed), losses(run_dir)[2:], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_two_nodes_on_loopback_train_exactly_as_one_node(four_ranks, tmp_path):
    """Two torchrun agents (--nnodes 2, 2 processes each, c10d rendezvous) form the same
    4-rank world as one node: the same losses, bit for bit."""
    run_dir = tmp_path / "two_nodes"
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "loopback",
                "-m", "meshtrain.cli", "fit", "--config", str(TINY4), *SMALL, *STEPS4,
                "--parallel.nproc_per_node", "2", "--run_dir", str(run_dir)]
    env = cli_env()
    nodes = [subprocess.Popen(torchrun, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, out + err
    assert json.loads((run_dir / "plan.json").read_text())["world"] == 4
    torch.testing.assert_close(losses(run_dir), losses(four_ranks[0]), rtol=0, atol=0)


# --- exact resume in one process ----------------------------------------------------------

def _final_state(cfg: RunConfig) -> TrainState:
    path = checkpoint.latest(Path(cfg.run_dir) / "checkpoints")
    state = TrainState.create({n: torch.empty(s.shape) for n, s in cfg.model_def().specs.items()})
    checkpoint.load(path, state)
    return state


def test_stop_and_resume_equals_an_uninterrupted_run_bitwise(tmp_path, one_thread):
    base = small_cfg(tmp_path, steps=20, warmup_steps=2)
    base.checkpoint = dataclasses.replace(base.checkpoint, every=5)
    whole = dataclasses.replace(base, run_dir=str(tmp_path / "whole"))
    pieces = dataclasses.replace(base, run_dir=str(tmp_path / "pieces"))
    fit(whole)
    first = fit(dataclasses.replace(pieces, train=dataclasses.replace(base.train, stop_at=10)))
    assert [r["step"] for r in first] == list(range(1, 11))
    (Path(pieces.run_dir) / "checkpoints" / "step_00000005" / "meta.json").unlink()  # a half-written one
    second = fit(pieces)
    assert [r["step"] for r in second] == list(range(11, 21))
    assert losses(Path(pieces.run_dir)).tolist() == losses(Path(whole.run_dir)).tolist()
    a, b = _final_state(whole), _final_state(pieces)
    assert a.step == b.step == 20
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.optimizer[moment][name], b.optimizer[moment][name]), (moment, name)
    kept = sorted(p.name for p in (Path(pieces.run_dir) / "checkpoints").iterdir())
    assert kept == ["step_00000015", "step_00000020"]  # keep_last 2


def test_a_finished_run_resumed_has_nothing_to_do(tmp_path, one_thread):
    cfg = small_cfg(tmp_path, steps=2, warmup_steps=1)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=2)
    assert len(fit(cfg)) == 2
    assert fit(cfg) == [] and len(read_metrics(Path(cfg.run_dir))) == 2


@pytest.mark.parametrize("damage", ["truncated", "missing_file", "bad_metadata", "wrong_shapes"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, one_thread, damage, capsys):
    cfg = small_cfg(tmp_path, steps=8, warmup_steps=1)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=2)
    whole = fit(dataclasses.replace(cfg, run_dir=str(tmp_path / "whole")))
    fit(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_at=6)))
    latest = Path(cfg.run_dir) / "checkpoints" / "step_00000006"
    tensors = latest / "__0_0.distcp"
    if damage == "truncated":
        tensors.write_bytes(tensors.read_bytes()[:1000])
    elif damage == "missing_file":
        tensors.unlink()
    elif damage == "bad_metadata":
        (latest / ".metadata").write_bytes(b"not a pickle")
    else:  # a checkpoint of another model under the latest name
        other = dataclasses.replace(cfg, run_dir=str(tmp_path / "other"),
                                    model=dataclasses.replace(cfg.model, ffn_dim=64),
                                    train=dataclasses.replace(cfg.train, stop_at=6))
        fit(other)
        shutil.rmtree(latest)
        shutil.copytree(Path(other.run_dir) / "checkpoints" / "step_00000006", latest)
    capsys.readouterr()
    resumed = fit(cfg)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]  # from step 4, the one before the damaged one
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[4:]]
    # One line says which checkpoint was skipped and why, in words for each kind of damage.
    why = {"truncated": "reading the tensors failed on rank 0 (EOFError", "missing_file": "__0_0.distcp",
           "bad_metadata": "DCP .metadata is unreadable", "wrong_shapes": "has shape (64, 64) in the checkpoint "
           "but (176, 64) in the model"}[damage]
    lines = capsys.readouterr().out.splitlines()
    skipped = [line for line in lines if line.startswith("skipping ")]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipping step_00000006: checkpoint {latest}: "), lines
    assert why in skipped[0], skipped
    assert lines[lines.index(skipped[0]) + 1].startswith(f"resumed from {latest.parent / 'step_00000004'} at step 4")


def test_sigterm_checkpoints_exits_0_and_the_resume_continues_the_curve(tmp_path):
    """A real SIGTERM to a real one-process run: it checkpoints at the next step boundary
    and exits 0; the same command resumes on the uninterrupted run's curve. Several ranks,
    group signals and a second signal: tests/test_stop_signals.py."""
    args = ["fit", "--config", str(TINY), *SMALL, "--train.steps", "400"]
    run_dir = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "meshtrain.cli", *args, "--run_dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    stopped = read_metrics(run_dir)[-1]["step"]
    assert f"stopped by SIGTERM after step {stopped}" in out
    assert checkpoint.latest(run_dir / "checkpoints").name == f"step_{stopped:08d}"
    until = ["--train.stop_at", str(stopped + 3)]  # the same 400-step schedule, 3 more steps
    resumed = run_cli(*args, *until, "--run_dir", str(run_dir))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout + resumed.stderr
    reference = run_cli(*args, *until, "--run_dir", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped + 4))
    assert losses(run_dir).tolist() == losses(tmp_path / "reference").tolist()


# --- evaluation and metrics --------------------------------------------------------------

def _held_out_loss(cfg: RunConfig, params: dict) -> float:
    """The validation loss as docs/fit.md defines it, computed without meshtrain's data
    pipeline or loss: the built-in corpus is one document per paragraph (BOS 256 + UTF-8
    bytes + EOS 257); the last round(valid_fraction x documents) of them (at least one) are
    held out, concatenated and cut into samples of seq_len + 1 tokens that share one token;
    the first eval_batches x global_batch samples (wrapping around) are scored with a plain
    forward and F.cross_entropy, the mean over every target token."""
    from meshtrain.data.builtin import CORPUS
    from meshtrain.models.context import LocalContext

    docs = [p for p in re.split(r"\n\s*\n", CORPUS.strip()) if p.strip()]
    held = max(1, math.floor(cfg.data.valid_fraction * len(docs) + 0.5))
    stream = torch.tensor([t for d in docs[-held:] for t in [256, *d.encode("utf-8"), 257]])
    S, t = cfg.train.seq_len, cfg.train
    n = (len(stream) - 1) // S
    samples = torch.stack([stream[(k % n) * S:(k % n) * S + S + 1] for k in range(t.eval_batches * t.global_batch)])
    with torch.no_grad():
        logits = cfg.model_def().forward(params, samples[:, :-1], LocalContext())
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), samples[:, 1:].flatten()).item()


def test_validation_loss_and_perplexity(tmp_path, one_thread):
    cfg = small_cfg(tmp_path, steps=4, warmup_steps=1, eval_every=2, log_every=3)
    records = fit(cfg)
    assert [r["step"] for r in records] == [2, 3, 4]
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:
        assert 0 < r["val_loss"] < 10 and math.isclose(r["val_ppl"], math.exp(r["val_loss"]), rel_tol=1e-9)
    # The last one, computed here from the corpus text and the final checkpoint.
    expected = _held_out_loss(cfg, _final_state(cfg).params)
    # Measured 3.3e-8 relative (fp32 chunked loss vs float64 cross-entropy); 30x that.
    assert evaluated[-1]["val_loss"] == pytest.approx(expected, rel=1e-6, abs=0)
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "memory_gib", "eta_s"} <= set(r)
        assert r["mfu"] is None  # no known peak on a CPU


def test_flops_per_token_matches_the_architecture():
    """6 x matmul parameters + 12 x layers x dim x seq, counted here from the shapes."""
    cfg = RunConfig.from_dict(yaml.safe_load((ROOT / "configs" / "llama3-8b.yaml").read_text()))
    m = cfg.model
    hd = m.dim // m.n_heads
    attn = m.dim * (m.n_heads * hd) * 2 + m.dim * (m.n_kv_heads * hd) * 2
    mlp = 3 * m.dim * m.ffn_dim
    matmul = m.n_layers * (attn + mlp) + m.vocab_size * m.dim  # the output head, not the lookup
    expected = 6 * matmul + 12 * m.n_layers * m.dim * 8192
    assert flops_per_token(cfg.model_def(), 8192) == expected
    assert 6 * matmul / 1e9 == pytest.approx(45.1, abs=0.1)  # 6 x 7.5B non-embedding parameters


@pytest.mark.parametrize("name", ["tiny", "tiny-4proc", "tiny-pp2", "tiny-cp2", "tiny-moe", "tiny-deepseek", "mixtral-8x7b", "qwen3-moe-30b-a3b", "deepseek-v3-671b", "llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b"])
def test_config_presets_validate(name):
    raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    cfg = RunConfig.from_dict(raw).validate()
    assert cfg.run_dir == f"runs/{name}"


# --- real datasets through the CLI --------------------------------------------------------

def _jsonl(path: Path, n: int = 40) -> Path:
    words = "the miller weighed every sack of grain and wrote the numbers in a red book".split()
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(words[(i + j) % len(words)] for j in range(30 + i % 7))
            f.write(json.dumps({"text": f"{i}: {text}."}) + "\n")
    return path


def test_preprocess_then_fit_with_a_blend_and_evaluation(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for prefix, n in ((a, 40), (b, 30)):
        proc = run_cli("preprocess", "--input", str(_jsonl(tmp_path / f"{prefix.name}.jsonl", n)),
                       "--output_prefix", str(prefix), "--tokenizer", "bytes", "--append_eod")
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / f"{prefix.name}.idx").exists() and "documents" in proc.stdout
    run_dir = tmp_path / "run"
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--data.paths", f"[[0.7, {a}], [0.3, {b}]]",
                   "--data.valid_fraction", "0.1", "--train.eval_every", "3", "--run_dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3] and "val_loss" in records[-1]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["paths"] == [[0.7, str(a)], [0.3, str(b)]]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run with a checkpoint and metrics that bad input must leave exactly as it is."""
    run_dir = tmp_path_factory.mktemp("finished")
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--train.steps", "2", "--checkpoint.every", "2",
                   "--run_dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    return run_dir


def _idx(prefix: Path, tokens: list[int]) -> None:
    """A one-document Megatron dataset of int32 tokens, written with struct."""
    prefix.with_suffix(".bin").write_bytes(struct.pack(f"<{len(tokens)}i", *tokens))
    prefix.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 1, 2)
                                           + struct.pack("<i", len(tokens)) + struct.pack("<q", 0)
                                           + struct.pack("<2q", 0, 1))


@pytest.mark.parametrize("case", ["missing", "token_id", "short", "bad_magic", "config", "resume"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(finished_run, tmp_path, case):
    prefix = tmp_path / "data"
    args, words = [], []
    if case == "missing":
        args, words = ["--data.paths", str(tmp_path / "nope")], [str(tmp_path / "nope")]
    elif case == "token_id":
        _idx(prefix, [1, 2, 300] + [5] * 200)
        args, words = ["--data.paths", str(prefix), "--data.valid_fraction", "0"], ["300", str(prefix)]
    elif case == "short":
        _idx(prefix, [1, 2, 3])
        args, words = ["--data.paths", str(prefix), "--data.valid_fraction", "0"], [str(prefix)]
    elif case == "bad_magic":
        _idx(prefix, [1] * 100)
        prefix.with_suffix(".idx").write_bytes(b"NOTMMIDX" + prefix.with_suffix(".idx").read_bytes()[8:])
        args, words = ["--data.paths", str(prefix)], [str(prefix)]
    elif case == "config":
        args, words = ["--train.lr", "-1"], ["train.lr"]
    elif case == "resume":
        args, words = ["--checkpoint.resume", str(tmp_path / "ckpt")], ["checkpoint.resume"]
    before = _tree_digest(finished_run)
    proc = run_cli("fit", "--config", str(TINY), *SMALL, "--train.steps", "4", "--checkpoint.every", "2",
                   "--run_dir", str(finished_run), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert all(w in proc.stderr for w in words), proc.stderr
    assert _tree_digest(finished_run) == before


def test_bad_preprocess_input_names_the_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"text": broken}\n')
    proc = run_cli("preprocess", "--input", str(src), "--output_prefix", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{src}:2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list(tmp_path.glob("out*"))


def test_tensorboard_gets_the_metrics_and_the_run_says_so(tmp_path, one_thread, capsys):
    """tensorboard is in the dev extra: this runs in CI."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = small_cfg(tmp_path, steps=2, warmup_steps=1, eval_every=2)
    records = fit(cfg)
    assert f"tensorboard: {Path(cfg.run_dir) / 'tensorboard'}" in capsys.readouterr().out
    events = EventAccumulator(str(Path(cfg.run_dir) / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in records])
    assert [e.step for e in events.Scalars("val/loss")] == [2]
