"""``--concurrency N`` of ``ralmspec bench spec`` and ``ralmspec eval``: one configuration's
requests run N at a time through one in-process pipeline.

The N request threads share one retriever and one :class:`ralm.engine.LMEngine`; the
engine's continuous batcher (:mod:`ralm.batching.continuous_batcher`) packs their steps into one
forward per iteration, and since that forward is batch-invariant every request's tokens
are the ones it gets alone, so the exactness check against RaLMSeq is unchanged.

Thread safety of what the requests share (checked, so no extra lock is taken here):

* the engine: model work runs on the batcher's thread only; the doc-KV tree and the KV
  session store have their own locks;
* EDR/ADR (:mod:`ralm.retrieval.dense`): FAISS indexes are safe for concurrent searches,
  the one global FAISS setting that is changed is under the lock of :mod:`ralm.retrieval.faiss_search`, the bf16 scan only
  reads, and queries are encoded on the encoder's single worker with its memo under a lock;
* SR (:mod:`ralm.retrieval.bm25`): every Lucene call is under ``JVM_LOCK`` and the BM25
  scorer's caches under its own lock.

Only the retrievers' ``stats`` counters may lose an increment under races; they are
diagnostics, never read by these reports.

RaLMSpec's asynchronous verification submits ``kb.batch_search`` to an executor and waits
for it; a verification never waits on a request thread, so N requests sharing a pool
cannot deadlock. Each wave still gets its own pool of N verification workers
(:func:`verify_pool`), so that with N > 8 no request queues behind another's verification
(the process-wide default pool has 8).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ralm.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")

CONCURRENCY_HELP = (
    "requests run at once per configuration (threads sharing the in-process engine, whose continuous "
    "batcher batches their steps); 1 runs them one by one, each cold. With N > 1 the caches are "
    "cleared once per configuration and the report adds throughput (requests/s, tokens/s)"
)


def check_concurrency(n: int, engine: Any = None) -> int:
    """``n`` if usable: at least 1, and above 1 only with an ``engine`` that has the
    continuous batcher (not checked when ``engine`` is ``None``)."""
    if n < 1:
        raise ConfigError(f"--concurrency must be at least 1, not {n}")
    if n > 1 and engine is not None and getattr(engine, "batcher", None) is None:
        raise ConfigError("--concurrency > 1 needs the continuous batcher (generator.invariant=true)")
    return n


def verify_pool(concurrency: int) -> ThreadPoolExecutor:
    """The asynchronous-verification executor of one wave of ``concurrency`` requests."""
    return ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="ralm-wave-verify")


def _detach_jvm() -> None:
    # pyjnius attaches every thread that calls Java (SR) to the JVM and never detaches it;
    # a worker thread ends here, so it detaches itself (a no-op if it never attached)
    jnius = sys.modules.get("jnius")
    if jnius is not None:
        try:
            jnius.detach()
        except Exception:  # pragma: no cover - best effort at thread end
            pass


def ordered_map(fn: Callable[[T], R], items: Sequence[T], concurrency: int) -> Iterator[R]:
    """``fn(item)`` for every item on ``concurrency`` worker threads, yielded in ``items``'
    order (each as soon as it and every earlier one have finished). An exception of ``fn``
    is raised here, at its item's turn, after the workers stop taking new items."""
    futures: list[Future[R]] = [Future() for _ in items]
    lock = threading.Lock()
    next_index = 0
    stop = threading.Event()

    def worker() -> None:
        nonlocal next_index
        try:
            while not stop.is_set():
                with lock:
                    i = next_index
                    next_index += 1
                if i >= len(items):
                    return
                try:
                    futures[i].set_result(fn(items[i]))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    futures[i].set_exception(e)
        finally:
            _detach_jvm()

    threads = [
        threading.Thread(target=worker, name=f"ralm-request-{w}", daemon=True)
        for w in range(min(max(1, concurrency), len(items)))
    ]
    for t in threads:
        t.start()
    try:
        for f in futures:
            yield f.result()
    finally:
        stop.set()
        for t in threads:
            t.join()


@dataclass
class Throughput:
    """One configuration's wave: its requests, generated tokens and wall time."""

    concurrency: int
    requests: int
    tokens: int
    wall_s: float

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, other: Throughput) -> Throughput:
        """Two waves of one configuration as one (their wall times add up)."""
        return Throughput(
            self.concurrency, self.requests + other.requests, self.tokens + other.tokens, self.wall_s + other.wall_s
        )


def run_wave(
    fn: Callable[[T], R], items: Sequence[T], concurrency: int, tokens: Callable[[R], int]
) -> tuple[list[R], Throughput]:
    """All ``items`` through ``fn`` with ``concurrency`` threads: results in item order and
    the wave's throughput (``tokens(result)``: a result's generated token count)."""
    t0 = time.perf_counter()
    results = list(ordered_map(fn, items, concurrency))
    wall = time.perf_counter() - t0
    return results, Throughput(concurrency, len(results), sum(tokens(r) for r in results), wall)
