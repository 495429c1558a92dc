"""Request coordinators, many to a process: :class:`Coordinator` runs one request with the core
loops; :class:`CoordinatorHost` (a threaded Ray actor) runs up to ``slots`` of them at once.

Each request gets its own :class:`Coordinator` - its own local speculative cache, its own
cancellation flag, its own checkpoints - a few kilobytes of Python objects, not a process. A
host shares what does not depend on the request: the generator's tokenizer and limits
(fetched once), each retriever's exact scorer and its document-key LRU, the state store and
the thread pool that runs asynchronous verifications. The pool (:mod:`actors.pool`) leases
*slots* of hosts (:class:`actors.pool.CoordinatorSlot`); a slot runs one request at a time.

A coordinator is a thin shell around :func:`ralm.seq.run_seq` and :func:`ralm.spec.run_spec`
(called as they are, not copied, with the job's :class:`~ralm.config.RequestConfig`: every
generation-side mode - drafting, several documents, FLARE, Iter-RetGen, IDGR - reaches the
generator as the step's options). KNN-LM jobs (``knnlm-seq``/``knnlm-spec``) are a
token-level loop that needs the model's hidden states, so they are handed to the generator
deployment, which runs :mod:`ralm.knnlm`'s loops next to the model. For the document-level
loops it gives:

- a :class:`~actors.remote_proxies.RemoteGenerator` (the :class:`~ralm.generator.Generator`
  protocol): tokenising and decoding happen locally with the generator's own tokenizer,
  and each step ``f(doc, X, k)`` is a call to the generator deployment, sent with the
  request's session key as Serve's multiplexed model id so that the request's steps stay
  on the replica holding its KV sessions, which are released when the request ends;
- a :class:`~actors.remote_proxies.VerifierKB` (the :class:`~ralm.retrieval.base.Retriever`
  protocol): KB searches and verifications go to that kind's verifier actor, which batches
  them with other requests' and fans them out to the shards;
- its local :class:`~cache.speculative.SpeculativeCache`, ranked with the KB's exact scorer
  (query encoding and document keys come from the verifier, so they are the very bits the
  KB uses; the score function runs here).

Asynchronous verification (A) is real overlap: ``run_spec`` submits the verification to the
host's thread pool, whose thread blocks on the verifier's ObjectRef while the request's
thread runs the next speculative step.

A job with a ``request_id`` is checkpointed in a durable state store as it goes and resumes
from its checkpoint when sent again (:mod:`actors.checkpoints`): a host that dies loses
nothing its requests verified.
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.checkpoints import checkpointer, forget_checkpoint, resume_point
from actors.metrics import record_request, record_state_store_skip
from actors.remote_proxies import RemoteGenerator, RemoteScorer, StreamDecoder, VerifierKB, remote_result
from cache.speculative import SpeculativeCache
from cache.state import StateStoreConfig, StoreCachedRetriever, open_state_store
from cache.state.degrading import DegradingStore
from ralm import constants as C
from ralm.config import GeneratorConfig
from ralm.errors import ConfigError, RequestCancelled
from ralm.job import RalmJob
from ralm.results import RalmResult
from ralm.retrieval.base import Retriever
from ralm.seq import run_seq
from ralm.spec import run_spec
from ralm.tokens import decode as decode_ids

log = logging.getLogger(__name__)


class CoordinatorShared:
    """What the coordinators of one host share (all of it request-independent).

    ``state`` (optional): ``{"store": StateStoreConfig dict, "checkpoints": bool,
    "kb_cache": {kind: index_version}}`` - where to checkpoint requests (durable stores only)
    and which retrievers' verified KB results to cache across requests."""

    def __init__(self, generator: Any, verifiers: dict[str, Any], verify_threads: int = 4, state: dict | None = None):
        self.generator_handle = generator
        self.verifiers = dict(verifiers)
        self.executor = ThreadPoolExecutor(max_workers=verify_threads, thread_name_prefix="coord-verify")
        self.state = dict(state or {})
        self._lock = threading.Lock()
        self._gen_parts: tuple[Any, GeneratorConfig, int | None] | None = None
        self._scorers: dict[str, RemoteScorer] = {}
        self._curves: dict[str, dict[int, float] | None] = {}
        self._store_obj: DegradingStore | None = None

    def generator_parts(self) -> tuple[Any, GeneratorConfig, int | None]:
        """(tokenizer, limits, EOS id) of the generator, fetched once."""
        with self._lock:
            if self._gen_parts is None:
                h = self.generator_handle
                tok = remote_result(h.tokenizer.remote())
                info = remote_result(h.info.remote())
                cfg = GeneratorConfig(
                    max_prompt_tokens=info["max_prompt_tokens"], max_new_tokens_limit=info["max_new_tokens"]
                )
                self._gen_parts = (tok, cfg, info["eos_token_id"])
            return self._gen_parts

    def scorer(self, kind: str) -> RemoteScorer:
        """The exact scorer of retriever ``kind`` (its score function fetched once; the
        document-key LRU shared by every request of the host)."""
        if kind not in self.verifiers:
            raise ConfigError(f"unknown retriever {kind!r}: this server has {', '.join(sorted(self.verifiers))}")
        with self._lock:
            if kind not in self._scorers:
                v = self.verifiers[kind]
                self._scorers[kind] = RemoteScorer(v, remote_result(v.score_function.remote()))
            return self._scorers[kind]

    def cost_curve(self, kind: str) -> dict[int, float] | None:
        """The verifier's batch cost curve (its shards' start-up timings), fetched once."""
        with self._lock:
            if kind not in self._curves:
                self._curves[kind] = remote_result(self.verifiers[kind].cost_curve.remote())
            return self._curves[kind]

    def store(self) -> DegradingStore | None:
        """The state store (None when none is configured), behind a circuit breaker: while it
        is unreachable, requests go on without checkpoints and the KB cache. Its calls give up
        after ``serve_retry_timeout_s`` (a request never waits out the eval jobs' long retry
        budget)."""
        with self._lock:
            if self._store_obj is None and self.state.get("store"):
                cfg = StateStoreConfig.model_validate(self.state["store"])
                serving = cfg.model_copy(
                    update={
                        "retry_timeout_s": min(cfg.retry_timeout_s, cfg.serve_retry_timeout_s),
                        "startup_wait_s": min(cfg.startup_wait_s, cfg.serve_retry_timeout_s),
                    }
                )
                self._store_obj = DegradingStore(
                    lambda: open_state_store(serving),
                    durable=cfg.scheme != "memory",
                    cooldown_s=cfg.serve_cooldown_s,
                    on_skip=record_state_store_skip,
                )
            return self._store_obj

    @property
    def checkpoints(self) -> bool:
        store = self.store()
        return bool(store is not None and self.state.get("checkpoints", True) and store.durable)

    def ready(self) -> None:
        """Fetch the tokenizer and the scorers and connect the store now, so the first request
        does not wait (a wrong password fails here; a missing Redis is an outage)."""
        self.generator_parts()
        store = self.store()
        if store is not None:
            store.connect()
        for kind in self.verifiers:
            self.scorer(kind)
            self.cost_curve(kind)


class Coordinator:
    """Runs one request (its own cache, cancellation flag and checkpoints) over ``shared``."""

    def __init__(self, shared: CoordinatorShared, session: str):
        self.shared = shared
        self.session = session  # this request, at the verifiers and the generator
        self.cancelled = threading.Event()  # set by cancel(): the next step or KB call raises
        tok, cfg, eos = shared.generator_parts()
        self.gen = RemoteGenerator(shared.generator_handle, tok, cfg, eos, self.cancelled)
        self.resumed = False
        self.kb_cache: StoreCachedRetriever | None = None

    def _kb(self, kind: str) -> tuple[Retriever, VerifierKB, SpeculativeCache]:
        scorer = self.shared.scorer(kind)
        vkb = VerifierKB(kind, self.shared.verifiers[kind], scorer, self.cancelled, self.shared.cost_curve(kind))
        kb: Retriever = vkb
        version = (self.shared.state.get("kb_cache") or {}).get(kind)
        store = self.shared.store()
        if version and store is not None:
            # exact: verified results only; the DegradingStore has the StateStore methods it uses
            kb = self.kb_cache = StoreCachedRetriever(vkb, store, version)  # type: ignore[arg-type]
        return kb, vkb, SpeculativeCache(scorer)

    def run(self, job: RalmJob, on_commit: Callable[[list[int]], None] | None = None) -> RalmResult:
        """Answer ``job`` (every option resolved where the request entered)."""
        if job.info.knn:
            res = remote_result(self.shared.generator_handle.knn_generate.remote(job))
            if on_commit is not None and res.tokens:
                on_commit(list(res.tokens))
            record_request(res.stats)
            return res
        if job.retriever is None:  # RalmJob guarantees a retriever for document-level methods
            raise ConfigError(f"method {job.method!r} needs a retriever")
        kb, vkb, cache = self._kb(job.retriever)
        gen, rid, store = self.gen, job.request_id, self.shared.store()
        resume = on_verified = None
        if rid and store is not None and self.shared.checkpoints:
            digest = job.digest()
            q_tokens = gen.encode_question(job.question)
            resume = resume_point(store, rid, digest, q_tokens)
            if resume is not None:
                self.resumed = True
                log.info("request %s resumes from a checkpoint of %d tokens", rid, len(resume.tokens))
            on_verified = checkpointer(store, rid, digest, q_tokens)
        vkb.begin(self.session)
        gen.begin(self.session)
        try:
            if not job.info.speculative:
                res = run_seq(
                    job.question, gen, kb, job.request, on_commit=on_commit, resume=resume, on_verified=on_verified
                )
            else:
                res = run_spec(
                    job.question,
                    gen,
                    kb,
                    job.request,
                    job.spec,
                    cache=cache,
                    executor=self.shared.executor,
                    on_commit=on_commit,
                    resume=resume,
                    on_verified=on_verified,
                )
            if on_verified is not None:
                forget_checkpoint(store, rid)
            record_request(res.stats)
            return res
        except RequestCancelled:
            if on_verified is not None:  # nobody waits for it any more: do not keep its checkpoint
                forget_checkpoint(store, rid)
            raise
        finally:
            gen.end()
            vkb.end()
            cache.clear()

    def cancel(self) -> None:
        """Stop the request at its next step or KB call (it raises
        :class:`~ralm.errors.RequestCancelled`; its cache and KV sessions are freed as for any
        finished request)."""
        self.cancelled.set()


class CoordinatorHost:
    """Up to ``slots`` requests at once, each on its own :class:`Coordinator` (body of the
    coordinator host actor). The pool gives a slot at most one request at a time."""

    def __init__(
        self,
        generator: Any,
        verifiers: dict[str, Any],
        slots: int = C.POOL_SLOTS_PER_HOST,
        verify_threads: int | None = None,
        state: dict | None = None,
    ):
        self.slots = int(slots)
        self.shared = CoordinatorShared(generator, verifiers, verify_threads or max(4, self.slots), state)
        self._me = uuid.uuid4().hex[:12]  # tags this host's requests at the verifiers
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)  # notified when a slot's request ends
        self._running: dict[int, Coordinator] = {}
        self.handoff_waits = 0  # leases that found their slot's last request still ending
        self.served = 0
        self.cancels = 0
        self.resumed = 0
        self.generator_calls = 0
        self.kb_hits: dict[str, int] = {}
        self.kb_misses: dict[str, int] = {}
        self.stride_decisions: dict[str, int] = {}  # RaLMSpec's stride decisions by reason (ralm.stride.load_gate)

    # ---------------------------------------------------------------- set-up
    def ready(self) -> dict:
        """Fetch the tokenizer and the scorers now, so the first request does not wait."""
        self.shared.ready()
        return {
            "pid": os.getpid(),
            "kinds": sorted(self.shared.verifiers),
            "checkpoints": self.shared.checkpoints,
            "slots": self.slots,
        }

    def ping(self) -> bool:
        """Answers at once, even while requests run: the pool's liveness probe."""
        return True

    # ---------------------------------------------------------------- requests
    def _start(self, slot: int) -> Coordinator:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of this host's {self.slots}")
        with self._free:
            previous = self._running.get(slot)
            if previous is not None:
                # the pool leased the slot again while its last request was still ending (a
                # cancelled one stops at its next step): wait for it rather than fail this one
                self.handoff_waits += 1
                log.warning(
                    "slot %d was leased while request %s (cancelled: %s) still ran on it; waiting up to %g s",
                    slot,
                    previous.session,
                    previous.cancelled.is_set(),
                    C.COORDINATOR_SLOT_HANDOFF_S,
                )
                if not self._free.wait_for(lambda: slot not in self._running, C.COORDINATOR_SLOT_HANDOFF_S):
                    raise RuntimeError(
                        f"slot {slot} still runs request {previous.session} after {C.COORDINATOR_SLOT_HANDOFF_S:g} s"
                    )
            coord = Coordinator(self.shared, f"{self._me}:{slot}:{self.served}")
            self._running[slot] = coord
            self.served += 1
        return coord

    def _finish(self, slot: int, coord: Coordinator) -> None:
        with self._free:
            if self._running.get(slot) is coord:
                del self._running[slot]
            self._free.notify_all()
            self.resumed += coord.resumed
            self.generator_calls += coord.gen.calls
            if coord.kb_cache is not None:
                name = coord.kb_cache.name
                self.kb_hits[name] = self.kb_hits.get(name, 0) + coord.kb_cache.hits
                self.kb_misses[name] = self.kb_misses.get(name, 0) + coord.kb_cache.misses

    def run(self, slot: int, job: RalmJob, on_commit: Callable[[list[int]], None] | None = None) -> RalmResult:
        """Answer one job on ``slot`` (``on_commit``: see :meth:`Coordinator.run`)."""
        coord = self._start(slot)
        try:
            res = coord.run(job, on_commit)
        finally:
            self._finish(slot, coord)
        with self._lock:
            for reason, n in res.stats.stride_reasons.items():
                self.stride_decisions[reason] = self.stride_decisions.get(reason, 0) + n
        return res

    def run_stream(self, slot: int, job: RalmJob) -> Iterator[dict]:
        """Like :meth:`run`, yielding ``{"delta": text, "tokens": [...]}`` as tokens are verified,
        then ``{"done": True, "result": RalmResult}``. Call with ``num_returns="streaming"``."""
        chunks: queue.Queue = queue.Queue()
        tokenizer = self.shared.generator_parts()[0]
        dec = StreamDecoder(lambda ids: decode_ids(tokenizer, ids))
        box: dict = {}

        def work():
            try:
                box["result"] = self.run(slot, job, lambda toks: chunks.put(list(toks)))
            except BaseException as e:  # re-raised in the generator below
                box["error"] = e
            finally:
                chunks.put(None)

        t = threading.Thread(target=work, name=f"coord-stream-{slot}", daemon=True)
        t.start()
        while True:
            toks = chunks.get()
            if toks is None:
                break
            yield {"delta": dec.push(toks), "tokens": toks}
        t.join()
        if "error" in box:
            raise box["error"]
        yield {"delta": dec.push([], final=True), "tokens": [], "done": True, "result": box["result"]}

    def cancel(self, slot: int) -> bool:
        """Stop the request running on ``slot`` at its next step or KB call; whether one ran.
        Called while the request runs (the actor serves many calls at once)."""
        with self._lock:
            coord = self._running.get(slot)
            if coord is None:
                return False
            self.cancels += 1
        coord.cancel()
        return True

    def info(self) -> dict:
        store = self.shared._store_obj
        with self._lock:
            busy = len(self._running)
            calls = self.generator_calls + sum(c.gen.calls for c in self._running.values())
        return {
            "pid": os.getpid(),
            "slots": self.slots,
            "busy": busy,
            "served": self.served,
            "cancelled": self.cancels,
            "handoff_waits": self.handoff_waits,
            "generator_calls": calls,
            "resumed": self.resumed,
            "checkpoints": self.shared.checkpoints,
            "kb_cache": {k: {"hits": self.kb_hits[k], "misses": self.kb_misses.get(k, 0)} for k in self.kb_hits},
            "stride_decisions": dict(self.stride_decisions),
            "state_store": store.stats() if store is not None else None,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # peak, Linux KiB
        }


def coordinator_host_class(num_cpus: float = 0.05, slots: int = C.POOL_SLOTS_PER_HOST):
    """``ray.remote`` class for :class:`CoordinatorHost` with ``slots`` request threads (plus a
    few so pings, ``info`` and ``cancel`` answer while every slot is busy)."""
    import ray  # lazy: the core loops above are importable (and tested) without Ray

    # Ray's stubs type only the task options of ``ray.remote``, not the actor ones (max_concurrency)
    return ray.remote(num_cpus=num_cpus, max_concurrency=slots + 8, max_restarts=0)(CoordinatorHost)  # type: ignore[call-overload]
