"""Fuzzing the config validation of `meshtrain fit`: hundreds of invalid configs, each one
mutation of a valid base config (configs/tiny*.yaml), through the real command line in
this process (`meshtrain.cli.main`, one parser built once).

Every case must: exit 2 (ConfigError/DataError printed by main, or a jsonargparse type
error's SystemExit(2)); print a short message without a traceback that names the
mutated key and the offending value; leave an existing run_dir exactly as it was; and
start no rank (`meshtrain.run.launch.launch` and the single-process `_Run` are replaced by
functions that fail the test). The generator is deterministic (seeded `random`).

Categories: type (wrong types for ints, floats, bools, strings), range (0, negative,
NaN, inf, huge, values outside a documented interval), choice (unknown choices), unknown
(unknown keys, as flags and in the YAML file), shape (sections and structured values of
the wrong shape), cross (rules between fields), file (paths checked before launch).
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import hashlib
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import meshtrain.run.launch
import meshtrain.run.fit as fit_module
from meshtrain import cli
from meshtrain.config import RunConfig, schema
from meshtrain.errors import ConfigError
from meshtrain.models.mla import MlaConfig
from meshtrain.models.moe import MoeConfig
from meshtrain.models.mtp import MtpConfig
from meshtrain.train.config import MuonConfig
from meshtrain.train.loss_scale import LossScaleConfig

ROOT = Path(__file__).resolve().parent.parent
BASES = ("tiny", "tiny-4proc", "tiny-moe", "tiny-pp2", "tiny-cp2")
MULTI_RANK = ("tiny-4proc", "tiny-moe", "tiny-pp2", "tiny-cp2")
SEED = 1010
HUGE = str(10**30)


@dataclass(frozen=True)
class Case:
    category: str
    base: str
    key: str  # the field the message must name
    values: tuple[str, ...]  # the offending value, as the message may show it (any one)
    flags: tuple[str, ...] = ()
    edits: tuple[tuple[tuple[str, ...], object], ...] = ()  # (path, value) set in a copy of the base YAML

    @property
    def id(self) -> str:
        what = " ".join(self.flags) or " ".join(f"{'.'.join(p)}={v!r}" for p, v in self.edits)
        return f"{self.category}-{self.base}-{what}"[:120]


def _shown(text: str, *extra: str) -> tuple[str, ...]:
    """How a message may show the value written as `text` on the command line or in YAML."""
    forms = {text, *extra}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    forms |= {str(value), repr(value)}
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:
        forms |= {str(number), repr(number)} | ({str(int(number))} if number.is_integer() else set())
    return tuple(sorted(f for f in forms if f))


def _flag(key: str, text: str) -> str:
    return f"--{key}={text}"  # one argv element: negative numbers are not taken for options


def _case(category, base, key, text, *more_flags, via_yaml=False, values=None) -> Case:
    values = values or _shown(text)
    if via_yaml:
        return Case(category, base, key, values, tuple(more_flags), ((tuple(key.split(".")), yaml.safe_load(text)),))
    return Case(category, base, key, values, (_flag(key, text), *more_flags))


# --- the fields ----------------------------------------------------------------------------

def schema_fields() -> list[tuple[str, str]]:
    """(dotted key, annotation) of every leaf field: the top level, each section, model.moe,
    model.mla, model.mtp, train.loss_scale."""
    out = [(f.name, f.type) for f in dataclasses.fields(RunConfig) if f.name not in schema.SECTIONS]
    for section, cls in schema.SECTIONS.items():
        out += [(f"{section}.{f.name}", f.type) for f in dataclasses.fields(cls)]
    for name, cls in (("model.moe", MoeConfig), ("model.mla", MlaConfig), ("model.mtp", MtpConfig),
                      ("train.loss_scale", LossScaleConfig), ("train.muon", MuonConfig)):
        out += [(f"{name}.{f.name}", f.type) for f in dataclasses.fields(cls)]
    return out


INT_MIN = {"seed": 0, "model.head_dim": 2, "train.warmup_steps": 0, "train.eval_every": 0, "train.max_skipped": 0,
           "train.stop_at": 0, "checkpoint.every": 0, "model.moe.shared_experts": 0, "parallel.prefetch": 0,
           "data.mean_doc_len": 0, "model.mla.qk_rope_head_dim": 2, "model.mtp.depth": 0}
FILL_AXES = ("parallel.dp", "parallel.fsdp", "parallel.tp")  # may be -1
HUGE_IS_VALID = {"seed", "train.steps", "train.global_batch", "train.log_every", "train.eval_every",
                 "train.eval_batches", "train.max_skipped", "train.stop_at", "checkpoint.every", "checkpoint.keep_last",
                 "train.loss_scale.growth_interval"}  # huge: the scale never grows
# Numbers outside each float's interval (NaN and infinities are added for all).
FLOAT_BAD = {
    "model.rope_theta": ["0", "-10000"], "model.norm_eps": ["0", "-1e-05"],
    "parallel.collective_timeout_s": ["0", "-5", "1e+300"], "parallel.watchdog_s": ["-1", "900", "1e+299"],
    "train.lr": ["0", "-0.0003"], "train.min_lr": ["-3e-05", "1.0"], "train.weight_decay": ["-0.1"],
    "train.grad_clip": ["-1"], "train.spike_factor": ["-1", "0.5", "1"], "data.valid_fraction": ["-0.1", "1", "1.5"],
    "model.moe.aux_coef": ["-0.01"], "model.moe.z_loss_coef": ["-1"], "model.moe.capacity_factor": ["0", "-1.25"],
    "model.moe.route_scale": ["0", "-2.5"], "model.moe.bias_update_rate": ["-0.001"],
    "model.mtp.loss_coef": ["-0.3"],
    "train.loss_scale.init_scale": ["0", "-65536"], "train.loss_scale.growth_factor": ["0.5", "-2"],
    "train.loss_scale.backoff_factor": ["0", "1", "1.5"], "train.loss_scale.min_scale": ["0", "-1", "1e+300"],
    "train.muon.lr": ["0", "-0.02"], "train.muon.momentum": ["-0.1", "1", "1.5"], "train.muon.weight_decay": ["-0.1"],
}
CHOICES = {"model.arch": "llama", "parallel.cp_comm": "ring", "parallel.pp_schedule": "1f1b",
           "train.lr_schedule": "cosine", "train.precision": "bf16", "train.fp8_recipe": "rowwise",
           "train.activation_checkpointing": "full", "train.nonfinite": "skip", "model.moe.router": "sigmoid",
           "model.moe.balance": "aux_free", "parallel.fsdp_accumulate": "unsharded", "train.optimizer": "muon",
           "train.muon.adjust_lr": "original"}
# Fields with hand-written cases below (structured or free-form values).
SPECIAL = {"run_dir", "model.init_from", "model.rope_scaling", "model.moe", "model.moe.layers", "model.mla", "model.mtp",
           "train.loss_scale", "train.muon",
           "parallel.pp_layout",
           "parallel.bucket",
           "data.paths", "data.tokenizer", "checkpoint.resume"}


def _bases_for(key: str) -> tuple[str, ...]:
    if key.startswith(("model.mla.", "model.mtp.")):
        return ("tiny-deepseek",)
    return ("tiny-moe",) if key.startswith("model.moe.") else BASES


def field_cases(rng: random.Random) -> list[Case]:
    """Per leaf field: wrong types, values out of range, unknown choices; each on a base
    drawn at random, a third of them written into the YAML file instead of a flag."""
    cases = []
    for key, kind in schema_fields():
        if key in SPECIAL:
            continue
        bases = _bases_for(key)

        def base():
            return rng.choice(bases)

        def via_yaml():
            return rng.random() < 0.3

        nullable = "None" in kind
        if kind.startswith("int"):
            bad_types = ["abc", "1.5", "true", "[1, 2]", "{a: 1}"] + ([] if nullable else ["null"])
            cases.append(_case("type", base(), key, rng.choice(bad_types), via_yaml=via_yaml()))
            if key in FILL_AXES:
                below = ["0", rng.choice(["-2", str(rng.randint(-10**6, -3))])]
            else:
                low = INT_MIN.get(key, 1)
                below = [str(low - 1)] + ([str(rng.randint(-10**6, low - 2))] if rng.random() < 0.25 else [])
            for text in below:
                cases.append(_case("range", base(), key, text, via_yaml=via_yaml()))
            if key not in HUGE_IS_VALID:
                cases.append(_case("range", base(), key, rng.choice([HUGE, str(2**63), str(2**31)]),
                                   via_yaml=via_yaml()))
        elif kind.startswith("float"):
            text = rng.choice(["abc", "true", "[0.5]", "{a: 1}", "nan", "inf"])
            cases.append(_case("type", base(), key, text))  # jsonargparse rejects these spellings
            text = rng.choice([".nan", ".inf", "-.inf"])  # YAML's spellings: they reach validate()
            cases.append(_case("range", base(), key, text, via_yaml=via_yaml()))
            for text in rng.sample(FLOAT_BAD[key], min(2, len(FLOAT_BAD[key]))):
                cases.append(_case("range", base(), key, text, via_yaml=via_yaml()))
        elif kind == "bool":
            text = rng.choice(["maybe", "2", "[true]", "0.5", "{a: 1}", "null"])
            cases.append(_case("type", base(), key, text))
            cases.append(_case("type", base(), key, "1", via_yaml=True))  # an int in YAML is no bool
        elif key in CHOICES:
            good = CHOICES[key]
            text = rng.choice([good.upper(), good[:-1], good + "2", "16", "[" + good + "]", "null"])
            cases.append(_case("choice", base(), key, text))
            if rng.random() < 0.5:
                cases.append(_case("choice", base(), key, "3", via_yaml=True))  # a number in YAML is no string
            else:
                cases.append(_case("choice", base(), key, "null", via_yaml=True, values=("None",)))
        else:
            raise AssertionError(f"no mutations for {key}: {kind}")
    return cases


# --- structured values, unknown keys, section shapes, files -----------------------------------

RS = "model.rope_scaling"
GOOD_SCALING = "factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192"


def special_cases() -> list[Case]:
    c = []
    # model.rope_scaling
    for base, text, key, values in [
        ("tiny", "[1]", RS, None), ("tiny-pp2", "5", RS, None), ("tiny-cp2", "{a: 1}", RS, None),
        ("tiny", "{factor: 8}", RS, None),
        ("tiny-4proc", "{" + GOOD_SCALING.replace("factor: 8,", "factor: 0.5,", 1) + "}", RS + ".factor", ("0.5",)),
        ("tiny", "{" + GOOD_SCALING.replace("factor: 8,", "factor: -8,", 1) + "}", RS + ".factor", ("-8",)),
        ("tiny-moe", "{" + GOOD_SCALING.replace("factor: 8,", "factor: .nan,", 1) + "}", RS + ".factor", ("nan",)),
        ("tiny", "{" + GOOD_SCALING.replace("low_freq_factor: 1", "low_freq_factor: 4") + "}",
         RS + ".low_freq_factor", ("4",)),
        ("tiny-pp2", "{" + GOOD_SCALING.replace("high_freq_factor: 4", "high_freq_factor: 1") + "}",
         RS + ".high_freq_factor", ("1",)),
        ("tiny", "{" + GOOD_SCALING.replace("8192", "8192.5") + "}", RS + ".original_max_position_embeddings",
         ("8192.5",)),
        ("tiny-cp2", "{" + GOOD_SCALING.replace("8192", "abc") + "}", RS + ".original_max_position_embeddings",
         ("abc",)),
    ]:
        c.append(_case("shape" if key == RS else "range", base, RS, text, values=values))
        if key != RS:
            c[-1] = dataclasses.replace(c[-1], key=key)
    c.append(Case("cross", "tiny", RS, ("gpt2",), (_flag(RS, "{" + GOOD_SCALING + "}"), "--model.arch=gpt2",
                                                     "--model.n_kv_heads=null", "--model.rope_theta=null")))
    # parallel.pp_layout (list[int] | None)
    for base, text, via_yaml in [("tiny", "{a: 1}", False), ("tiny-pp2", "[]", False), ("tiny-pp2", "[0, 4]", False),
                                 ("tiny-pp2", "[1.5, 2.5]", False), ("tiny-pp2", "[a, b]", True),
                                 ("tiny-pp2", "[-1, 5]", True), ("tiny-pp2", "[true, 3]", True),
                                 ("tiny-pp2", "7", True)]:
        element = str(yaml.safe_load(text)[0]) if text.startswith("[") and text != "[]" else text
        c.append(_case("shape", base, "parallel.pp_layout", text, via_yaml=via_yaml,
                       values=_shown(text, f"[0]={element}")))
    # parallel.bucket (block | param | a size in MB)
    for base, text, via_yaml in [("tiny-4proc", "blocks", False), ("tiny", "0", False), ("tiny-cp2", "-25", True),
                                 ("tiny-4proc", ".nan", True), ("tiny-pp2", "[25]", False), ("tiny", "true", True),
                                 ("tiny-4proc", "null", True)]:
        c.append(_case("choice", base, "parallel.bucket", text, via_yaml=via_yaml))
    # model.moe.layers (str | list[int]); in YAML, where "1:" stays a string
    for text in ["'9:'", "[99]", "[1, 1]", "[true]", "'x:'", "[]"]:
        c.append(_case("shape", "tiny-moe", "model.moe.layers", text, via_yaml=True,
                       values=_shown(text, str(yaml.safe_load(text)).strip("'"))))
    # model.moe, model.mla and model.mtp as a whole
    for base, text, via_yaml in [("tiny", "5", False), ("tiny-moe", "[8, 2]", False), ("tiny-moe", "5", True),
                                 ("tiny", "[1]", True), ("tiny-moe", "abc", True)]:
        c.append(_case("shape", base, "model.moe", text, via_yaml=via_yaml))
    for key, text, via_yaml in [("model.mla", "5", False), ("model.mla", "[1]", True), ("model.mtp", "abc", True),
                                ("model.mtp", "[1, 0.3]", False)]:
        c.append(_case("shape", "tiny-deepseek", key, text, via_yaml=via_yaml))
    for base, text, via_yaml in [("tiny", "5", False), ("tiny-4proc", "[1024]", True), ("tiny-pp2", "abc", True)]:
        c.append(_case("shape", base, "train.loss_scale", text, via_yaml=via_yaml))
    # data.paths (Any), data.tokenizer, checkpoint.resume, model.init_from (free strings)
    for base, text, shown in [("tiny", "{a: 1}", None), ("tiny-4proc", "5", None), ("tiny", "[]", None),
                              ("tiny-pp2", "[[0.5]]", "[0.5]"), ("tiny-cp2", "[[-1, builtin]]", "is -1"),
                              ("tiny", "[[0, a], [1, b]]", "of 'a' is 0"), ("tiny-moe", "[[.nan, builtin]]", "is nan")]:
        c.append(_case("shape", base, "data.paths", text, values=_shown(text, *([shown] if shown else []))))
    c.append(_case("shape", "tiny", "data.paths", "null", via_yaml=True))
    for key, base in [("data.tokenizer", "tiny"), ("checkpoint.resume", "tiny-pp2"), ("model.init_from", "tiny-cp2")]:
        c.append(_case("range", base, key, "", values=("''",)))  # --key= : the empty string
        c.append(_case("type", base, key, "[1, 2]", via_yaml=True))
    # unknown keys, as flags and in the file
    for base, key in [("tiny", "train.stpes"), ("tiny-4proc", "model.dimm"), ("tiny-pp2", "parallel.tpp"),
                      ("tiny-cp2", "checkpoint.evry"), ("tiny", "data.pahts"), ("tiny-moe", "trainer.steps"),
                      ("tiny", "foo"), ("tiny-moe", "model.moe.expertz"), ("tiny-pp2", "train.nonfinte"),
                      ("tiny-4proc", "parallel.watchdogs"), ("tiny", "train.muon.nesterof")]:
        c.append(Case("unknown", base, key, (key, key.rsplit(".", 1)[-1]), (_flag(key, "3"),)))
    for base, path in [("tiny", ("train", "stpes")), ("tiny-4proc", ("model", "n_head")),
                       ("tiny-pp2", ("parallel", "world_size")), ("tiny-cp2", ("optimizer",)),
                       ("tiny", ("data", "tokeniser")), ("tiny-moe", ("model", "moe", "num_expert")),
                       ("tiny", ("checkpoint", "every_steps")), ("tiny-cp2", ("train", "loss_scale", "initial")),
                       ("tiny-4proc", ("train", "muon", "betas"))]:
        key = ".".join(path)
        c.append(Case("unknown", base, key, (key, path[-1]), (), ((path, 3),)))
    c.append(Case("unknown", "tiny-4proc", "train.stpes", ("train.stpes",), ("--train={stpes: 3}",)))
    c.append(Case("unknown", "tiny", "train.loss_scale.scale", ("train.loss_scale.scale",), ("--train.loss_scale.scale=3",)))
    # sections of the wrong shape
    for base, key, text in [("tiny", "train", "5"), ("tiny-4proc", "model", "[1, 2]"), ("tiny-pp2", "parallel", "abc"),
                            ("tiny-cp2", "checkpoint", "null"), ("tiny-moe", "data", "7"), ("tiny", "train.muon", "5")]:
        c.append(_case("shape", base, key, text))
    for base, key, text in [("tiny", "train", "5"), ("tiny-4proc", "model", "[1, 2]"), ("tiny-pp2", "parallel", "null"),
                            ("tiny-cp2", "checkpoint", "abc"), ("tiny-moe", "data", "[builtin]")]:
        c.append(_case("shape", base, key, text, via_yaml=True))
    # paths that do not exist, checked before the ranks start
    c += [_case("file", "tiny-4proc", "data.paths", "/nonexistent/meshtrain_fuzz_prefix"),
          _case("file", "tiny-pp2", "data.tokenizer", "/nonexistent/tokenizer.json"),
          _case("file", "tiny-cp2", "checkpoint.resume", "/nonexistent/checkpoints/step_00000010"),
          _case("file", "tiny-moe", "model.init_from", "/nonexistent/hf_model")]
    return c


# --- rules between fields ------------------------------------------------------------------------

def _x(base: str, *assignments: str, key: str | None = None, value: str | None = None) -> Case:
    """A cross-field case: `key=value` flags; the message must name `key` (default: the first)."""
    first_key, first_value = assignments[0].split("=", 1)
    key, value = key or first_key, value if value is not None else first_value
    return Case("cross", base, key, _shown(value), tuple(_flag(*a.split("=", 1)) for a in assignments))


CROSS = [
    # batch: global_batch = micro_batch x data-parallel size x accumulation
    _x("tiny", "train.global_batch=10"), _x("tiny", "train.micro_batch=3"), _x("tiny", "train.micro_batch=32"),
    _x("tiny", "parallel.dp=8"), _x("tiny-4proc", "train.global_batch=12"), _x("tiny-4proc", "train.micro_batch=16"),
    _x("tiny", "parallel.nproc_per_node=8"),  # fsdp=-1 takes 8 ranks: 16 % (4 x 8)
    _x("tiny", "parallel.nproc_per_node=2", "train.global_batch=12"),
    _x("tiny-moe", "train.global_batch=12", "parallel.fsdp=-1"),
    # sequence
    _x("tiny", "train.seq_len=512"), _x("tiny", "model.max_seq_len=64"),
    _x("tiny-4proc", "train.seq_len=127"), _x("tiny-cp2", "train.seq_len=126"), _x("tiny-cp2", "train.seq_len=130"),
    _x("tiny", "parallel.cp=2", "parallel.nproc_per_node=2", "train.seq_len=126", key="train.seq_len", value="126"),
    _x("tiny", "parallel.tp=2", "parallel.sp=true", "parallel.nproc_per_node=2", "train.seq_len=127",
       key="train.seq_len", value="127"),
    _x("tiny-cp2", "train.seq_len=132", "parallel.tp=4", "parallel.sp=true", "parallel.nproc_per_node=8"),
    # the mesh against the world
    _x("tiny-4proc", "parallel.nproc_per_node=8"), _x("tiny-4proc", "parallel.nproc_per_node=2"),
    _x("tiny-4proc", "parallel.nproc_per_node=1"), _x("tiny-4proc", "parallel.tp=4"),
    _x("tiny-4proc", "parallel.fsdp=4"), _x("tiny-4proc", "parallel.dp=2"), _x("tiny-4proc", "parallel.cp=2"),
    _x("tiny-moe", "parallel.nproc_per_node=4"), _x("tiny-pp2", "parallel.nproc_per_node=4"),
    _x("tiny-pp2", "parallel.nproc_per_node=1"), _x("tiny-cp2", "parallel.nproc_per_node=4"),
    _x("tiny", "parallel.pp=2"), _x("tiny", "parallel.cp=2"), _x("tiny", "parallel.tp=4", "parallel.nproc_per_node=6"),
    _x("tiny", "parallel.dp=-1"), _x("tiny-4proc", "parallel.fsdp=-1", "parallel.tp=-1"),
    _x("tiny-moe", "parallel.fsdp=1"),
    # splits of the model over tp, ep, cp
    _x("tiny", "parallel.tp=3"), _x("tiny-4proc", "parallel.tp=8", "parallel.fsdp=1", "parallel.nproc_per_node=8"),
    _x("tiny-4proc", "model.vocab_size=515"), _x("tiny-4proc", "model.ffn_dim=687"),
    _x("tiny-4proc", "model.n_kv_heads=1"),
    _x("tiny-moe", "model.moe.expert_ffn_dim=191", "parallel.tp=2", "parallel.nproc_per_node=4"),
    _x("tiny", "parallel.ep=2"), _x("tiny-4proc", "parallel.ep=2"), _x("tiny-moe", "parallel.ep=4"),
    _x("tiny-moe", "model.moe.num_experts=7"), _x("tiny-moe", "model.moe.top_k=9"),
    _x("tiny-moe", "parallel.ep=3", "model.moe.num_experts=9"),
    _x("tiny-cp2", "parallel.cp_comm=a2a", "model.n_kv_heads=1", key="model.n_kv_heads", value="1"),
    _x("tiny-cp2", "parallel.cp=8", "parallel.nproc_per_node=8", "parallel.cp_comm=a2a"),
    _x("tiny-cp2", "parallel.tp=4", "parallel.nproc_per_node=8", "parallel.cp_comm=a2a"),
    _x("tiny-cp2", "parallel.cp=3", "parallel.nproc_per_node=3"),
    # the model's own shape
    _x("tiny", "model.n_heads=6"), _x("tiny", "model.n_kv_heads=3"), _x("tiny", "model.dim=250"),
    _x("tiny", "model.dim=264"), _x("tiny-pp2", "model.head_dim=3"), _x("tiny", "model.vocab_size=200"),
    _x("tiny", "model.arch=gpt2"), _x("tiny-4proc", "model.arch=gpt2", "model.n_kv_heads=null"),
    _x("tiny", "model.qk_norm=true", "model.arch=gpt2", "model.n_kv_heads=null", "model.rope_theta=null"),
    _x("tiny-moe", "model.arch=gpt2", "model.n_kv_heads=null", "model.rope_theta=null"),
    _x("tiny", "model.ffn_dim=null"), _x("tiny-cp2", "model.rope_theta=null"),
    _x("tiny", "model.moe={num_experts: 4, top_k: 8}", key="model.moe.top_k", value="8"),
    _x("tiny-moe", "model.moe.top_k=3", "model.moe.num_experts=2", key="model.moe.top_k", value="3"),
    # the optimisation loop
    _x("tiny", "train.min_lr=0.001"),
    _x("tiny", "train.eval_every=10", "data.valid_fraction=0", key="data.valid_fraction", value="0"),
    _x("tiny-moe", "data.valid_fraction=0", "train.eval_every=5"),
    _x("tiny", "train.spike_factor=1"),
    # timeouts
    _x("tiny", "parallel.watchdog_s=900"), _x("tiny-4proc", "parallel.collective_timeout_s=300"),
    _x("tiny-pp2", "parallel.watchdog_s=60", "parallel.collective_timeout_s=60"),
    _x("tiny-cp2", "parallel.collective_timeout_s=1e9"),
    # pipelines
    _x("tiny-pp2", "parallel.pp=8", "parallel.nproc_per_node=8"), _x("tiny-pp2", "model.n_layers=1"),
    _x("tiny-pp2", "parallel.pp_layout=[3, 2]"), _x("tiny-pp2", "parallel.pp_layout=[4]"),
    _x("tiny-pp2", "parallel.pp_layout=[1, 1, 2]"), _x("tiny", "parallel.pp_layout=[3, 1]"),
    _x("tiny-4proc", "parallel.pp_layout=[2]"), _x("tiny", "parallel.pp_virtual=2"),
    _x("tiny-pp2", "parallel.pp_virtual=2"), _x("tiny-pp2", "parallel.pp_schedule=interleaved"),
    _x("tiny-pp2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "train.global_batch=12",
       key="train.global_batch", value="12"),
    _x("tiny-pp2", "parallel.pp_virtual=4", "parallel.pp_schedule=interleaved"),
    _x("tiny", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "parallel.pp=2",
       "parallel.nproc_per_node=4", "train.global_batch=24", key="train.global_batch", value="24"),
    # compile (MoE with ep, and with selective checkpointing, compiles on a mesh now)
    _x("tiny-4proc", "train.compile=true", "train.activation_checkpointing=full", key="train.activation_checkpointing",
       value="full"),
    _x("tiny-moe", "train.activation_checkpointing=full", "train.compile=true", key="train.activation_checkpointing",
       value="full"),
]


def generate(seed: int = SEED) -> list[Case]:
    cases = field_cases(random.Random(seed)) + special_cases() + CROSS
    unique = {(c.base, c.flags, repr(c.edits)): c for c in cases}
    return list(unique.values())


CASES = generate()


# --- running a case --------------------------------------------------------------------------

_build_parser = cli.build_parser


@functools.lru_cache(maxsize=None)
def _parser():
    return _build_parser()


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """The real main() with one parser, a populated run_dir, and no rank allowed to start."""
    root = tmp_path_factory.mktemp("fuzz")
    run_dir = root / "existing_run"
    (run_dir / "sub").mkdir(parents=True)
    (run_dir / "SENTINEL").write_text("do not touch\n")
    (run_dir / "sub" / "data.bin").write_bytes(bytes(range(256)))

    def launched(*args, **kwargs):
        raise AssertionError("a worker process was launched: the config passed every check before launch")

    def single(*args, **kwargs):
        raise AssertionError("the single-process run was started: the config passed validation")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(meshtrain.run.launch, "launch", launched)
        mp.setattr(fit_module, "_Run", single)
        mp.setattr(cli, "build_parser", _parser)
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            mp.delenv(var, raising=False)
        yield root, run_dir


def _snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): (p.read_bytes() if p.is_file() else None) for p in run_dir.rglob("*")}


def run_main(root: Path, run_dir: Path, case: Case, capsys) -> tuple[str, int, str]:
    """('returned' or 'exit', code, stderr) of main() on this case."""
    config = ROOT / "configs" / f"{case.base}.yaml"
    if case.edits:
        data = yaml.safe_load(config.read_text())
        for path, value in case.edits:
            node = data
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        config = root / f"{hashlib.sha1(repr(case).encode()).hexdigest()[:16]}.yaml"
        config.write_text(yaml.safe_dump(data, sort_keys=False))
    capsys.readouterr()
    try:
        how, code = "returned", cli.main(["fit", "--config", str(config), *case.flags, "--run_dir", str(run_dir)])
    except SystemExit as e:
        how, code = "exit", e.code
    return how, code, capsys.readouterr().err


def _names(err: str, key: str) -> bool:
    """The message names the key: dotted, or (jsonargparse's nested errors) its section and leaf."""
    if key in err:
        return True
    parent, _, leaf = key.rpartition(".")
    return bool(parent) and parent in err and re.search(rf"\b{re.escape(leaf)}\b", err) is not None


def _shows(message: str, value: str) -> bool:
    """The value appears whole: "1" is not found in "0.1" or "128"."""
    before = r"(?<![\w.])" if re.match(r"[\w.]", value) else ""
    after = r"(?!\w)" if re.search(r"\w$", value) else ""
    return re.search(before + re.escape(value) + after, message) is not None


def check_message(how: str, code, err: str, case: Case) -> None:
    assert code == 2, f"exit code {code!r}:\n{err}"
    assert "Traceback" not in err, err
    if how == "returned":  # ConfigError / DataError / CheckpointError: one line
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("meshtrain: ") and len(lines[0]) < 1000, err
        message = lines[0]
    else:  # jsonargparse: usage, then "error: ..."
        assert "error: " in err, err
        message = err[err.index("error: "):]
        assert len(message.splitlines()) <= 25, message
    assert _names(message, case.key), f"the message does not name {case.key}: {message}"
    assert any(_shows(message, v) for v in case.values), f"the message does not show {case.values}: {message}"


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{i:03d}-{c.id}") for i, c in enumerate(CASES)])
def test_invalid_config_is_refused_before_any_rank_starts(harness, case, capsys):
    root, run_dir = harness
    before = _snapshot(run_dir)
    how, code, err = run_main(root, run_dir, case, capsys)
    check_message(how, code, err, case)
    assert _snapshot(run_dir) == before, "the existing run_dir was changed"


# --- the generator itself ------------------------------------------------------------------------

def test_the_generator_is_deterministic_and_large():
    assert generate() == CASES
    assert len(CASES) >= 200, len(CASES)
    categories = {c.category for c in CASES}
    assert categories == {"type", "range", "choice", "unknown", "shape", "cross", "file"}, categories
    for category in categories:
        assert sum(c.category == category for c in CASES) >= 4, category


def test_every_field_is_mutated():
    """A new config key gets fuzzed: every leaf field (but run_dir, always given as a flag)
    is the named key of some case."""
    named = {c.key for c in CASES} | {c.key.rsplit(".", 1)[0] for c in CASES}
    missing = [key for key, _ in schema_fields() if key != "run_dir" and key not in named]
    assert not missing, missing


@pytest.mark.parametrize("base", BASES)
def test_valid_bases_pass_validation(harness, base, capsys):
    """Each base reaches the point where ranks would start: the mutations are what fails."""
    root, run_dir = harness
    before = {k: v for k, v in _snapshot(run_dir).items() if k != "run.lock"}
    expected = "worker process was launched" if base in MULTI_RANK else "single-process run was started"
    with pytest.raises(AssertionError, match=expected):
        cli.main(["fit", "--config", str(ROOT / "configs" / f"{base}.yaml"), "--run_dir", str(run_dir)])
    # The run's lock (run.lock, rundir.py) is the first file a start that passed every check writes.
    assert {k: v for k, v in _snapshot(run_dir).items() if k != "run.lock"} == before


# --- specific rules, exact messages --------------------------------------------------------------

def _cfg(base: str, **sections) -> RunConfig:
    data = yaml.safe_load((ROOT / "configs" / f"{base}.yaml").read_text())
    for dotted, value in sections.items():
        section, _, key = dotted.partition("__")
        data[section][key] = value
    return RunConfig.from_dict(data)


def _check_before_launch(cfg: RunConfig) -> None:
    """What fit() checks of the config before it starts any rank."""
    cfg.validate()
    cfg.plan(world=cfg.parallel.nproc_per_node)


@pytest.mark.parametrize("base, changes, fragment", [
    ("tiny", dict(train__global_batch=18), "train.global_batch=18 is not divisible by train.micro_batch=4"),
    ("tiny-4proc", dict(train__global_batch=12),
     "train.global_batch=12 is not divisible by train.micro_batch=4 x data-parallel size 2 (parallel.dp=1 x "
     "parallel.fsdp=2) = 8 sequences per micro-step: choose a global_batch that is a multiple of 8"),
    ("tiny", dict(parallel__nproc_per_node=8),
     "data-parallel size 8 (parallel.dp=1 x parallel.fsdp=8, where parallel.fsdp=-1 takes the ranks left of world "
     "size 8; parallel.nproc_per_node=8) = 32 sequences per micro-step"),
    ("tiny", dict(train__seq_len=300), "train.seq_len=300 exceeds model.max_seq_len=256"),
    ("tiny-4proc", dict(parallel__nproc_per_node=8),
     "axis sizes fsdp=2 x tp=2 (parallel.fsdp x parallel.tp) multiply to 4, but the world size is 8"),
    ("tiny-4proc", dict(model__n_kv_heads=1), "parallel.tp=2 does not divide model.n_kv_heads=1"),
    ("tiny-moe", dict(parallel__ep=4), "parallel.ep=4 must divide fsdp x cp = 2 x 1 = 2 (parallel.fsdp x "
                                       "parallel.cp"),
    ("tiny-pp2", dict(parallel__pp_layout=[1, 2]),
     "parallel.pp_layout=[1, 2] sums to 3 but the model has 4 layers (model.n_layers=4)"),
    ("tiny-pp2", dict(parallel__pp_layout=[4]),
     "parallel.pp_layout=[4] has 1 entries but parallel.pp=2 x parallel.pp_virtual=1 = 2 stages"),
    ("tiny-pp2", dict(parallel__pp=8, parallel__nproc_per_node=8),
     "parallel.pp=8 x parallel.pp_virtual=1 = 8 stages but the model has 4 layers (model.n_layers=4)"),
    ("tiny-pp2", dict(parallel__pp_schedule="interleaved", parallel__pp_virtual=2, train__global_batch=12),
     "micro-batch count (train.global_batch=12 / (train.micro_batch=4 x data-parallel size 1) = 3) to be a multiple "
     "of parallel.pp=2: change global_batch (e.g. 16)"),
    ("tiny", dict(parallel__pp_virtual=2), "parallel.pp_virtual=2 sets pipeline stages per pp rank, but parallel.pp=1"),
    ("tiny-cp2", dict(train__seq_len=126), "train.seq_len=126 is not a multiple of 4"),
    ("tiny-cp2", dict(parallel__cp_comm="a2a", model__n_kv_heads=1),
     "model.n_kv_heads gives 1 = 1 heads per rank, not divisible by 2"),
    ("tiny-cp2", dict(parallel__cp_comm="a2a", parallel__tp=4, parallel__nproc_per_node=8),
     "model.n_kv_heads gives 4 / parallel.tp=4 = 1 heads per rank, not divisible by 2"),
    ("tiny-cp2", dict(parallel__sp=True, parallel__tp=4, parallel__nproc_per_node=8, train__seq_len=132),
     "train.seq_len=132 must be a multiple of cp x tp = 8"),
    ("tiny", dict(parallel__watchdog_s=900.0), "parallel.watchdog_s=900.0 must be below "
                                               "parallel.collective_timeout_s=900.0"),
    ("tiny", dict(parallel__collective_timeout_s=1e12),
     "parallel.collective_timeout_s=1000000000000.0 exceeds 1e+08 s"),
    ("tiny", dict(model__n_layers=2000), "model.n_layers=2000 exceeds the largest supported value 1024"),
    ("tiny", dict(model__rope_scaling={"factor": 8, "low_freq_factor": 4, "high_freq_factor": 4,
                                       "original_max_position_embeddings": 8192}),
     "model.rope_scaling.low_freq_factor=4 must be below model.rope_scaling.high_freq_factor=4"),
    ("tiny", dict(model__head_dim=33), "model.head_dim=33 is odd"),
    ("tiny", dict(model__dim=264), "model.dim=264 / model.n_heads=8 = 33 is odd"),
    ("tiny", dict(model__arch="gpt2", model__n_kv_heads=None, model__rope_theta=None, model__qk_norm=True),
     "model.qk_norm=True is not read by model.arch='gpt2'"),
])
def test_cross_field_rule(base, changes, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        _check_before_launch(_cfg(base, **changes))


def test_validation_is_pure(monkeypatch):
    """validate() and plan(world) of every base: no process group, no file written."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("validation must not create a process group or write a file")

    real_open = builtins.open

    def read_only_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            refuse()
        return real_open(file, mode, *args, **kwargs)

    for name in ("init_process_group", "new_group", "barrier"):
        monkeypatch.setattr(dist, name, refuse)
    monkeypatch.setattr(builtins, "open", read_only_open)
    monkeypatch.setattr(os, "mkdir", refuse)
    monkeypatch.setattr(os, "makedirs", refuse)
    for base in BASES:
        _check_before_launch(_cfg(base))
    assert not dist.is_initialized()


def test_type_errors_print_one_line(harness, capsys):
    root, run_dir = harness
    case = _case("type", "tiny", "train.micro_batch", "abc")
    how, code, err = run_main(root, run_dir, case, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_a_prefix_of_a_key_is_an_unknown_key(harness, capsys):
    root, run_dir = harness
    case = Case("unknown", "tiny-4proc", "parallel.watchdog", ("parallel.watchdog",), ("--parallel.watchdog=3",))
    check_message(*run_main(root, run_dir, case, capsys), case)
