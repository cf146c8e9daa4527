"""per_rank_memory against what real sharded steps hold (gloo CPU ranks).

State (params, grads after backward, AdamW state) is measured on every rank from the
tensors the runtime produced and must equal the estimate for the most loaded rank. What
autograd keeps for backward is measured with saved-tensor hooks: the unique storages
created by the forward (not parameters or input tokens) that autograd saves, skipping
gathered weights that the eager runtime re-gathers in backward (its own hook swaps them
for their shard).

The peak estimate is not checked here: the gloo CPU runtime has no allocator peak to
compare it with (docs/features.md lists it as an estimate).
"""

from __future__ import annotations

import dataclasses
import gc
import time

import pytest
import torch

from meshtrain import MeshSpec, Rules, build, init_params, make_plan
from meshtrain.models import gpt2, llama
from meshtrain.models.deepseek_v3 import DeepseekV3Config
from meshtrain.estimate.memory import per_rank_memory
from meshtrain.layout.traffic import Traffic
from meshtrain.testing import run_ranks
from support import deepseek
from support.memory import kept_instead

CFG = llama.LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, max_seq_len=64)
# 130 rows over fsdp 4: shards of 33, 33, 32, 32 (rank 0 holds more).
UNEVEN_CFG = llama.LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=130,
                               max_seq_len=64)
UNEVEN = {"tok_emb": {"vocab": ("fsdp",), "embed": ()}, "output": {"vocab": ("fsdp",), "embed": ()}}
QK_CFG = dataclasses.replace(CFG, qk_norm=True)
GPT2_CFG = gpt2.GPT2Config(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=128, max_seq_len=64)
# MLA (query and key/value latents with their norms, values narrower than keys: the math
# kernel on CPU, fp32 inside under bf16), YaRN's tables; dense blocks (MoE: below).
MLA_CFG = dataclasses.replace(deepseek.CFG, moe=None)
MLA_NO_Q_CFG = dataclasses.replace(MLA_CFG, mla=dataclasses.replace(MLA_CFG.mla, q_lora_rank=None))
# A multi-token prediction module after the head (its lookup, norms, eh_proj, block, head
# and loss), with a dense block and with an MoE block (the blocks' own experts and groups).
MTP_CFG = dataclasses.replace(deepseek.MTP_CFG, moe=None)
MTP_MOE_CFG = deepseek.MTP_CFG
MICRO, SEQ = 2, 24  # sequences per data-parallel rank; seq != head_dim keeps shapes apart

# name: (mesh sizes, sequence parallel, rule overrides, config)
LAYOUTS = {
    1: {"single": ({}, False, None, CFG), "single_qk_norm": ({}, False, None, QK_CFG),
        "single_gpt2": ({}, False, None, GPT2_CFG), "single_mla": ({}, False, None, MLA_CFG),
        "single_mla_no_q_latent": ({}, False, None, MLA_NO_Q_CFG), "single_mtp": ({}, False, None, MTP_CFG),
        "single_mtp_moe": ({}, False, None, MTP_MOE_CFG)},
    2: {"fsdp2": ({"fsdp": 2}, False, None, CFG), "tp2": ({"tp": 2}, False, None, CFG),  # sp: fsdp2_tp2_sp
        "tp2_sp_qk_norm": ({"tp": 2}, True, None, QK_CFG), "tp2_sp_gpt2": ({"tp": 2}, True, None, GPT2_CFG),
        "cp2_allgather": ({"cp": 2}, False, None, CFG), "cp2_ring": ({"cp": 2}, False, None, CFG),
        "cp2_a2a": ({"cp": 2}, False, None, CFG), "tp2_sp_mla": ({"tp": 2}, True, None, MLA_CFG),
        "cp2_allgather_mla": ({"cp": 2}, False, None, MLA_CFG), "cp2_ring_mla": ({"cp": 2}, False, None, MLA_CFG),
        "cp2_a2a_mla": ({"cp": 2}, False, None, MLA_CFG), "tp2_sp_mtp": ({"tp": 2}, True, None, MTP_CFG),
        "fsdp2_mtp_moe": ({"fsdp": 2}, False, None, MTP_MOE_CFG), "cp2_ring_mtp": ({"cp": 2}, False, None, MTP_CFG)},
    4: {"fsdp2_tp2_sp": ({"fsdp": 2, "tp": 2}, True, None, CFG), "dp2_fsdp2": ({"dp": 2, "fsdp": 2}, False, None, CFG),
        "fsdp4_uneven": ({"fsdp": 4}, False, UNEVEN, UNEVEN_CFG),
        "cp2_tp2_sp_allgather": ({"cp": 2, "tp": 2}, True, None, CFG),
        "fsdp2_tp2_sp_mla": ({"fsdp": 2, "tp": 2}, True, None, MLA_CFG)},
}
CP_COMM = {"cp2_allgather": "allgather", "cp2_ring": "ring", "cp2_a2a": "a2a", "cp2_tp2_sp_allgather": "allgather",
           "cp2_allgather_mla": "allgather", "cp2_ring_mla": "ring", "cp2_a2a_mla": "a2a", "cp2_ring_mtp": "ring"}
FAMILIES = {gpt2.GPT2Config: "gpt2", llama.LlamaConfig: "llama", DeepseekV3Config: "deepseek_v3"}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def _plan(name, world):
    sizes, sp, overrides, cfg = LAYOUTS[world][name]
    model = build(FAMILIES[type(cfg)], cfg)
    return model, make_plan(model.specs, Rules(Rules.default(sp=sp).mapping, overrides or {}), MeshSpec(**sizes),
                            world=world, cp_comm=CP_COMM.get(name, "allgather"))


def _storage(t):
    from torch.distributed.tensor import DTensor

    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.untyped_storage()


def _loss(model, params, tokens, targets, rows, ctx):
    """The step's cross-entropy sums: the head's, and with multi-token prediction each
    module's on the tokens ahead (models/mtp.py's rows)."""
    if not rows:
        return ctx.cross_entropy_sum(model.forward(params, tokens, ctx), targets)
    depth = len(rows) // 2
    logits, depths = model.family.forward_mtp(model.cfg, params, tokens, ctx, (0, model.cfg.n_layers), True,
                                              [rows[f"mtp_tokens_{k}"] for k in range(1, depth + 1)])
    return ctx.cross_entropy_sum(logits, targets) + sum(
        ctx.cross_entropy_sum(out, rows[f"mtp_targets_{k}"]) for k, out in enumerate(depths, 1))


# Layouts also measured under train.activation_checkpointing offload: one process, the
# regathered weights (fsdp), tp, the sequence-parallel gathers kept as shards, both;
# multi-token prediction's module blocks (and MoE blocks: fsdp2_mtp_moe).
OFFLOADED = {"single_mtp", "fsdp2_mtp_moe", "single", "single_gpt2", "fsdp2", "tp2", "tp2_sp_qk_norm", "tp2_sp_gpt2", "fsdp2_tp2_sp", "dp2_fsdp2"}


def measure(world: int):
    """On every rank: each layout x precision (x offload, for OFFLOADED), one forward +
    backward of one micro-batch."""
    out = {}
    for name in LAYOUTS[world]:
        for mode in ("none", "offload") if name in OFFLOADED else ("none",):
            for precision, dtype in PRECISIONS.items():
                key = (name, precision) if mode == "none" else (name, precision, mode)
                out[key] = _measure_one(name, world, dtype, mode)
    return out


def _measure_one(name, world, dtype, mode):
    """State bytes and what autograd keeps on the device for one micro-batch: under
    offload, the saved storages its hooks did not move to host (models/offload.py's
    observe(); on CPU host and device are one memory, so the moves are counted, not the
    allocator), and "host": the bytes they moved."""
    from meshtrain.models.mtp import mtp_rows
    from meshtrain.models.offload import observe
    from meshtrain.models.policy import Policy
    from meshtrain.parallel.context import ShardedContext
    from meshtrain.layout.placements import local_tensor
    from meshtrain.train.optim import init_state

    model, plan = _plan(name, world)
    mesh = plan.mesh.build()
    params = init_params(plan, mesh, seed=0)
    ctx = ShardedContext(plan, mesh, Policy(dtype, checkpointing=mode))
    g = torch.Generator().manual_seed(0)
    batch = MICRO * plan.mesh.dp * plan.mesh.fsdp
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, SEQ), generator=g)
    targets = torch.randint(0, model.cfg.vocab_size, (batch, SEQ), generator=g)
    rows = mtp_rows(tokens, targets, model.cfg.mtp.depth) if getattr(model.cfg, "mtp", None) else {}
    before = {_storage(p).data_ptr() for p in params.values()}
    before |= {t.untyped_storage().data_ptr() for t in (tokens, targets, *rows.values())}
    kept, regathered, held = {}, {}, []

    def pack(t):
        held.append(t)  # no saved storage freed (offloaded) and its address reused while measuring
        s = _storage(t)
        ptr = s.data_ptr()
        instead = kept_instead(ctx, t)
        if instead and instead[0] == "shard":
            kept[_storage(instead[1]).data_ptr()] = (_storage(instead[1]).nbytes(), instead[1])
        elif instead:
            regathered[ptr] = s.nbytes()
        elif ptr not in before:
            kept[ptr] = (s.nbytes(), t)  # hold the tensor: its address stays unique
        return t

    with ctx.regather_in_backward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            observe() as moved:
        loss = _loss(model, params, tokens, targets, rows, ctx)
    loss.backward()
    state = init_state(params)
    moved = dict(moved)
    return {
        "params": sum(local_tensor(p).nbytes for p in params.values()),
        "grads": sum(local_tensor(p.grad).nbytes for p in params.values() if p.grad is not None),
        "optimizer": sum(local_tensor(t).nbytes for group in state.values() for t in group.values()),
        "activations": sum(n for ptr, (n, _) in kept.items() if ptr not in moved),
        "host": sum(n for ptr, (n, _) in kept.items() if ptr in moved),
        "regathered": sum(regathered.values()),
    }


@pytest.fixture(scope="module")
def measured():
    results = {}
    for world in LAYOUTS:
        for rank, per_layout in enumerate(run_ranks(measure, world, world)):
            for key, value in per_layout.items():
                results.setdefault((world, *key), []).append(value)
    return results


def _estimate(world, name, precision, **kw):
    model, plan = _plan(name, world)
    return per_rank_memory(plan, model, micro_batch=MICRO, seq_len=SEQ, precision=precision, **kw)


CASES = [(w, n, p) for w in LAYOUTS for n in LAYOUTS[w] for p in PRECISIONS]


@pytest.mark.parametrize("world,name,precision", CASES)
def test_state_bytes_match(measured, world, name, precision):
    """params + grads + optimizer: exact for the most loaded rank, no rank above it."""
    est = _estimate(world, name, precision)
    ranks = measured[(world, name, precision)]
    for key in ("params", "grads", "optimizer"):
        values = [r[key] for r in ranks]
        assert max(values) == est[key], (key, values, est[key])
    if name == "fsdp4_uneven":  # rank 0 holds 33 embedding rows, rank 3 holds 32
        assert ranks[0]["params"] > ranks[3]["params"]


@pytest.mark.parametrize("world,name,precision", CASES)
def test_activation_bytes_match(measured, world, name, precision):
    """Saved-for-backward bytes (eager), estimate vs hooks. Counted per saved tensor from
    the same shapes, so the tolerance is 0: any missing or extra tensor fails."""
    est = _estimate(world, name, precision)
    values = [r["activations"] for r in measured[(world, name, precision)]]
    assert max(values) == est["activations"], (values, est["activations"], est)
    # Gathered weights the runtime gathers again: what a step without resharding keeps.
    kept = _estimate(world, name, precision, traffic=Traffic(reshard_after_forward=False))
    regathered = max(r["regathered"] for r in measured[(world, name, precision)])
    assert kept["gathered_weights"] == regathered, (regathered, kept["gathered_weights"])


# Not planned exactly: bf16 copies of an MTP module's block weights, which the offload moves
# with its block, are counted on the device (weight_memory.py knows the layers' blocks only;
# measured 38544 bytes over here). Gathered (fsdp2_mtp_moe), there are no such copies.
OFFLOAD_CASES = [(w, n, p) for w in LAYOUTS for n in LAYOUTS[w] if n in OFFLOADED for p in PRECISIONS
                 if (n, p) != ("single_mtp", "bf16")]


@pytest.mark.parametrize("world,name,precision", OFFLOAD_CASES)
def test_offloaded_activation_bytes_match(measured, world, name, precision):
    """train.activation_checkpointing offload: what stays on the device (the saved
    storages the offload hooks did not move: the head's, the sequence-parallel shards the
    regather hooks keep) equals the estimate, tolerance 0; what they moved equals the
    estimate's drop from none (activations_offloaded); the state is untouched."""
    none = _estimate(world, name, precision)
    est = _estimate(world, name, precision, activation_checkpointing="offload")
    ranks = measured[(world, name, precision, "offload")]
    assert max(r["activations"] for r in ranks) == est["activations"], ([r["activations"] for r in ranks], est)
    assert max(r["host"] for r in ranks) == est["activations_offloaded"] == none["activations"] - est["activations"]
    assert est["activations_offloaded"] > 0.7 * none["activations"]
    for key in ("params", "grads", "optimizer"):
        assert max(r[key] for r in ranks) == est[key] == none[key], key
    # The host holds each block's copy of the tables the blocks keep (RoPE's), so a little more.
    assert est["host_activations"] + est["host_saved_weights"] >= est["activations_offloaded"]


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_optimizer_offload_moves_the_moments_off_the_device(precision):
    """train.optimizer_offload: the device's optimizer bytes are 0, the host holds them,
    and the peak drops by exactly them (nothing else changes)."""
    none = _estimate(2, "fsdp2", precision)
    est = _estimate(2, "fsdp2", precision, optimizer_offload=True, device="cuda")
    on_device = _estimate(2, "fsdp2", precision, device="cuda")
    assert est["optimizer"] == 0 and est["host_optimizer"] == none["optimizer"] == 2 * none["params"]
    assert on_device["peak"] - on_device["allocator_slack"] - (est["peak"] - est["allocator_slack"]) == \
        none["optimizer"]


@pytest.mark.alone
def test_llama3_405b_at_16384_ranks():
    model = build("llama", llama.PRESETS["llama3-405b"])
    # The planner's time, not a collection of what earlier tests left (timeit's way: CI
    # once measured 1.10 s here, late in the suite, where it takes 0.55 s cold alone).
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        plan = make_plan(model.specs, Rules.default(sp=True), MeshSpec(fsdp=-1, tp=8), world=16384)
        est = per_rank_memory(plan, model, micro_batch=1, seq_len=8192, precision="bf16", device="cuda")
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    assert elapsed < 1.0, elapsed
    assert plan.mesh.fsdp == 2048
    n = sum(p.spec.numel for p in plan.params.values())
    assert 4.0e11 < n < 4.1e11, n  # 405B
    # fp32 params, grads, exp_avg, exp_avg_sq: 16 bytes per parameter over every rank.
    state = est["params"] + est["grads"] + est["optimizer"]
    assert state == pytest.approx(16 * n / 16384, rel=0.02), state  # ~0.40 GB
    # Activations, first principles: Llama's textbook constant (docs/plan.md; Korthikanti
    # et al. 2022 with flash attention, RMSNorm, GQA and SwiGLU) of (12 + 4 g + 8 F / D)
    # bytes per token and unit of D in bf16, all divided by t under tp + sp (the sp
    # gathers keep their shard), plus one fp32 rsqrt per norm and the fp32 log-sum-exp
    # per head. g = kv heads / q heads.
    D, F, t, S, Hq, Hkv = 16384, 53248, 8, 8192, 128, 8
    textbook = (12 * D + 4 * D * Hkv // Hq + 8 * F) * S // t
    per_layer = textbook + (2 * 4 + 4 * Hq) * S // t
    assert est["activations_per_layer"] == per_layer
    # ~0.64 GB per layer, ~81 GB for 126 layers: 405B at seq 8192 needs checkpointing on
    # an 80 GB device.
    assert 0.6e9 < per_layer < 0.7e9
    res = S // t * D  # sequence-parallel residual elements
    full = per_rank_memory(plan, model, micro_batch=1, seq_len=8192, precision="bf16",
                           activation_checkpointing="full", device="cuda")
    assert full["activations_per_layer"] == 2 * res  # the layer input only
    assert full["peak"] < 80e9 < est["peak"]


# ----------------------------------------------------------------------------------------
# Mixture of experts, in one process on the fake process group (shapes are real, values
# are not). The activation estimate is the uniform-routing expectation (every rank's
# experts receive as many rows as it sends); no peer answers on the fake group, so the
# per-expert counts "received" are set to the ones sent, which is such a routing: then
# the estimate must be exact. Unlike `measure` above, a saved tensor counts as re-gathered
# only when the runtime would swap it (a DTensor view of a gathered parameter): router and
# expert weights are used as local tensors and stay kept.

MOE_MEMORY_CASES = [
    # id, moe, mesh sizes, sp, world, precision
    ("fsdp2-ep2-dense0-bf16", dict(shared_experts=1, z_loss_coef=1e-3, layers="1:"), {"fsdp": 2, "ep": 2}, False, 2,
     "bf16"),
    ("fsdp2xtp2-ep2-sp-all", dict(shared_experts=1, router="sigmoid", balance="aux_free", layers="all"),
     {"fsdp": 2, "tp": 2, "ep": 2}, True, 4, "fp32"),
    # DeepSeek-V3 (MLA; 8 experts in 4 groups, the best 2 eligible; a shared expert; block 0 dense)
    ("deepseek-fsdp2-ep2-bf16", None, {"fsdp": 2, "ep": 2}, False, 2, "bf16"),
    ("deepseek-fsdp2xtp2-ep2-sp", None, {"fsdp": 2, "tp": 2, "ep": 2}, True, 4, "fp32"),
]


def measure_moe(model, plan, precision, monkeypatch):
    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtrain.parallel.context import ShardedContext
    from meshtrain.layout.placements import local_tensor

    real = dist.all_to_all_single

    def mirrored(out, inp, *args, **kwargs):  # the counts exchange: receive what we send
        work = real(out, inp, *args, **kwargs)
        out.copy_(inp)
        return work

    def storage(t):
        t = t._local_tensor if isinstance(t, DTensor) else t
        return (t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t).untyped_storage()

    monkeypatch.setattr(dist, "all_to_all_single", mirrored)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.mesh.world)
    try:
        mesh = plan.mesh.build()
        params = init_params(plan, mesh, seed=0)
        ctx = ShardedContext(plan, mesh, PRECISIONS[precision])
        tokens = torch.randint(0, model.cfg.vocab_size, (MICRO * plan.mesh.dp * plan.mesh.fsdp, SEQ),
                               generator=torch.Generator().manual_seed(0))
        before = {storage(p).data_ptr() for p in params.values()} | {tokens.untyped_storage().data_ptr()}
        kept, regathered = {}, {}

        def pack(t):
            s = storage(t)
            instead = kept_instead(ctx, t)  # as the runtime: plain tensors too
            if instead and instead[0] == "shard":
                kept[storage(instead[1]).data_ptr()] = (storage(instead[1]).nbytes(), instead[1])
            elif instead:
                regathered[s.data_ptr()] = s.nbytes()
            elif s.data_ptr() not in before:
                kept[s.data_ptr()] = (s.nbytes(), t)
            return t

        with ctx.regather_in_backward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ctx.cross_entropy_sum(model.forward(params, tokens, ctx), tokens)
        return {"params": sum(local_tensor(p).nbytes for p in params.values()),
                "activations": sum(n for n, _ in kept.values()), "regathered": sum(regathered.values())}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", MOE_MEMORY_CASES, ids=[c[0] for c in MOE_MEMORY_CASES])
def test_moe_activation_bytes_match(case, monkeypatch):
    """Dense and MoE blocks (block 0 MoE too), ep over fsdp, experts split over tp, SP:
    saved-for-backward bytes equal the estimate at uniform routing, tolerance 0; rank 0's
    parameter bytes do not exceed the most loaded rank's."""
    from meshtrain.models.moe import MoeConfig

    _, moe, sizes, sp, world, precision = case
    if moe is None:
        model = build("deepseek_v3", deepseek.CFG)
    else:
        model = build("llama", llama.LlamaConfig(**{**CFG.__dict__, "moe": MoeConfig(num_experts=4, top_k=2,
                                                                                     expert_ffn_dim=32, **moe)}))
    plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=world)
    got = measure_moe(model, plan, precision, monkeypatch)
    est = per_rank_memory(plan, model, micro_batch=MICRO, seq_len=SEQ, precision=precision)
    assert got["activations"] == est["activations"], (got, est)
    assert got["params"] <= est["params"]
    kept = per_rank_memory(plan, model, micro_batch=MICRO, seq_len=SEQ, precision=precision,
                           traffic=Traffic(reshard_after_forward=False))
    assert kept["gathered_weights"] == got["regathered"]
    assert est["activations_per_moe_layer"] > 0


def test_mla_layer_under_each_checkpointing_mode_matches_the_allocator():
    """What one MLA block keeps (bench/layer_memory.py's allocator measure: the model at 2
    and 3 layers) under none / selective / full checkpointing, fp32 and bf16, one process
    and tp2 + sp, equals the planner's to the byte. On CPU its narrower values take the
    math kernel, whose matmuls (scores, output) selective checkpointing keeps; YaRN is left
    out here: its query gain is a float64 scalar autograd keeps (8 bytes a block, no
    tensor the planner counts)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import layer_memory

    cfg = dataclasses.replace(MLA_CFG, rope_scaling=None, dim=64, max_seq_len=128)
    family = "deepseek_v3"
    layer_memory.FAMILIES[family] = lambda n: dataclasses.replace(cfg, n_layers=n)
    try:
        for tp in (1, 2):
            cases = [(family, n, m, p, 2, 64, tp) for m in ("none", "selective", "full") for p in PRECISIONS
                     for n in (2, 3)]
            held = layer_memory._measure_all(cases, tp)
            for _, n, mode, precision, b, s, _ in cases[1::2]:
                measured = held[(family, n, mode, precision, b, s, tp)] - held[(family, n - 1, mode, precision, b, s, tp)]
                planner = []
                for layers in (n - 1, n):
                    model = build(family, layer_memory.FAMILIES[family](layers))
                    plan = layer_memory._plan(model, tp) or make_plan(model.specs, Rules.default(), MeshSpec(), world=1)
                    planner.append(per_rank_memory(plan, model, micro_batch=b, seq_len=s, precision=precision,
                                                   activation_checkpointing=mode)["activations"])
                assert planner[1] - planner[0] == measured, (tp, mode, precision, planner, measured)
    finally:
        del layer_memory.FAMILIES[family]
