"""Continuous batching: one thread owns the model and runs one batched forward per iteration.

Callers (request threads, a serving replica's handlers) :meth:`~ContinuousBatcher.submit` a
:class:`~ralm.batching.engine.StepCall` and wait on the returned future. Between two
iterations the loop admits every newly submitted step and retires every finished one, so
requests join and leave at iteration granularity: no lock-step, no global lock. A step
whose start fails (bad input) fails its own future only.

Other work that needs the model (a drafted step, KNN-LM hidden states) is run on the same
thread between iterations through :meth:`~ContinuousBatcher.call`, so the model is never
used by two threads at once.

Metrics: histograms of sequences and tokens per iteration, generated tokens, busy time,
tokens/s, and each iteration's *host time*: the loop's wall time per iteration (admitting
steps, planning, packing, picking tokens, retiring steps) minus the model's forward, with
its mean, median and 99th percentile over the last :data:`HOST_WINDOW` iterations
(:meth:`~ContinuousBatcher.metrics`). On a GPU the host time is what keeps the device
waiting between two forwards.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ralm.batching.engine import ActiveStep, BatchEngine, FeedCall, StepCall

log = logging.getLogger(__name__)

#: sequences-per-iteration histogram buckets (upper bounds)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
HOST_WINDOW = 1024  # recent iterations kept for the host-time percentiles


def _bucket(n: int) -> int:
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return BATCH_BUCKETS[-1] * 2


class ContinuousBatcher:
    """The iteration loop over a :class:`BatchEngine`, on a daemon thread started on first use."""

    def __init__(self, engine: BatchEngine, name: str = "ralm-batcher"):
        self.engine = engine
        self.name = name
        self._inbox: queue.SimpleQueue[tuple[str, Any, Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stop = False
        self.iterations = 0
        self.batch_hist: Counter[int] = Counter()
        self.tokens_fed = 0
        self.tokens_generated = 0
        self.steps_done = 0
        self.busy_s = 0.0
        self.forward_s = 0.0  # of busy_s, in the model's forward
        self.host_s = 0.0  # loop time outside the forward, over every iteration
        self._host_recent: deque[float] = deque(maxlen=HOST_WINDOW)  # seconds per iteration
        self.on_host_time: Callable[[float], None] | None = None  # e.g. a metrics counter
        self.max_batch = 0
        self._seq_total = 0

    # ------------------------------------------------------------------ API
    def submit(self, call: StepCall | FeedCall) -> Future:
        """Queue a step (the future's result is its :class:`~ralm.step_output.StepOutput`) or a
        feed (its :class:`~ralm.batching.engine.FeedOutput`)."""
        fut: Future = Future()
        self._ensure_thread()
        self._inbox.put(("step", call, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the model's thread between two iterations."""
        fut: Future = Future()
        self._ensure_thread()
        self._inbox.put(("call", fn, fut))
        return fut

    def metrics(self) -> dict:
        """Batch-size histogram, token counts and throughput since start."""
        busy = self.busy_s
        recent = sorted(self._host_recent)

        def pct(q: float) -> float:
            return recent[min(len(recent) - 1, int(q * len(recent)))] * 1e3 if recent else 0.0

        return {
            "iterations": self.iterations,
            "batch_size_histogram": {f"<={b}": self.batch_hist[b] for b in sorted(self.batch_hist)},
            "max_batch": self.max_batch,
            "mean_batch": self._seq_total / self.iterations if self.iterations else 0.0,
            "tokens_fed": self.tokens_fed,
            "tokens_generated": self.tokens_generated,
            "steps_done": self.steps_done,
            "busy_s": busy,
            "generated_tokens_per_s": self.tokens_generated / busy if busy > 0 else 0.0,
            "forward_s": self.forward_s,
            "host_s": self.host_s,
            "host_share": self.host_s / (self.host_s + self.forward_s) if self.host_s + self.forward_s > 0 else 0.0,
            "host_ms_per_iteration": self.host_s * 1e3 / self.iterations if self.iterations else 0.0,
            "host_ms_p50": pct(0.5),
            "host_ms_p99": pct(0.99),
        }

    def close(self) -> None:
        self._stop = True
        if self._thread is not None:
            self._inbox.put(("stop", None, Future()))
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ loop
    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def _admit(self, item: tuple[str, Any, Future], active: list[tuple[ActiveStep, Future]]) -> None:
        kind, payload, fut = item
        if kind == "stop":
            self._stop = True
            return
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if kind == "call":
                fut.set_result(payload())
            else:
                active.append((self.engine.start(payload), fut))
        except BaseException as e:  # the caller's error, not the loop's
            fut.set_exception(e)

    def _loop(self) -> None:
        active: list[tuple[ActiveStep, Future]] = []
        while not self._stop:
            if not active:
                self._admit(self._inbox.get(), active)  # idle: block for work
            t_loop = time.perf_counter()  # the iteration's host time starts here (not while idle)
            while True:  # admit everything that arrived since the last iteration
                try:
                    self._admit(self._inbox.get_nowait(), active)
                except queue.Empty:
                    break
            if not active:
                continue
            try:
                t0 = time.perf_counter()
                st = self.engine.iterate([a for a, _ in active])
                self.busy_s += time.perf_counter() - t0
            except BaseException as e:  # a failed forward fails the steps in it, not the loop
                log.exception("batched forward failed")
                for a, fut in active:
                    self.engine.abandon(a)
                    fut.set_exception(e)
                active = []
                continue
            self.iterations += 1
            self._seq_total += st.sequences
            self.batch_hist[_bucket(st.sequences)] += 1
            self.max_batch = max(self.max_batch, st.sequences)
            self.tokens_fed += st.tokens
            still = []
            for a, fut in active:
                if a.done:
                    out = self.engine.finish(a)
                    self.tokens_generated += 0 if a.is_feed else len(out.tokens)
                    self.steps_done += 1
                    fut.set_result(out)
                else:
                    still.append((a, fut))
            active = still
            self._record_host(time.perf_counter() - t_loop - st.forward_s, st.forward_s)

    def _record_host(self, host_s: float, forward_s: float) -> None:
        host_s = max(0.0, host_s)
        self.forward_s += forward_s
        self.host_s += host_s
        self._host_recent.append(host_s)
        if self.on_host_time is not None:
            self.on_host_time(host_s)
