"""The collectives of one real training step, counted, against the closed forms of
docs/parallelism.md ("Per-step collectives"), for both units of parameter traffic:
bucket="param" (one collective per parameter and use: the reference) and the default
bucket="block" (parallel/bucket_run.py: one collective per block per mesh group).

Each case runs `make_train_step(...)` once, in-process, on the fake process group (every
collective is issued with its real shape; the values are garbage, which does not
matter here). Two independent counters watch the step:

* `CommDebugMode` (torch's own): collectives per op type;
* `CollectiveRecorder` (support/collectives.py), a TorchDispatchMode that records every
  c10d / functional collective with its phase (forward, backward, optimizer), the mesh
  axis it runs over and its bytes.

The expected values are computed here from the model config with the formulas in the
doc, never by running meshtrain another way. Bytes are defined as in the doc:

    all_gather      bytes of the gathered output on one rank (= input x group size)
    reduce_scatter  bytes of the input on one rank (= output x group size)
    all_reduce      bytes of the tensor

`test_checks_can_fail` shows that each of the three checks (totals, per-message
multiset, CommDebugMode counts) catches one collective too many or too few of every
(phase, op, axis) kind that the step issues; `test_injected_collectives_are_caught` does
the same with a real collective added to or removed from the step.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from meshtrain.models.llama import LlamaConfig
from support.collectives import CFG, Msg, Observed, run_step

FP32 = 4  # bytes per element; every case here trains in fp32

# Eager steps drop gathered parameters after forward and gather them again in backward
# (ZeRO-3, FSDP2's reshard_after_forward=True; docs/parallelism.md's r = 1); compiled steps
# keep them (r = 0, not counted here). Every step here is eager, so r = 1: fixed by the
# documented design, not read from the code under test (a runtime that lost the re-gather
# must fail here, not switch the expectation).
REGATHER = True


# ----------------------------------------------------------------------------------------
# The doc's formulas, from the config alone
#
# L layers, d dim, hd = d / n_heads, kv = n_kv_heads, f ffn_dim, V vocab, B batch, S seq,
# T = B * S tokens, m micro-batches, b = 4 bytes (fp32: gradients, loss, norms),
# c = bytes of the compute dtype (4 in fp32, 2 in bf16: gathered parameters, activations).

def block_param_sizes(cfg: LlamaConfig) -> dict[str, tuple[int, bool]]:
    """Per block, in forward order: name -> (elements, split by tp?)."""
    d, hd, kv, f = cfg.dim, cfg.dim // cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim
    return {"attn_norm": (d, False), "wq": (d * d, True), "wk": (kv * hd * d, True), "wv": (kv * hd * d, True),
            "wo": (d * d, True), "mlp_norm": (d, False), "w_gate": (f * d, True), "w_up": (f * d, True),
            "w_down": (d * f, True)}


def param_uses(cfg: LlamaConfig) -> list[tuple[int, bool]]:
    """(elements, split by tp?) of every parameter gathered in one forward: 9 per block, the
    final norm, and the vocab x dim tables (tok_emb for the lookup, `output` for the
    projection; a tied tok_emb serves both and is gathered and reduced once)."""
    uses = [(cfg.vocab_size * cfg.dim, True)]
    for _ in range(cfg.n_layers):
        uses += list(block_param_sizes(cfg).values())
    uses += [(cfg.dim, False)]
    if not cfg.tie_embeddings:
        uses += [(cfg.vocab_size * cfg.dim, True)]
    return uses


def p_block(cfg: LlamaConfig) -> int:
    """Closed form of one block's elements: 2d + 2d^2 + 2 kv hd d + 3 f d."""
    d, hd = cfg.dim, cfg.dim // cfg.n_heads
    return 2 * d + 2 * d * d + 2 * cfg.n_kv_heads * hd * d + 3 * cfg.ffn_dim * d


LAYOUTS = ("fsdp", "dp", "hsdp", "tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp")


def bucket_elements(cfg: LlamaConfig, with_tp: bool, tp: int = 2) -> list[int]:
    """bucket="block": the tp-local elements of each bucket, in forward order: the token
    table; each block's 9 parameters; the final norm, with the output table when untied
    (a tied table is in the first bucket only, gathered once and kept for the head)."""
    d, V = cfg.dim, cfg.vocab_size
    split = tp if with_tp else 1
    table = V * d // split
    block = 2 * d + (p_block(cfg) - 2 * d) // split  # the norms whole, the rest split over tp
    return [table] + [block] * cfg.n_layers + [d + (0 if cfg.tie_embeddings else table)]


def loss_axis(kind: str) -> str | None:
    """The loss is a partial sum over the ranks that split the tokens (dp, fsdp), reduced
    once per step by one fp32 all-reduce over all of them as one group (its axes joined
    by "+"); none where no axis splits them."""
    axes = [a for a, present in (("dp", kind in ("dp", "hsdp")),
                                 ("fsdp", kind in ("fsdp", "hsdp", "fsdp_tp", "fsdp_tp_sp"))) if present]
    return "+".join(axes) or None


def closed_form(kind: str, cfg: LlamaConfig, B: int, S: int, m: int = 1, c: int = FP32,
                tp: int = 2, bucket: str = "param") -> dict[tuple, tuple[int, int]]:
    """(phase, op, axis) -> (count, total bytes): the doc's closed-form tables. Every axis
    that exists has size 2; `kind` is one of LAYOUTS; `bucket` "param" or "block"."""
    if kind not in LAYOUTS or bucket not in ("param", "block"):
        raise ValueError((kind, bucket))
    L, d, V, b = cfg.n_layers, cfg.dim, cfg.vocab_size, FP32
    tables = 1 if cfg.tie_embeddings else 2  # a tied table is gathered and reduced once
    n, k = 9 * L + 1 + tables, 2 * L + 1  # parameters gathered per forward; tp/sp boundaries per forward
    # bucket="block": one gather, one reduction per bucket (L + 2 of them: the table, each
    # block, the final norm with the output table), each over all of its parameters.
    calls = L + 2 if bucket == "block" else n
    fsdp = kind in ("fsdp", "hsdp", "fsdp_tp", "fsdp_tp_sp")
    dp = kind in ("dp", "hsdp")
    with_tp, sp = kind in ("tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp"), kind in ("tp_sp", "fsdp_tp_sp")
    out: dict[tuple, tuple[int, int]] = {}

    # Parameters: one gather per use (bucket), one gradient reduction per use (bucket), over fsdp / dp.
    U = L * p_block(cfg) + d + tables * V * d  # elements of all parameters gathered
    # Backward needs no value of the lookup-only table (untied tok_emb, a bucket of its
    # own); a tied one is needed by the output projection.
    lookup = 0 if cfg.tie_embeddings else V * d
    if with_tp:  # tp-local pieces: everything but the norms is split tp ways
        U = L * (2 * d + (p_block(cfg) - 2 * d) // tp) + d + tables * V * d // tp
        lookup //= tp
    if fsdp:
        out[("fwd", "all_gather", "fsdp")] = (m * calls, m * c * U)
        if REGATHER:
            out[("bwd", "all_gather", "fsdp")] = (m * (calls - (lookup > 0)), m * c * (U - lookup))
        out[("bwd", "reduce_scatter_sum", "fsdp")] = (m * calls, m * b * U)
    # Per bucket, what is still partial after the reduce-scatter is all-reduced once per
    # step (held over micro-steps, DDP's no_sync); per parameter, on every micro-step.
    r = 1 if bucket == "block" else m
    if dp:  # after the reduce-scatter when fsdp is there too: the shard (textbook HSDP)
        out[("bwd", "all_reduce_sum", "dp")] = (r * calls, r * b * U // (2 if fsdp else 1))

    # The loss: summed over micro-steps, then one scalar all-reduce per step over the
    # batch axes as one group.
    if loss_axis(kind):
        out[("fwd", "all_reduce_sum", loss_axis(kind))] = (1, b)

    # Tensor (and sequence) parallel activations, on the tokens of one batch shard.
    if with_tp:
        Bl = B // 2 if fsdp else B
        Tl = Bl * S
        out[("fwd", "all_reduce_max", "tp")] = (m, m * b * Tl)  # vocab-parallel loss: row max
        if sp:
            A = c * Bl * tp * math.ceil(S / tp) * d  # the sequence padded to a multiple of tp
            for phase in ("fwd", "bwd"):
                out[(phase, "reduce_scatter_sum", "tp")] = (m * k, m * k * A)
                out[(phase, "all_gather", "tp")] = (m * k, m * k * A)
            # Eager: each gathered normed input is kept as its shard and gathered again.
            out[("bwd", "all_gather", "tp")] = (2 * m * k, 2 * m * k * A)
            out[("fwd", "all_reduce_sum", "tp")] = (m, m * 2 * b * Tl)  # [sum_exp, target_logit]
            norm = d // 2 if fsdp else d  # norm-weight grads, as the fsdp shard
            # param: one per norm (2 per block, the final one); block: one per bucket with norms.
            out[("bwd", "all_reduce_sum", "tp")] = (r * (k if bucket == "param" else L + 1), r * k * b * norm)
        else:
            A = c * Tl * d
            out[("fwd", "all_reduce_sum", "tp")] = (m * (k + 1), m * (k * A + 2 * b * Tl))
            out[("bwd", "all_reduce_sum", "tp")] = (m * k, m * k * A)

    # The optimizer: the squared grad norm, once per step, over the whole world.
    world_axis = {"fsdp": "fsdp", "dp": "dp", "tp": "tp", "tp_sp": "tp"}.get(kind, "world")  # 1-D: its axis
    out[("opt", "all_reduce_sum", world_axis)] = (1, b)
    return out


def per_message(kind: str, cfg: LlamaConfig, B: int, S: int, m: int = 1, c: int = FP32, tp: int = 2,
                bucket: str = "param") -> Counter:
    """The doc's per-use (per-bucket) tables as a multiset of messages (each size, not just totals)."""
    L, d, b = cfg.n_layers, cfg.dim, FP32
    k = 2 * L + 1
    out: Counter = Counter()
    with_fsdp = kind in ("fsdp", "hsdp", "fsdp_tp", "fsdp_tp_sp")
    with_tp = kind in ("tp", "tp_sp", "fsdp_tp", "fsdp_tp_sp")
    if bucket == "param":
        units = [n // tp if with_tp and tp_split else n for n, tp_split in param_uses(cfg)]
    else:
        units = bucket_elements(cfg, with_tp, tp)
    for i, n in enumerate(units):  # one gather, one gradient reduction per use (bucket)
        if with_fsdp:
            out[Msg("fwd", "all_gather", "fsdp", c * n)] += m
            # Entry 0 is tok_emb (its bucket): untied, only the lookup uses it and backward
            # needs no value of it; tied, the output projection needs it again.
            if REGATHER and (i > 0 or cfg.tie_embeddings):
                out[Msg("bwd", "all_gather", "fsdp", c * n)] += m
            out[Msg("bwd", "reduce_scatter_sum", "fsdp", b * n)] += m
        r = 1 if bucket == "block" else m  # the dp all-reduce: once per step per bucket
        if kind == "hsdp":
            out[Msg("bwd", "all_reduce_sum", "dp", b * n // 2)] += r
        if kind == "dp":
            out[Msg("bwd", "all_reduce_sum", "dp", b * n)] += r
    if loss_axis(kind):
        out[Msg("fwd", "all_reduce_sum", loss_axis(kind), b)] += 1  # the loss, once per step
    if with_tp:
        Bl = B // 2 if with_fsdp else B
        Tl = Bl * S
        out[Msg("fwd", "all_reduce_max", "tp", b * Tl)] += m  # vocab-parallel loss
        out[Msg("fwd", "all_reduce_sum", "tp", 2 * b * Tl)] += m
        if kind in ("tp_sp", "fsdp_tp_sp"):
            A = c * Bl * tp * math.ceil(S / tp) * d
            for phase in ("fwd", "bwd"):
                out[Msg(phase, "reduce_scatter_sum", "tp", A)] += m * k
                out[Msg(phase, "all_gather", "tp", A)] += m * k
            out[Msg("bwd", "all_gather", "tp", A)] += m * k  # the kept shards gathered again
            norm = b * (d // 2 if with_fsdp else d)
            if bucket == "param":  # each norm's gradient, every micro-step
                out[Msg("bwd", "all_reduce_sum", "tp", norm)] += m * k
            else:  # per block its two norms' together, and the final norm: once per step
                out[Msg("bwd", "all_reduce_sum", "tp", 2 * norm)] += L
                out[Msg("bwd", "all_reduce_sum", "tp", norm)] += 1
        else:
            out[Msg("fwd", "all_reduce_sum", "tp", c * Tl * d)] += m * k
            out[Msg("bwd", "all_reduce_sum", "tp", c * Tl * d)] += m * k
    world_axis = {"fsdp": "fsdp", "dp": "dp", "tp": "tp", "tp_sp": "tp"}.get(kind, "world")
    out[Msg("opt", "all_reduce_sum", world_axis, b)] += 1
    return out


_COMM_NAME = {"all_gather": "all_gather_into_tensor", "reduce_scatter_sum": "reduce_scatter_tensor",
              "all_reduce_sum": "all_reduce", "all_reduce_max": "all_reduce"}


def check_totals(obs: Observed, kind: str, cfg: LlamaConfig, B: int, S: int, m: int = 1, c: int = FP32) -> None:
    """The closed forms: count and total bytes per (phase, op, axis)."""
    expected = closed_form(kind, cfg, B, S, m, c, bucket=obs.bucket)
    got: dict[tuple, list[int]] = {}
    for msg in obs.msgs:
        tally = got.setdefault((msg.phase, msg.op, msg.axis), [0, 0])
        tally[0] += 1
        tally[1] += msg.nbytes
    assert {k: tuple(v) for k, v in got.items()} == expected, _diff(got, expected)


def check_messages(obs: Observed, kind: str, cfg: LlamaConfig, B: int, S: int, m: int = 1, c: int = FP32) -> None:
    """The per-use tables: the multiset of individual messages (phase, op, axis, bytes)."""
    want, have = per_message(kind, cfg, B, S, m, c, bucket=obs.bucket), Counter(obs.msgs)
    assert have == want, f"extra: {dict(have - want)}\nmissing: {dict(want - have)}"


def check_comm_counts(obs: Observed, kind: str, cfg: LlamaConfig, B: int, S: int, m: int = 1,
                      c: int = FP32) -> None:
    """torch's CommDebugMode agrees with the closed forms on the count per op type."""
    want: Counter = Counter()
    for (_, op, _), (count, _) in closed_form(kind, cfg, B, S, m, c, bucket=obs.bucket).items():
        want[_COMM_NAME[op]] += count
    assert obs.comm_counts == dict(want), f"CommDebugMode {obs.comm_counts} != formula {dict(want)}"


CHECKS = (check_totals, check_messages, check_comm_counts)


def check(obs: Observed, kind: str, cfg: LlamaConfig, B: int, S: int, m: int = 1, c: int = FP32) -> None:
    """Raise AssertionError unless the step's collectives equal the doc's formulas."""
    cfg = LlamaConfig(**{**cfg.__dict__, "tie_embeddings": obs.tied})
    for f in CHECKS:
        f(obs, kind, cfg, B, S, m, c)


def _diff(got, expected) -> str:
    lines = []
    for k in sorted(set(got) | set(expected)):
        g, e = tuple(got.get(k, (0, 0))), expected.get(k, (0, 0))
        if g != e:
            lines.append(f"  {k}: got (count, bytes) {g}, formula {e}")
    return "collectives differ from the closed forms:\n" + "\n".join(lines)


# ----------------------------------------------------------------------------------------
# The three layouts of the doc (world 2), tied and untied

CASES = [
    # id, layout, sp, tied, kind, B, S
    ("fsdp2", dict(fsdp=2), False, False, "fsdp", 4, 7),
    ("fsdp2-tied", dict(fsdp=2), False, True, "fsdp", 4, 7),
    ("tp2", dict(tp=2), False, False, "tp", 3, 7),
    ("tp2-tied", dict(tp=2), False, True, "tp", 3, 7),
    ("tp2-sp", dict(tp=2), True, False, "tp_sp", 3, 10),
    ("tp2-sp-tied-uneven-seq", dict(tp=2), True, True, "tp_sp", 3, 9),
]


# Every case runs with both units of parameter traffic: "param" (the per-parameter
# reference) and "block" (the default).
BUCKETS = ("param", "block")


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("layout,sp,tied,kind,B,S", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_step_collectives_match_formulas(layout, sp, tied, kind, B, S, bucket):
    obs = run_step(layout, bucket=bucket, sp=sp, tied=tied, batch=B, seq=S)
    check(obs, kind, CFG, B, S)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_micro_batches_repeat_forward_and_backward_only(bucket):
    """m micro-batches: every forward / backward collective m times, the optimizer's and
    the loss's once."""
    obs = run_step(dict(fsdp=2), bucket=bucket, tied=True, batch=4, seq=5, micro=2)
    check(obs, "fsdp", CFG, 4, 5, m=2)


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("layout,sp,kind", [(dict(fsdp=2), False, "fsdp"), (dict(tp=2), True, "tp_sp")],
                         ids=["fsdp2", "tp2-sp"])
def test_bf16_halves_gathers_and_activations_only(layout, sp, kind, bucket):
    """bf16 compute: parameters are gathered and activations move in bf16 (c = 2); the
    gradient reduce-scatters, norm-grad all-reduces, loss reductions and the grad norm stay fp32."""
    obs = run_step(layout, bucket=bucket, sp=sp, tied=True, batch=2, seq=6, precision="bf16")
    check(obs, kind, CFG, 2, 6, c=2)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_fsdp_backward_all_gathers(bucket):
    """Kept gathered parameters: no all-gather in backward. Re-gathered (ZeRO-3): per
    parameter, one per use whose value backward needs, i.e. all but the embedding lookup
    (9 L + 2); per block bucket, one per bucket with such a use, i.e. all but the table's
    (L + 1)."""
    obs = run_step(dict(fsdp=2), bucket=bucket, batch=2, seq=5)
    gathers = [m for m in obs.msgs if m.phase == "bwd" and m.op == "all_gather"]
    want = 9 * CFG.n_layers + 2 if bucket == "param" else CFG.n_layers + 1
    assert len(gathers) == (want if REGATHER else 0)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_data_parallel_collectives(bucket):
    """Plain dp: one gradient all-reduce per parameter per micro-step, or per bucket once
    per step (L + 2)."""
    obs = run_step(dict(dp=2), bucket=bucket, tied=True, batch=4, seq=5)
    check(obs, "dp", CFG, 4, 5)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_hsdp_collectives(bucket):
    """Reduce-scatter over fsdp first, then all-reduce the shard over dp; the loss over
    dp x fsdp as one group."""
    obs = run_step(dict(dp=2, fsdp=2), bucket=bucket, batch=4, seq=5, world=4)
    check(obs, "hsdp", CFG, 4, 5)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_fsdp_x_tp_collectives(bucket):
    """FSDP x TP (world 4). Also guards the vocab-parallel embedding's gradient: before
    cb158b8 its table gradient was marked Replicate over fsdp, so tok_emb's lookup use
    got no reduce-scatter (one short here) and a gradient from one batch shard only."""
    obs = run_step(dict(fsdp=2, tp=2), bucket=bucket, batch=4, seq=5, world=4)
    check(obs, "fsdp_tp", CFG, 4, 5)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_fsdp_x_tp_sp_tied_collectives(bucket):
    obs = run_step(dict(fsdp=2, tp=2), bucket=bucket, sp=True, tied=True, batch=4, seq=6, world=4)
    check(obs, "fsdp_tp_sp", CFG, 4, 6)


def test_block_closed_forms_at_three_layers_and_three_micro_steps():
    """The block closed forms of docs/parallelism.md for an untied L-block Llama and m
    micro-steps, written out (L = 3, m = 3): fsdp eager gathers m (L + 2) buckets in
    forward and m (L + 1) again in backward (not the lookup table's), reduce-scatters
    m (L + 2); the scalars are one loss all-reduce and one grad-norm all-reduce per step.
    dp: L + 2 gradient all-reduces per step (the micro-steps' partial sums held and
    reduced on the last)."""
    cfg = LlamaConfig(**{**CFG.__dict__, "n_layers": 3})
    L, m = 3, 3
    fsdp = run_step(dict(fsdp=2), bucket="block", batch=4, seq=5, micro=m, cfg=cfg)
    check(fsdp, "fsdp", cfg, 4, 5, m=m)
    calls = Counter((x.phase, x.op) for x in fsdp.msgs)
    assert calls == {("fwd", "all_gather"): m * (L + 2), ("bwd", "all_gather"): m * (L + 1),
                     ("bwd", "reduce_scatter_sum"): m * (L + 2), ("fwd", "all_reduce_sum"): 1,
                     ("opt", "all_reduce_sum"): 1}
    dp = run_step(dict(dp=2), bucket="block", batch=4, seq=5, micro=m, cfg=cfg)
    check(dp, "dp", cfg, 4, 5, m=m)
    assert Counter((x.phase, x.op) for x in dp.msgs) == {("bwd", "all_reduce_sum"): L + 2,
                                                          ("fwd", "all_reduce_sum"): 1, ("opt", "all_reduce_sum"): 1}


# ----------------------------------------------------------------------------------------
# The checks can fail

def test_checks_can_fail():
    """Each of the three checks, on its own, catches one collective too many or too few
    (or one message resized) of every (phase, op, axis) kind the step issues."""
    for (_, layout, sp, tied, kind, B, S), bucket in ((CASES[0], "param"), (CASES[2], "param"), (CASES[4], "param"),
                                                      (CASES[0], "block"), (CASES[4], "block")):
        obs = run_step(layout, bucket=bucket, sp=sp, tied=tied, batch=B, seq=S)
        check(obs, kind, CFG, B, S)
        kinds = {(m.phase, m.op, m.axis): m for m in obs.msgs}
        assert len(kinds) >= 4
        for msg in kinds.values():
            i = obs.msgs.index(msg)
            fewer = Observed(obs.msgs[:i] + obs.msgs[i + 1:], obs.comm_counts, bucket=bucket)
            more = Observed(obs.msgs + [msg], obs.comm_counts, bucket=bucket)
            resized = Observed(obs.msgs[:i] + [Msg(msg.phase, msg.op, msg.axis, msg.nbytes + FP32)]
                               + obs.msgs[i + 1:], obs.comm_counts, bucket=bucket)
            for bad in (fewer, more, resized):
                for f in (check_totals, check_messages):
                    with pytest.raises(AssertionError):
                        f(bad, kind, CFG, B, S)
        for op in obs.comm_counts:
            for delta in (-1, 1):
                bad = Observed(obs.msgs, {**obs.comm_counts, op: obs.comm_counts[op] + delta}, bucket=bucket)
                with pytest.raises(AssertionError):
                    check_comm_counts(bad, kind, CFG, B, S)
        # The right collectives against another layout's formulas do not pass either,
        # nor (where buckets change the traffic) against the other unit's.
        for other in ("fsdp", "tp", "tp_sp"):
            if other != kind:
                for f in CHECKS:
                    with pytest.raises(AssertionError):
                        f(obs, other, CFG, B, S)
        if kind != "tp":
            swapped = Observed(obs.msgs, obs.comm_counts, bucket="block" if bucket == "param" else "param")
            for f in CHECKS:
                with pytest.raises(AssertionError):
                    f(swapped, kind, CFG, B, S)


def test_injected_collectives_are_caught(monkeypatch):
    """A real extra or missing collective in the step (the grad-norm all-reduce doubled or
    dropped) fails the check."""
    import meshtrain.train.step as step_module

    real = step_module.all_reduce_sum
    monkeypatch.setattr(step_module, "all_reduce_sum", lambda x: real(real(x)))
    with pytest.raises(AssertionError, match="opt"):
        check(run_step(dict(tp=2), bucket="param", batch=2, seq=4), "tp", CFG, 2, 4)
    monkeypatch.setattr(step_module, "all_reduce_sum", lambda x: x)
    with pytest.raises(AssertionError, match="opt"):
        check(run_step(dict(tp=2), bucket="param", batch=2, seq=4), "tp", CFG, 2, 4)
