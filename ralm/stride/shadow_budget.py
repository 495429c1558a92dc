"""The shadow budget: how much cache work a direct (s = 0) step may do.

A direct step is a RaLMSeq step: the KB answers it, and nothing the cache does in it
changes its token. The cache still *probes* on some direct steps (it guesses the step's
document or neighbours before the KB answers) so that OS3 keeps measuring gamma and can
return to speculation when it would pay. A probe is overhead the baseline does not pay,
so probes are rationed: the probe work of a request's direct steps stays within
``SHADOW_BUDGET`` (a share) of the KB time those same steps spent.

Worked example (share 0.05): a BM25 KB at 2 ms a query and a cache lookup of 0.4 ms. The
first direct step probes (no cost known yet); after it, probes average one per
0.4 / 0.05 = 8 ms of KB time, one every 4 steps (steps 0, 8, 12, 16, ...: the free first
probe is paid back first). A dense KB at 200 ms a call affords a probe on every step.

Both speculation loops use it: document-level (:mod:`ralm.spec`) and KNN-LM
(:mod:`ralm.knnlm.loop`, whose probes also insert the last KB answer into the cache).
"""

from __future__ import annotations

from collections.abc import Hashable

from ralm import constants as C

LAST_PROBE_COST: dict[Hashable, float] = {}
"""KB key -> seconds of the last probe on that KB in this process: a new request's budget
starts from it, so that on a KB cheaper than its cache no request pays a probe to find that
out again. Without an entry the first direct step probes (its cost is unknown)."""


class ShadowBudget:
    """One request's probe allowance (see the module docstring). ``key`` names the KB and
    whatever sets a probe's cost (for KNN-LM: entries, k, entries fetched)."""

    def __init__(self, key: Hashable, share: float = C.SHADOW_BUDGET):
        self.key, self.share = key, share
        self.probe_s = 0.0  # seconds spent on probes so far
        self.kb_s = 0.0  # KB seconds of this request's direct steps so far
        self.next_cost_s = LAST_PROBE_COST.get(key, 0.0)  # the cost expected of the next probe

    def allowed(self) -> bool:
        """Whether the next probe fits: spent + expected cost <= share x KB time."""
        return self.probe_s + self.next_cost_s <= self.share * self.kb_s

    def spend(self, seconds: float) -> None:
        """A probe ran and took ``seconds``; the next probe is expected to cost as much."""
        self.next_cost_s = LAST_PROBE_COST[self.key] = seconds
        self.probe_s += seconds

    def add_kb_time(self, seconds: float) -> None:
        """A direct step's KB call took ``seconds``."""
        self.kb_s += seconds
