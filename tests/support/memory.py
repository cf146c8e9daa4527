"""What the eager runtime keeps for backward, seen from a saved-tensor hook: the measure
of the saved-bytes estimates (tests/test_memory_estimate.py, tests/test_family_registry.py).
"""

from __future__ import annotations

import torch


def kept_instead(ctx, t):
    """What the eager runtime keeps for backward in place of the saved tensor `t` (the
    ShardedContext's pack hook, regather_in_backward): ("shard", the shard DTensor) for
    an all-gathered activation, ("weight", None) for a gathered weight it gathers again
    from the shard it holds anyway, None when it keeps `t` itself."""
    from torch.distributed.tensor import DTensor

    from meshtrain.parallel.regather import _FetchActivation

    local = t._local_tensor if isinstance(t, DTensor) else t
    if type(local) is not torch.Tensor:  # a pending collective's result: no storage of its own
        return None
    ptr = local.untyped_storage().data_ptr()
    entry = ctx._gathered.get(ptr)
    alive = entry[0]() if entry else None
    if alive is None or alive.untyped_storage().data_ptr() != ptr:
        return None
    return ("shard", entry[1].shard) if isinstance(entry[1], _FetchActivation) else ("weight", None)
