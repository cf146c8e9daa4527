"""Counts collectives per (phase, op, axis): how many, and their bytes per rank.

`redistribute` is DTensor's rule per mesh dim (P->R all-reduce, P->S reduce-scatter,
S->R all-gather, S(i)->S(j) all-to-all, nothing otherwise) with its order and padding;
`add_group` names a collective over several mesh dims as the runtime's groups do. The
counts are what the walker (walker.py) and the bucket replay (bucket_replay.py) add up."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

from ..layout.buckets import group_axes
from .placement_rules import P, R, numel_on_rank


class CollectiveTally:
    """(phase "fwd" | "bwd" | "opt", op, axis) -> [count, bytes] in `out`, over the dims
    of `mesh` unless a call names another mesh (an expert weight's, a bucket's)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.out: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        self._last_replay: dict = {}

    def add(self, phase, op, i, nbytes, n=1, mesh=None):
        """n collectives of nbytes each over mesh dim i (of the dense mesh unless `mesh`)."""
        mesh = mesh or self.mesh
        if n and mesh.size(mesh.axes[i]) > 1:
            entry = self.out[(phase, op, mesh.axes[i])]
            entry[0] += n
            entry[1] += n * nbytes

    def add_group(self, phase, op, dims, nbytes, n=1, mesh=None):
        """n collectives of nbytes each over the group of mesh dims `dims` (of the dense
        mesh unless `mesh`: a parameter bucket's group, parallel/bucket_groups.py), named as
        `group_axes` names it."""
        mesh = mesh or self.mesh
        if n and math.prod(mesh.shape[i] for i in dims) > 1:
            entry = self.out[(phase, op, group_axes(mesh.axes, dims))]
            entry[0] += n
            entry[1] += n * nbytes

    def redistribute(self, phase, shape, cur, dst, itemsize, n=1, mesh=None):
        mesh = mesh or self.mesh
        add = lambda *a: self.add(*a, mesh=mesh)  # noqa: E731
        numel = lambda shape, pls, pad=None: numel_on_rank(shape, pls, mesh, pad)  # noqa: E731
        cur = list(cur)
        # DTensor all-gathers innermost mesh dim first (undoing a nested split, e.g. a dim
        # over fsdp x cp), then takes the other changes in mesh order.
        gathers = [i for i, (a, b) in enumerate(zip(cur, dst)) if a[0] == "S" and b == R]
        for i in reversed(gathers):
            add(phase, "all_gather", i, itemsize * numel(shape, cur, pad=(i, cur[i][1])), n)
            cur[i] = R
        for i, (a, b) in enumerate(zip(cur, dst)):
            if a == b or a == R:
                cur[i] = b
                continue
            if a == P and b == R:
                add(phase, "all_reduce_sum", i, itemsize * numel(shape, cur), n)
            elif a == P:
                add(phase, "reduce_scatter_sum", i, itemsize * numel(shape, cur, pad=(i, b[1])), n)
            elif b == R:
                add(phase, "all_gather", i, itemsize * numel(shape, cur, pad=(i, a[1])), n)
            else:
                add(phase, "all_to_all_single", i, itemsize * numel(shape, cur), n)
            cur[i] = b

    @contextlib.contextmanager
    def replayed_in_backward(self):
        """The forward collectives counted inside are counted again in backward (a block
        recomputed there issues them again); `drop_last_replay` takes back the last."""
        before = {k: list(v) for k, v in self.out.items() if k[0] == "fwd"}
        yield
        self._last_replay = {}
        for (phase, op, axis), (n, nbytes) in list(self.out.items()):
            n0, b0 = before.get((phase, op, axis), (0, 0))
            if phase == "fwd" and n > n0:
                self._last_replay[("bwd", op, axis)] = (n - n0, nbytes - b0)
                entry = self.out[("bwd", op, axis)]
                entry[0] += n - n0
                entry[1] += nbytes - b0

    def drop_last_replay(self):
        """Uncount the last `replayed_in_backward`'s backward collectives."""
        for key, (n, nbytes) in self._last_replay.items():
            self.out[key][0] -= n
            self.out[key][1] -= nbytes
            if not self.out[key][0]:
                del self.out[key]
        self._last_replay = {}
