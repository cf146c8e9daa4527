"""How a sharded step moves its parameters, as one value beside the precision Policy: the
traffic switches parallel.bucket, prefetch, reshard_after_forward, fsdp_accumulate and
pp_keep_gathered. Each has its default here and only here; the step factories, the
runtime and the estimators take a `Traffic` (the factories still accept the loose
keywords and build one, as they build a Policy from precision keywords)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError, check_bool, check_int

BUCKET_UNITS = ("block", "param")
ZERO_STAGES = (1, 2, 3)  # parallel.zero
ACCUMULATE = ("sharded", "unsharded")
MAX_PREFETCH = 64  # buckets in flight: each holds a block's gathered weights, so a typo, not a layout


def check_bucket(value, key: str = "parallel.bucket") -> str | float:
    """`block`, `param`, or a size in MB (> 0)."""
    if isinstance(value, str) and value in BUCKET_UNITS:
        return value
    try:
        mb = float(value)
    except (TypeError, ValueError):
        mb = None
    if isinstance(value, bool) or mb is None or not math.isfinite(mb) or mb <= 0:
        raise ConfigError(f"{key}={value!r}: use block (one bucket per transformer block), param (one "
                          "collective per parameter) or a bucket size in MB (a number > 0)")
    return mb


@dataclass(frozen=True)
class Traffic:
    """bucket: block (a transformer block's weights, and the groups before and after the
    blocks, per collective), param (one collective per parameter: the reference path), or
    a size in MB. prefetch: buckets whose gather is issued ahead of use (also the most
    reductions left in flight). reshard_after_forward: drop gathered weights after a
    block's forward and gather them again in backward. fsdp_accumulate: sharded (reduce-
    scatter every micro-step) or unsharded (accumulate whole gradients, reduce-scatter once
    per step). keep_gathered: the rank keeps its weights gathered over the step's
    micro-batches (parallel.pp_keep_gathered, and parallel.zero 1 and 2, which set it:
    ParallelConfig.traffic). zero: the ZeRO stage; 2 reduces the kept weights' gradients
    every micro-batch (sharded between them), 1 once per step; 3 is the sharded runtime
    the other switches shape."""

    bucket: str | float = "block"
    prefetch: int = 1
    reshard_after_forward: bool = True
    fsdp_accumulate: str = "sharded"
    keep_gathered: bool = False
    zero: int = 3

    @property
    def buckets(self) -> bool:
        """Parameters travel in buckets (not one collective per parameter)."""
        return self.bucket != "param"

    def check(self) -> "Traffic":
        """Raise ConfigError naming the parallel.* key and the fix for a value that cannot
        work, alone or with the other switches (the rules against the rest of a run, such
        as keep_gathered needing a pipeline, are the config's: config/assemble.py)."""
        check_bucket(self.bucket, "parallel.bucket")
        check_int(self.prefetch, "parallel.prefetch", 0, MAX_PREFETCH)
        check_bool(self.reshard_after_forward, "parallel.reshard_after_forward")
        check_bool(self.keep_gathered, "parallel.pp_keep_gathered")
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ConfigError(f"parallel.zero={self.zero!r}: choose 1 (parameters replicated, optimizer state sharded: "
                              "Megatron's distributed optimizer), 2 (gradients sharded too) or 3 (parameters too: "
                              "FSDP)")
        if self.zero < 3 and not self.keep_gathered:
            raise ConfigError(f"parallel.zero={self.zero} keeps the weights gathered over the step: build the "
                              "traffic with keep_gathered true (ParallelConfig.traffic does)")
        if self.fsdp_accumulate not in ACCUMULATE:
            raise ConfigError(f"parallel.fsdp_accumulate={self.fsdp_accumulate!r}: choose sharded (reduce-scatter "
                              "every micro-step) or unsharded (accumulate locally, reduce-scatter once per step)")
        if self.fsdp_accumulate == "unsharded" and not self.buckets:
            raise ConfigError("parallel.fsdp_accumulate=unsharded does not work with parallel.bucket param (the "
                              "per-parameter reference path): set parallel.fsdp_accumulate sharded")
        return self

