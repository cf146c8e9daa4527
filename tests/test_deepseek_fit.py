"""`meshtrain fit` from a transformers DeepseekV3ForCausalLM directory with model.init_from
alone (every model key read from its config.json) equals transformers' model trained on
the run's own batches with torch.optim.AdamW, clip_grad_norm_ and the aux-free bias
update: loss and gradient norm per step (rtol 1e-5), on one process (eager and compiled)
and on ranks (fsdp 2 x ep 2, cp 2 with the ring, pp 2, fsdp 2 x tp 2 + sp), the reader's
batches sharded. The
layouts' equivalence at the step level: tests/test_deepseek_layouts.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml

from meshtrain.cli import main
from meshtrain.data import build_data
from support.cli import read_metrics, run_cli
from support.deepseek import hf_model, moe_gates, train_reference

transformers = pytest.importorskip("transformers")
STEPS = 3
TRAIN = {"steps": STEPS, "global_batch": 4, "micro_batch": 2, "seq_len": 16, "lr": 3e-4, "min_lr": 3e-5,
         "warmup_steps": 1, "weight_decay": 0.1, "grad_clip": 0.5}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek")
    hf_model(transformers, vocab_size=264).save_pretrained(directory)  # the bytes tokenizer's 258 ids fit
    return directory


def _config(tmp_path, release, name: str, **parallel) -> str:
    cfg = {"run_dir": str(tmp_path / name), "model": {"init_from": str(release)},
           "data": {"paths": "builtin", "tokenizer": "bytes"}, "train": TRAIN, "checkpoint": {"every": 0},
           "parallel": {"nproc_per_node": 1, **parallel}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _reference(release, run_dir):
    """transformers' model from the same directory, trained on the run's batches."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    d, t = cfg["data"], cfg["train"]
    data = build_data(d["paths"], d["tokenizer"], t["seq_len"], cfg["seed"], cfg["model"]["vocab_size"],
                      d["valid_fraction"])
    model = transformers.AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32)

    def objective(step):
        window = data.train.batch(step * t["global_batch"], t["global_batch"])
        loss = F.cross_entropy(model(window[:, :-1]).logits.flatten(0, 1), window[:, 1:].flatten())
        return loss, (loss.item(),)

    return train_reference(list(model.parameters()), moe_gates(model.model.layers), t["steps"], objective,
                           lr=t["lr"], min_lr=t["min_lr"], warmup=t["warmup_steps"], clip=t["grad_clip"],
                           weight_decay=t["weight_decay"], rate=cfg["model"]["moe"]["bias_update_rate"])


def _check(run_dir, expected):
    rows = read_metrics(run_dir)
    got = [(r["loss"], r["grad_norm"]) for r in rows]
    assert len(got) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_fit_from_init_from_alone_equals_transformers(release, tmp_path, compile):
    name = f"one_{compile}"
    assert main(["fit", "--config", _config(tmp_path, release, name), "--train.compile", str(compile).lower()]) == 0
    saved = yaml.safe_load((tmp_path / name / "config.yaml").read_text())["model"]
    assert saved["arch"] == "deepseek_v3" and saved["mla"]["kv_lora_rank"] == 16 and saved["moe"]["groups"] == 4
    _check(tmp_path / name, _reference(release, tmp_path / name))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"fsdp": 2, "ep": 2}, {"fsdp": 1, "cp": 2, "cp_comm": "ring"},
                                      {"fsdp": 1, "pp": 2}, {"fsdp": 2, "tp": 2, "sp": True}],
                         ids=["fsdp2_ep2", "cp2_ring", "pp2", "fsdp2_tp2_sp"])
def test_ranks_from_init_from_alone_equal_transformers(release, tmp_path, parallel):
    """Each rank reads its own slices of the transformers files (pp: its stage's)."""
    config = _config(tmp_path, release, "ranks", **parallel)
    ranks = 4 if parallel.get("tp") else 2
    proc = run_cli("fit", "--config", config, "--parallel.nproc_per_node", str(ranks))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(tmp_path / "ranks", _reference(release, tmp_path / "ranks"))
