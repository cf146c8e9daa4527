"""DeepSeek-V3 on every layout equals one process (fp32, gloo CPU ranks): loss and
gradient norm per step (rtol 1e-5, the clip below every norm) and the final parameters,
the aux-free expert bias included (atol 1e-5), over 4 steps of 2 micro-steps (the
pipelines 4) against one process taking each batch whole. One process itself equals
transformers' DeepseekV3ForCausalLM trained the same way (tests/test_deepseek_v3.py), so
each layout does too. Heads split over tp (MLA's latents and shared rotary key whole on
every tp rank), cp with its three exchanges (values narrower than keys), ep folded from
fsdp (x tp, x dp), a 2-stage pipeline with the dense block on one stage and the MoE
block on the other, checkpointing, packed documents, a multi-token prediction module
(its loss too; in a pipeline on the last stage), and compiled steps (aot_eager,
error_on_recompile, one loss graph and one update graph). The cases of a world size
share one launch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan, make_train_step
from meshtrain.models.spec import init_slice
from meshtrain.pipeline.partition import partition
from meshtrain.pipeline.schedule import build_pipeline_schedule
from meshtrain.testing import run_ranks
from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step
from support.deepseek import BATCH, CFG, CLIP, MTP_CFG, SEQ, batches, optimizer_args, single_process

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5
# name: (mesh sizes, sp, cp_comm, pipeline schedule, compile, activation checkpointing, variant): the
# variant "documents" packs documents into the rows, "mtp" adds a multi-token prediction module.
CASES = {
    2: {"fsdp2": ({"fsdp": 2}, False, "allgather", None, False, "none", "plain"),
        "tp2_sp": ({"tp": 2}, True, "allgather", None, False, "none", "plain"),
        "cp2_allgather": ({"cp": 2}, False, "allgather", None, False, "none", "plain"),
        "cp2_ring": ({"cp": 2}, False, "ring", None, False, "none", "plain"),
        "cp2_a2a": ({"cp": 2}, False, "a2a", None, False, "none", "plain"),
        "ep2": ({"fsdp": 2, "ep": 2}, False, "allgather", None, False, "none", "plain"),
        "pp2_1f1b": ({"pp": 2}, False, "allgather", "1f1b", False, "none", "plain"),
        "tp2_sp_selective": ({"tp": 2}, True, "allgather", None, False, "selective", "plain"),
        "ep2_full": ({"fsdp": 2, "ep": 2}, False, "allgather", None, False, "full", "plain"),
        "tp2_sp_documents": ({"tp": 2}, True, "allgather", None, False, "none", "documents"),
        "cp2_ring_documents": ({"cp": 2}, False, "ring", None, False, "none", "documents"),
        "fsdp2_compiled": ({"fsdp": 2}, False, "allgather", None, "aot_eager", "none", "plain"),
        "tp2_sp_compiled": ({"tp": 2}, True, "allgather", None, "aot_eager", "none", "plain"),
        "cp2_a2a_compiled": ({"cp": 2}, False, "a2a", None, "aot_eager", "none", "plain"),
        "ep2_compiled": ({"fsdp": 2, "ep": 2}, False, "allgather", None, "aot_eager", "selective", "plain"),
        "tp2_sp_mtp": ({"tp": 2}, True, "allgather", None, False, "none", "mtp"),
        "cp2_ring_mtp": ({"cp": 2}, False, "ring", None, False, "none", "mtp"),
        "ep2_mtp": ({"fsdp": 2, "ep": 2}, False, "allgather", None, False, "selective", "mtp"),
        "tp2_sp_mtp_compiled": ({"tp": 2}, True, "allgather", None, "aot_eager", "none", "mtp"),
        # the modules on the last stage, which embeds the tokens ahead with stage 0's table
        "pp2_1f1b_mtp": ({"pp": 2}, False, "allgather", "1f1b", False, "none", "mtp"),
        "pp2_zb_mtp_compiled": ({"pp": 2}, False, "allgather", "zb", "aot_eager", "none", "mtp")},
    4: {"fsdp2_tp2_sp": ({"fsdp": 2, "tp": 2}, True, "allgather", None, False, "none", "plain"),
        "dp2_fsdp2": ({"dp": 2, "fsdp": 2}, False, "allgather", None, False, "none", "plain"),
        "ep2_tp2_sp": ({"fsdp": 2, "tp": 2, "ep": 2}, True, "allgather", None, False, "none", "plain"),
        "ep4_fsdp2_cp2": ({"fsdp": 2, "cp": 2, "ep": 4}, False, "ring", None, False, "none", "plain"),
        "pp2_fsdp2_ep2_zb": ({"pp": 2, "fsdp": 2, "ep": 2}, False, "allgather", "zb", False, "none", "plain"),
        "fsdp2_tp2_sp_compiled": ({"fsdp": 2, "tp": 2}, True, "allgather", None, "aot_eager", "none", "plain"),
        "ep2_tp2_sp_mtp": ({"fsdp": 2, "tp": 2, "ep": 2}, True, "allgather", None, False, "none", "mtp"),
        "pp2_fsdp2_ep2_1f1b_mtp": ({"pp": 2, "fsdp": 2, "ep": 2}, False, "allgather", "1f1b", False, "none", "mtp")},
}
COMPILED_GRAPHS = 2  # the loss (forward and backward) and the update; a compiled pipeline: one per stage


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _case(world, sizes, sp, cp_comm, schedule, compile, checkpointing, variant):
    model = build("deepseek_v3", MTP_CFG if variant == "mtp" else CFG)
    plan = make_plan(model.specs, Rules.default(sp=sp), MeshSpec(**sizes), world=world, cp_comm=cp_comm)
    mesh = plan.mesh.build()
    if schedule is None:
        params = init_params(plan, mesh, seed=0)
        step = make_train_step(model, plan, mesh, compile=compile, activation_checkpointing=checkpointing,
                               **optimizer_args())
        micro = 2
    else:
        micro = 4
        stages = partition(model, sizes["pp"], seq_len=SEQ, micro_batch=BATCH // micro)
        mine, sub_plan, sub_mesh = local_stage_layout(plan, mesh, stages)
        params = init_params(sub_plan, sub_mesh, seed=0, names=mine) if sub_plan is not None else \
            {n: init_slice(model.specs[n], n, seed=0).requires_grad_(model.specs[n].trainable) for n in mine}
        step = make_pipeline_step(model, stages, build_pipeline_schedule(schedule, sizes["pp"], micro), plan, mesh,
                                  compile=compile, activation_checkpointing=checkpointing, **optimizer_args())
    state = TrainState.create(params)
    metrics = [step(state, b) for b in batches(micro, variant == "documents")]
    return _numbers(metrics), {n: _full(p).detach() for n, p in params.items()}


def _numbers(metrics):
    """Per step: loss, grad_norm (and mtp_loss with multi-token prediction)."""
    return [(m["loss"], m["grad_norm"], *([m["mtp_loss"]] if "mtp_loss" in m else [])) for m in metrics]


def _layouts():
    torch.set_num_threads(1)
    world, out = dist.get_world_size(), {}
    for name, case in CASES[world].items():
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            run = _case(world, *case)
        out[name] = run, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    return out


@pytest.fixture(scope="module")
def references():
    out = {}
    for variant in ("plain", "documents", "mtp"):
        metrics, params = single_process(documents=variant == "documents", cfg=MTP_CFG if variant == "mtp" else CFG)
        assert all(m["grad_norm"] > 1.5 * CLIP for m in metrics)  # clipping engages on every step
        out[variant] = _numbers(metrics), params
    # Each variant changes the run: a layout that dropped it fails on its losses (documents)
    # or its gradient norms (the module's gradients; mtp_loss is compared besides).
    for variant, column in (("documents", 0), ("mtp", 1)):
        ours, plain = out[variant][0][0][column], out["plain"][0][0][column]
        assert abs(ours - plain) > 100 * LOSS_RTOL * plain, variant
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_deepseek_layouts_match_single_process(references, world):
    held = {}
    for rank_out in run_ranks(_layouts, world):
        for name, ((metrics, params), graphs) in rank_out.items():
            ref_metrics, ref_params = references[CASES[world][name][-1]]
            got, want = torch.tensor(metrics), torch.tensor(ref_metrics)
            torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0, msg=lambda m: f"{name} loss, norm: {m}")
            for n, p in params.items():
                torch.testing.assert_close(p, ref_params[n], rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name} {n}: {m}")
            held.setdefault(name, set()).update(params)
            if CASES[world][name][4]:
                assert graphs == (1 if CASES[world][name][3] else COMPILED_GRAPHS), (name, graphs)
    for name, names in held.items():  # every parameter is checked, the pipelines' on their stages
        assert names == set(references[CASES[world][name][-1]][1]), name
