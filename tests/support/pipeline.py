"""Pipeline settings shared by the pipeline tests: the executor's steps, batch and
optimizer (tests/test_pipeline_exec.py, tests/test_keep_gathered.py, over the config and
batches of support/equivalence.py), and the planned and recorded pipelines
(tests/test_pipeline_plan.py, tests/test_keep_gathered_plan.py).
"""

from __future__ import annotations

import dataclasses

from meshtrain.models import build
from meshtrain.models.llama import LlamaConfig
from meshtrain.layout.mesh import MeshSpec
from meshtrain.layout.plan import make_plan
from meshtrain.layout.rules import Rules
from meshtrain.train.optim import AdamW
from meshtrain.train.lr_schedule import LRSchedule

from . import collectives, equivalence
from .configs import preset

# --- the executor against one process (tests/test_pipeline_exec.py) ----------------------

STEPS, BATCH = 4, 8
LLAMA4 = dataclasses.replace(equivalence.CFG, n_layers=4)


def lr_schedule():
    return LRSchedule(lr=3e-4, min_lr=3e-5, warmup_steps=2, total_steps=STEPS)


def adamw():
    return AdamW(lr=3e-4, weight_decay=0.1)


def loss_and_norm(metrics):
    return metrics["loss"], metrics["grad_norm"]


# --- planned pipelines (tests/test_pipeline_plan.py) --------------------------------------

def pipelined(name="llama3-70b", world=512, **parallel):
    """A preset with `parallel` (fsdp taking what the world leaves), validated, and its world."""
    cfg = preset(name, compile=False, activation_checkpointing="none")  # every schedule, zero-bubble included
    p = dataclasses.replace(cfg.parallel, fsdp=-1, **parallel)
    return dataclasses.replace(cfg, parallel=p).validate(), world


# The recorded pipelined steps (pp 2 x fsdp 2, a 4-block Llama, 2 micro-batches of 4 rows
# of 6 tokens): their model and plan.
PIPE_MICRO, PIPE_ROWS, PIPE_SEQ = 2, 4, 6


def pipe_model(tied: bool):
    """support/collectives.py's config with 4 blocks."""
    return build("llama", LlamaConfig(**{**collectives.CFG.__dict__, "tie_embeddings": tied, "n_layers": 4}))


def pipe_plan(model):
    return make_plan(model.specs, Rules.default(), MeshSpec(pp=2, fsdp=2), world=4)
