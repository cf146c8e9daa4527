"""Matmuls on sharded operands: `linear` on DTensors, or on local shards where DTensor's
own would not do (the row-parallel op selective checkpointing tells apart, fp8 with
amaxes reduced over the mesh, a sequence split over cp)."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial, Shard

from ..errors import ConfigError
from ..models.fp8 import fp8_linear


@torch.library.custom_op("meshtrain::row_parallel_linear", mutates_args=())
def _row_parallel_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T on local shards split on the in features: a partial sum. An op of its own
    so selective checkpointing can tell it from the other matmuls (models/policy.py): it
    keeps the reduced sum (a sequence shard under sp), not this (the whole sequence)."""
    return torch.nn.functional.linear(x, w)


@_row_parallel_linear.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _row_parallel_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _row_parallel_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w, grad.flatten(0, -2).T @ x.flatten(0, -2)


_row_parallel_linear.register_autograd(_row_parallel_backward, setup_context=_row_parallel_setup)


class ShardedLinear:
    """ShardedContext's `linear`. Reads the context's `mesh` and `policy`."""

    def linear(self, x: DTensor, params, name: str, bias: DTensor | None = None) -> DTensor:
        w, recipe = params[name], self.policy.fp8_recipe(name)
        if recipe is not None:
            out = self._local_linear(x, w, partial(self._fp8_gemm, recipe))
            if out is None:
                raise ConfigError(f"fp8 linear: unsupported layout of input {x.placements} and weight "
                                  f"{w.placements}: use train.precision bf16 for this plan")
        elif self.policy.checkpointing == "selective" and any(
                isinstance(px, Shard) and px.dim == x.ndim - 1 and isinstance(pw, Shard) and pw.dim == 1
                for px, pw in zip(x.placements, w.placements)):
            out = self._local_linear(x, w, lambda a, b, *_: _row_parallel_linear(a, b))
            if out is None:
                out = torch.nn.functional.linear(x, w)
        elif any(isinstance(p, Shard) and 0 < p.dim < x.ndim - 1 for p in x.placements):
            # The sequence dim is split (cp): DTensor's linear flattens it with the batch
            # dim into a strided shard, which a traced step beside another mesh axis
            # cannot take (hundreds of unbacked sizes, torch 2.13: Known gap 12).
            out = self._local_linear(x, w, lambda a, b, *_: torch.nn.functional.linear(a, b))
            if out is None:
                out = torch.nn.functional.linear(x, w)
        else:
            return torch.nn.functional.linear(x, w, bias)
        return out if bias is None else out + bias

    def _local_linear(self, x: DTensor, w: DTensor, gemm) -> DTensor | None:
        """x @ w.T on local shards, `gemm(x_local, w_local, x_dims, w_dims)`, or None for a
        layout it does not take. Per mesh dim, x split on a token dim gives an output split
        the same way; a column-parallel w (split on out features) an output split on its
        last dim; a row-parallel pair (x and w split on in features) a partial sum.
        `x_dims` and `w_dims` name the mesh dims splitting x as (tokens: rows, in: cols)
        and w as (out: rows, in: cols)."""
        last = x.ndim - 1
        x_dims = {"rows": set(), "cols": set()}
        w_dims = {"rows": set(), "cols": set()}
        out_placements = []
        for i, (px, pw) in enumerate(zip(x.placements, w.placements)):
            x_split = isinstance(px, Shard) and ("cols" if px.dim == last else "rows")
            w_split = isinstance(pw, Shard) and ("cols" if pw.dim == 1 else "rows")
            if px.is_partial() or pw.is_partial() or (x_split == "cols") != (w_split == "cols") \
                    or (x_split == "rows" and w_split):
                return None
            if x_split:
                x_dims[x_split].add(i)
            if w_split:
                w_dims[w_split].add(i)
            out_placements.append(Shard(last) if w_split == "rows" else Partial() if x_split == "cols"
                                  else px)
        # The gradients of local operands: partial sums over the dims the other operand
        # splits on its own rows.
        x_local = x.to_local(grad_placements=[Partial() if i in w_dims["rows"] else p
                                              for i, p in enumerate(x.placements)])
        w_local = w.to_local(grad_placements=[Partial() if i in x_dims["rows"] else p
                                              for i, p in enumerate(w.placements)])
        out = gemm(x_local, w_local, x_dims, w_dims)
        shape = (*x.shape[:-1], w.shape[0])
        return DTensor.from_local(out, self.mesh, out_placements, run_check=False, shape=shape,
                                  stride=make_contiguous_strides_for(shape))

    def _fp8_gemm(self, recipe: str, x: torch.Tensor, w: torch.Tensor, x_dims, w_dims) -> torch.Tensor:
        """fp8 GEMM of local shards, quantised with the scales one process would use: each
        amax is all-reduced (max) over the mesh dims that split the dims it was taken over."""
        # Dims of the operands as fp8_linear names them: x (M, K), w (N, K), grad (M, N).
        split = {"x": (x_dims["rows"], x_dims["cols"]), "w": (w_dims["rows"], w_dims["cols"]),
                 "grad": (x_dims["rows"], w_dims["rows"])}

        def allmax(t, operand, over):
            for i in sorted(set().union(*(split[operand][d] for d in over))):
                t = funcol.all_reduce(t, "max", (self.mesh, i))
            return t

        return fp8_linear(x, w, recipe, allmax)
