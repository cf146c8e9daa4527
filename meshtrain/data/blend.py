"""Blending several datasets by weight: which dataset each global sample comes from,
by random access."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from .errors import DataError

_MAX_WEIGHT_TOTAL = 2**30  # integer weights up to this total keep the arithmetic in int64


_MAX_WEIGHT_RATIO = 10**6  # random access costs time and memory in proportion to this


_WALK_LIMIT = 512  # reach a start this far past the last one by drawing, not recomputing


class BlendSchedule:
    """Global sample i -> (dataset d, d's own draw count k), with every dataset's share
    within one sample of its weight at every prefix: after n draws dataset d has drawn
    c_d(n) times and |c_d(n) - w_d * n| < 1.

    The rule is the quota method, earliest deadline first: d's draw k may not come before
    slot floor(k / w_d) (d would be a sample or more ahead) and must come before slot
    (k + 1) / w_d (d would be a sample or more behind). Each slot draws, among the datasets
    whose next draw is allowed, the one whose deadline is earliest (ties: lower index). A
    schedule meeting every such window exists for any weights (Tijdeman, "The chairman
    assignment problem", 1980) and EDF finds one. Megatron-LM's greedy rule (the d
    maximising w_d * (i + 1) - c_d) is not used: with five or more datasets it can fall
    more than one sample behind.

    Random access: `counts_at(n)` gives the counts after n draws directly, then the
    requested slots are drawn one by one (cheap: a batch). The direct form holds because
    EDF's first n draws are the greedy basis of a matroid: every draw below the lower quota
    floor(w_d * n) is made, and the n - sum(floor(w_d * n)) extra draws are the next draws
    of some datasets, chosen in deadline order and kept when the first n slots can still
    hold every kept draw at or after its release slot (Hall's condition, checked slot by
    slot over the window where it can fail).

    Weights are exact fractions (decimal floats as written: 0.3 is 3/10).
    """

    def __init__(self, weights):
        self.a, self.total = _integer_weights(weights)
        self.weights = [x / self.total for x in self.a]
        self._cursor = (0, [0] * len(self.a))  # (n, counts after n draws) of the last call

    def __len__(self) -> int:
        return len(self.a)

    def counts_at(self, n: int) -> list[int]:
        """How many times each dataset has drawn among global samples [0, n)."""
        a, total = self.a, self.total
        floor = [x * n // total for x in a]
        extra = n - sum(floor)
        if extra == 0:
            return floor
        # Datasets a fraction of a sample behind their share; their next draw k = floor
        # was released at slot k * total // a and is due at slot (k + 1) / w.
        cand = [d for d in range(len(a)) if a[d] * n % total]
        release = {d: floor[d] * total // a[d] for d in cand}
        cand.sort(key=lambda d: (Fraction(floor[d] + 1, a[d]), d))
        # Hall's condition can only fail for slots t in (lo, n]: below lo every extra draw
        # counts against t, and the slack there is at least the number of extra draws.
        cuts = sorted(set(release.values()))
        slack = self._segment_slack(n, floor, cuts)
        counts, used = list(floor), [0] * len(slack)
        for d in cand:
            last = cuts.index(release[d])  # segments 0..last-1 lie at or before d's release slot
            if all(slack[j] - used[j] >= 1 for j in range(last)):
                for j in range(last):
                    used[j] += 1
                counts[d] += 1
                extra -= 1
                if extra == 0:
                    return counts
        raise AssertionError(f"blend schedule: no feasible counts at n={n} for weights {self.a}")  # cannot happen

    def _segment_slack(self, n: int, floor: list[int], cuts: list[int]) -> list[int]:
        """For each segment (cuts[j], cuts[j+1]]: the least, over its slots t, of the slots
        [t, n) left after the lower-quota draws released at t or later."""
        a, total = self.a, self.total
        dtype = np.int64 if max(a) * n < 2**62 else object  # exact either way
        out = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            best = None
            for start in range(lo + 1, hi + 1, 1 << 20):  # bounded memory on long segments
                t = np.arange(start, min(hi, start + (1 << 20) - 1) + 1).astype(dtype)
                slack = n - t
                for d, f in enumerate(floor):
                    if f:
                        released_before = -((-a[d] * t) // total)  # ceil(w_d * t): d's draws released before t
                        slack = slack - np.maximum(f - released_before, 0)
                low = int(slack.min())
                best = low if best is None else min(best, low)
            out.append(best)
        return out

    def assign(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(datasets, draws): for global samples start..start+count-1 the dataset and that
        dataset's own draw index."""
        n, counts = self._cursor
        if not n <= start <= n + _WALK_LIMIT:
            n, counts = start, self.counts_at(start)
        counts = list(counts)
        if start > n:
            self._draw(n, counts, start - n)
        datasets, draws = self._draw(start, counts, count)
        self._cursor = (start + count, counts)
        return datasets, draws

    def _draw(self, n: int, counts: list[int], count: int) -> tuple[np.ndarray, np.ndarray]:
        """EDF for slots n..n+count-1 from `counts` (updated in place)."""
        a, total, K = self.a, self.total, len(self.a)
        release = [counts[d] * total // a[d] for d in range(K)]  # slot of each dataset's next draw
        datasets, draws = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        for j in range(count):
            slot, best, due_num, due_den = n + j, -1, 0, 1
            for d in range(K):
                # deadline of d's next draw is (counts[d] + 1) / a[d], in units of total slots
                if release[d] <= slot and (best < 0 or (counts[d] + 1) * due_den < due_num * a[d]):
                    best, due_num, due_den = d, counts[d] + 1, a[d]
            datasets[j], draws[j] = best, counts[best]
            counts[best] += 1
            release[best] = counts[best] * total // a[best]
        return datasets, draws


def _integer_weights(weights) -> tuple[list[int], int]:
    """Positive weights as coprime integers and their total."""
    exact = [Fraction(w) if isinstance(w, int) else Fraction(repr(float(w))) for w in weights]
    den = math.lcm(*(f.denominator for f in exact))
    ints = [int(f * den) for f in exact]
    g = math.gcd(*ints)
    a = [x // g for x in ints]
    if sum(a) > _MAX_WEIGHT_TOTAL:  # more digits than any blend needs: round to 2**-30
        a = [round(x * _MAX_WEIGHT_TOTAL / sum(a)) for x in a]
    if min(a) == 0 or max(a) > _MAX_WEIGHT_RATIO * min(a):
        raise DataError(f"blend weights {list(weights)}: the smallest is less than 1e-6 of the largest; drop the "
                        "dataset with the tiny weight or raise its weight")
    return a, sum(a)

