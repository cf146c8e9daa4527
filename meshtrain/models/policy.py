"""How a context runs the model's compute: the dtype parameters are cast to where they are
used, which linears run their GEMMs in fp8, and what backward recomputes instead of
keeping. Chosen by train.precision, train.fp8_recipe and train.activation_checkpointing;
master parameters, gradients and optimizer state stay fp32 whatever the policy.

The precision rules are by parameter name, here and nowhere else:
  - the MoE router and its bias keep fp32: their logits pick experts, a discrete choice
    that bf16 rounding of the weight would change;
  - the embedding, the head and the router never run in fp8 (the embedding is a lookup,
    the head's and router's outputs are logits); every other linear does under fp8.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..errors import check_choice
from .fp8 import RECIPES, cpu_scaled_mm_op
from .offload import offloaded

# train.precision -> the compute dtype (fp8: bf16, with fp8 GEMMs; fp16 needs loss
# scaling, train/loss_scale.py).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
# train.activation_checkpointing's recompute policies, least recompute first (estimate/advice.py
# searches them in this order); offload recomputes nothing and moves what the blocks save to
# host memory instead (models/offload.py).
CHECKPOINTING = ("none", "selective", "full")
ACTIVATION_MODES = CHECKPOINTING + ("offload",)

# torch.compile warns once per process (4 lines on each rank's stderr) when it traces a
# checkpoint with a context_fn: "Detected that context_fn is passed to
# torch.utils.checkpoint under torch.compile. Please make sure the checkpointed region
# does not contain in-place ops". Every compiled sharded step has such checkpoints, with
# train.activation_checkpointing none too: the traced ZeRO-3 gathers are recomputed in
# backward under one (parallel/param_gather.py `_recomputed`), as is a selectively
# checkpointed block (Policy.remat). Their in-place ops write only tensors the region
# itself creates, which recompute the same, and the equivalence tests compare compiled
# steps with eager ones: the warning is no news to a user, so that message alone is
# dropped (tests/test_compiled_reshard.py).
CONTEXT_FN_WARNING = "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile"


class _NoContextFnWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return CONTEXT_FN_WARNING not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_NoContextFnWarning())

KEEP_FP32 = ("router", "expert_bias")  # the last component of a parameter's name
NO_FP8 = ("tok_emb", "output", "router")


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def keeps_fp32(name: str) -> bool:
    """Whether parameter `name` is used in fp32 whatever the compute dtype."""
    return _leaf(name) in KEEP_FP32


@dataclass(frozen=True)
class Policy:
    dtype: torch.dtype | None = None  # None: parameters are used in their own dtype
    fp8: str | None = None  # the fp8 recipe, or None
    checkpointing: str = "none"
    # Selective: what a block saved serves every backward through it, not only the first
    # (the zero-bubble schedule backpropagates a block twice: input, then weight gradients).
    backward_twice: bool = False

    @staticmethod
    def of(precision: str = "fp32", fp8_recipe: str = "tensorwise", activation_checkpointing: str = "none") -> "Policy":
        check_choice(precision, "train.precision", PRECISIONS)
        check_choice(fp8_recipe, "train.fp8_recipe", RECIPES)
        check_choice(activation_checkpointing, "train.activation_checkpointing", ACTIVATION_MODES)
        return Policy(PRECISIONS[precision], fp8_recipe if precision == "fp8" else None, activation_checkpointing)

    @staticmethod
    def coerce(policy: "Policy | torch.dtype | None") -> "Policy":
        """A Policy, or just a compute dtype (None: fp32) for the plain policy."""
        return policy if isinstance(policy, Policy) else Policy(policy)

    def param_dtype(self, name: str) -> torch.dtype | None:
        """The dtype parameter `name` is used in (None: its own)."""
        return None if keeps_fp32(name) else self.dtype

    def fp8_recipe(self, name: str) -> str | None:
        """The fp8 recipe of the linear whose weight is `name`, or None for a plain one."""
        return None if self.fp8 is None or _leaf(name) in NO_FP8 else self.fp8

    def remat(self, fn, *args):
        """fn(*args) (a transformer block) under the checkpointing policy: none keeps every
        activation; full keeps only the block's inputs and recomputes the block in
        backward; selective keeps the outputs of matmuls and attention (the expensive
        ops) and recomputes the rest (norms, RoPE, activations, casts, gathers); offload
        keeps every activation, in host memory (models/offload.py)."""
        if self.checkpointing == "none":
            return fn(*args)
        if self.checkpointing == "offload":
            return offloaded(fn, *args)
        # The blocks draw no random numbers (no dropout): no RNG state to keep per block
        # (5 KB of CPU generator state each, measured by bench/layer_memory.py).
        if self.checkpointing == "full":
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        # A partial, not a lambda: dynamo traces checkpoint only with such a context_fn.
        contexts = _reusable_contexts if self.backward_twice else create_selective_checkpoint_contexts
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False,
                          context_fn=partial(contexts, _save_expensive))


class _KeepFirst(dict):
    """One op's saved outputs in a selective checkpoint: written once, by the forward.
    torch marks an entry consumed when a backward's recompute takes it, so a second
    backward through the block would find nothing; here the entries stay until the
    checkpoint is freed with the block's graph."""

    def __setitem__(self, index, value):
        if index not in self:
            super().__setitem__(index, value)


def _reusable_contexts(policy_fn):
    caching, cached = create_selective_checkpoint_contexts(policy_fn)
    caching.storage = cached.storage = defaultdict(_KeepFirst)
    return caching, cached


_aten = torch.ops.aten
_EXPENSIVE_ATEN = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._scaled_mm.default,
                   _aten._scaled_dot_product_flash_attention.default,
                   _aten._scaled_dot_product_efficient_attention.default,
                   _aten._scaled_dot_product_cudnn_attention.default,
                   _aten._scaled_dot_product_flash_attention_for_cpu.default,
                   cpu_scaled_mm_op._opoverload}  # the compiled CPU fp8 GEMM (models/fp8.py)


# A row-parallel matmul's output is a partial sum of the whole sequence: keep its reduction
# instead (under sequence parallelism a sequence shard, tp times smaller), and recompute
# the matmul where backward needs what follows it (wo's: the MLP's input).
_PARTIAL_SUMS = {"meshtrain::row_parallel_linear"}
_REDUCTIONS = {"_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_reduce"}


def _save_expensive(ctx, op, *args, **kwargs):
    # Our own ops (meshtrain::grouped_linear, meshtrain::cp_attention) are GEMM and
    # attention kernels too.
    name = op.name() if hasattr(op, "name") else ""
    if name in _PARTIAL_SUMS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    expensive = op in _EXPENSIVE_ATEN or getattr(op, "namespace", None) == "meshtrain" or name in _REDUCTIONS
    return CheckpointPolicy.MUST_SAVE if expensive else CheckpointPolicy.PREFER_RECOMPUTE
