"""OS3: the optimal speculation stride scheduler (RaLMSpec paper, section 4 and appendix A.2).

Let ``a`` be the latency of a speculative step, ``b(s)`` that of a verification of batch
size ``s`` and ``gamma`` the speculation accuracy. The expected number of documents a
window of ``s`` verifies is ``(1 - gamma^s) / (1 - gamma)``. OS3 picks the ``s`` that
maximises verified documents per second:

- synchronous:  (1-g^s) / ((1-g) (s a + b))
- asynchronous: (1-g^s) / ((1-g) [g^s ((s-1) a + max(a, b)) + (1-g^s)(s a + b)])

Worked example (synchronous, a = 10 ms, b = 40 ms, gamma = 0.6):
s=1: 1/50 = 0.0200, s=2: 1.6/60 = 0.0267, s=3: 1.96/70 = 0.0280, s=4: 2.18/80 = 0.0272
(each divided by 1-g=0.4, which does not change the argmax) -> s = 3.

gamma is estimated over the last ``w`` verifications as sum(M) / (sum(M) + sum(1[M < s]))
(M = matched steps of a window of size s), capped at ``gamma_max``.

**Extension: s = 0 (direct retrieval).** The paper's objective leaves out the cost of the
correction step after a mismatch (one more generation step, ``g``). When retrieval is
much cheaper than generation (small HNSW or BM25 indexes) every stride >= 1 is slower
than plain RaLMSeq, because rollbacks cost more generation than speculation saves in
retrieval. With ``allow_direct`` the scheduler compares the best stride's rate, now
counting the correction, ``E(s) / (L(s) + (1-g^s) g)``, with the rate of a direct step,
``1 / (g + b_direct)``, and returns 0 when direct is faster. A direct step is exactly a
RaLMSeq step, so outputs do not change; the loop still asks the cache for its guess and
records whether it was right, so gamma stays current and speculation resumes when it
pays.

**Extension: gamma without a cap (the default, ``gamma_estimate='bayes'``).** The paper
caps its estimate at 0.6 because a few lucky windows would otherwise send the stride to its
maximum; but with prefetching the measured accuracy is about 0.95, and the cap then picks
strides that are too short (3-4 where 8 or more is faster). Instead each window is read as
Bernoulli evidence (``M`` matched steps, and one mismatch if ``M < s``), gamma gets a
Beta(1 + sum M, 1 + mismatches) posterior over the last 32 windows, and the scheduler uses
its ``gamma_quantile`` quantile (0.3): cautious while evidence is thin, close to the
measured accuracy once it is not, with no hand-set cap. Worked example at quantile 0.3:
no window yet, Beta(1, 1), gamma = 0.3; one matched window of s = 1, Beta(2, 1) (CDF x^2),
gamma = 0.548; then a matched window of s = 3, Beta(5, 1), gamma = 0.786; then s = 8 with
a mismatch after 6, Beta(11, 2), gamma = 0.809. The start rule below then uses the
posterior's upper quantile (1 - 0.3) as its optimistic prior. In this mode the argmax also
counts the correction step after a mismatch.

**Extension: b(s) measured per batch size (with ``gamma_estimate='bayes'``).** The paper's
model, and the ``capped`` mode here, fits a line through recent (s, b) pairs. A line fitted
to sizes 1 and 2 alone extrapolates any step between them to every larger size, and a
batch kernel's cost is not linear: measured at 4M rows with the int8 scan, b(1) = 169 ms,
b(16) = 368 ms, while one noisy b(2) made the line predict b(8) > 800 ms. The scheduler
then kept s = 1, which only measured b(1) again, until the b(2) point left the history 16
windows later. In bayes mode b(s) is the recent mean at each measured size, linear in
between, non-decreasing (a running maximum over sizes), and flat beyond the largest size
measured. Flat is optimistic (b only grows with s), so an unmeasured larger batch gets
tried once, and its measurement then corrects the estimate: on a KB whose batches cost
s times one query, the next decisions fall back to short strides. Worked example: means
b(1) = 0.17, b(2) = 0.26 -> b(8) = 0.26 (flat), so s = 8 is tried; it measures 0.30, and
now b(4) = 0.26 + (0.30 - 0.26) * 2/6 = 0.273.

**Extension: b(s) from the KB's start-up timings.** Where a KB timed its batch sizes (exact
dense, :mod:`ralm.stride.batch_cost`), b(s) beyond the largest size measured follows that curve, not
flat: b(1) = 0.17 s and {1: 1.0, 4: 1.3, 16: 3.4} give b(8) = 0.34 s before any batch ran.

**Extension: gamma by position, and the request's end (the default, ``'positional'``).**
Mismatches cluster in the middle of a request; each step of a window gets the gamma of
its position bucket (:mod:`ralm.stride.position_gamma`), and with the steps left known the first
stride is the one that finishes the request soonest (:func:`finish_time_stride`).

**Start.** The paper starts at s = 1. Here the loop's step 0 runs on the warm-up KB call
(:mod:`ralm.spec`), which measures b(1), the query encoding and a generation step before
the first decision. With ``allow_direct``, that decision compares direct steps with the
best stride at the optimistic prior gamma = gamma_max: if even that loses, the request
starts with direct steps (no rollback is ever paid on a KB cheaper than a step), else it
starts speculating at s = 1 as the paper does. Before any speculative step, ``a`` is
estimated as generation plus the measured lookup (encoding + cache search), the two
parts a speculative step consists of.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Mapping
from statistics import fmean

from ralm import constants as C
from ralm.config import SpecConfig
from ralm.stride.batch_cost import curve_at, monotone, scaled
from ralm.stride.beta_posterior import beta_quantile_int
from ralm.stride.gamma_prior import GammaPrior
from ralm.stride.position_gamma import PositionEvidence


def expected_verified(gamma: float, s: int) -> float:
    """(1 - gamma^s) / (1 - gamma): expected documents verified by a window of ``s``."""
    if gamma >= 1.0:
        return float(s)
    return (1.0 - gamma**s) / (1.0 - gamma)


def window_latency(s: int, gamma: float, a: float, b: float, asynchronous: bool, correction: float = 0.0) -> float:
    """Expected wall time of a window of ``s`` (plus ``correction`` on a mismatch)."""
    return _latency(s, gamma**s, a, b, asynchronous, correction)


def _latency(s: int, all_match: float, a: float, b: float, asynchronous: bool, correction: float) -> float:
    """Expected wall time of a window of ``s`` whose steps all match with probability ``all_match``."""
    if asynchronous:
        lat = all_match * ((s - 1) * a + max(a, b)) + (1 - all_match) * (s * a + b)
    else:
        lat = s * a + b
    return lat + (1 - all_match) * correction


def objective(s: int, gamma: float, a: float, b: float, asynchronous: bool, correction: float = 0.0) -> float:
    """Expected verified documents per second for stride ``s`` (a, b in seconds)."""
    return expected_verified(gamma, s) / max(window_latency(s, gamma, a, b, asynchronous, correction), 1e-12)


def window_rates(
    gammas: list[float], a: float, b: dict[int, float], asynchronous: bool, correction: float
) -> list[float]:
    """Verified documents per second of each stride s = 1..len(gammas) when step j of the
    window matches with probability ``gammas[j]`` (given the steps before it matched):
    E(s) = sum_{j<s} prod_{t<j} gammas[t], the steps all match with prod_{t<s} gammas[t].
    With every gamma equal this is :func:`objective`.

    >>> [round(r, 4) for r in window_rates([0.6] * 4, 0.010, {s: 0.040 for s in range(1, 5)}, False, 0.0)]
    [20.0, 26.6667, 28.0, 27.2]
    """
    rates, expected, all_match = [], 0.0, 1.0
    for s, g in enumerate(gammas, start=1):
        expected += all_match  # P(the first s-1 steps matched): step s is verified
        all_match *= g
        rates.append(expected / max(_latency(s, all_match, a, b[s], asynchronous, correction), 1e-12))
    return rates


def finish_time_stride(
    gammas: list[float], a: float, b: dict[int, float], asynchronous: bool, correction: float
) -> tuple[int, float]:
    """The first stride that minimises the expected time to commit the ``len(gammas)``
    steps left in the request, and that time (seconds); ``gammas[t]``: gamma of the step
    ``t`` steps from now; strides up to ``max(b)``.

    The rate objective is the long-run answer; a request is short (32 steps at 128 tokens in
    steps of 4), and a window cut short by the request's end still costs a whole KB call:
    at 4M rows (a KB call about 8 speculative steps) strides of 10 from step 1 end with
    windows of 10, 10, 10 and 1, five KB calls, where 16 and 15 take three. Dynamic
    programming over the steps left r (T(0) = 0):

        T(r) = min_s  P_s (L_match(s) + T(r - s))
                      + sum_{j<s} P_j (1 - g_j) (L_miss(s) + T(r - j - 1))

    with P_j = prod_{t<j} g_t (the first j steps match), a mismatch at step j committing j
    steps and the correction, and the latencies of :func:`window_latency`. O(r x max(b)).

    Worked example (synchronous, a = 1, b = 8, every gamma 1, 20 steps, strides to 16):
    T(20) = two windows; 16 + 4 costs 16 + 8 + 4 + 8 = 36, as does 10 + 10; any first
    stride from 4 to 16 ties, and the smallest wins ties.

    >>> finish_time_stride([1.0] * 20, 1.0, {s: 8.0 for s in range(1, 17)}, False, 0.0)
    (4, 36.0)
    """
    n, top = len(gammas), max(b)
    T = [0.0] * (n + 1)
    first = [1] * (n + 1)
    for r in range(1, n + 1):
        p0, best = n - r, math.inf
        all_match, miss_prob, miss_t = 1.0, 0.0, 0.0
        for s in range(1, min(top, r) + 1):
            g = gammas[p0 + s - 1]
            miss = all_match * (1.0 - g)  # the steps before matched, this one did not: s committed
            miss_prob += miss
            miss_t += miss * T[r - s]
            all_match *= g
            lat_match = (s - 1) * a + max(a, b[s]) if asynchronous else s * a + b[s]
            cost = all_match * (lat_match + T[r - s]) + miss_prob * (s * a + b[s] + correction) + miss_t
            if cost < best * (1 - 1e-12):
                best, first[r] = cost, s
        T[r] = best
    return first[n], T[n]


class StrideScheduler:
    """Chooses the speculation stride; fixed unless ``cfg.adaptive_stride`` (OS3)."""

    def __init__(
        self,
        cfg: SpecConfig,
        history: int = 16,
        prior: GammaPrior | None = None,
        prior_key: Hashable = None,
        cost_curve: Mapping[int, float] | None = None,
    ):
        """``prior``: earlier requests' evidence under ``prior_key`` (bayes mode; :mod:`ralm.stride.gamma_prior`),
        which :meth:`finish` extends; ``cost_curve``: the KB's start-up batch costs (bayes mode)."""
        self.cfg = cfg
        self.cost_curve = monotone(cost_curve) if cost_curve else None
        self.bayes = cfg.gamma_estimate != "capped"  # 'bayes' and 'positional' share the Beta machinery
        self.positional = cfg.gamma_estimate == "positional"
        self._prior = prior if (self.bayes and cfg.adaptive_stride and cfg.gamma_prior) else None
        self._prior_key = prior_key
        self._prior_ev = self._prior.evidence(prior_key) if self._prior is not None else (0, 0)
        # 'positional': evidence per position bucket, this request's (all its windows) and the prior's
        self._position = 0  # committed steps before the window (or direct step) being decided
        self._own_pos = PositionEvidence()
        self._pos = PositionEvidence(self._prior.position_evidence(prior_key) if self._prior is not None else None)
        self._windows: deque[tuple[int, int]] = deque(
            maxlen=C.BAYES_WINDOWS if self.bayes else cfg.os3_window
        )  # (s, matched)
        self._step_lat: deque[float] = deque(maxlen=history)  # speculative step, s
        self._gen_lat: deque[float] = deque(maxlen=history)  # generation only, s
        self._verify_lat: deque[tuple[int, float]] = deque(maxlen=history)  # (batch size, s)
        self._verify_by_size: dict[int, deque[float]] = {}  # batch size -> recent latencies, s
        self._own_step_lat: deque[float] = deque(maxlen=history)  # this request's own, for the prior
        self._own_verify: dict[int, list[float]] = {}  # this request's own KB calls by size, s
        self._direct_lat: deque[float] = deque(maxlen=history)  # direct retrieval, s
        self._lookup_lat: deque[float] = deque(maxlen=history)  # query + cache lookup, s
        self.decisions: list[int] = []
        # realized costs (bayes mode's rate check): seconds and committed steps in speculation
        # windows and in direct steps, this request's own and the prior's (scaled)
        self._own_realized = [0.0, 0, 0.0, 0]
        self._prior_realized = (0.0, 0.0, 0.0, 0.0)
        self._vetoed_direct = 0  # direct steps taken since the rate check last vetoed speculation
        self.vetoes = 0
        # the overlap check (module docstring): KB calls that nothing overlapped, by batch size;
        # this request's overlap ratios and the recent requests' (one mean each)
        self._sync_verify: dict[int, deque[float]] = {}
        self._overlap: deque[float] = deque(maxlen=history)
        self._prior_overlap: list[float] = []
        self._sync_run = 0  # windows run synchronously since the check last let one overlap
        self.overlap_off = 0  # windows the overlap check ran synchronously
        if self._prior is not None:  # what recent requests measured on this KB (ralm/stride/gamma_prior.py)
            ws, wn, ds, dn = self._prior.realized(prior_key)
            fw = min(1.0, C.GAMMA_PRIOR_WEIGHT / wn) if wn else 0.0  # at most that many steps each
            fd = min(1.0, C.GAMMA_PRIOR_WEIGHT / dn) if dn else 0.0
            self._prior_realized = (ws * fw, wn * fw, ds * fd, dn * fd)
            step, by_size = self._prior.latencies(prior_key)
            if step is not None:
                self._step_lat.append(step)
            for size, lat in by_size.items():
                self._verify_by_size[size] = deque([lat], maxlen=C.VERIFY_HISTORY_PER_SIZE)
                self._verify_lat.append((size, lat))
            self._prior_overlap = self._prior.overlap(prior_key)

    # ---- measurements
    def record_step(self, latency_s: float) -> None:
        """A speculative step: query, cache lookup and generation."""
        self._step_lat.append(latency_s)
        self._own_step_lat.append(latency_s)

    def record_generation(self, latency_s: float) -> None:
        """The generation part of any step."""
        self._gen_lat.append(latency_s)

    def record_verification(self, s: int, matched: int, latency_s: float, overlapped: bool = False) -> None:
        """The window just decided (from the position given to :meth:`next_stride`): its
        size, its steps that matched, and the KB call's latency (``overlapped``: a speculative
        step ran meanwhile, asynchronous verification)."""
        self._windows.append((s, matched))
        self._add_position_evidence(s, matched)
        self.record_kb_latency(s, latency_s, overlapped)

    def _add_position_evidence(self, s: int, matched: int) -> None:
        self._own_pos.add_window(self._position, s, matched)
        self._pos.add_window(self._position, s, matched)

    def record_kb_latency(self, s: int, latency_s: float, overlapped: bool = False) -> None:
        """A KB call of ``s`` queries that verified nothing (the first step's): b(s) only.
        One that nothing overlapped (``overlapped`` false) also prices the overlap check."""
        self._verify_lat.append((s, latency_s))
        self._verify_by_size.setdefault(s, deque(maxlen=C.VERIFY_HISTORY_PER_SIZE)).append(latency_s)
        self._own_verify.setdefault(s, []).append(latency_s)
        if not overlapped:
            self._sync_verify.setdefault(s, deque(maxlen=C.VERIFY_HISTORY_PER_SIZE)).append(latency_s)

    def record_overlap(self, phase_s: float, s: int, step_s: float | None) -> None:
        """An asynchronous window's overlapped phase: ``phase_s`` from the verification's start
        to its answer, the extra speculative step running meanwhile; ``step_s``: what one of the
        window's own (not overlapped) speculative steps took. Its ratio to running the two one
        after the other, ``phase_s / (step_s + b_sync(s))``, is the check's sample (nothing is
        recorded before a KB call that nothing overlapped was measured)."""
        b = self.sync_verify_latency(s)
        if b is None or step_s is None or step_s <= 0 or phase_s <= 0:
            return
        self._overlap.append(phase_s / (step_s + b))

    def sync_verify_latency(self, s: int) -> float | None:
        """b(s) measured with nothing overlapping it: the recent mean at the sizes measured,
        linear between them; beyond the largest, the KB's start-up curve, else proportional to
        ``s`` (which over-prices running one after the other, so the check only turns
        overlapping off on evidence)."""
        if not self._sync_verify:
            return None
        return self._per_size_latency(self._sync_verify, s, proportional_beyond=True)

    def overlap_ratio(self) -> float | None:
        """The mean overlap ratio, this request's windows and the recent requests' means
        together; None until ``OVERLAP_CHECK_MIN_WINDOWS`` of them."""
        samples = [*self._prior_overlap, *self._overlap]
        return fmean(samples) if len(samples) >= C.OVERLAP_CHECK_MIN_WINDOWS else None

    def _overlap_loses(self) -> bool:
        """The overlap check's verdict: overlapping saves less than ``OVERLAP_CHECK_MARGIN`` of
        running the step and the verification one after the other (adaptive strides only)."""
        if not (self.cfg.async_verify and self.cfg.overlap_check and self.cfg.adaptive_stride and self.bayes):
            return False
        r = self.overlap_ratio()
        return r is not None and r > 1.0 - C.OVERLAP_CHECK_MARGIN

    def async_pays(self) -> bool:
        """Whether the window about to be verified runs its verification asynchronously (one
        call per window). Off by the overlap check, except one window in every
        ``OVERLAP_CHECK_EXPLORE + 1``, which measures the overlap again."""
        if not self.cfg.async_verify:
            return False
        if not self._overlap_loses():
            self._sync_run = 0
            return True
        if self._sync_run >= C.OVERLAP_CHECK_EXPLORE:
            self._sync_run = 0
            return True
        self._sync_run += 1
        self.overlap_off += 1
        return False

    def record_direct(self, cache_was_right: bool | None, retrieval_s: float, lookup_s: float | None = None) -> None:
        """A direct (s = 0) step: its KB latency, whether the cache's guess was right (None:
        the cache did not guess on this step) and, if given, what the guess cost (query
        encoding and cache lookup)."""
        if cache_was_right is not None:
            self._windows.append((1, int(cache_was_right)))
            self._add_position_evidence(1, int(cache_was_right))
        self._direct_lat.append(retrieval_s)
        if lookup_s is not None:
            self.record_lookup(lookup_s)

    def record_lookup(self, latency_s: float) -> None:
        """The non-generation part of a speculative step (query encoding, cache lookup),
        measured outside one: it estimates ``a`` before any speculative step ran."""
        self._lookup_lat.append(latency_s)

    def record_realized(self, direct: bool, seconds: float, committed: int) -> None:
        """What a direct step (``direct``) or a whole speculation window (its steps, the
        verification, a rollback and the correction) really cost, and the steps it committed."""
        r = self._own_realized
        if direct:
            r[2] += seconds
            r[3] += committed
        else:
            r[0] += seconds
            r[1] += committed

    # ---- estimates
    def _own_evidence(self) -> tuple[int, int]:
        """(matched steps, mismatches) over this request's windows kept."""
        return sum(mt for _, mt in self._windows), sum(1 for s, mt in self._windows if mt < s)

    def _evidence(self) -> tuple[int, int]:
        """This request's evidence plus the prior's pseudo-observations (bayes mode)."""
        m, f = self._own_evidence()
        return m + self._prior_ev[0], f + self._prior_ev[1]

    def finish(self) -> None:
        """The request ended: its own evidence and latencies join the prior of later requests."""
        if self._prior is not None:
            own_steps = self._own_step_lat
            ws, wn, ds, dn = self._own_realized
            self._prior.record(
                self._prior_key,
                *self._own_evidence(),
                step_s=fmean(own_steps) if own_steps else None,
                verify_s={s: fmean(v) for s, v in self._own_verify.items()},
                realized=(float(ws), int(wn), float(ds), int(dn)),
                by_position=self._own_pos.counts(),
                overlap=fmean(self._overlap) if self._overlap else None,
            )

    @property
    def gamma(self) -> float | None:
        """The speculation accuracy estimate, or None before any evidence: the posterior's
        ``gamma_quantile`` quantile ('bayes', counting the prior of earlier requests), else
        the paper's capped maximum likelihood."""
        if not self._windows and self._prior_ev == (0, 0):
            return None
        m, fails = self._evidence()
        if self.bayes:
            return beta_quantile_int(self.cfg.gamma_quantile, 1 + m, 1 + fails)
        if m + fails == 0:
            return 0.0
        return min(m / (m + fails), self.cfg.gamma_max)

    def optimistic_gamma(self) -> float:
        """The start rule's prior: gamma_max ('capped'), or the posterior's upper quantile."""
        if not self.bayes:
            return self.cfg.gamma_max
        m, fails = self._evidence()
        return beta_quantile_int(1 - self.cfg.gamma_quantile, 1 + m, 1 + fails)

    def step_latency(self) -> float | None:
        """a: measured speculative steps; before any, generation plus the cache lookups
        measured in direct steps (a speculative step is exactly those two parts)."""
        if self._step_lat:
            return fmean(self._step_lat)
        if not self._gen_lat:
            return None
        return fmean(self._gen_lat) + (fmean(self._lookup_lat) if self._lookup_lat else 0.0)

    def generation_latency(self) -> float | None:
        """g: the mean generation part of recent steps (None before any)."""
        return fmean(self._gen_lat) if self._gen_lat else None

    def verify_latency(self, s: int) -> float | None:
        """b(s). Bayes mode: per-size means, interpolated (see the module docstring).
        Capped mode (the paper's): a least-squares line over recent (s, latency) when several
        sizes were seen, else their mean; slope and intercept clamped at zero."""
        if not self._verify_lat:
            return None
        if self.bayes:
            return self._interpolated_verify_latency(s)
        xs = [float(x) for x, _ in self._verify_lat]
        ys = [y for _, y in self._verify_lat]
        if len(set(xs)) < 2:
            return fmean(ys)
        mx, my = fmean(xs), fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
        intercept = max(0.0, my - slope * mx)
        return intercept + slope * s

    def _interpolated_verify_latency(self, s: int) -> float:
        return self._per_size_latency(self._verify_by_size, s)

    def _per_size_latency(
        self, by_size: Mapping[int, deque[float]], s: int, proportional_beyond: bool = False
    ) -> float:
        """b(s) from recent latencies per batch size (non-empty): their means made non-decreasing,
        linear between the sizes measured; beyond the largest, the KB's own start-up curve, else
        flat (optimistic, then measured) or, ``proportional_beyond``, growing with ``s``."""
        means = monotone({size: fmean(v) for size, v in by_size.items()})
        last = max(means)
        if s <= last:
            return curve_at(means, s)
        if self.cost_curve is not None:
            return scaled(self.cost_curve, last, means[last], s)
        return means[last] * s / last if proportional_beyond else means[last]

    def _known_verify_latency(self, s: int) -> float:
        """b(s) where a verification has been measured (the decision paths check that first)."""
        b = self.verify_latency(s)
        if b is None:
            raise RuntimeError("no verification latency measured yet: the stride cannot be optimised")
        return b

    # ---- decision
    def verify_table(self) -> dict[int, float]:
        """b(s) for s = 1..max_stride (computed once per decision)."""
        return {s: self._known_verify_latency(s) for s in range(1, self.cfg.max_stride + 1)}

    def step_gammas(self, g: float, n: int, pooled: bool = False) -> list[float]:
        """gamma of each of the next ``n`` steps from the current position: per position
        bucket ('positional', once there is evidence, unless ``pooled``;
        :mod:`ralm.stride.position_gamma`), else ``g`` for every step."""
        if self.positional and not pooled and any(self._pos.totals()):
            return self._pos.step_gammas(self._position, n, self.cfg.gamma_quantile, C.POSITION_SHRINK)
        return [g] * n

    def best_stride(
        self,
        g: float,
        a: float,
        remaining: int | None = None,
        pooled: bool = False,
        b: dict[int, float] | None = None,
    ) -> tuple[int, float]:
        """argmax over s of the paper's objective (with per-step gammas: :meth:`step_gammas`),
        and that s's rate counting corrections. 'positional', with ``remaining`` steps known
        and at most ``OS3_HORIZON``: the stride that finishes the request soonest
        (:func:`finish_time_stride`), and the rate ``remaining / expected time``.
        ``pooled``: one gamma ``g`` for every step and the rate objective (the 'bayes' answer).
        ``b``: :meth:`verify_table`, when the caller already has it."""
        cfg = self.cfg
        gen = fmean(self._gen_lat) if self._gen_lat else a
        corr = gen if self.bayes else 0.0  # the paper's argmax leaves the correction out
        b = b if b is not None else self.verify_table()
        overlap = cfg.async_verify and not self._overlap_loses()  # the model of the windows that will run
        if self.positional and not pooled and remaining is not None and 0 < remaining <= C.OS3_HORIZON:
            s, t = finish_time_stride(self.step_gammas(g, remaining), a, b, overlap, gen)
            return s, remaining / max(t, 1e-12)
        gammas = self.step_gammas(g, cfg.max_stride, pooled)
        rates = window_rates(gammas, a, b, overlap, corr)
        best_s, best = 1, -1.0
        for s, val in enumerate(rates, start=1):
            if val > best * (1 + 1e-9):
                best_s, best = s, val
        return best_s, window_rates(gammas[:best_s], a, b, overlap, gen)[-1]

    def speculation_loses(self) -> bool:
        """The rate check (bayes mode): once speculation windows have committed
        ``RATE_CHECK_MIN_STEPS`` steps (this request's and the prior's, scaled), is their
        realized cost per committed step more than ``RATE_CHECK_MARGIN`` above a direct
        step's (measured over 3 or more direct steps, else generation + b(1))?

        The model above predicts; this measures. They disagree where the model misses a
        cost: on BM25 over 8M passages (10 ms a query, 31 ms a generation step) the model
        chose s = 1 with asynchronous verification, whose discarded extra steps and
        corrections made every committed step dearer than a direct one (PSA 0.90x RaLMSeq).
        Worked example: windows took 2.2 s for 48 committed steps (45.8 ms each), direct
        steps 41 ms each: 45.8 > 41 x 1.03, so speculation is vetoed."""
        ws, wn, ds, dn = (o + p for o, p in zip(self._own_realized, self._prior_realized))
        if wn < C.RATE_CHECK_MIN_STEPS:
            return False
        if dn >= 3:
            direct = ds / dn
        elif self._gen_lat and self._verify_lat:
            direct = fmean(self._gen_lat) + self._known_verify_latency(1)
        else:
            return False
        return ws / wn > direct * (1 + C.RATE_CHECK_MARGIN)

    def next_stride(self, position: int | None = None, remaining: int | None = None) -> int:
        """The stride of the next window; 0 means one direct (RaLMSeq) step. ``position``:
        the steps committed so far (the window's or direct step's first position; the
        'positional' estimate reads its gammas from there); ``remaining``: the most steps
        the request can still take (the 'positional' estimate plans to its end)."""
        cfg = self.cfg
        if position is not None:
            self._position = position
        if not cfg.adaptive_stride:
            return cfg.stride
        g, a = self.gamma, self.step_latency()
        if a is None or not self._verify_lat:
            s = 1  # start at s = 1 until there is something to estimate
        else:
            start = g is None
            # No accuracy observed yet: the paper starts at s = 1. With the s = 0 extension,
            # first ask whether speculation could pay at all, at the optimistic prior
            # gamma = gamma_max; where even that loses to direct steps (cheap retrieval),
            # start with direct steps, whose shadow guesses then measure gamma.
            g0 = self.optimistic_gamma() if g is None else g
            b = self.verify_table()
            # whether to speculate at all is a long-run question: with 'positional' the
            # pooled gamma's rate decides it (positions only shape the stride). Measured on
            # BM25 over 1M passages, the per-position rate chose windows of 1 where direct
            # steps were as fast (PSA 0.96x against 1.02x for the pooled estimate).
            s, rate = self.best_stride(g0, a, pooled=True, b=b)  # one gamma for every step
            direct = False
            if cfg.allow_direct and self._gen_lat:
                gen = fmean(self._gen_lat)
                # a direct step costs generation + one KB retrieval (measured, or b(1) plus
                # the speculative step's non-generation overhead)
                b1 = fmean(self._direct_lat) if self._direct_lat else self._known_verify_latency(1) + max(0.0, a - gen)
                direct = 1.0 / max(gen + b1, 1e-12) > rate
            if direct:
                s = 0
            elif start:
                s = 1
            elif self.positional:
                # the stride itself from the per-position gammas, planned to the request's
                # end (not computed for a direct step: a decision costs ~0.5 ms there,
                # against a 2-6 ms BM25 query)
                s = self.best_stride(g0, a, remaining, b=b)[0]
            if s > 0 and self.bayes and cfg.allow_direct and self.speculation_loses():
                # measured slower than direct steps: direct, but let the model choose again
                # (one window, re-measured) every RATE_CHECK_EXPLORE direct steps
                if self._vetoed_direct < C.RATE_CHECK_EXPLORE:
                    self._vetoed_direct += 1
                    self.vetoes += 1
                    s = 0
                else:
                    self._vetoed_direct = 0
        self.decisions.append(s)
        return s
