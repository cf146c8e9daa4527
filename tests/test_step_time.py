"""The step-time model of `meshtrain plan` (estimate/step_time.py, step_work.py,
comm_time.py): each piece against a closed form on hand-made hardware where everything
but that piece is free, each switch moving the prediction the way its mechanism says,
and the `time` that `meshtrain plan --json` writes. Every case also checks that the
breakdown adds up to step_s and that tokens/s and MFU follow from it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtrain.cli import main
from meshtrain.config import RunConfig
from meshtrain.estimate.dryrun import dry_run
from meshtrain.estimate.hardware import Curve, Hardware, collective_terms
from meshtrain.estimate.hardware_builtins import BUILTINS
from meshtrain.estimate.step_time import ADAMW_BYTES
from meshtrain.estimate.step_work import MOE_LOAD
from meshtrain.pipeline.schedule import build_pipeline_schedule
from meshtrain.pipeline.simulate import simulate
from support.cli import ROOT
from support.configs import preset as preset_cfg
from support.step_time import FREE, hand, tiny, timed

H100 = BUILTINS["h100"]
P = 100.0  # TFLOP/s of the piece under test
FSDP2 = {"fsdp": 2, "nproc_per_node": 2}  # world 2 in one node
OPS = {"all_gather": "all_gather", "reduce_scatter_sum": "reduce_scatter", "all_reduce_sum": "all_reduce"}


def weights(cfg: RunConfig) -> tuple[int, int]:
    """(elements of one block's GEMM weights, the head's) of a dense Llama: q, k, v, o,
    gate, up, down; the head V x d. The embedding is a lookup: no GEMM."""
    m = cfg.model
    kv = m.n_kv_heads * m.dim // m.n_heads
    return 2 * m.dim**2 + 2 * kv * m.dim + 3 * m.ffn_dim * m.dim, m.vocab_size * m.dim


def priced(entries: list[dict], hw: Hardware, level: str = "intra_node") -> float:
    """Ring collectives on groups of 2 ranks: per entry count x latency steps + bytes x
    share / bandwidth (bytes: all calls together)."""
    link, total = hw.links[level], 0.0
    for e in entries:
        steps, share = collective_terms(OPS[e["op"]], 2)
        total += e["count"] * steps * link.latency_s + e["bytes"] * share / link.bandwidth
    return total


# --- the pieces against closed forms ---------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("sections, world, shards", [
    ({}, 1, 1), ({"parallel": FSDP2}, 2, 2), ({"parallel": {"fsdp": 1, "tp": 2}}, 2, 2),
    ({"model": {"tie_embeddings": True}}, 1, 1)], ids=["one-rank", "fsdp2", "tp2", "tied"])
def test_a_pure_matmul_step_is_its_gemm_flops_at_the_matmul_rate(precision, sections, world, shards):
    """Each trainable linear (out, in) on T tokens: 2 T out in forward, twice that
    backward (input and weight gradients); the head too (tied or not), the embedding's
    lookup none. fsdp splits the tokens, tp the weights."""
    cfg = tiny(**sections, train={"precision": precision})
    block, head = weights(cfg)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    flops = 6 * tokens * (cfg.model.n_layers * block + head) / shards
    t = timed(cfg, world, hand(mm=P))
    assert t["breakdown"]["matmuls"] == pytest.approx(flops / (P * 1e12), rel=1e-9)
    assert t["step_s"] == pytest.approx(flops / (P * 1e12), rel=1e-9)


def test_full_checkpointing_recomputes_the_blocks_forward_gemms_and_selective_none():
    """Full: each block's forward again (2 T out in per linear; not the head's).
    Selective keeps the GEMM outputs: on free element-wise work it recomputes nothing."""
    cfg = tiny(train={"activation_checkpointing": "full"})
    block, _ = weights(cfg)
    again = 2 * cfg.train.global_batch * cfg.train.seq_len * cfg.model.n_layers * block / (P * 1e12)
    base = timed(tiny(), 1, hand(mm=P))
    full = timed(cfg, 1, hand(mm=P))
    assert full["breakdown"]["recompute"] == pytest.approx(again, rel=1e-9)
    assert full["step_s"] == pytest.approx(base["step_s"] + again, rel=1e-9)
    sel = timed(tiny(train={"activation_checkpointing": "selective"}), 1, hand(mm=P))
    assert sel["breakdown"]["recompute"] < 1e-9 * again


def test_full_checkpointing_recomputes_the_blocks_forward_attention():
    """Attention alone priced: the recomputed forward is 2 T S d per layer (a third of
    forward and backward)."""
    cfg = tiny(train={"activation_checkpointing": "full"})
    tokens, m = cfg.train.global_batch * cfg.train.seq_len, cfg.model
    t = timed(cfg, 1, hand(attention=50.0))
    assert t["breakdown"]["recompute"] == pytest.approx(2 * tokens * 128 * m.dim * m.n_layers / 50e12, rel=1e-9)


def test_selective_checkpointing_relaunches_all_but_the_gemms_and_attention():
    """Each kernel costs the host's launch, nothing else: full relaunches every forward
    kernel of the blocks, selective all but each block's 7 GEMMs and its attention."""
    t = {mode: timed(tiny(train={"activation_checkpointing": mode}), 1, hand(launch=1e-5))
         for mode in ("selective", "full")}
    kept = 8 * tiny().model.n_layers * tiny().accumulation_steps(1) * 1e-5
    assert t["full"]["breakdown"]["recompute"] - t["selective"]["breakdown"]["recompute"] == \
        pytest.approx(kept, rel=1e-9)


def test_a_gemm_shorter_than_the_host_launch_waits_for_it_forward_and_backward():
    """Element-wise and attention free, each kernel at least the launch (10 us): GEMMs at
    1 TFLOP/s (the smallest 34 us) hide their launches, free GEMMs wait for 3 each (forward,
    input and weight gradients): 7 per block and the head, per micro-step."""
    cfg = tiny()
    slow, free = (timed(cfg, 1, hand(mm=mm, launch=1e-5))["breakdown"]["host_overhead"] for mm in (1.0, FREE))
    gemms = 7 * cfg.model.n_layers + 1
    assert free - slow == pytest.approx(3 * gemms * cfg.accumulation_steps(1) * 1e-5, rel=1e-9)


def test_a_host_that_runs_the_kernels_adds_every_launch_and_a_sharded_eager_step_its_own():
    """host_overlap false (a CPU): GEMMs at 1 TFLOP/s no longer hide their launches, each
    kernel adds one; on fsdp2 an eager step pays sharded_launch_s per kernel, a compiled
    one launch_s (its graph, no DTensor dispatch)."""
    cfg = tiny()
    ahead = hand(mm=1.0, launch=1e-5)
    cpu = dataclasses.replace(ahead, host_overlap=False)
    on_gpu, on_cpu = (timed(cfg, 1, hw)["breakdown"]["host_overhead"] for hw in (ahead, cpu))
    free = timed(cfg, 1, hand(launch=1e-5))["breakdown"]["host_overhead"]
    assert on_cpu == pytest.approx(free, rel=1e-9) and on_gpu < free
    sharded = dataclasses.replace(cpu, sharded_launch_s=3e-5)
    eager, compiled = (timed(tiny(parallel=FSDP2, train={"compile": c}), 2, sharded)["breakdown"]["host_overhead"]
                       for c in (False, True))
    plain = timed(tiny(parallel=FSDP2), 2, cpu)["breakdown"]["host_overhead"]
    assert eager == pytest.approx(3 * plain, rel=1e-9) and compiled < plain


@pytest.mark.parametrize("compile_", [False, True])
def test_the_optimizer_moves_its_bytes_per_held_element_at_the_memory_bandwidth(compile_):
    """AdamW over the rank's fsdp shard of every parameter (blocks' weights and 2 norms,
    the final norm, embedding and head), ADAMW_BYTES (an assumption) per element."""
    cfg = tiny(parallel=FSDP2, train={"compile": compile_})
    block, head = weights(cfg)
    m = cfg.model
    elements = (m.n_layers * (block + 2 * m.dim) + m.dim + 2 * head) / 2
    t = timed(cfg, 2, hand(memory=1e12))
    assert t["breakdown"]["optimizer"] == pytest.approx(ADAMW_BYTES[compile_] * elements / 1e12, rel=1e-9)


@pytest.mark.parametrize("axes, nproc, level", [({"fsdp": 2}, 2, "intra_node"), ({"fsdp": 2}, 1, "inter_node"),
                                                ({"dp": 2, "fsdp": 1}, 2, "intra_node")],
                         ids=["fsdp2-one-node", "fsdp2-two-nodes", "dp2"])
def test_a_pure_collective_step_waits_for_every_collective_without_prefetch(axes, nproc, level):
    """prefetch 0 hides nothing: the exposed comm is the sum of the dry run's own
    collectives, each on the link its group uses (one node, or two)."""
    cfg = tiny(parallel={**axes, "nproc_per_node": nproc, "prefetch": 0})
    hw = hand(intra=(3e-6, 100e9), inter=(20e-6, 10e9))
    t = timed(cfg, 2, hw)
    closed = priced(t["run"].collectives, hw, level)
    assert t["comm"] == pytest.approx(closed, rel=1e-9)
    assert t["step_s"] == pytest.approx(closed, rel=1e-9)  # the compute is free


def test_prefetch_waits_only_for_the_first_transfer_of_each_phase_behind_long_compute():
    """prefetch 1, compute outlasting every transfer: of a phase's n = buckets x
    micro-steps gathers (backward: with the reduce-scatters) only the first is waited for;
    the loss's and the grad norm's all-reduces are waited for whole."""
    cfg = tiny(parallel=FSDP2)
    hw = hand(mm=0.01, intra=(3e-6, 100e9))
    t = timed(cfg, 2, hw)
    run = t["run"]
    n = run.buckets["count"] * cfg.accumulation_steps(2)
    kind = {"forward": [], "backward": [], "reduce": []}
    for e in run.collectives:
        kind["reduce" if e["op"] == "all_reduce_sum" else e["phase"]].append(e)
    closed = (priced(kind["forward"], hw) + priced(kind["backward"], hw)) / n + priced(kind["reduce"], hw)
    assert t["comm"] == pytest.approx(closed, rel=1e-9)
    assert t["comm"] < priced(run.collectives, hw) / 5


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_compute_beside_a_gather_hides_the_hardwares_share_of_it(share):
    """comm_overlap: behind long compute each transfer after the first adds what the
    compute does not hide of it, (1 - share) of it; 0 waits for all, as prefetch 0 does."""
    cfg = tiny(parallel=FSDP2)
    hw = dataclasses.replace(hand(mm=0.01, intra=(3e-6, 100e9)), comm_overlap=share)
    t = timed(cfg, 2, hw)
    run = t["run"]
    n = run.buckets["count"] * cfg.accumulation_steps(2)
    phases = [[e for e in run.collectives if e["phase"] == p and e["op"] != "all_reduce_sum"]
              for p in ("forward", "backward")]
    reduce = priced([e for e in run.collectives if e["op"] == "all_reduce_sum"], hw)
    closed = sum(priced(es, hw) / n * (1 + (n - 1) * (1 - share)) for es in phases) + reduce
    assert t["comm"] == pytest.approx(closed, rel=1e-9)
    if share == 0:
        assert t["comm"] == pytest.approx(priced(run.collectives, hw), rel=1e-9)


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_cp_ring_sends_hide_behind_attention_by_the_hardwares_share(share):
    """cp's ring: its sends beside long attention are hidden (share 1) or waited whole
    (share 0); the rest of cp's traffic the same either way (prefetch 0: the weights'
    gathers over cp are all waited)."""
    cfg = tiny(parallel={"cp": 2, "fsdp": 1, "cp_comm": "ring", "nproc_per_node": 2, "prefetch": 0})
    base = hand(attention=0.001, intra=(3e-6, 100e9))
    t = {s: timed(cfg, 2, dataclasses.replace(base, comm_overlap=s)) for s in (share, 1.0)}
    link = base.links["intra_node"]
    ring = sum(e["count"] * link.latency_s + e["bytes"] / link.bandwidth
               for e in t[share]["run"].collectives if e["axis"] == "cp" and e["op"] == "recv")
    assert ring > 0
    assert t[share]["comm"] - t[1.0]["comm"] == pytest.approx(ring * (1 - share), rel=1e-9)


def _stage_costs(cfg: RunConfig, layout: list[int]) -> dict:
    """Per stage, on matmuls alone: F = 2 T x its weights, B = 2 F, W (weight grads) = F;
    the head on the last stage, the embedding nothing."""
    block, head = weights(cfg)
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    out = {}
    for s, n in enumerate(layout):
        f = 2 * tokens * (n * block + (head if s == len(layout) - 1 else 0)) / (P * 1e12)
        out[s] = {"F": f, "B": 2 * f, "W": f}
    return out


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2)])
def test_a_pipeline_step_is_the_simulated_schedule_of_its_stage_costs(schedule, virtual):
    layout = [2, 2] if virtual == 1 else [1, 1, 1, 1]
    cfg = tiny("tiny-pp2", parallel={"pp_schedule": schedule, "pp_virtual": virtual, "pp_layout": layout})
    m = cfg.accumulation_steps(1)
    result = simulate(build_pipeline_schedule(schedule, 2, m, virtual), stage_costs=_stage_costs(cfg, layout))
    last = max(range(2), key=lambda r: result.finish[r])  # the step is the rank that ends last's
    t = timed(cfg, 2, hand(mm=P))
    assert t["breakdown"]["pipeline_bubble"] == pytest.approx(result.finish[last] - result.busy[last], rel=1e-9)
    assert t["breakdown"]["matmuls"] == pytest.approx(result.busy[last], rel=1e-9)
    assert t["step_s"] == pytest.approx(result.step_time, rel=1e-9)


def test_attention_is_its_causal_flops_over_the_span_keys_at_the_attention_rate():
    """Causal q k^T and p v over `span` keys: 2 T span d forward, x3 with backward, per
    layer; a document mask spans the mean document, not the row."""
    whole = tiny()
    docs = tiny(data={"document_mask": True, "mean_doc_len": 32})
    for cfg, span in ((whole, 128), (docs, 32)):
        t = timed(cfg, 1, hand(attention=50.0))
        tokens = cfg.train.global_batch * cfg.train.seq_len
        closed = 6 * tokens * span * cfg.model.dim * cfg.model.n_layers / 50e12
        assert t["breakdown"]["attention"] == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("comm", ["ring", "allgather", "a2a"])
def test_cp_attention_runs_at_the_block_kernels_rate_where_the_hardware_has_one(comm):
    """Under cp the rank's causal share (half the layer's at cp 2) at block_attention's
    curve; without one, at the attention curve."""
    cfg = tiny(parallel={"cp": 2, "fsdp": 1, "cp_comm": comm, "nproc_per_node": 2})
    tokens = cfg.train.global_batch * cfg.train.seq_len
    closed = 6 * tokens * cfg.train.seq_len * cfg.model.dim * cfg.model.n_layers / 2
    plain = hand(attention=50.0)
    blocks = dataclasses.replace(plain, block_attention={d: Curve(20.0, 0.0) for d in plain.attention})
    assert timed(cfg, 2, plain)["breakdown"]["attention"] == pytest.approx(closed / 50e12, rel=1e-9)
    assert timed(cfg, 2, blocks)["breakdown"]["attention"] == pytest.approx(closed / 20e12, rel=1e-9)
    one = tiny()  # one rank: SDPA, whatever the block curve
    assert timed(one, 1, blocks)["breakdown"]["attention"] == timed(one, 1, plain)["breakdown"]["attention"]


def test_fp8_runs_the_blocks_gemms_at_the_fp8_rate_and_the_head_in_bf16():
    """fp8 at twice the bf16 rate: the blocks' GEMMs take half the time, the head's not."""
    cfg = tiny(train={"precision": "fp8"})
    block, head = weights(cfg)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    closed = 6 * tokens * (cfg.model.n_layers * block / (2 * P) + head / P) / 1e12
    assert timed(cfg, 1, hand(mm=P, fp8=2 * P))["breakdown"]["matmuls"] == pytest.approx(closed, rel=1e-9)


def test_unbalanced_routing_waits_for_the_busiest_expert():
    """balance none vs aux: each local expert's three GEMMs (dim x expert_ffn) on its
    expected routed rows (the ep group's tokens x top_k / E) times the busiest expert's
    load (MOE_LOAD: an assumption), per MoE layer ("1:") and micro-step."""
    cfg = tiny("tiny-moe")
    m, t, ep = cfg.model.moe, cfg.train, cfg.parallel.ep
    rows = ep * t.micro_batch * t.seq_len * m.top_k / m.num_experts
    gemms = 3 * 6 * m.expert_ffn_dim * cfg.model.dim * (m.num_experts // ep)
    delta = (MOE_LOAD["none"] - MOE_LOAD["aux"]) * rows * gemms * (cfg.model.n_layers - 1) * cfg.accumulation_steps(2)
    aux, none = (timed(tiny("tiny-moe", model={"moe": {"balance": b}}), 2, hand(mm=P)) for b in ("aux", "none"))
    got = none["breakdown"]["matmuls"] - aux["breakdown"]["matmuls"]
    assert got == pytest.approx(delta / (P * 1e12), rel=0.01)  # the model rounds rows up per expert


# --- each switch moves the prediction the way its mechanism says (h100) ----------------

def test_checkpointing_adds_recompute_full_more_than_selective():
    t = {mode: timed(tiny(parallel=FSDP2, train={"activation_checkpointing": mode, "precision": "bf16"}), 2)
         for mode in ("none", "selective", "full")}
    recompute = [t[mode]["breakdown"]["recompute"] for mode in ("none", "selective", "full")]
    assert recompute[0] == 0 < recompute[1] < recompute[2]
    assert t["none"]["step_s"] < t["selective"]["step_s"] < t["full"]["step_s"]
    for part in ("matmuls", "attention", "elementwise", "host_overhead"):  # the step's own work is unchanged
        assert t["full"]["breakdown"][part] == t["none"]["breakdown"][part]


def test_compile_fuses_elementwise_work_and_launches():
    eager, compiled = (timed(tiny(parallel=FSDP2, train={"compile": c, "precision": "bf16"}), 2) for c in (False, True))
    for part in ("elementwise", "host_overhead", "optimizer"):
        assert compiled["breakdown"][part] < eager["breakdown"][part], part
    assert compiled["breakdown"]["matmuls"] == eager["breakdown"]["matmuls"]
    assert compiled["step_s"] < eager["step_s"]


def test_prefetch_0_exposes_the_gathers_prefetch_hides():
    t = {n: timed(tiny(parallel={**FSDP2, "prefetch": n}), 2) for n in (0, 1)}
    assert t[0]["comm"] == pytest.approx(priced(t[0]["run"].collectives, H100), rel=1e-9)
    assert t[1]["comm"] < t[0]["comm"] / 2 and t[1]["step_s"] < t[0]["step_s"]


def test_bucket_param_waits_for_every_per_parameter_collective():
    block, param = (timed(tiny(parallel={**FSDP2, "bucket": b}), 2) for b in ("block", "param"))
    assert param["comm"] == pytest.approx(priced(param["run"].collectives, H100), rel=1e-9)
    assert param["comm"] > 10 * block["comm"] and param["step_s"] > block["step_s"]


def test_keeping_weights_after_forward_saves_the_backward_gathers():
    """Without prefetch (all waited for) the saving is the price of the backward gathers."""
    for prefetch in (0, 1):
        on, off = (timed(tiny(parallel={**FSDP2, "prefetch": prefetch, "reshard_after_forward": r}), 2)
                   for r in (True, False))
        assert off["comm"] < on["comm"] and off["step_s"] < on["step_s"]
        if prefetch == 0:
            regathers = [e for e in on["run"].collectives if e["op"] == "all_gather" and e["phase"] == "backward"]
            assert on["comm"] - off["comm"] == pytest.approx(priced(regathers, H100), rel=1e-6)


def test_unsharded_accumulation_reduce_scatters_once_per_step():
    """m = 2 micro-steps: one reduce-scatter per bucket instead of two; without prefetch
    the saving is half the reduce-scatters' price."""
    assert tiny(parallel=FSDP2).accumulation_steps(2) == 2
    for prefetch in (0, 1):
        sharded, unsharded = (timed(tiny(parallel={**FSDP2, "prefetch": prefetch, "fsdp_accumulate": a}), 2)
                              for a in ("sharded", "unsharded"))
        assert unsharded["comm"] < sharded["comm"]
        if prefetch == 0:
            rs = [e for e in sharded["run"].collectives if e["op"] == "reduce_scatter_sum"]
            assert sharded["comm"] - unsharded["comm"] == pytest.approx(priced(rs, H100) / 2, rel=1e-6)


def test_zero_1_and_2_move_less_parameter_traffic_than_zero_3():
    """Kept weights: gathered once per step; zero 1 also reduces once per step."""
    for prefetch in (0, 1):
        z = {n: timed(tiny(parallel={**FSDP2, "prefetch": prefetch, "zero": n}), 2)["comm"] for n in (1, 2, 3)}
        assert z[1] <= z[2] < z[3], (prefetch, z)
        if prefetch == 0:
            assert z[1] < z[2]


def test_pp_keep_gathered_saves_the_per_micro_batch_gathers():
    off, on = (timed(tiny("tiny-pp2", parallel={"fsdp": 2, "nproc_per_node": 4, "pp_keep_gathered": k}), 4)
               for k in (False, True))
    assert on["breakdown"]["exposed_comm"]["fsdp"] < off["breakdown"]["exposed_comm"]["fsdp"]
    assert on["step_s"] < off["step_s"]


def test_pipeline_schedules_order_their_bubbles_as_the_simulator_does():
    """At the same 4 micro-batches on 2 ranks: interleaved (2 stages a rank) and ZB-H1
    idle less than 1F1B, by the simulator with unit costs and by the model."""
    def bubble(schedule: str, v: int) -> tuple[float, float]:
        cfg = tiny("tiny-pp2", parallel={"pp_schedule": schedule, "pp_virtual": v})
        unit = simulate(build_pipeline_schedule(schedule, 2, cfg.accumulation_steps(1), v)).bubble
        return unit, timed(cfg, 2)["breakdown"]["pipeline_bubble"]

    one, inter, zb = bubble("1f1b", 1), bubble("interleaved", 2), bubble("zb", 1)
    assert inter[0] < one[0] and zb[0] < one[0]  # what the simulator says
    assert inter[1] < one[1] and zb[1] < one[1]
    assert 0 < inter[1] and 0 < zb[1]


def test_fp8_lowers_the_matmul_time_on_h100():
    """On llama3-1b (the tiny model's eager step on h100 waits for its launches, whatever
    the GEMMs' speed)."""
    bf16, fp8 = (timed(preset_cfg("llama3-1b", precision=p), 8) for p in ("bf16", "fp8"))
    assert fp8["breakdown"]["matmuls"] < 0.8 * bf16["breakdown"]["matmuls"] and fp8["step_s"] < bf16["step_s"]


def test_a_document_mask_lowers_attention_on_h100():
    whole, docs = (timed(tiny(parallel=FSDP2, data={"document_mask": d, "mean_doc_len": 32}), 2)
                   for d in (False, True))
    assert docs["breakdown"]["attention"] < whole["breakdown"]["attention"]


def test_unbalanced_routing_raises_the_moe_matmul_time_on_h100():
    aux, none = (timed(tiny("tiny-moe", model={"moe": {"balance": b}}), 2) for b in ("aux", "none"))
    assert none["breakdown"]["matmuls"] > aux["breakdown"]["matmuls"]


# --- meshtrain plan ------------------------------------------------------------------

def test_plan_json_writes_the_time_and_the_console_shows_the_step_time(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(ROOT / "configs" / "tiny.yaml"), "--world", "2", "--json", str(out)]) == 0
    time = json.loads(out.read_text())["time"]
    assert set(time) == {"hardware", "step_s", "tokens_per_s_per_gpu", "mfu", "breakdown", "hardware_given"}
    assert set(time["breakdown"]) == {"matmuls", "attention", "elementwise", "recompute", "host_overhead",
                                      "exposed_comm", "optimizer", "pipeline_bubble"}
    assert time["hardware"] == "h100" and time["hardware_given"] is False and time["step_s"] > 0
    assert time == dry_run(tiny(), 2).to_dict()["time"]
    text = capsys.readouterr().out
    assert "step time" in text and "h100, assumed" in text and "step time on h100 (modelled)" in text
