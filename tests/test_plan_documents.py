"""`meshtrain plan` over packed documents (issue 24, item 4): with data.document_mask and
data.mean_doc_len the step's attention FLOPs are the documents', and the activation
memory counts the masks the attention keeps, checked against the bytes a real forward
keeps (CPU, fp32) eager and compiled."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from meshtrain.config import RunConfig
from meshtrain.estimate.dryrun import dry_run
from meshtrain.models.attention import document_window
from meshtrain.models.context import Documents, LocalContext
from meshtrain.models.spec import init_slice
from meshtrain.train.metrics import flops_per_token
from meshtrain.train.peak_memory import _allocation_events
from support.cli import TINY, run_cli
from support.configs import small_cfg

SEQ, DOC, LAYERS = 1024, 100, 4  # documents that do not align with the 128-query tiles


def _cfg(tmp_path, compile=False, **data):
    cfg = small_cfg(tmp_path)
    cfg.model = dataclasses.replace(cfg.model, n_layers=LAYERS, max_seq_len=SEQ)
    cfg.train = dataclasses.replace(cfg.train, seq_len=SEQ, global_batch=2, micro_batch=1, compile=compile)
    cfg.data = dataclasses.replace(cfg.data, **data)
    return cfg.validate()


def test_attention_flops_are_the_documents_and_the_cli_reports_them(tmp_path):
    out = tmp_path / "plan.json"
    done = run_cli("plan", "--config", str(TINY), "--world", "1", "--data.document_mask", "true",
                   "--data.mean_doc_len", "16", "--json", str(out))
    assert done.returncode == 0, done.stderr
    compute = json.loads(out.read_text())["compute"]
    tiny = RunConfig.from_dict(yaml.safe_load(TINY.read_text())).validate()
    m, t = tiny.model, tiny.train
    seq = t.seq_len
    want = flops_per_token(tiny.model_def(), 16)
    assert compute["attention_span"] == 16
    assert compute["attention_flops_per_token"] == 12 * m.n_layers * m.dim * 16
    assert compute["attention_flops_per_token_whole_row"] == 12 * m.n_layers * m.dim * seq
    assert compute["model_flops_per_token"] == want
    assert compute["step_flops_per_rank"] == want * t.global_batch * seq
    assert f"documents of 16 tokens: attention {16 / seq:.2g}x of the whole row's" in done.stdout
    # Without the mask the documents change nothing, and the plan says so.
    done = run_cli("plan", "--config", str(TINY), "--world", "1", "--data.mean_doc_len", "16")
    assert done.returncode == 0 and "counts for nothing without data.document_mask" in done.stdout, done.stdout
    assert f"{flops_per_token(tiny.model_def(), seq) / 1e9:,.3g} GFLOP" in done.stdout
    bad = run_cli("plan", "--config", str(TINY), "--data.mean_doc_len", "-5")
    assert bad.returncode == 2 and "data.mean_doc_len=-5" in bad.stderr and "Traceback" not in bad.stderr


def _kept_by_forward(cfg, docs, compiled: bool) -> int:
    """Bytes a forward (to a scalar) leaves allocated: what it keeps for backward."""
    model = cfg.model_def()
    params = {n: init_slice(s, n, seed=0).requires_grad_() for n, s in model.specs.items()}
    tokens = torch.randint(0, cfg.model.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    fn = lambda: model.forward(params, tokens, LocalContext(), docs).sum()  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager")
        fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = {}
    for _, ptr, size in sorted(_allocation_events(prof)):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    del out
    return sum(live.values())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_document_masks_memory_is_what_a_forward_keeps(tmp_path, one_thread, compiled):
    """Eager: the tiles' fp32 masks once (about a tile plus half a document of keys per
    query; every layer shares them) and per layer the joined output; compiled: one
    window's mask for all layers (documents of 100 tokens: 256 keys per query) and per
    layer the padded keys and values, or, without the window, one mask over the row."""
    plain, masked = _cfg(tmp_path, compiled), _cfg(tmp_path, compiled, document_mask=True, mean_doc_len=DOC)
    estimate = {name: dry_run(cfg, 1).memory for name, cfg in (("plain", plain), ("masked", masked))}
    added = estimate["masked"]["activations"] - estimate["plain"]["activations"]
    detail = estimate["masked"]
    window = 256
    if compiled:
        pads = 2 * 4 * (window - 128) * masked.model.n_kv_heads * (masked.model.dim // masked.model.n_heads)
        assert detail["document_masks"] == 4 * SEQ * window and detail["window_pads_per_layer"] == pads
        assert detail["tiles_joined_per_layer"] == 0
    else:
        assert detail["window_pads_per_layer"] == 0
    # the masks once (each layer shares them), per layer the joined tiles (eager) or padded windows
    assert detail["document_masks"] > 0 and added == detail["document_masks"] + LAYERS * (
        detail["tiles_joined_per_layer"] + detail["window_pads_per_layer"])
    segments = (torch.arange(SEQ) // DOC)[None]
    docs = Documents(segments, None, document_window(segments))  # masks only, as the config says
    assert docs.window == window
    measured = _kept_by_forward(masked, docs, compiled) - _kept_by_forward(masked, None, compiled)
    assert measured == pytest.approx(added, rel=0.05), (measured, added)
    if compiled:  # a batch whose window would be the row: one dense mask, as the plan of long documents says
        long = _cfg(tmp_path, compiled, document_mask=True, mean_doc_len=SEQ // 2)
        assert dry_run(long, 1).memory["document_masks"] == 4 * SEQ * SEQ
        dense = _kept_by_forward(masked, docs._replace(window=None), compiled) - _kept_by_forward(masked, None, compiled)
        assert dense == pytest.approx(4 * SEQ * SEQ, rel=0.05), dense
    # The plan is no estimate for cp, whose blocks keep no mask.
    cp = dataclasses.replace(masked, parallel=dataclasses.replace(masked.parallel, cp=2))
    assert dry_run(cp.validate(), 2).memory["document_masks"] == 0
