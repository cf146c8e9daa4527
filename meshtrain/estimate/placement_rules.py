"""Placements as plain data, and how the operations of a recorded forward transform them.

A placement per mesh dim: ("S", tensor dim) sharded, R replicated, P a partial sum. The
rules read the plan's activation layouts and parameters' stored and compute placements;
nothing here counts a collective (collective_tally.py) or knows the runtime's calls
(walker.py)."""

from __future__ import annotations

import math

from torch.distributed.tensor import Shard

from ..layout.plan import Plan

R, P = ("R",), ("P",)


def _pl(p) -> tuple:
    return ("S", p.dim) if isinstance(p, Shard) else R  # _StridedShard is a Shard


def numel_on_rank(shape, pls, mesh, pad=None) -> int:
    """Local elements on the most loaded rank of a tensor with placements `pls` on `mesh`;
    `pad=(mesh dim, tensor dim)`: that dim whole over the mesh dim, padded to a multiple
    of its size."""
    size = list(shape)
    for i, p in enumerate(pls):
        if p[0] == "S" and (i, p[1]) != pad:
            size[p[1]] = math.ceil(size[p[1]] / mesh.size(mesh.axes[i]))
    if pad is not None:
        k = mesh.size(mesh.axes[pad[0]])
        size[pad[1]] = math.ceil(size[pad[1]] / k) * k
    return math.prod(size)


def gathers(src: tuple, dst: tuple) -> bool:
    """Does redistributing placements `src` to `dst` only gather (no reduction, no new
    split)?"""
    return src != dst and all(s == d or (s[0] == "S" and d == R) for s, d in zip(src, dst))


class PlacementRules:
    """The plan's placements of activations (by logical axes) and parameters, and those
    of the results of linear, addition and their gradients."""

    def __init__(self, plan: Plan):
        self.plan, self.mesh = plan, plan.mesh
        self._acts: dict[tuple, tuple] = {}

    def act(self, axes, partial=()) -> tuple:
        if axes not in self._acts:
            self._acts[axes] = tuple(_pl(p) for p in self.plan.activation(axes).placements)
        return tuple(P if i in partial else p for i, p in enumerate(self._acts[axes]))

    def compute(self, name) -> tuple:
        return tuple(_pl(p) for p in self.plan.params[name].compute_placements())

    def stored(self, name) -> tuple:
        return tuple(_pl(p) for p in self.plan.params[name].placements)

    def param_mesh(self, name):
        """The mesh a parameter's placements refer to (the expert mesh for expert weights)."""
        return self.plan.params[name].mesh

    def split_dims(self, name, dim) -> set[int]:
        return {i for i, p in enumerate(self.compute(name)) if p == ("S", dim)}

    def linear(self, x, w) -> tuple:
        """Placements of linear(x, w) (last dim 2)."""
        wp = self.compute(w)
        return tuple(("S", 2) if q == ("S", 0) else P if q == ("S", 1) and p == ("S", 2) else p
                     for p, q in zip(x, wp))

    def split_on(self, axes, dim) -> set[int]:
        """The mesh dims that split tensor dim `dim` of an activation with these logical axes."""
        return {i for i, p in enumerate(self.act(axes)) if p == ("S", dim)}

    @staticmethod
    def summed(a, b) -> tuple:
        """Placements of a + b: Partial where either addend is."""
        return tuple(P if P in (x, y) else x for x, y in zip(a, b))

    def moe_tp_split(self, expert) -> bool:
        """Expert weights split over tp: ctx.moe's routed output is partial over tp."""
        em = self.param_mesh(expert)
        return "tp" in em.axes and self.compute(expert)[em.axes.index("tp")][0] == "S"

    def layout(self, expr) -> tuple:
        """The placements of a recorded layout expression (models/recording.py)."""
        kind = expr[0]
        if kind == "act":
            return self.act(expr[1])
        if kind == "linear":
            return self.linear(self.layout(expr[1]), expr[2])
        if kind == "sum":
            return self.summed(self.layout(expr[1]), self.layout(expr[2]))
        if kind == "lookup":  # rows of a table split on vocab: partial over those dims
            split = self.split_dims(expr[2], 0)
            return tuple(P if i in split else p for i, p in enumerate(self.layout(expr[1])))
        if kind == "moe":
            split = self.moe_tp_split(expr[2])
            return tuple(P if split and a == "tp" else q for a, q in zip(self.mesh.axes, self.layout(expr[1])))
        raise ValueError(f"not a recorded layout: {expr!r}")

    def grad_in(self, x, consumers) -> tuple:
        """Gradient of x arriving from column-parallel linear consumers."""
        split = set().union(*(self.split_dims(w, 0) for w in consumers))
        return tuple(P if i in split and p != ("S", 2) else p for i, p in enumerate(x))

    def grad_of(self, name, acts_on, grad=None) -> tuple:
        """Placements of the gradient of a lookup of `name`: Partial where `acts_on` (dense
        activations' placements) split the tokens, unless `grad` gives them."""
        if grad is not None:
            return grad
        return tuple(q if q != R else P if any(a[i][0] == "S" for a in acts_on) else R
                     for i, q in enumerate(self.compute(name)))
