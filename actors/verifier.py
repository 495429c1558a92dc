"""Cross-request verification batching (docs/design.md, "Cross-request verification batching").

One :class:`Verifier` actor per retriever kind takes the KB calls of every in-flight
request - RaLMSpec's verifications and first retrievals, RaLMSeq's per-step searches.
It collects them for a window (``window_ms``), until ``max_batch`` queries are waiting, or
until every request in flight is waiting on it, then sends **one** batched search to each
shard (through its :class:`~actors.shard_router.ShardedRetriever`) and routes each request's rows
back.

"Every request in flight is waiting" is what makes a long window cheap: coordinators
announce their requests (:meth:`Verifier.begin` / :meth:`Verifier.end`) and tag their KB
calls with them. A request has at most one KB call outstanding, so once each announced
request has a call queued, no further call can come and waiting longer only adds latency.
One request alone is therefore searched at once whatever the window; sixteen share one
search. Requests whose call is being searched do *not* count as waiting: counting them
splits the requests into groups that alternate on the KB forever (measured: exactly 4
queries per search at 16 in flight), while waiting for them (bounded by the window) merges
the groups into one. A request that opened a speculation window says so
(:meth:`Verifier.away`): it makes no KB call until that window's verification, several
generation steps later, so it is not waited for (``wait_for_speculating`` off, the default)
until its next call. Requests that stopped calling
(a coordinator that died before ``end``) are forgotten after ``ACTIVE_TTL_S``; the window
always bounds the wait.

Batching never changes a result: each query's KB result is independent of the batch it
arrives in (every retriever re-scores exactly and ranks by (score desc, doc id asc)).
Submissions with different ``k`` go in separate searches, so a query is always searched
with its own ``k`` (HNSW's candidate set depends on ``k``), except on a KB whose top-``k``
is the first ``k`` of its top-``K`` for every ``K > k`` (``merge_k``: exact dense retrieval,
whose candidate scan provably holds the exact top-``K`` and whose ranking is exact): there a
batch is one search at its largest ``k``, each answer cut to its own ``k`` (RaLMSpec's
direct steps ask for 1 document and its verifications for ``prefetch_size``). Identical
queries within a batch are searched once.

The verifier is also where coordinators get the KB's query representations and
document keys for their local caches (:meth:`Verifier.encode`, :meth:`Verifier.doc_keys`),
so those are the very bits the KB uses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.metrics import record_batch
from actors.shard_router import ShardedRetriever
from ralm.config import RetrieverConfig
from ralm.errors import RalmInputError
from ralm.retrieval.base import Hit
from ralm.retrievers import entry

log = logging.getLogger(__name__)

SearchFn = Callable[[list[str], int], Awaitable[list[list[Hit]]]]

ACTIVE_TTL_S = 120.0  # an announced request that has not called for this long is forgotten
# Server defaults (deployments/app.py VerifierOptions). The window only bounds the wait: with
# every in-flight request announced, a batch leaves as soon as all of them wait, so one request
# alone is never delayed. It must cover one round of generation steps of all requests in
# flight, or the latest ones miss the batch and the requests split into groups that take turns
# on the KB: 16 requests through one CPU generator replica take 16 x 30-50 ms (served
# benchmark, 16 RaLMSeq requests in flight: 5.8 queries per search at 400 ms, 7.6 at 1 s;
# RaLMSpec PSA 7.2 and 11.3). One batch in
# flight lets the next one fill up while it is searched (two halve each batch and compete for
# the same cores).
DEFAULT_WINDOW_MS = 1000.0
DEFAULT_MAX_INFLIGHT = 1


@dataclass
class _Item:
    queries: list[str]
    k: int
    future: asyncio.Future
    t: float
    requester: str | None = None
    searched: int = 0  # queries of the search that answered it (its batch, other requests' included)


@dataclass
class BatchStats:
    submissions: int = 0
    queries: int = 0
    batches: int = 0  # flushes
    early_flushes: int = 0  # flushes because every announced request was waiting
    searches: int = 0  # KB searches sent (one per distinct k per flush)
    searched_queries: int = 0  # after de-duplication
    max_batch_queries: int = 0
    max_batch_submissions: int = 0
    sizes: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["sizes"] = dict(sorted(self.sizes.items()))
        d["mean_submissions_per_batch"] = self.submissions / self.batches if self.batches else 0.0
        return d


class VerificationBatcher:
    """Async batcher: ``await submit(queries, k)`` returns exactly ``search(queries, k)``.

    ``search(queries, k)`` is an async function doing one batched KB search. With
    ``enabled=False`` every submission is searched on its own, immediately. With
    ``flush_when_all_waiting``, a batch also goes as soon as every request announced with
    :meth:`begin` has a submission pending, not counting requests marked :meth:`away` (unless
    ``wait_for_speculating``).
    """

    def __init__(
        self,
        search: SearchFn,
        window_ms: float = DEFAULT_WINDOW_MS,
        max_batch: int = 64,
        enabled: bool = True,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        flush_when_all_waiting: bool = True,
        wait_for_speculating: bool = False,
        merge_k: bool = False,
    ):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.search = search
        self.window_s = max(0.0, float(window_ms)) / 1000.0
        self.max_batch = int(max_batch)
        self.enabled = bool(enabled)
        self.stats = BatchStats()
        self.on_batch: Callable[[int], None] | None = None  # called with each flushed batch's size
        self._pending: list[_Item] = []
        self._n_pending = 0
        self._wake: asyncio.Event | None = None
        self._flusher: asyncio.Task | None = None
        self._sem: asyncio.Semaphore | None = None
        self._max_inflight = max(1, int(max_inflight))
        self._tasks: set[asyncio.Task] = set()
        self.flush_when_all_waiting = bool(flush_when_all_waiting)
        self._active: dict[str, float] = {}  # announced request -> time of its last call (monotonic s)
        self.wait_for_speculating = bool(wait_for_speculating)
        self.merge_k = bool(merge_k)  # one search per batch at its largest k (prefix-exact KBs only)
        self._away: set[str] = set()  # announced requests speculating until their next call

    # ---- requests in flight
    def begin(self, requester: str) -> None:
        """A request that will submit KB calls (tagged ``requester``) is in flight."""
        self._active[str(requester)] = time.monotonic()
        self._poke()

    def end(self, requester: str) -> None:
        """That request finished: the others need not wait for it."""
        self._active.pop(str(requester), None)
        self._away.discard(str(requester))
        self._poke()

    def away(self, requester: str) -> None:
        """That request runs speculative steps until its next call: unless
        ``wait_for_speculating``, a batch need not wait for it. Its next submission ends this."""
        requester = str(requester)
        if requester in self._active:
            self._away.add(requester)
            self._poke()

    @property
    def active_requests(self) -> int:
        return len(self._active)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _all_waiting(self) -> bool:
        """Every announced request has a submission queued."""
        if not (self.flush_when_all_waiting and self._active and self._pending):
            return False
        now = time.monotonic()
        for r in [r for r, t in self._active.items() if now - t > ACTIVE_TTL_S]:
            del self._active[r]
            self._away.discard(r)
        waiting = {it.requester for it in self._pending}
        expected = [r for r in self._active if self.wait_for_speculating or r not in self._away]
        return bool(self._active) and all(r in waiting for r in expected)

    async def submit(self, queries: Sequence[str], k: int, requester: str | None = None) -> list[list[Hit]]:
        return (await self.submit_sized(queries, k, requester))[0]

    async def submit_sized(
        self, queries: Sequence[str], k: int, requester: str | None = None
    ) -> tuple[list[list[Hit]], int]:
        """:meth:`submit`, plus the number of queries in the search that answered them."""
        queries = list(queries)
        if not queries:
            return [], 0
        if requester is not None and requester in self._active:
            self._active[requester] = time.monotonic()
            self._away.discard(requester)
        self.stats.submissions += 1
        self.stats.queries += len(queries)
        if not self.enabled:
            self._record([len(queries)], 1)
            self.stats.searches += 1
            self.stats.searched_queries += len(queries)
            return await self.search(queries, int(k)), len(queries)
        loop = asyncio.get_running_loop()
        if self._wake is None:
            self._wake = asyncio.Event()
            self._sem = asyncio.Semaphore(self._max_inflight)
        item = _Item(queries, int(k), loop.create_future(), loop.time(), requester)
        self._pending.append(item)
        self._n_pending += len(queries)
        self._wake.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_loop())
        return await item.future, item.searched

    def _record(self, sizes: list[int], n_items: int) -> None:
        n = sum(sizes)
        self.stats.batches += 1
        self.stats.sizes[n] += 1
        self.stats.max_batch_queries = max(self.stats.max_batch_queries, n)
        self.stats.max_batch_submissions = max(self.stats.max_batch_submissions, n_items)
        if self.on_batch is not None:
            self.on_batch(n)

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None and self._sem is not None
        while self._pending:
            deadline = self._pending[0].t + self.window_s
            early = False
            while self._n_pending < self.max_batch:
                if self._all_waiting():
                    early = True
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            sem = self._sem  # (configure may swap it between batches)
            await sem.acquire()  # at most max_inflight batches in flight;
            batch: list[_Item] = []  # meanwhile more submissions accumulate
            total = 0
            while self._pending and (not batch or total + len(self._pending[0].queries) <= self.max_batch):
                it = self._pending.pop(0)
                batch.append(it)
                total += len(it.queries)
            self._n_pending -= total
            self.stats.early_flushes += int(early)
            task = asyncio.ensure_future(self._execute(batch, sem))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _execute(self, batch: list[_Item], sem: asyncio.Semaphore) -> None:
        try:
            self._record([len(it.queries) for it in batch], len(batch))
            by_k: dict[int, list[_Item]] = {}
            for it in batch:
                by_k.setdefault(it.k, []).append(it)
            if self.merge_k and len(by_k) > 1:  # top-k = top-K[:k]: one search at the largest k
                by_k = {max(by_k): list(batch)}
            for k, items in by_k.items():
                uniq = list(dict.fromkeys(q for it in items for q in it.queries))
                self.stats.searches += 1
                self.stats.searched_queries += len(uniq)
                try:
                    res = await self.search(uniq, k)
                except BaseException as e:  # every waiting request sees the error
                    for it in items:
                        if not it.future.done():
                            it.future.set_exception(e)
                    continue
                row = dict(zip(uniq, res))
                for it in items:
                    it.searched = len(uniq)
                    if not it.future.done():
                        it.future.set_result([list(row[q][: it.k]) for q in it.queries])
        finally:
            sem.release()

    @property
    def max_inflight(self) -> int:
        return self._max_inflight

    def set_max_inflight(self, n: int) -> None:
        """Allow ``n`` batches in flight from the next batch on (batches already sent finish
        under the old limit)."""
        if int(n) < 1:
            raise ValueError("max_inflight must be >= 1")
        self._max_inflight = int(n)
        if self._sem is not None:
            self._sem = asyncio.Semaphore(self._max_inflight)


class Verifier:
    """Body of the verifier actor of one retriever kind (an async actor)."""

    def __init__(
        self,
        kind: str,
        shards: Sequence[Any],
        bounds: Sequence[tuple[int, int]],
        retriever: dict,
        window_ms: float = DEFAULT_WINDOW_MS,
        max_batch: int = 64,
        batching: bool = True,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        flush_when_all_waiting: bool = True,
        wait_for_speculating: bool = False,
    ):
        self.kind = kind
        self.router = ShardedRetriever(kind, shards, bounds, RetrieverConfig.model_validate(retriever))
        self.batcher = VerificationBatcher(
            self._search,
            window_ms,
            max_batch,
            batching,
            max_inflight,
            flush_when_all_waiting,
            wait_for_speculating,
            merge_k=entry(kind).merge_k,  # an exact scan: a top-k is a prefix of any larger top-K
        )
        self.batcher.on_batch = self._observe_batch
        self.kb_time_s = 0.0

    def _observe_batch(self, n: int) -> None:
        record_batch(self.kind, n)

    async def _search(self, queries: list[str], k: int) -> list[list[Hit]]:
        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(self.router.batch_search, queries, k)
        finally:
            self.kb_time_s += time.perf_counter() - t0

    async def verify(self, queries: Sequence[str], k: int, requester: str | None = None) -> list[list[Hit]]:
        """KB top-``k`` of each query (batched with other requests' calls); ``requester`` tags
        the call with a request announced by :meth:`begin`."""
        return await self.batcher.submit(list(queries), int(k), requester)

    async def verify_shared(
        self, queries: Sequence[str], k: int, requester: str | None = None
    ) -> tuple[list[list[Hit]], int, int]:
        """:meth:`verify`, plus how many announced requests share the batches now and how many
        queries the search that answered carried (the stride scheduler prices its queries by
        what they add to such searches, :mod:`ralm.stride.load_gate`)."""
        hits, searched = await self.batcher.submit_sized(list(queries), int(k), requester)
        return hits, self.batcher.active_requests, searched

    async def begin(self, requester: str) -> None:
        """A request that will tag its calls ``requester`` is in flight (see the module docstring)."""
        self.batcher.begin(requester)

    async def end(self, requester: str) -> None:
        """That request finished."""
        self.batcher.end(requester)

    async def away(self, requester: str) -> None:
        """That request opened a speculation window: no call from it until the window's
        verification (see the module docstring)."""
        self.batcher.away(requester)

    async def search(self, query: str, k: int) -> list[Hit]:
        return (await self.batcher.submit([query], int(k)))[0]

    async def encode(self, queries: Sequence[str]) -> list[Any]:
        """The KB's query representations (what the shards score with)."""
        return await asyncio.to_thread(self.router.scorer.encode, list(queries))

    async def embed(self, texts: Sequence[str]) -> tuple[Any, list[int]]:
        """``/v1/embeddings``: the dense encoder's vectors ``(n, dim)`` and token counts."""
        enc = getattr(self.router.scorer, "encoder", None)
        if enc is None:
            raise RalmInputError(f"the {self.router.kind} retriever has no dense encoder")
        return await asyncio.to_thread(enc.embed, list(texts))

    async def doc_keys(self, doc_ids: Sequence[int]) -> list[Any]:
        """The KB's keys of ``doc_ids`` (fetched from their shards, cached)."""
        return await asyncio.to_thread(self.router.scorer.doc_keys, list(doc_ids))

    def score_function(self) -> Any:
        """The KB's pure, picklable scoring function ``(query_rep, keys) -> float64 scores``."""
        return self.router.scorer.score_function()

    def configure(
        self,
        window_ms: float | None = None,
        max_batch: int | None = None,
        batching: bool | None = None,
        max_inflight: int | None = None,
        flush_when_all_waiting: bool | None = None,
        wait_for_speculating: bool | None = None,
    ) -> dict:
        """Change the batching policy at run time (e.g. for a benchmark)."""
        b = self.batcher
        if window_ms is not None:
            b.window_s = max(0.0, float(window_ms)) / 1000.0
        if max_batch is not None:
            b.max_batch = int(max_batch)
        if batching is not None:
            b.enabled = bool(batching)
        if max_inflight is not None:
            b.set_max_inflight(max_inflight)
        if flush_when_all_waiting is not None:
            b.flush_when_all_waiting = bool(flush_when_all_waiting)
        if wait_for_speculating is not None:
            b.wait_for_speculating = bool(wait_for_speculating)
        return self.policy()

    def policy(self) -> dict:
        b = self.batcher
        return {
            "window_ms": b.window_s * 1000.0,
            "max_batch": b.max_batch,
            "batching": b.enabled,
            "max_inflight": b.max_inflight,
            "flush_when_all_waiting": b.flush_when_all_waiting,
            "wait_for_speculating": b.wait_for_speculating,
        }

    def stats(self, reset: bool = False) -> dict:
        out = {
            "kind": self.kind,
            **self.policy(),
            **self.batcher.stats.as_dict(),
            "kb_time_s": self.kb_time_s,
            "shard_retries": self.router.retries,
            "active_requests": self.batcher.active_requests,
        }
        if reset:
            self.batcher.stats = BatchStats()
            self.kb_time_s = 0.0
        return out

    def shard_infos(self) -> list[dict]:
        return self.router.infos()

    async def cost_curve(self) -> dict[int, float] | None:
        """A batch's cost relative to one query by batch size, as the shards timed it at
        start-up (the first shard that timed one; shards of a kind are alike), else None.
        (The shards are asked off the event loop: batches keep flowing meanwhile.)"""
        for info in await asyncio.to_thread(self.router.infos):
            if info.get("dense_scan_batch_cost"):
                return dict(info["dense_scan_batch_cost"])
        return None

    def ping(self) -> str:
        return self.kind


def verifier_actor_class(num_cpus: float = 0.25):
    import ray

    # verify, encode, embed and doc_keys are pure: a call interrupted by a restart is simply retried
    return ray.remote(num_cpus=num_cpus, max_restarts=3, max_task_retries=2)(Verifier)
