"""The recording context (models/recording.py): a family's own forward, run on the meta
device, tells the estimators what the cost walks used to declare by hand: each parameter
lookup in order, what it acts on and how many tensors of it autograd keeps; each
constrain, which column-parallel linears read it and whether its output is kept; the
attention and MoE calls; and the per-family memory terms (models/cost_terms.py).

That these records give the same collectives and bytes as the runtime is what the
estimate tests check (test_comms_estimate, test_memory_estimate, test_family_registry);
here each derivation is pinned on its own, so a wrong one names itself."""

from __future__ import annotations

import dataclasses
import resource
import time

import pytest
import torch

from meshtrain.models import build
from meshtrain.models.cost_terms import cost_terms
from meshtrain.models.family import BLOCK_IN, RESIDUAL, TOKENS
from meshtrain.models.gpt2.config import GPT2Config
from meshtrain.models.llama.config import LlamaConfig
from meshtrain.models.moe import MoeConfig
from meshtrain.models.recorded import record_block, record_ends
from meshtrain.models.recording import Attend, Constrain, Experts, Use

LLAMA = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96, max_seq_len=64)
GPT2 = GPT2Config(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=64)
Q, KV = ("batch", "seq", "q_heads", None), ("batch", "seq", "kv_heads", None)


def _uses(rec):
    return [(e.name, e.saves) for e in rec.events if isinstance(e, Use)]


def _constrains(rec):
    return [e for e in rec.events if isinstance(e, Constrain)]


def test_a_llama_block_records_its_lookups_in_forward_order_with_what_autograd_keeps():
    model = build("llama", dataclasses.replace(LLAMA, qk_norm=True))
    rec = record_block(model, 1, 2, 8, torch.float32)
    p = "layers.1."
    assert _uses(rec) == [(p + "attn_norm", 1), (p + "attn.wq", 1), (p + "attn.wk", 1), (p + "attn.wv", 1),
                          (p + "attn.q_norm", 1), (p + "attn.k_norm", 1), (p + "attn.wo", 1),
                          (p + "mlp_norm", 1), (p + "mlp.w_gate", 1), (p + "mlp.w_up", 1), (p + "mlp.w_down", 1)]
    cons = _constrains(rec)
    assert [c.axes for c in cons] == [BLOCK_IN, Q, KV, KV, RESIDUAL, BLOCK_IN, RESIDUAL]
    assert cons[0].consumers == [p + "attn.wq", p + "attn.wk", p + "attn.wv"]  # their gradients arrive partial
    assert cons[5].consumers == [p + "mlp.w_gate", p + "mlp.w_up"]
    assert cons[0].src == ("act", RESIDUAL) and cons[4].src == ("linear", ("act", Q), p + "attn.wo")
    # Kept: the normed inputs (by the matmuls), q and k (by their norms), v (by
    # attention); the residual additions keep nothing.
    assert [c.saved for c in cons] == [True, True, True, True, False, True, False]
    plain = _constrains(record_block(build("llama", LLAMA), 1, 2, 8, torch.float32))
    assert [c.saved for c in plain] == [True, False, False, True, False, True, False]  # q, k kept rotated
    attend = [e for e in rec.events if isinstance(e, Attend)]
    assert attend == [Attend((2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16))]
    q_norm = next(e for e in rec.events if isinstance(e, Use) and e.name == p + "attn.q_norm")
    assert q_norm.acts and all(a == ("act", Q) for a in q_norm.acts)  # acts on the heads: partial over tp
    assert rec.out == ("act", RESIDUAL)


def test_gpt2_biases_are_looked_up_before_their_weights_and_never_kept():
    rec = record_block(build("gpt2", GPT2), 0, 2, 8, torch.float32)
    uses = _uses(rec)
    names = [n for n, _ in uses]
    assert names.index("layers.0.attn.bq") + 1 == names.index("layers.0.attn.wq")
    for name, saves in uses:
        leaf = name.rsplit(".", 1)[-1]
        assert saves == (0 if leaf.startswith("b") or leaf.endswith("norm_bias") else 1), name


@pytest.mark.parametrize("shared, dtype, kept", [(0, torch.float32, True), (0, torch.bfloat16, False),
                                                 (1, torch.bfloat16, True)])
def test_the_moe_block_input_is_kept_where_the_router_or_the_shared_experts_read_it(shared, dtype, kept):
    """fp32: the router's h.float() is h itself, kept; bf16: a copy is kept instead,
    unless the shared experts' matmuls keep h."""
    moe = MoeConfig(num_experts=4, top_k=2, expert_ffn_dim=32, shared_experts=shared, balance="aux_free")
    model = build("llama", dataclasses.replace(LLAMA, moe=moe))
    rec = record_block(model, 0, 2, 8, dtype)
    block_in = _constrains(rec)[-2]  # the mlp norm's output, the MoE's input
    assert block_in.axes == BLOCK_IN and block_in.saved is kept
    uses = {e.name: e for e in rec.events if isinstance(e, Use)}
    e = "layers.0.moe."
    assert uses[e + "expert_bias"].saves == 0 and uses[e + "router"].saves == 1
    assert all(uses[e + w].experts and uses[e + w].saves == 1 for w in ("w_gate", "w_up", "w_down"))
    assert [x.expert for x in rec.events if isinstance(x, Experts)] == [e + "w_gate"]


def test_a_tied_table_is_one_parameter_used_twice():
    model = build("llama", dataclasses.replace(LLAMA, tie_embeddings=True))
    front, back = record_ends(model, True, True, 2, 8, torch.float32)
    first, again = (next(e for e in r.events if isinstance(e, Use) and e.name == "tok_emb") for r in (front, back))
    assert (first.reuse, first.saves) == (False, 0)  # the lookup keeps its ids, not the table
    assert (again.reuse, again.saves) == (True, 1)  # the projection keeps it
    assert ("act", TOKENS) in first.acts and ("act", BLOCK_IN) in first.acts  # one gradient, both uses
    assert back.out == ("act", ("batch", "seq", "vocab"))
    alone, head = record_ends(model, False, True, 2, 8, torch.float32)  # a last stage's own replica
    assert alone.events == () and [(e.name, e.reuse, e.saves) for e in head.events if isinstance(e, Use)] \
        == [("norm", False, 1), ("tok_emb", False, 1)]


def test_the_memory_terms_are_read_from_the_forward():
    llama = cost_terms(build("llama", LLAMA), 16, torch.bfloat16)
    assert (llama.mlp_saved, llama.mlp_matmuls, llama.norm_stats) == (4, 2, 1)  # SwiGLU, RMSNorm
    assert llama.per_sequence == (((16, 16), ("seq", None), 2),) * 2  # RoPE's cos and sin
    assert llama.weight_saved("layers.1.attn.wq") and llama.weight_saved("output")
    assert not llama.weight_saved("tok_emb")  # untied: the lookup keeps ids
    gpt2 = cost_terms(build("gpt2", GPT2), 16, torch.float32)
    assert (gpt2.mlp_saved, gpt2.mlp_matmuls, gpt2.norm_stats) == (2, 1, 2)  # GELU, LayerNorm
    assert gpt2.per_sequence == (((16,), ("seq",), 8),)  # the position ids
    assert gpt2.weight_saved("tok_emb")  # tied: the head's projection keeps it
    assert not any(gpt2.weight_saved(n) for n in ("pos_emb", "layers.0.attn.bq", "layers.0.mlp_norm_bias"))


@pytest.mark.alone
def test_a_recording_is_shapes_only():
    """An 8M-token sequence: the RoPE tables alone would be GBs on the CPU."""
    model = build("llama", dataclasses.replace(LLAMA, max_seq_len=2 ** 23))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    cost_terms(model, 2 ** 23, torch.float32)
    record_block(model, 0, 64, 2 ** 23, torch.float32)
    assert time.perf_counter() - start < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB
