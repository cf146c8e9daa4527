"""Attention on sharded q, k, v: heads split over tp run locally, a sequence split over cp
goes to context-parallel attention (parallel/cp_attention.py)."""

from __future__ import annotations

from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Shard

from ..errors import ConfigError
from ..models.context import causal_attention
from .cp_attention import context_parallel_attention


class ShardedAttention:
    """ShardedContext's `attention`. Reads the context's `plan`, `mesh` and `_cp_dim`."""

    def attention(self, q: DTensor, k: DTensor, v: DTensor, segments: DTensor | None = None,
                  window: int | None = None) -> DTensor:
        """Causal attention on local shards: heads split by tp need nothing; a sequence
        split over cp (zigzag) is exchanged the plan's cp_comm way. `segments` (batch,
        seq), as ("batch", "seq") lays them out: each rank's rows, every position;
        `window` as for models.context.ModelContext.attention (cp ignores it: its blocks
        skip what no local query sees)."""
        seq_dims = [i for i, p in enumerate(q.placements) if isinstance(p, Shard) and p.dim == 1]
        if any(i != self._cp_dim for i in seq_dims):
            raise ConfigError(f"attention: the sequence is split over mesh axis "
                              f"{self.plan.mesh.axes[seq_dims[-1]]}; only cp may split it there (rules "
                              f"{self.plan.rules.lookup('seq')} for 'seq')")
        local = None if segments is None else segments.to_local()
        if seq_dims:
            out = context_parallel_attention(q.to_local(), k.to_local(), v.to_local(),
                                             self.mesh.get_group(self._cp_dim), self.plan.cp_comm, local)
        else:
            out = causal_attention(q.to_local(), k.to_local(), v.to_local(), local, key=segments, window=window)
        # Contiguous, as the stride it is declared with says (the heads are flattened next,
        # which would copy a transposed kernel output anyway).
        shape = (*q.shape[:-1], v.shape[-1])  # values may be narrower than queries (MLA)
        return DTensor.from_local(out.contiguous(), self.mesh, q.placements, run_check=False,
                                  shape=shape, stride=make_contiguous_strides_for(shape))
