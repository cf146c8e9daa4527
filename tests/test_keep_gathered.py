"""parallel.pp_keep_gathered (parallel/keep_gathered.py): what it refuses, and bf16 steps
equal to the sharded pipeline's. Equivalence with one process in fp32 is in
test_pipeline_exec (the *_kept cases, eager and compiled); the collectives against a
recorded step in test_pipeline_plan; the memory trade in bench/keep_gathered_cpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtrain.errors import ConfigError
from meshtrain.testing import run_ranks
from support.configs import preset


def _with(cfg, **parallel):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


@pytest.mark.parametrize("parallel, words", [
    ({"pp": 1}, ["parallel.pp_keep_gathered", "parallel.pp is 1", "fsdp_accumulate unsharded"]),
    ({"pp": 2, "bucket": "param"}, ["parallel.pp_keep_gathered", "needs buckets", "parallel.bucket block"]),
    ({"pp": 2, "fsdp": 1}, ["parallel.pp_keep_gathered", "parallel.fsdp=1 and parallel.cp=1 shard none",
                            "parallel.fsdp > 1"]),
])
def test_refused_where_it_means_nothing(parallel, words):
    cfg = _with(preset("tiny"), pp_keep_gathered=True, **parallel)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert all(w in str(e.value) for w in words), str(e.value)


def test_accepted_on_a_pipeline():
    cfg = preset("tiny-pp2")
    _with(cfg, pp_keep_gathered=True, fsdp=2).validate()
    _with(cfg, pp_keep_gathered=True, fsdp=-1).validate()  # the world decides: a note where it takes 1 rank
    _with(cfg, pp_keep_gathered=True, fsdp=1, cp=2).validate()  # cp shards the weights too


# name: (schedule, precision, parallel.bucket)
CASES = {
    "zb bf16": ("zb", "bf16", "block"),
    # 0.05 MB buckets: one holds the last weight of stage 0 and the first ones of stage 1.
    "gpipe buckets across the stage boundary": ("gpipe", "fp32", 0.05),
}


def _steps(names, compile):
    """Per case, the losses and norms of pp 2 x fsdp 2, sharded then kept."""
    from meshtrain import MeshSpec, Rules, TrainState, build, init_params, make_plan
    from meshtrain.pipeline.partition import partition
    from meshtrain.pipeline.schedule import build_pipeline_schedule
    from meshtrain.train.pipeline_step import local_stage_layout, make_pipeline_step
    from support.equivalence import GRAD_CLIP, SEQ, batches
    from support.pipeline import BATCH, LLAMA4, STEPS, adamw, loss_and_norm, lr_schedule

    torch.set_num_threads(1)
    out = {}
    for name in names:
        schedule, precision, bucket = CASES[name]
        for kept in (False, True):
            torch._dynamo.reset()
            model = build("llama", LLAMA4)
            plan = make_plan(model.specs, Rules.default(), MeshSpec(pp=2, fsdp=2), world=4)
            mesh = plan.mesh.build()
            stages = partition(model, 2, 1, None, seq_len=SEQ, micro_batch=BATCH // 4)
            params, sub_plan, sub_mesh = local_stage_layout(plan, mesh, stages)
            step = make_pipeline_step(model, stages, build_pipeline_schedule(schedule, 2, 4), plan, mesh,
                                      precision=precision, optimizer=adamw(), lr_schedule=lr_schedule(),
                                      grad_clip=GRAD_CLIP, bucket=bucket, keep_gathered=kept, compile=compile)
            state = TrainState.create(init_params(sub_plan, sub_mesh, seed=0, names=params))
            out[name, kept] = [loss_and_norm(step(state, b)) for b in batches(4, STEPS)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_kept_equals_sharded(compile):
    """The weights are gathered in fp32 and cast per use, the gradients summed in fp32 and
    reduced once: the same losses and norms as the sharded pipeline's (rtol 1e-6: the
    micro-batches' gradients are added before the reduction instead of after), in bf16
    (one bf16 process differs by ~1e-5, test_pipeline_exec's bound) and with size buckets
    that span the stage boundary (each rank's weights of such a bucket are gathered with
    it and reduced once, not twice: 14% off the norm when they were reduced twice)."""
    names = list(CASES) if not compile else ["zb bf16"]
    for rank in run_ranks(_steps, 4, names, compile):
        for name in names:
            torch.testing.assert_close(torch.tensor(rank[name, True]), torch.tensor(rank[name, False]), rtol=1e-6,
                                       atol=0, msg=lambda m: f"{name}: {m}")
