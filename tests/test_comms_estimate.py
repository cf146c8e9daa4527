"""`step_collectives` (estimate/comms.py, a table of what the runtime issues) against the
collectives of real steps, recorded on the fake process group by `CollectiveRecorder`
(support/collectives.py): for every layout test_collectives exercises, and for GPT-2, the
estimate must equal the recording (same (phase, op, axis) keys, equal count and bytes),
with one collective per parameter (bucket="param", the reference), per block
(bucket="block", the default) and per bucket of a size in MB (buckets that split blocks
and span them). Also: the estimate at llama3-405b scale is fast and has the magnitudes
first principles give."""

from __future__ import annotations

import math
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshtrain.models import build
from meshtrain.models.gpt2 import GPT2Config
from meshtrain.models.llama import PRESETS, LlamaConfig
from meshtrain.estimate.comms import step_collectives
from meshtrain.parallel.init import init_params
from meshtrain.layout.mesh import MeshSpec
from meshtrain.layout.plan import make_plan
from meshtrain.layout.rules import Rules
from meshtrain.layout.traffic import Traffic
from meshtrain.train.optim import AdamW
from meshtrain.train.step import TrainState, make_train_step
from support.collectives import CFG, CollectiveRecorder, Msg, axis_names, run_model_step, run_step
from support.comms import SHORT, assert_same, estimate, totals

GPT2_CFG = GPT2Config(dim=48, n_layers=2, n_heads=6, ffn_dim=100, vocab_size=130, max_seq_len=16)


# id, layout, sp, tied, batch, seq, micro, world, precision: every case of test_collectives
CASES = [
    ("fsdp2", dict(fsdp=2), False, False, 4, 7, 1, 2, "fp32"),
    ("fsdp2-tied", dict(fsdp=2), False, True, 4, 7, 1, 2, "fp32"),
    ("tp2", dict(tp=2), False, False, 3, 7, 1, 2, "fp32"),
    ("tp2-tied", dict(tp=2), False, True, 3, 7, 1, 2, "fp32"),
    ("tp2-sp", dict(tp=2), True, False, 3, 10, 1, 2, "fp32"),
    ("tp2-sp-tied-uneven-seq", dict(tp=2), True, True, 3, 9, 1, 2, "fp32"),
    ("fsdp2-tied-micro2", dict(fsdp=2), False, True, 4, 5, 2, 2, "fp32"),
    ("fsdp2-tied-bf16", dict(fsdp=2), False, True, 2, 6, 1, 2, "bf16"),
    ("tp2-sp-tied-bf16", dict(tp=2), True, True, 2, 6, 1, 2, "bf16"),
    ("dp2-tied", dict(dp=2), False, True, 4, 5, 1, 2, "fp32"),
    ("hsdp", dict(dp=2, fsdp=2), False, False, 4, 5, 1, 4, "fp32"),
    ("fsdp2xtp2", dict(fsdp=2, tp=2), False, False, 4, 5, 1, 4, "fp32"),
    ("fsdp2xtp2-sp-tied", dict(fsdp=2, tp=2), True, True, 4, 6, 1, 4, "fp32"),
]
# Every case with one collective per parameter (the reference) and per block (the default).
BUCKETS = ("param", "block")
_RECORDED: dict[tuple, dict] = {}


def recorded(case, bucket) -> dict:
    cid, layout, sp, tied, B, S, m, world, precision = case
    if (cid, bucket) not in _RECORDED:
        obs = run_step(layout, bucket=bucket, sp=sp, tied=tied, batch=B, seq=S, micro=m, world=world,
                       precision=precision)
        _RECORDED[(cid, bucket)] = totals(obs.msgs)
    return _RECORDED[(cid, bucket)]


def llama(tied: bool):
    return build("llama", LlamaConfig(**{**CFG.__dict__, "tie_embeddings": tied}))


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_estimate_equals_recorded_step(case, bucket):
    _, layout, sp, tied, B, S, m, world, precision = case
    est = estimate(llama(tied), layout, bucket=bucket, sp=sp, batch=B, seq=S, micro=m, world=world,
                   precision=precision)
    assert_same(est, recorded(case, bucket))


# Buckets of a size in MB (CFG: a block is 82,560 fp32 bytes, each vocab table 24,960): id,
# MB, layout, sp, tied, batch, seq, micro, world, precision. 0.05 MB cuts blocks apart and
# puts the tied table in one bucket with block 0's attention, whose gather the head's
# save then needs again after the other buckets'; 0.2 MB spans blocks; 0.003 MB leaves
# most weights a bucket of their own.
MB_CASES = [
    ("fsdp2-0.05MB", 0.05, dict(fsdp=2), False, False, 4, 7, 1, 2, "fp32"),
    ("fsdp2-tied-0.05MB-micro2", 0.05, dict(fsdp=2), False, True, 4, 5, 2, 2, "fp32"),
    ("fsdp2-0.2MB-bf16", 0.2, dict(fsdp=2), False, False, 2, 6, 1, 2, "bf16"),
    ("hsdp-0.003MB", 0.003, dict(dp=2, fsdp=2), False, False, 4, 5, 1, 4, "fp32"),
    ("fsdp2xtp2-sp-tied-0.05MB", 0.05, dict(fsdp=2, tp=2), True, True, 4, 6, 1, 4, "fp32"),
    ("dp2-0.05MB", 0.05, dict(dp=2), False, False, 4, 5, 1, 2, "fp32"),
]


@pytest.mark.parametrize("case", MB_CASES, ids=[c[0] for c in MB_CASES])
def test_estimate_equals_recorded_step_with_buckets_in_mb(case):
    cid, mb, layout, sp, tied, B, S, m, world, precision = case
    rec = recorded((cid, layout, sp, tied, B, S, m, world, precision), mb)
    assert_same(estimate(llama(tied), layout, bucket=mb, sp=sp, batch=B, seq=S, micro=m, world=world,
                         precision=precision), rec)


@pytest.mark.parametrize("layout,sp,world", [(dict(fsdp=2), False, 2), (dict(dp=2, fsdp=2), False, 4),
                                             (dict(fsdp=2, tp=2), True, 4)], ids=["fsdp2", "hsdp", "fsdp2xtp2-sp"])
def test_unsharded_accumulation_reduce_scatters_once_per_step(layout, sp, world):
    """parallel.fsdp_accumulate unsharded, 3 micro-steps: one reduce-scatter per bucket per
    step (L + 2) instead of per micro-step, a third of the bytes; the estimate follows."""
    model, m = llama(False), 3
    kw = dict(bucket="block", sp=sp, batch=4, seq=5, micro=m, world=world)
    rec = totals(run_model_step(model, layout, fsdp_accumulate="unsharded", **kw))
    assert_same(estimate(model, layout, fsdp_accumulate="unsharded", **kw), rec)
    sharded = estimate(model, layout, **kw)
    key = ("bwd", "reduce_scatter_sum", "fsdp")
    assert rec[key][0] == CFG.n_layers + 2 and sharded[key][0] == m * (CFG.n_layers + 2)
    assert rec[key][1] * m == sharded[key][1]
    assert {k: v for k, v in rec.items() if k != key} == {k: v for k, v in sharded.items() if k != key}


@pytest.mark.parametrize("traffic", [dict(reshard_after_forward=False), dict(prefetch=0), dict(prefetch=3)],
                         ids=["kept", "prefetch0", "prefetch3"])
@pytest.mark.parametrize("bucket", ["block", 0.05])
def test_estimate_follows_resharding_and_prefetch(bucket, traffic):
    """reshard_after_forward False keeps the gathered weights (no backward all-gather);
    prefetch moves gathers earlier, never adds or drops one in a step that uses every
    bucket in order."""
    model = llama(True)
    rec = totals(run_model_step(model, dict(fsdp=2), bucket=bucket, sp=False, batch=4, seq=5, **traffic))
    est = estimate(model, dict(fsdp=2), bucket=bucket, sp=False, batch=4, seq=5, **traffic)
    assert_same(est, rec)
    assert (("bwd", "all_gather", "fsdp") in est) == traffic.get("reshard_after_forward", True)


GPT2_CASES = [
    ("gpt2-fsdp2", dict(fsdp=2), False, 4, 7, 2),
    ("gpt2-dp2", dict(dp=2), False, 4, 5, 2),
    ("gpt2-tp2", dict(tp=2), False, 3, 7, 2),
    ("gpt2-tp2-sp-uneven", dict(tp=2), True, 3, 9, 2),
    ("gpt2-fsdp2xtp2", dict(fsdp=2, tp=2), False, 4, 5, 4),
]


@pytest.mark.parametrize("bucket", [*BUCKETS, 0.02])  # 0.02 MB: a gpt2 block is 111,360 bytes
@pytest.mark.parametrize("case", GPT2_CASES, ids=[c[0] for c in GPT2_CASES])
def test_gpt2_estimate_equals_recorded_step(case, bucket):
    _, layout, sp, B, S, world = case
    model = build("gpt2", GPT2_CFG)
    rec = totals(run_model_step(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world))
    assert_same(estimate(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world), rec)


# Context parallelism: id, family, layout, sp, cp_comm, batch, seq, world, precision. The
# attention exchanges (c10d calls, sends included) and the fsdp x cp parameter traffic.
CP_CASES = [
    ("cp2-allgather", "llama", dict(cp=2), False, "allgather", 2, 8, 2, "fp32"),
    ("cp2-ring", "llama", dict(cp=2), False, "ring", 2, 8, 2, "fp32"),
    ("cp2-a2a-bf16", "llama", dict(cp=2), False, "a2a", 2, 8, 2, "bf16"),
    ("cp4-ring", "llama", dict(cp=4), False, "ring", 2, 16, 4, "fp32"),
    ("cp4-allgather-bf16", "llama", dict(cp=4), False, "allgather", 2, 16, 4, "bf16"),
    ("fsdp2xcp2-a2a", "llama", dict(fsdp=2, cp=2), False, "a2a", 4, 8, 4, "fp32"),
    ("cp2xtp2-sp-ring", "llama", dict(cp=2, tp=2), True, "ring", 2, 8, 4, "fp32"),
    ("gpt2-cp2xtp2-allgather", "gpt2", dict(cp=2, tp=2), False, "allgather", 2, 8, 4, "fp32"),
]


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("case", CP_CASES, ids=[c[0] for c in CP_CASES])
def test_context_parallel_estimate_equals_recorded_step(case, bucket):
    _, family, layout, sp, comm, B, S, world, precision = case
    model = llama(False) if family == "llama" else build("gpt2", GPT2_CFG)
    rec = totals(run_model_step(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world,
                                precision=precision, cp_comm=comm))
    assert not [k for k in rec if k[2] == "?" or k[2].startswith("group:")], f"collectives on an unknown group: {rec}"
    assert any(k[2] == "cp" and k[1] != "all_gather" for k in rec)  # the attention exchange is there
    assert_same(estimate(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world, precision=precision,
                         cp_comm=comm), rec)


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("i", [0, 5, 12], ids=[CASES[i][0] for i in (0, 5, 12)])
def test_comparison_can_fail(i, bucket):
    """One message more, fewer or resized in the recording, of every kind, fails; so does
    the estimate for a different mode, precision, micro-step count, layout or (where it
    changes the traffic) unit of parameter traffic."""
    case = CASES[i]
    _, layout, sp, tied, B, S, m, world, precision = case
    model, rec = llama(tied), recorded(case, bucket)
    est = estimate(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, micro=m, world=world, precision=precision)
    assert_same(est, rec)
    for key, (n, nbytes) in rec.items():
        one = nbytes // n
        for bad in ((n + 1, nbytes + one), (n - 1, nbytes - one), (n, nbytes + 4)):
            with pytest.raises(AssertionError):
                assert_same(est, {**rec, key: bad} if bad[0] else {k: v for k, v in rec.items() if k != key})
    # Each change alters the step where it applies (fsdp gathers, tp activations).
    variants = [dict(micro=m + 1), dict(precision="bf16" if precision == "fp32" else "fp32")]
    if "fsdp" in layout:
        # (A compiled step issues the same collectives here: no dp part to hold back.)
        variants += [dict(reshard_after_forward=False), dict(bucket="block" if bucket == "param" else "param")]
    if "tp" in layout:
        variants += [dict(sp=not sp), dict(batch=2 * B), dict(seq=S + 2)]
    for change in variants:
        kw = dict(bucket=bucket, sp=sp, batch=B, seq=S, micro=m, world=world, precision=precision)
        kw.update(change)
        with pytest.raises(AssertionError):
            assert_same(estimate(model, layout, **kw), rec)


@pytest.mark.alone
def test_llama3_405b_at_16384_ranks():
    """fsdp 2048 x tp 8 with SP: fast, and the closed forms of docs/parallelism.md at scale.

    From first principles, per micro-step: every parameter is gathered over fsdp once in
    forward as its tp-local piece (norms whole, everything else / tp), so the forward
    all-gathers move c x (parameter elements / tp, norms counted whole) bytes; eager
    backward gathers all but the untied lookup table again, so gathers total about twice
    the tp-local parameter bytes (c = 4: ~2 x 4 x 405e9 / 8 ~ 0.4 TB). Each use's gradient
    is reduce-scattered once in fp32 (the same tp-local size x 4). The 2L + 1 SP boundaries
    each reduce-scatter and all-gather one fsdp rank's (B / fsdp) x S x d activations in
    forward and in backward, and (eager) all-gather once more in backward the normed
    input they kept as its shard; the 2L + 1 norm gradients are all-reduced over tp as
    their fsdp shard (d / fsdp elements, fp32)."""
    cfg = PRESETS["llama3-405b"]
    model = build("llama", cfg)
    world, tp, B, S = 16384, 8, 2048, 8192
    plan = make_plan(model.specs, Rules.default(sp=True), MeshSpec(fsdp=-1, tp=tp), world=world)
    fsdp = plan.mesh.fsdp
    assert fsdp == 2048
    t0 = time.perf_counter()
    entries = step_collectives(plan, model, micro_batch_rows=B, seq_len=S, micro_steps=1, precision="fp32",
                               traffic=Traffic(bucket="param"))
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"estimate took {elapsed:.2f} s"
    est = {(SHORT[e["phase"]], e["op"], e["axis"]): (e["count"], e["bytes"]) for e in entries}

    L, d, V = cfg.n_layers, cfg.dim, cfg.vocab_size
    hd, kv, f = cfg.head_dim, cfg.n_kv_heads, cfg.ffn_dim
    block = 2 * d + (2 * d * d + 2 * kv * hd * d + 3 * f * d) // tp  # tp-local block elements
    U = L * block + d + 2 * V * d // tp  # tok_emb and output: vocab split over tp
    total_params = sum(p.spec.numel for p in plan.params.values())
    assert 400e9 < total_params < 410e9
    n, k = 9 * L + 3, 2 * L + 1
    A = 4 * (B // fsdp) * S * d
    want = {
        ("fwd", "all_gather", "fsdp"): (n, 4 * U),
        ("bwd", "all_gather", "fsdp"): (n - 1, 4 * (U - V * d // tp)),
        ("bwd", "reduce_scatter_sum", "fsdp"): (n, 4 * U),
        ("fwd", "all_reduce_sum", "fsdp"): (1, 4),
        ("fwd", "reduce_scatter_sum", "tp"): (k, k * A),
        ("fwd", "all_gather", "tp"): (k, k * A),
        ("bwd", "reduce_scatter_sum", "tp"): (k, k * A),
        ("bwd", "all_gather", "tp"): (2 * k, 2 * k * A),
        ("bwd", "all_reduce_sum", "tp"): (k, k * 4 * d // fsdp),
        ("fwd", "all_reduce_max", "tp"): (1, 4 * (B // fsdp) * S),
        ("fwd", "all_reduce_sum", "tp"): (1, 2 * 4 * (B // fsdp) * S),
        ("opt", "all_reduce_sum", "world"): (1, 4),
    }
    assert_same(est, want)
    gathers = est[("fwd", "all_gather", "fsdp")][1] + est[("bwd", "all_gather", "fsdp")][1]
    ratio = gathers / (4 * total_params / tp)
    assert 1.95 < ratio < 2.05, ratio  # ~2x the tp-local fp32 parameter bytes
    assert math.isclose(est[("bwd", "reduce_scatter_sum", "fsdp")][1], 4 * total_params / tp, rel_tol=0.01)
    bf16 = step_collectives(plan, model, micro_batch_rows=B, seq_len=S, micro_steps=4, precision="bf16",
                            compiled=True, traffic=Traffic(bucket="param"))
    got = Counter({(SHORT[e["phase"]], e["op"], e["axis"]): e["bytes"] for e in bf16})
    assert got[("fwd", "all_gather", "fsdp")] == 4 * 2 * U  # 4 micro-steps, gathered in bf16
    # Compiled with resharding: gathered again once in backward, but the untied table.
    assert got[("bwd", "all_gather", "fsdp")] == 4 * 2 * (U - V * d // tp)
    kept = step_collectives(plan, model, micro_batch_rows=B, seq_len=S, micro_steps=4, precision="bf16",
                            compiled=True, traffic=Traffic(bucket="param", reshard_after_forward=False))
    assert ("bwd", "all_gather", "fsdp") not in {(SHORT[e["phase"]], e["op"], e["axis"]) for e in kept}
    assert got[("bwd", "reduce_scatter_sum", "fsdp")] == 4 * 4 * U  # reduced in fp32
    assert got[("opt", "all_reduce_sum", "world")] == 4  # once per step
    assert got[("fwd", "all_reduce_sum", "fsdp")] == 4  # the loss: once per step too

    # bucket="block" (the default): the same bytes in one collective per bucket (the
    # table, each block, the final norm with the output table): L + 2 gathers, L + 1
    # again in backward (not the table's), L + 2 reduce-scatters; the norms' tp
    # all-reduce once per block (its two norms together) and once for the final norm.
    t0 = time.perf_counter()
    blocks = step_collectives(plan, model, micro_batch_rows=B, seq_len=S, micro_steps=1, precision="fp32")
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"estimate took {elapsed:.2f} s"
    est = {(SHORT[e["phase"]], e["op"], e["axis"]): (e["count"], e["bytes"]) for e in blocks}
    want.update({
        ("fwd", "all_gather", "fsdp"): (L + 2, 4 * U),
        ("bwd", "all_gather", "fsdp"): (L + 1, 4 * (U - V * d // tp)),
        ("bwd", "reduce_scatter_sum", "fsdp"): (L + 2, 4 * U),
        ("bwd", "all_reduce_sum", "tp"): (L + 1, k * 4 * d // fsdp),
    })
    assert_same(est, want)


# ----------------------------------------------------------------------------------------
# Mixture of experts: dense and MoE blocks walked apart; expert weights on the expert mesh.
#
# On the fake process group no peer answers, so the per-expert counts that ep peers would
# send (the first all-to-all of each MoE call) are made up: here rank 0's experts receive
# twice the rows it sends (a hot spot), so the recorded token all-to-alls differ from the
# estimate's uniform-routing bytes. Everything else must match exactly; the ep all-to-alls
# must match in count, and their recorded bytes must be what the captured routing gives.

MOE_CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, vocab_size=64, max_seq_len=16)
# id, moe, layout, sp, batch, seq, world, precision
MOE_CASES = [
    ("moe-fsdp2-ep2-dense0-bf16", dict(shared_experts=1, z_loss_coef=1e-3, layers="1:"), dict(fsdp=2, ep=2), False,
     4, 8, 2, "bf16"),
    ("moe-fsdp2xtp2-ep2-sp-all", dict(shared_experts=1, layers="all"), dict(fsdp=2, tp=2, ep=2), True, 4, 8, 4,
     "fp32"),
    # Expert weights with something to gather (the expert mesh's fsdp 2) and to all-reduce
    # (its dp 2): their own buckets, on the expert mesh's groups.
    ("moe-fsdp4-ep2", dict(shared_experts=1, layers="all"), dict(fsdp=4, ep=2), False, 4, 8, 4, "fp32"),
    ("moe-dp2xfsdp2-ep2-bf16", dict(balance="aux_free"), dict(dp=2, fsdp=2, ep=2), False, 4, 8, 4, "bf16"),
]


class _MoeRecorder(CollectiveRecorder):
    """CollectiveRecorder, plus the expert mesh's groups: all-to-alls on the ep group are
    named "ep" (with ep = fsdp its group is the fsdp group, under that name in
    `axis_of_group`)."""

    def __init__(self, axis_of_group, ep_group):
        super().__init__(axis_of_group)
        self.ep_group = ep_group

    def _describe(self, ns, name, args):
        msg = super()._describe(ns, name, args)
        boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)  # c10d ops: the group first
        group = dist.ProcessGroup.unbox(boxed).group_name if boxed is not None else args[-1]
        if msg.op == "all_to_all_single" and group == self.ep_group:
            return Msg(msg.phase, msg.op, "ep", msg.nbytes)
        return msg


def run_moe_step(model, layout, *, bucket, sp, batch, seq, world, precision, monkeypatch):
    """One step on the fake process group: (recorded totals, rows sent, rows received by
    this rank's experts), both summed over the MoE calls."""
    from meshtrain.parallel import expert_parallel
    from meshtrain.layout.mesh import device_mesh_for

    real_a2a, real_dispatch = dist.all_to_all_single, expert_parallel.AllToAllExchange.dispatch
    routed = [0, 0]

    def counts_a2a(out, inp, *args, **kwargs):  # the counts exchange: peers send twice ours
        work = real_a2a(out, inp, *args, **kwargs)
        out.copy_(2 * inp)
        return work

    def dispatch(self, rows, counts):
        result = real_dispatch(self, rows, counts)
        routed[0] += sum(self.send)
        routed[1] += sum(self.recv)
        return result

    monkeypatch.setattr(dist, "all_to_all_single", counts_a2a)
    monkeypatch.setattr(expert_parallel.AllToAllExchange, "dispatch", dispatch)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**layout), world=world)
        mesh = plan.mesh.build()
        experts = device_mesh_for(mesh, plan.mesh.experts())
        step = make_train_step(model, plan, mesh, optimizer=AdamW(lr=3e-4), precision=precision, bucket=bucket)
        groups = axis_names(mesh)
        for i, a in enumerate(experts.mesh_dim_names):
            groups.setdefault(experts.get_group(i).group_name, a)
        state = TrainState.create(init_params(plan, mesh, seed=0))
        t = torch.randint(0, model.cfg.vocab_size, (1, batch, seq + 1), generator=torch.Generator().manual_seed(0))
        recorder = _MoeRecorder(groups, experts.get_group("ep").group_name)
        with recorder:
            step(state, {"tokens": t[..., :-1], "targets": t[..., 1:]})
        return totals(recorder.msgs), routed[0], routed[1]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bucket", [*BUCKETS, 0.01])
@pytest.mark.parametrize("case", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_moe_estimate_equals_recorded_step(case, bucket, monkeypatch):
    """Every collective of an MoE step but the routing-dependent token all-to-alls: equal
    count and bytes. Those (axis ep): equal count; recorded bytes = the captured routing's
    rows (out and back, forward and backward) + the counts; estimated bytes = the same
    with as many rows received as sent (uniform routing: T x top_k each way)."""
    from meshtrain.models.moe import MoeConfig

    _, moe, layout, sp, B, S, world, precision = case
    cfg = LlamaConfig(**{**MOE_CFG.__dict__, "moe": MoeConfig(num_experts=4, top_k=2, expert_ffn_dim=24, **moe)})
    model = build("llama", cfg)
    rec, sent, received = run_moe_step(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world,
                                       precision=precision, monkeypatch=monkeypatch)
    est = estimate(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world, precision=precision)
    a2a = [k for k in rec if k[1:] == ("all_to_all_single", "ep")]
    assert {k[0] for k in a2a} == {"fwd", "bwd"}
    assert_same({k: v for k, v in est.items() if k not in a2a}, {k: v for k, v in rec.items() if k not in a2a})
    moe_layers, c = len(cfg.moe_layers), 2 if precision == "bf16" else 4
    row, counts = c * cfg.dim, 8 * cfg.moe.num_experts * moe_layers
    tokens = B // (layout.get("dp", 1) * layout.get("fsdp", 1)) * S
    assert sent == moe_layers * tokens * cfg.moe.top_k and received == 2 * sent  # dropless; the hot spot
    assert rec[("fwd", "all_to_all_single", "ep")] == (3 * moe_layers, counts + (sent + received) * row)
    assert rec[("bwd", "all_to_all_single", "ep")] == (2 * moe_layers, (sent + received) * row)
    assert est[("fwd", "all_to_all_single", "ep")] == (3 * moe_layers, counts + 2 * sent * row)
    assert est[("bwd", "all_to_all_single", "ep")] == (2 * moe_layers, 2 * sent * row)
    assert not [k for k in rec if k[2] == "?" or k[2].startswith("group:") or k[1].startswith("c10d.")], rec


def test_moe_plan_with_every_block_moe():
    """`meshtrain plan` for tiny-moe with block 0 MoE too (it used to look for
    layers.0.mlp.w_gate): the ep all-to-alls are in the table and the per-layer line, per
    MoE layer per micro-step, 4 x T top_k dim c token bytes + 8 E of counts; without ep,
    no all-to-all. Blocks are counted by kind: 4 MoE blocks gather 4 routers."""
    import dataclasses

    import yaml

    from meshtrain.config import RunConfig
    from meshtrain.estimate.dryrun import dry_run
    from support.cli import ROOT

    raw = yaml.safe_load((ROOT / "configs" / "tiny-moe.yaml").read_text())
    raw["model"]["moe"]["layers"] = "all"
    cfg = RunConfig.from_dict(raw).validate()
    run = dry_run(cfg)
    text = run.render(width=250)
    rows = {(c["axis"], c["op"], c["phase"]): c for c in run.collectives}
    t, m = cfg.train, cfg.model.moe
    steps = t.global_batch // (t.micro_batch * 2)
    per_layer = 4 * t.micro_batch * t.seq_len * m.top_k * cfg.model.dim * 4 + 8 * m.num_experts
    assert rows[("ep", "all_to_all_single", "forward")]["count"] == 3 * 4 * steps
    assert rows[("ep", "all_to_all_single", "backward")]["count"] == 2 * 4 * steps
    assert sum(rows[("ep", "all_to_all_single", p)]["bytes"] for p in ("forward", "backward")) == 4 * steps * per_layer
    assert run.expert_exchange["bytes"] == per_layer and run.to_dict()["expert_all_to_all"] == run.expert_exchange
    assert "all_to_all_single" in text and "expert all-to-all over ep" in text
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=1, fsdp=1, nproc_per_node=1))
    run = dry_run(single.validate())
    assert not run.collectives and run.expert_exchange is None and "expert_all_to_all" not in run.to_dict()
    assert run.memory["activations_per_moe_layer"] > 0


# Activation checkpointing: id, family, layout, sp, cp_comm, batch, seq, world. Full
# recomputes each block in backward, issuing its activation collectives again but the
# last (the block output's reduction); selective recomputes the sp gathers in place of
# the kept shards' re-gathers and keeps reductions and attention: no count changes.
CHECKPOINT_CASES = [
    ("tp2-sp", "llama", dict(tp=2), True, "allgather", 3, 10, 2),
    ("tp2", "llama", dict(tp=2), False, "allgather", 3, 7, 2),
    ("fsdp2", "llama", dict(fsdp=2), False, "allgather", 4, 7, 2),
    ("fsdp2xtp2-sp", "llama", dict(fsdp=2, tp=2), True, "allgather", 4, 6, 4),
    ("cp2-ring", "llama", dict(cp=2), False, "ring", 2, 8, 2),
    ("cp2-allgather", "llama", dict(cp=2), False, "allgather", 2, 8, 2),
    ("gpt2-tp2-sp", "gpt2", dict(tp=2), True, "allgather", 2, 8, 2),
    # DeepSeek-V3 with a multi-token prediction module: its block recomputed too (a region
    # of its own after the head), its bucket apart from its norms and projection
    ("deepseek-mtp-tp2-sp", "deepseek_v3", dict(tp=2), True, "allgather", 2, 8, 2),
    ("deepseek-mtp-cp2-allgather", "deepseek_v3", dict(cp=2), False, "allgather", 2, 8, 2),
    ("deepseek-mtp-fsdp2", "deepseek_v3", dict(fsdp=2), False, "allgather", 2, 8, 2),
]


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_checkpointed_estimate_equals_recorded_step(case, bucket, mode):
    from support.deepseek import MTP_CFG

    _, family, layout, sp, comm, B, S, world = case
    model = llama(False) if family == "llama" else build(family, {"gpt2": GPT2_CFG, "deepseek_v3": MTP_CFG}[family])
    rec = totals(run_model_step(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world, cp_comm=comm,
                                activation_checkpointing=mode))
    assert_same(estimate(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world, cp_comm=comm,
                         activation_checkpointing=mode), rec)
    if mode == "full" and (sp or "cp" in layout):  # the recompute's collectives are counted
        assert estimate(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world, cp_comm=comm) != rec


# DeepSeek-V3 (tests/support/deepseek.py: MLA, values narrower than keys, experts in groups):
# id, layout, sp, cp_comm, batch, seq, world, precision. Layouts with experts split over ep
# use run_moe_step (the routing-dependent token all-to-alls compared by count).
DEEPSEEK_CASES = [
    ("fsdp2", dict(fsdp=2), False, "allgather", 2, 8, 2, "fp32"),
    ("dp2", dict(dp=2), False, "allgather", 2, 8, 2, "fp32"),
    ("cp2-ring", dict(cp=2), False, "ring", 2, 8, 2, "fp32"),  # values padded to the keys' width
    ("cp2-a2a-bf16", dict(cp=2), False, "a2a", 2, 8, 2, "bf16"),
    ("ep2", dict(fsdp=2, ep=2), False, "allgather", 4, 8, 2, "fp32"),
    ("ep2xtp2-sp-bf16", dict(fsdp=2, tp=2, ep=2), True, "allgather", 4, 8, 4, "bf16"),
    # with a multi-token prediction module after the head (its bucket, block, head and loss)
    ("fsdp2-mtp", dict(fsdp=2), False, "allgather", 2, 8, 2, "fp32"),
    ("tp2-sp-mtp", dict(tp=2), True, "allgather", 2, 8, 2, "fp32"),
    ("cp2-ring-mtp-bf16", dict(cp=2), False, "ring", 2, 8, 2, "bf16"),
    ("ep2-mtp", dict(fsdp=2, ep=2), False, "allgather", 4, 8, 2, "fp32"),
]


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=[c[0] for c in DEEPSEEK_CASES])
def test_deepseek_estimate_equals_recorded_step(case, bucket, monkeypatch):
    from support.deepseek import CFG, MTP_CFG

    name, layout, sp, comm, B, S, world, precision = case
    model = build("deepseek_v3", MTP_CFG if name.endswith("mtp") or "-mtp-" in name else CFG)
    est = estimate(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world, precision=precision,
                   cp_comm=comm)
    if "ep" not in layout:
        rec = totals(run_model_step(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world,
                                    precision=precision, cp_comm=comm))
        assert_same(est, rec)
        return
    rec = run_moe_step(model, layout, bucket=bucket, sp=sp, batch=B, seq=S, world=world, precision=precision,
                       monkeypatch=monkeypatch)[0]
    a2a = [k for k in rec if k[1:] == ("all_to_all_single", "ep")]
    assert len(a2a) == 2 and all(rec[k][0] == est[k][0] for k in a2a)
    assert_same({k: v for k, v in est.items() if k not in a2a}, {k: v for k, v in rec.items() if k not in a2a})


MUON_CASES = [("fsdp2", dict(fsdp=2), False, 2, "llama"), ("hsdp", dict(dp=2, fsdp=2), False, 4, "llama"),
              ("fsdp2xtp2-sp", dict(fsdp=2, tp=2), True, 4, "llama"),
              ("deepseek-ep2xtp2-sp", dict(fsdp=2, tp=2, ep=2), True, 4, "deepseek")]


@pytest.mark.parametrize("layout,sp,world,arch", [c[1:] for c in MUON_CASES], ids=[c[0] for c in MUON_CASES])
def test_muon_gathers_are_counted(layout, sp, world, arch):
    """train.optimizer muon: each block matrix's update gathered whole in the optimizer
    phase (one all-gather per sharded mesh dim; experts' on the expert mesh), as
    recorded; AdamW's step has none."""
    from meshtrain.train.muon import Muon
    from support.deepseek import CFG as DEEPSEEK

    # 4 layers: each stack of matrices splits evenly over fsdp x tp (an uneven stack's
    # padding is not counted: DTensor's gloo fallback pads it its own way)
    model = build("llama", LlamaConfig(**{**CFG.__dict__, "n_layers": 4})) if arch == "llama" else \
        build("deepseek_v3", DEEPSEEK)
    kw = dict(bucket="block", sp=sp, batch=4, seq=5, world=world)
    # DeepSeek's stacks (2 blocks, 1 MoE block) do not split evenly: its gathering path only
    for assemble in ("owner", "gather") if arch == "llama" else ("gather",):
        rec = totals(run_model_step(model, layout, optimizer=Muon(AdamW(lr=3e-4), assemble=assemble), **kw))
        if assemble == "owner":
            est = _on_cpu(estimate(model, layout, optimizer="muon", **kw), layout)
        else:  # the planner counts the default (owner); gather's is every matrix gathered whole
            est = {**estimate(model, layout, **kw), **_gathered(model, layout, sp, world)}
        if arch == "deepseek":  # the MoE exchange's own recording is not this test's: the optimizer's
            est, rec = ({k: v for k, v in d.items() if k[0] == "opt"} for d in (est, rec))
        assert_same(est, rec)
    assert any(k[0] == "opt" and k[1] == "all_to_all_single" for k in estimate(model, layout, optimizer="muon", **kw))
    assert not any(k[0] == "opt" and k[1] != "all_reduce_sum" for k in estimate(model, layout, **kw))


def _on_cpu(est: dict, layout: dict) -> dict:
    """An estimate's optimizer all-to-alls as gloo runs them: DTensor falls back to an
    all-gather of the whole input and a chunk (the bytes: the gathered output)."""
    out = {}
    for (phase, op, axis), (n, nbytes) in est.items():
        if phase == "opt" and op == "all_to_all_single":
            key, nbytes = (phase, "all_gather", axis), nbytes * layout.get(axis, 1)
            old = out.get(key, (0, 0))
            out[key] = (old[0] + n, old[1] + nbytes)
        else:
            out[(phase, op, axis)] = tuple(a + b for a, b in zip(out.get((phase, op, axis), (0, 0)), (n, nbytes)))
    return out


def _gathered(model, layout: dict, sp: bool, world: int) -> dict:
    """Each Muon matrix's fp32 update gathered whole from its stored placements."""
    from meshtrain.estimate.collective_tally import CollectiveTally
    from meshtrain.estimate.placement_rules import PlacementRules, R
    from meshtrain.train.muon import muon_name

    plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**layout), world=world)
    tally, rules = CollectiveTally(plan.mesh), PlacementRules(plan)
    for name, p in plan.params.items():
        if muon_name(name, len(p.spec.shape)):
            stored = rules.stored(name)
            tally.redistribute("opt", p.spec.shape, stored, (R,) * len(stored), 4, mesh=p.mesh)
    return {k: tuple(v) for k, v in tally.out.items()}
