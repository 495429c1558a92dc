"""Serving metrics through Ray's metrics API (``ray.util.metrics``).

Ray exports them on every node's metrics export port (Prometheus text format) with a
``ray_`` prefix, and counters get a ``_total`` suffix; ``k8s/grafana-dashboard.json`` reads:

==========================================  =========  ========================  ==================
exported name                               type       labels                    recorded by
==========================================  =========  ========================  ==================
ray_ralmspec_request_latency_seconds_*      histogram  retriever, method         coordinator
ray_ralmspec_kb_calls_total                 counter    retriever, method         coordinator
ray_ralmspec_cache_hit_rate                 gauge      retriever, method         coordinator
ray_ralmspec_rollbacks_total                counter    retriever, method         coordinator
ray_ralmspec_gamma                          gauge      retriever, method         coordinator
ray_ralmspec_stride_decisions_total         counter    retriever, method, reason coordinator
ray_ralmspec_verifier_batch_size_*          histogram  retriever                 verifier
ray_ralmspec_shard_latency_seconds_*        histogram  retriever, shard          shard actor
ray_ralmspec_generator_batch_size_*         histogram  (none)                    generator replica
ray_ralmspec_generator_tokens_total         counter    (none)                    generator replica
ray_ralmspec_generator_busy_seconds_total   counter    (none)                    generator replica
ray_ralmspec_generator_host_seconds_total   counter    (none)                    generator replica
==========================================  =========  ========================  ==================

``method`` is ``seq`` or ``spec[...]`` (e.g. ``spec[PSA]``). The cache hit rate of a
request is the fraction of its speculative-cache lookups whose document the KB confirmed
(``(matched_steps + shadow_hits) / cache_lookups``: right guesses, speculative or
the shadow guesses of direct steps, per lookup); the gauges hold the last request's value per process.
Recording is best effort: outside a Ray worker, or if Ray's metrics fail, it does nothing,
and it never changes a result.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "ralmspec_"
LATENCY_BOUNDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0]
BATCH_BOUNDS: list[float] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
SHARD_BOUNDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]

_lock = threading.Lock()
_metrics: SimpleNamespace | None = None
_disabled = False


def _get() -> SimpleNamespace | None:
    global _metrics, _disabled
    if _metrics is not None or _disabled:
        return _metrics
    with _lock:
        if _metrics is not None or _disabled:
            return _metrics
        try:
            import ray

            if not ray.is_initialized():
                return None
            from ray.util.metrics import Counter, Gauge, Histogram

            req = ("retriever", "method")
            _metrics = SimpleNamespace(
                latency=Histogram(
                    PREFIX + "request_latency_seconds",
                    description="End-to-end latency of a request in its coordinator.",
                    boundaries=LATENCY_BOUNDS,
                    tag_keys=req,
                ),
                kb_calls=Counter(
                    PREFIX + "kb_calls",
                    description="Knowledge-base calls (a batched verification counts once).",
                    tag_keys=req,
                ),
                cache_hit_rate=Gauge(
                    PREFIX + "cache_hit_rate",
                    description="Speculative cache hit rate of the last "
                    "request: right guesses (matched speculative steps and direct steps' shadow guesses) / cache lookups.",
                    tag_keys=req,
                ),
                rollbacks=Counter(
                    PREFIX + "rollbacks",
                    description="Verifications that rolled back a wrong speculated document.",
                    tag_keys=req,
                ),
                gamma=Gauge(
                    PREFIX + "gamma",
                    description="OS3 speculation accuracy estimate at the end of the last request.",
                    tag_keys=req,
                ),
                batch_size=Histogram(
                    PREFIX + "verifier_batch_size",
                    description="Queries per batch flushed by the cross-request verifier.",
                    boundaries=BATCH_BOUNDS,
                    tag_keys=("retriever",),
                ),
                gen_batch=Histogram(
                    PREFIX + "generator_batch_size",
                    description="Sequences per batched forward of a generator replica (continuous batching).",
                    boundaries=BATCH_BOUNDS,
                ),
                gen_tokens=Counter(
                    PREFIX + "generator_tokens",
                    description="Tokens generated by a generator replica's batched forwards.",
                ),
                gen_busy=Counter(
                    PREFIX + "generator_busy_seconds",
                    description="Seconds a generator replica spent in batched forwards (tokens/s = rate(tokens) / rate(busy)).",
                ),
                gen_host=Counter(
                    PREFIX + "generator_host_seconds",
                    description="Seconds a generator replica's iteration loop spent outside the model's forward (host share = rate(host) / (rate(host) + rate(busy))).",
                ),
                stride_decisions=Counter(
                    PREFIX + "stride_decisions",
                    description="RaLMSpec's stride decisions by reason: speculate, direct_shared (the shared KB makes a window dearer), direct_crowded, direct_model, direct_measured (ralm.stride.load_gate.REASONS).",
                    tag_keys=("retriever", "method", "reason"),
                ),
                state_skipped=Counter(
                    PREFIX + "state_store_skipped_total",
                    description="State-store calls skipped while the store was unreachable (requests served without checkpoints / KB cache).",
                    tag_keys=("op",),
                ),
                shard_latency=Histogram(
                    PREFIX + "shard_latency_seconds",
                    description="Latency of one batched search on one index shard.",
                    boundaries=SHARD_BOUNDS,
                    tag_keys=("retriever", "shard"),
                ),
            )
        except Exception as e:  # never let metrics break serving
            log.warning("ralmspec metrics disabled: %s", e)
            _disabled = True
    return _metrics


def record_request(stats: Any) -> None:
    """Per-request metrics from a :class:`~ralm.results.RequestStats` (in the coordinator)."""
    m = _get()
    if m is None:
        return
    try:
        tags = {"retriever": str(stats.retriever or "unknown"), "method": str(stats.method or "unknown")}
        m.latency.observe(float(stats.total_time_s), tags=tags)
        _add(m.kb_calls, stats.kb_calls, tags)
        _add(m.rollbacks, stats.rollbacks, tags)
        if stats.cache_lookups:
            m.cache_hit_rate.set((stats.matched_steps + stats.shadow_hits) / stats.cache_lookups, tags=tags)
        if stats.gamma is not None:
            m.gamma.set(float(stats.gamma), tags=tags)
        for reason, n in (getattr(stats, "stride_reasons", None) or {}).items():
            _add(m.stride_decisions, n, {**tags, "reason": str(reason)})
    except Exception as e:
        log.debug("metrics: %s", e)


def _add(counter: Any, value: float, tags: dict) -> None:
    if value > 0:
        counter.inc(float(value), tags=tags)
    else:  # export the series at 0 (rate() shows 0, not "no data"); inc() refuses 0
        try:
            counter._record(0.0, tags=tags)
        except Exception:
            pass


def record_state_store_skip(op: str) -> None:
    """A state-store call a coordinator skipped during an outage (``op``: save_checkpoint, ...)."""
    m = _get()
    if m is None:
        return
    try:
        m.state_skipped.inc(1.0, tags={"op": str(op)})
    except Exception as e:
        log.debug("metrics: %s", e)


def record_batch(retriever: str, n_queries: int) -> None:
    """One flushed verifier batch of ``n_queries`` queries."""
    m = _get()
    if m is None:
        return
    try:
        m.batch_size.observe(float(n_queries), tags={"retriever": str(retriever)})
    except Exception as e:
        log.debug("metrics: %s", e)


def record_shard_search(retriever: str, shard: int, seconds: float) -> None:
    """One batched search on one shard."""
    m = _get()
    if m is None:
        return
    try:
        m.shard_latency.observe(float(seconds), tags={"retriever": str(retriever), "shard": str(shard)})
    except Exception as e:
        log.debug("metrics: %s", e)


def record_generator_host(seconds: float) -> None:
    """One iteration's host time (its loop time outside the model's forward)."""
    m = _get()
    if m is None or seconds <= 0:
        return
    try:
        m.gen_host.inc(float(seconds))
    except Exception as e:
        log.debug("metrics: %s", e)


def record_generator_iteration(stats: Any) -> None:
    """One batched forward of a generator replica (a :class:`~ralm.batching.engine.IterationStats`)."""
    m = _get()
    if m is None:
        return
    try:
        m.gen_batch.observe(float(stats.sequences))
        if stats.generated > 0:
            m.gen_tokens.inc(float(stats.generated))
        if stats.seconds > 0:
            m.gen_busy.inc(float(stats.seconds))
    except Exception as e:
        log.debug("metrics: %s", e)
