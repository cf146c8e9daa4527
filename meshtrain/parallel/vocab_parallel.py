"""The vocab-parallel ends of the model: the embedding lookup and the cross-entropy loss,
each rank working on its slice of the vocabulary, never gathering the whole of it."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..models.losses import cross_entropy_sum


class VocabParallel:
    """ShardedContext's `embedding` and `cross_entropy_sum`. Reads the context's `mesh`
    and `constrain` (parallel/activations.py)."""

    def embedding(self, ids: DTensor, table: DTensor) -> DTensor:
        """Vocab-parallel lookup: each rank returns the rows it holds and zeros elsewhere,
        as a Partial sum over the vocab axes that the next `constrain` reduces."""
        vocab_dims = [i for i, p in enumerate(table.placements) if isinstance(p, Shard) and p.dim == 0]
        if not vocab_dims:
            return torch.nn.functional.embedding(ids, table)
        (i,) = vocab_dims
        # Each rank's rows see only its own tokens: their gradient is a partial sum over
        # the mesh dims that split the tokens.
        grad_placements = [Partial() if isinstance(ids.placements[j], Shard) else p
                           for j, p in enumerate(table.placements)]
        rows = table.to_local(grad_placements=grad_placements)
        start = self.mesh.get_local_rank(i) * rows.shape[0]
        local_ids = ids.to_local() - start
        inside = (local_ids >= 0) & (local_ids < rows.shape[0])
        out = torch.nn.functional.embedding(local_ids.clamp(0, rows.shape[0] - 1), rows) * inside.unsqueeze(-1)
        placements = [Partial() if j == i else p for j, p in enumerate(ids.placements)]
        shape = (*ids.shape, rows.shape[1])
        return DTensor.from_local(out, self.mesh, placements, run_check=False, shape=shape,
                                  stride=make_contiguous_strides_for(shape))

    def cross_entropy_sum(self, logits: DTensor, targets: torch.Tensor, reduce: bool = True) -> DTensor:
        """Vocab-parallel cross entropy (models.losses): each rank works on its vocab slice,
        a chunk of rows at a time; two small reductions over the vocab axes (the row max,
        then the sum of exp and the target logit stacked), so the full-vocab logits are
        never gathered and no fp32 copy of them is made. Returns a replicated scalar, or
        with `reduce` False the partial sums over the token-splitting ranks (a Partial
        DTensor: a step reduces its micro-steps' sum once, `reduce_sum`)."""
        vocab_dim = logits.ndim - 1
        targets = self.constrain(targets, ("batch", "seq")).to_local()
        local = logits.to_local()
        vocab_mesh_dims = [i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim == vocab_dim]
        start, all_max, all_sum = 0, None, None
        if vocab_mesh_dims:
            (i,) = vocab_mesh_dims  # default rules shard vocab on one axis
            start = self.mesh.get_local_rank(i) * local.shape[-1]
            all_max = partial(funcol.all_reduce, reduceOp="max", group=(self.mesh, i))
            all_sum = partial(funcol.all_reduce, reduceOp="sum", group=(self.mesh, i))
        total = cross_entropy_sum(local, targets, vocab_start=start, all_max=all_max, all_sum=all_sum)
        # Tokens are split over the batch and sequence axes: the loss is a sum over them.
        token_dims = {i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim < vocab_dim}
        placements = [Partial() if i in token_dims else Replicate() for i in range(self.mesh.ndim)]
        total = DTensor.from_local(total, self.mesh, placements, run_check=False)
        return total.redistribute(self.mesh, [Replicate()] * self.mesh.ndim) if reduce else total
