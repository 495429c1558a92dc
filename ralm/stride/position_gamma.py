"""Speculation accuracy by a step's position in the request (OS3's ``positional`` estimate).

OS3's model reads every step as the same coin: a window of ``s`` steps all match with
probability ``gamma^s``. Measured on the demo corpus (EDR, prefetching, 30 questions of
32 steps each, every step verified on its own), mismatches are not spread that way:

=====================  =========  =========  ==========  ==========  =========
committed steps         0-3        4-7        8-11        12-15       16-31
mismatch rate           0.00       0.07       0.12        0.03        0.00
=====================  =========  =========  ==========  ==========  =========

(with a fixed stride of 4: 0.01, 0.15, 0.18, 0.07, 0.002). The document changes while the
answer moves away from the question's wording, then stays put. One pooled gamma (0.95)
is too low for the stable tail, where a stride of 16 nearly always matches, and too high
for the steps in between; OS3 then picks one middling stride for the whole request (9 at
4M rows where a fixed 16 ran 17% faster).

So the evidence is kept per *position bucket* (committed steps before the step: 0, 1,
2-3, 4-7, 8-15, ... doubling, the last bucket open-ended) and each step of a window gets
its own gamma: the ``quantile`` of a Beta posterior over its bucket's matches and
mismatches, started from the pooled evidence of all buckets scaled to at most ``shrink``
pseudo-observations (empirical Bayes). A bucket with no evidence of its own then behaves
like the pooled estimate (the same, while the pooled evidence is under ``shrink``); one
with much evidence follows its own rate.

Worked example (quantile 0.3, shrink 32, the default). Pooled evidence: 150 matches, 6
mismatches, scaled by 32 / 156 to 31 and 1 pseudo-observations (rounded). Bucket 16-31
saw 40 matches and no mismatch: Beta(1 + 40 + 31, 1 + 0 + 1), gamma 0.967. Bucket 8-15
saw 30 matches and 5 mismatches: Beta(62, 7), gamma 0.883. An empty bucket: Beta(32, 2),
gamma 0.928 (the pooled posterior Beta(151, 7) would say 0.949 for every step).

The shrink weighs as much as the prior's evidence per bucket (32 observations): measured
at 4M rows, a shrink of 8 made thin buckets' lower quantiles cautious enough to cut the
mean stride from 10.5 to 8.2 and the speed-up from 2.16x to 1.99x (fixed s = 16: 2.13x and
2.10x in the same runs).

Each window is evidence for the buckets its steps fall in: ``matched`` steps from
``start`` are matches, and the step after them, if ``matched < s``, a mismatch.
"""

from __future__ import annotations

from collections.abc import Iterable

from ralm.stride.beta_posterior import beta_quantile_int, pseudo_observations

BUCKETS = 9  # positions 0, 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64-127, 128 and over


def bucket(position: int) -> int:
    """The bucket of a step ``position`` committed steps into the request.

    >>> [bucket(p) for p in (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 500)]
    [0, 1, 2, 2, 3, 3, 4, 5, 5, 6, 8]
    """
    return min(max(position, 0).bit_length(), BUCKETS - 1)


class PositionEvidence:
    """Matches and mismatches per position bucket."""

    def __init__(self, counts: dict[int, tuple[int, int]] | None = None):
        self.matched = [0] * BUCKETS
        self.missed = [0] * BUCKETS
        for b, (m, f) in (counts or {}).items():
            self.matched[b] += int(m)
            self.missed[b] += int(f)

    def add_window(self, start: int, s: int, matched: int) -> None:
        """A verified window of ``s`` steps from position ``start``, ``matched`` of them right."""
        for j in range(matched):
            self.matched[bucket(start + j)] += 1
        if matched < s:
            self.missed[bucket(start + matched)] += 1

    def counts(self) -> dict[int, tuple[int, int]]:
        """{bucket: (matched, missed)} of the buckets with evidence."""
        return {b: (m, f) for b, (m, f) in enumerate(zip(self.matched, self.missed)) if m or f}

    def totals(self) -> tuple[int, int]:
        return sum(self.matched), sum(self.missed)

    def step_gammas(self, start: int, n: int, quantile: float, shrink: int) -> list[float]:
        """gamma of each of the ``n`` steps from position ``start`` (see the module docstring)."""
        pm, pf = pseudo_observations(*self.totals(), shrink)
        by_bucket: dict[int, float] = {}
        out = []
        for p in range(start, start + n):
            b = bucket(p)
            if b not in by_bucket:
                by_bucket[b] = beta_quantile_int(quantile, 1 + self.matched[b] + pm, 1 + self.missed[b] + pf)
            out.append(by_bucket[b])
        return out


def scaled(counts: Iterable[tuple[int, int, int]], weight: int) -> dict[int, tuple[int, int]]:
    """Sum (bucket, matched, missed) triples and scale each bucket to at most ``weight``
    pseudo-observations (rounded), as the pooled prior is scaled."""
    tot: dict[int, list[int]] = {}
    for b, m, f in counts:
        t = tot.setdefault(b, [0, 0])
        t[0] += m
        t[1] += f
    return {b: pseudo_observations(m, f, weight) for b, (m, f) in tot.items() if m + f}
