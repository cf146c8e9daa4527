"""`meshtrain plan` for parallel.pp_keep_gathered (estimate/pipeline.py `keep_gathered`):
a pp rank's parameter traffic once per step (gathers in the compute dtype, reductions in
fp32) instead of every micro-batch, and the
memory that costs, in closed form on the pp 2 x fsdp 2 Llama of tests/test_pipeline_plan.py;
and both sides in the dry run (JSON `pipeline.keep_gathered`, one block of the console
plan). Planner only: the runtime is checked against these counts elsewhere."""

from __future__ import annotations

import dataclasses
import math

import pytest

from meshtrain.estimate.dryrun import dry_run
from meshtrain.estimate.pipeline import pipeline_estimate
from meshtrain.layout.plan import without_pp
from meshtrain.layout.traffic import Traffic
from support.pipeline import PIPE_ROWS, PIPE_SEQ, pipe_model, pipe_plan, pipelined

FSDP = 2


def _estimate(keep: bool, m: int, precision: str = "fp32", **traffic):
    model = pipe_model(False)
    return pipeline_estimate(pipe_plan(model), model, pp_schedule="1f1b", virtual=1, layout=None,
                             micro_batch=PIPE_ROWS // FSDP, seq_len=PIPE_SEQ, micro_steps=m, precision=precision,
                             traffic=Traffic(keep_gathered=keep, **traffic), device="cpu")


def _entries(rank: dict) -> dict:
    return {(e["axis"], e["op"], e["phase"]): (e["count"], e["bytes"]) for e in rank["collectives"]}


def _gathered_fp32(rank: int) -> tuple[int, int]:
    """(buckets, bytes) of a pp rank's weights gathered whole over fsdp in fp32: each
    parameter's shard (the largest, rank 0's) times fsdp, 4 bytes an element; one bucket
    per block and one for what comes before (embedding) or after (final norm, head)."""
    model = pipe_model(False)
    sub = without_pp(pipe_plan(model))
    stage = _estimate(True, 2).stages[rank]
    names = stage.params + stage.shared
    return stage.n_layers + 1, sum(FSDP * math.prod(sub.params[n].local_shape) * 4 for n in names)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_weights_are_gathered_and_reduced_once_per_step(precision):
    """With keep_gathered, on "fsdp": one all-gather per bucket in forward (compute dtype)
    and one fp32 reduce-scatter per bucket in backward, whatever the micro-batch count, no
    gather in backward; without, m of each and the backward's gathers again. The loss's per-micro-batch all-reduce (last stage) is the same both ways."""
    for r in (0, 1):
        buckets, nbytes = _gathered_fp32(r)
        c = 2 if precision == "bf16" else 4
        for m in (2, 4):
            on, off = _estimate(True, m, precision).ranks[r], _estimate(False, m, precision).ranks[r]
            kept, each = _entries(on), _entries(off)
            assert kept[("fsdp", "all_gather", "forward")] == (buckets, nbytes * c // 4)
            assert kept[("fsdp", "reduce_scatter_sum", "backward")] == (buckets, nbytes)
            assert ("fsdp", "all_gather", "backward") not in kept
            assert on["param_bytes"] == nbytes + nbytes * c // 4
            assert each[("fsdp", "all_gather", "forward")] == (m * buckets, m * nbytes * c // 4)
            assert each[("fsdp", "reduce_scatter_sum", "backward")] == (m * buckets, m * nbytes)
            assert each[("fsdp", "all_gather", "backward")][0] > 0  # reshard_after_forward
            assert off["param_bytes"] > m * (1 + c / 4) * nbytes
            loss = ("fsdp", "all_reduce_sum", "forward")
            assert kept.get(loss) == each.get(loss) == ((m, 4 * m) if r == 1 else None)
            rest = lambda d: {k: v for k, v in d.items() if k[0] != "fsdp"}  # noqa: E731  (pp, world)
            assert rest(kept) == rest(each)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_weights_memory_in_closed_form(precision):
    """kept_weights = the rank's weights gathered, in the compute dtype; kept_grads = their
    fp32 sums. Nothing gathered is
    saved for backward, not even without resharding, and a micro-batch's backward has no
    communication buffers (its transient is its weight gradients, or the loss's); the
    release holds one bucket's reduction buffers (the packed fp32 gradients: the rank's
    largest bucket, gathered) beside the kept weights and sums, each bucket's sums dropped
    as its shards' gradients are made. The peak is the larger of the two phases."""
    for r in (0, 1):
        _, nbytes = _gathered_fp32(r)
        on, off = _estimate(True, 4, precision).ranks[r]["memory"], _estimate(False, 4, precision).ranks[r]["memory"]
        assert on["kept_weights"] * (2 if precision == "bf16" else 1) == on["kept_grads"] == nbytes
        assert off["kept_weights"] == off["kept_grads"] == off["release"] == 0
        assert on["gathered_weights"] == on["saved_weights"] == 0
        assert on["transient_backward"] < off["transient_backward"]
        assert off["comm_buffers"] > on["comm_buffers"] > 0
        assert on["release"] == on["comm_buffers"]  # each bucket's sums dropped as its shards' gradients are made
        state = on["params"] + on["optimizer"] + on["kept_weights"] + nbytes
        working = on["activations"] + on["recompute"] + on["transient"]
        assert on["peak"] == state + max(working, on["release"])
        assert off["peak"] == off["params"] + off["optimizer"] + off["grads"] + off["activations"] \
            + off["recompute"] + off["transient"]
        kept = _estimate(True, 4, precision, reshard_after_forward=False).ranks[r]["memory"]
        assert _estimate(False, 4, precision, reshard_after_forward=False).ranks[r]["memory"]["gathered_weights"] > 0
        assert kept["gathered_weights"] == 0 and kept["peak"] == on["peak"]


def _with(cfg, **parallel):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel)).validate()


def test_the_plan_weighs_both_sides():
    """The dry run of a pp x fsdp layout carries pipeline.keep_gathered: per side the most
    loaded pp rank's peak and parameter traffic, the configured side being the plan's own
    numbers; the console prints both. Without a gather dim (fsdp 1) or with bucket param:
    null."""
    cfg, world = pipelined(pp=4)
    runs = {keep: dry_run(_with(cfg, pp_keep_gathered=keep), world) for keep in (False, True)}
    for keep, run in runs.items():
        sides = run.to_dict()["pipeline"]["keep_gathered"]
        assert sides == runs[not keep].to_dict()["pipeline"]["keep_gathered"] | {"configured": sides["configured"]}
        assert sides["configured"] == ("on" if keep else "off")
        mine = sides[sides["configured"]]
        assert mine["peak_bytes"] == run.memory["peak"] and mine["pp_rank"] == run.memory["pp_rank"]
        rank = run.pipeline.ranks[mine["pp_rank"]]
        assert mine["param_bytes"] == rank["param_bytes"]
        text = run.render(width=80)
        assert "parallel.pp_keep_gathered, each way the pp rank with the highest peak:" in text
        assert f"{sides['configured']} (set)" in text
    off, kept = runs[False].to_dict()["pipeline"]["keep_gathered"]["off"], runs[True].memory
    # One gather of the rank's weights (kept_weights, compute dtype), one fp32 reduce-scatter
    # of their gradients' sums (kept_grads), and per block one all-reduce over tp of its two
    # norm weights' gradients (partial there under sequence parallelism), fp32 shards.
    layers, fsdp = runs[True].pipeline.most_loaded["layers"], without_pp(runs[True].plan).mesh.fsdp
    norms = _entries(runs[True].pipeline.most_loaded)[("tp", "all_reduce_sum", "backward")]
    assert norms == (layers, layers * 2 * cfg.model.dim // fsdp * 4)
    param_bytes = kept["kept_weights"] + kept["kept_grads"] + norms[1]
    assert runs[True].pipeline.most_loaded["param_bytes"] == param_bytes < off["param_bytes"]
    width = 2 if cfg.train.precision in ("bf16", "fp16", "fp8") else 1
    assert kept["peak"] > off["peak_bytes"] and kept["kept_grads"] == width * kept["kept_weights"] > 0
    assert dry_run(_with(cfg, bucket="param"), world).to_dict()["pipeline"]["keep_gathered"] is None
    no_gather = dry_run(_with(cfg, fsdp=1, dp=-1), world)
    assert no_gather.to_dict()["pipeline"]["keep_gathered"] is None
    assert "pp_keep_gathered" not in no_gather.render(width=80)
