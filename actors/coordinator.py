"""Coordinator actor: runs one request at a time with the core loops, over Ray.

A coordinator is a thin shell around :func:`ralm.seq.run_seq` and
:func:`ralm.spec.run_spec` (called as they are, not copied, with the request's
:class:`~ralm.config.RequestConfig`: every generation-side mode - drafting, several
documents, FLARE, Iter-RetGen, IDGR - reaches the generator as the step's options).
KNN-LM requests (``knnlm-seq``/``knnlm-spec``) are a token-level loop that needs the model's
hidden states, so they are handed to the generator deployment, which runs
:mod:`ralm.knnlm`'s loops next to the model. For the document-level loops it gives:

- a :class:`~actors.remote_proxies.RemoteGenerator` (the :class:`~ralm.generator.Generator`
  protocol): tokenising and decoding happen locally with the generator's own tokenizer
  (fetched once), and each step ``f(doc, X, k)`` is a call to the generator deployment,
  sent with the request's session key as Serve's multiplexed model id so that the
  request's steps stay on the replica holding its KV sessions, which are released when the
  request ends;
- a :class:`~actors.remote_proxies.VerifierKB` (the :class:`~ralm.retrieval.base.Retriever`
  protocol) per retriever kind: KB searches and verifications go to that kind's verifier
  actor, which batches them with other requests' and fans them out to the shards;
- the request's local :class:`~cache.speculative.SpeculativeCache`, ranked with the KB's
  exact scorer (query encoding and document keys come from the verifier, so they are
  the very bits the KB uses; the score function runs here). It is cleared after each
  request, before the coordinator goes back to its pool.

Asynchronous verification (A) is real overlap: ``run_spec`` submits the verification to
the coordinator's thread pool, whose thread blocks on the verifier's ObjectRef while the
main thread runs the next speculative step.

A request with a ``request_id`` is checkpointed in a durable state store as it goes and
resumes from its checkpoint when sent again (:mod:`actors.checkpoints`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.checkpoints import checkpointer, forget_checkpoint, resume_point
from actors.remote_proxies import RemoteGenerator, RemoteScorer, StreamDecoder, VerifierKB, remote_result
from ralm.config import GeneratorConfig
from ralm.errors import ConfigError, RequestCancelled
from ralm.job import RalmJob
from ralm.results import RalmResult
from ralm.retrieval.base import Retriever

log = logging.getLogger(__name__)


class Coordinator:
    """Runs requests one at a time (body of the coordinator actor)."""

    def __init__(
        self,
        generator: Any,
        verifiers: dict[str, Any],
        verify_threads: int = 4,
        state: dict | None = None,
    ):
        """``state`` (optional): ``{"store": StateStoreConfig dict, "checkpoints": bool,
        "kb_cache": {kind: index_version}}`` - where to checkpoint requests (durable stores
        only) and which retrievers' verified KB results to cache across requests."""
        self.generator_handle = generator
        self.verifiers = dict(verifiers)
        self.executor = ThreadPoolExecutor(max_workers=verify_threads, thread_name_prefix="coord-verify")
        self._gen: RemoteGenerator | None = None
        self._kbs: dict[str, Retriever] = {}  # the retriever each request uses (maybe store-cached)
        self._vkbs: dict[str, VerifierKB] = {}  # the verifier-backed one underneath
        self._caches: dict[str, Any] = {}
        self._me = uuid.uuid4().hex[:12]  # tags this coordinator's requests at the verifiers
        self.served = 0
        self.busy = False
        self.cancelled = threading.Event()  # the request in flight is to stop (cancel())
        self.cancels = 0
        self.state = dict(state or {})
        self._store_obj = None
        self.resumed = 0

    def _store(self):
        """The state store (None when none is configured), behind a circuit breaker: while it
        is unreachable, requests go on without checkpoints and the KB cache
        (:class:`cache.state.degrading.DegradingStore`). Its calls give up after
        ``serve_retry_timeout_s`` (a request never waits out the eval jobs' long retry budget)."""
        if self._store_obj is None and self.state.get("store"):
            from actors.metrics import record_state_store_skip
            from cache.state import StateStoreConfig, open_state_store
            from cache.state.degrading import DegradingStore

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
        store = self._store()
        return bool(store is not None and self.state.get("checkpoints", True) and store.durable)

    # ---------------------------------------------------------------- set-up
    def ready(self) -> dict:
        """Fetch the tokenizer and the scorers now, so the first request does not wait."""
        self._generator()
        store = self._store()
        if store is not None:  # a wrong password fails at startup; a missing Redis is an outage
            store.connect()
        for kind in self.verifiers:
            self._kb(kind)
        return {"pid": os.getpid(), "kinds": sorted(self.verifiers), "checkpoints": self.checkpoints}

    def ping(self) -> bool:
        """Answers at once, even while a request runs: the pool's liveness probe."""
        return True

    def _generator(self) -> RemoteGenerator:
        if self._gen is None:
            h = self.generator_handle
            tok = remote_result(h.tokenizer.remote())
            info = remote_result(h.info.remote())
            cfg = GeneratorConfig(max_prompt_tokens=info["max_prompt_tokens"], max_new_tokens=info["max_new_tokens"])
            self._gen = RemoteGenerator(h, tok, cfg, info["eos_token_id"], self.cancelled)
        return self._gen

    def _kb(self, kind: str) -> Retriever:
        if kind not in self.verifiers:
            raise ConfigError(f"unknown retriever {kind!r}: this server has {', '.join(sorted(self.verifiers))}")
        if kind not in self._kbs:
            from cache.speculative import SpeculativeCache

            v = self.verifiers[kind]
            scorer = RemoteScorer(v, remote_result(v.score_function.remote()))
            vkb = VerifierKB(kind, v, scorer, self.cancelled)
            self._vkbs[kind] = vkb
            kb: Retriever = vkb
            version = (self.state.get("kb_cache") or {}).get(kind)
            if version and self._store() is not None:
                from cache.state import StoreCachedRetriever

                kb = StoreCachedRetriever(kb, self._store(), version)  # exact: verified results only
            self._kbs[kind] = kb
            self._caches[kind] = SpeculativeCache(scorer)
        return self._kbs[kind]

    # ---------------------------------------------------------------- requests
    def _run(self, job: RalmJob, on_commit=None) -> RalmResult:
        from actors.metrics import record_request
        from ralm.seq import run_seq
        from ralm.spec import run_spec

        if job.info.knn:
            return self._run_knn(job, on_commit)
        kind = job.retriever
        assert kind is not None  # RalmJob: every document-level job names its retriever
        gen, kb = self._generator(), self._kb(kind)
        rid = job.request_id
        resume = on_verified = None
        if rid and self.checkpoints:
            store = self._store()
            digest = job.digest()
            q_tokens = gen.encode_question(job.question)
            resume = resume_point(store, rid, digest, q_tokens)
            if resume is not None:
                self.resumed += 1
                log.info("request %s resumes from a checkpoint of %d tokens", rid, len(resume.tokens))
            on_verified = checkpointer(store, rid, digest, q_tokens)
        self.busy = True
        self.cancelled.clear()  # shared with the generator and the KBs (made with it)
        vkb = self._vkbs[kind]
        session = f"{self._me}:{self.served}"  # this request, at the verifiers and the generator
        vkb.begin(session)
        gen.begin(session)
        try:
            if not job.info.speculative:
                res = run_seq(
                    job.question, gen, kb, job.request, on_commit=on_commit, resume=resume, on_verified=on_verified
                )
            else:
                cache = self._caches[kind]
                res = run_spec(
                    job.question,
                    gen,
                    kb,
                    job.request,
                    job.spec,
                    cache=cache,
                    executor=self.executor,
                    on_commit=on_commit,
                    resume=resume,
                    on_verified=on_verified,
                )
            if on_verified is not None:
                forget_checkpoint(self._store(), rid)
            record_request(res.stats)
            return res
        except RequestCancelled:
            if on_verified is not None:  # nobody waits for it any more: do not keep its checkpoint
                forget_checkpoint(self._store(), rid)
            raise
        finally:
            gen.end()
            vkb.end()
            for c in self._caches.values():
                c.clear()
            self.busy = False
            self.served += 1

    def _run_knn(self, job: RalmJob, on_commit=None) -> RalmResult:
        """A KNN-LM request: the token-level loop runs in a generator replica, next to the model
        and the token datastore (:class:`deployments.modes.KnnServer`); not checkpointed."""
        from actors.metrics import record_request

        self.busy = True
        try:
            res = remote_result(self.generator_handle.knn_generate.remote(job))
            if on_commit is not None and res.tokens:
                on_commit(list(res.tokens))
            record_request(res.stats)
            return res
        finally:
            self.busy = False
            self.served += 1

    def cancel(self) -> bool:
        """Stop the request in flight at its next step or KB call (it raises
        :class:`~ralm.errors.RequestCancelled`; its caches and KV sessions are freed as for any
        finished request). Called while the request runs (the actor serves several calls at
        once); returns whether a request was running."""
        if not self.busy:
            return False
        self.cancelled.set()
        self.cancels += 1
        return True

    def run(self, job: RalmJob) -> dict:
        """Answer one job (every option resolved where the request entered).

        Returns :meth:`RalmResult.as_dict` plus ``prompt_tokens``.
        """
        res = self._run(job)
        out = res.as_dict()
        out["prompt_tokens"] = len(self._generator().encode_question(job.question))
        return out

    def run_stream(self, job: RalmJob) -> Iterator[dict]:
        """Like :meth:`run`, yielding ``{"delta": text, "tokens": [...]}`` as tokens are verified,
        then ``{"done": True, "result": ...}``. Call with ``num_returns="streaming"``."""
        chunks: queue.Queue = queue.Queue()
        dec = StreamDecoder(self._generator().decode)
        box: dict = {}

        def work():
            try:
                box["result"] = self._run(job, on_commit=lambda toks: chunks.put(list(toks)))
            except BaseException as e:  # re-raised in the generator below
                box["error"] = e
            finally:
                chunks.put(None)

        t = threading.Thread(target=work, name="coord-stream", daemon=True)
        t.start()
        while True:
            toks = chunks.get()
            if toks is None:
                break
            delta = dec.push(toks)
            yield {"delta": delta, "tokens": toks}
        t.join()
        if "error" in box:
            raise box["error"]
        res: RalmResult = box["result"]
        tail = dec.push([], final=True)
        out = res.as_dict()
        out["prompt_tokens"] = len(self._generator().encode_question(job.question))
        yield {"delta": tail, "tokens": [], "done": True, "result": out}

    def info(self) -> dict:
        from cache.state import StoreCachedRetriever

        kb_cache = {
            k: {"hits": kb.hits, "misses": kb.misses}
            for k, kb in self._kbs.items()
            if isinstance(kb, StoreCachedRetriever)
        }
        return {
            "pid": os.getpid(),
            "served": self.served,
            "busy": self.busy,
            "cancelled": self.cancels,
            "generator_calls": self._gen.calls if self._gen else 0,
            "resumed": self.resumed,
            "checkpoints": self.checkpoints,
            "kb_cache": kb_cache,
            "state_store": self._store_obj.stats() if self._store_obj is not None else None,
        }


def coordinator_actor_class(num_cpus: float = 0.05, max_concurrency: int = 4):
    """``ray.remote`` class for :class:`Coordinator`.

    ``max_concurrency`` > 1 only so ``info``/``ready`` answer while a request runs; the pool
    never gives a coordinator a second request while it holds one.
    """
    import ray

    # Ray's stubs type only the task options of ``ray.remote``, not the actor ones (max_concurrency)
    return ray.remote(num_cpus=num_cpus, max_concurrency=max_concurrency, max_restarts=0)(Coordinator)  # type: ignore[call-overload]
