"""Coordinator actor: runs one request at a time with the core loops, over Ray.

A coordinator is a thin shell around :func:`ralm.seq.run_seq` and
:func:`ralm.spec.run_spec` (called as they are, not copied, with the request's
:class:`~ralm.config.RequestConfig`: every generation-side mode - drafting, several
documents, FLARE, Iter-RetGen, IDGR - reaches the generator as the step's options).
KNN-LM requests (``knnlm-seq``/``knnlm-spec``) are a token-level loop that needs the model's
hidden states, so they are handed to the generator deployment, which runs
:mod:`ralm.knnlm`'s loops next to the model. For the document-level loops it gives:

- a :class:`RemoteGenerator` (the :class:`~ralm.generator.Generator` protocol): tokenising
  and decoding happen locally with the generator's own tokenizer (fetched once), and
  each step ``f(doc, X, k)`` is a call to the generator deployment, sent with the
  request's session key as Serve's multiplexed model id so that the request's steps stay
  on the replica holding its KV sessions, which are released when the request ends;
- a :class:`VerifierKB` (the :class:`~ralm.retrieval.base.Retriever` protocol) per
  retriever kind: KB searches and verifications go to that kind's verifier actor, which
  batches them with other requests' and fans them out to the shards;
- the request's local :class:`~cache.speculative.SpeculativeCache`, ranked with the KB's
  exact scorer (query encoding and document keys come from the verifier, so they are
  the very bits the KB uses; the score function runs here). It is cleared after each
  request, before the coordinator goes back to its pool.

Asynchronous verification (A) is real overlap: ``run_spec`` submits the verification to
the coordinator's thread pool, whose thread blocks on the verifier's ObjectRef while the
main thread runs the next speculative step.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ralm.config import GeneratorConfig, RequestConfig, SpecConfig
from ralm.engine import LMEngine, StepOutput
from ralm.errors import ConfigError, RequestCancelled
from ralm.methods import method_info
from ralm.results import RalmResult
from ralm.retrieval.base import ExactScorer, Hit, Retriever

log = logging.getLogger(__name__)


def _get(ref_or_response, timeout: float | None = None):
    """Value of an ObjectRef or a Serve DeploymentResponse (blocking)."""
    import ray

    if hasattr(ref_or_response, "result"):
        return ref_or_response.result(timeout_s=timeout)
    return ray.get(ref_or_response, timeout=timeout)


class RemoteGenerator:
    """:class:`~ralm.generator.Generator` whose steps run on the generator deployment."""

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        cfg: GeneratorConfig,
        eos_token_id: int | None,
        cancelled: threading.Event | None = None,
    ):
        self.handle = handle
        self.tokenizer = tokenizer  # LMEngine.encode_question/decode only use these two
        self.cfg = cfg
        self.eos_token_id = eos_token_id
        self.calls = 0
        self.session: str | None = None  # the session key of the request in flight
        self._steps = handle  # the handle steps go through (with the session key while a request runs)
        self.cancelled = cancelled or threading.Event()  # set by Coordinator.cancel: the next step raises

    def begin(self, session: str) -> None:
        """Start a request: its steps carry ``session`` as Serve's multiplexed model id, so they
        are routed to the generator replica that holds the request's KV sessions, which are
        tagged with it (:mod:`deployments.affinity`). A plain actor handle (one generator, no
        Serve) takes the steps as they are."""
        if callable(getattr(type(self.handle), "options", None)):  # a Serve DeploymentHandle
            self.session = session
            self._steps = self.handle.options(multiplexed_model_id=session)

    def end(self) -> None:
        """End the request (done, failed or cancelled): ask the replica that served it to free its
        sessions. Fire and forget: a lost release costs memory until the session LRU evicts them,
        never a result."""
        session, self.session, self._steps = self.session, None, self.handle
        if session is None:
            return
        try:
            self.handle.options(multiplexed_model_id=session).release.remote(session)
        except Exception as e:
            log.warning("cannot release the generator sessions of %s: %s", session, e)

    # LMEngine's methods run unbound on this duck-typed stand-in: they only read
    # ``tokenizer`` and ``cfg``, which this class provides.
    def encode_question(self, question: str) -> list[int]:
        return LMEngine.encode_question(self, question)  # type: ignore[arg-type]  # the engine's own validation

    def decode(self, tokens: Sequence[int]) -> str:
        return LMEngine.decode(self, tokens)  # type: ignore[arg-type]  # see encode_question

    def step(
        self, doc_id: Any, context: Sequence[int], k: int, ignore_eos: bool = False, options: Any = None
    ) -> StepOutput:
        """``f`` on the generator deployment; ``doc_id`` may be a tuple of ranked ids and
        ``options`` a :class:`ralm.drafting.StepOptions` (drafting, FLARE, several documents).
        Raises :class:`~ralm.errors.RequestCancelled` once the request was cancelled."""
        if self.cancelled.is_set():
            raise RequestCancelled("the request was cancelled")
        self.calls += 1
        h = self._steps
        if options is not None:
            return _get(h.step.remote(doc_id, list(context), int(k), bool(ignore_eos), options))
        if ignore_eos:
            return _get(h.step.remote(doc_id, list(context), int(k), True))
        return _get(h.step.remote(doc_id, list(context), int(k)))


class RemoteScorer:
    """The KB's exact scorer seen from a coordinator.

    ``encode`` and ``doc_keys`` ask the verifier (so the bits are the KB's own; document
    keys are immutable and kept in a small LRU); ``score`` is the KB's pure scoring
    function, run locally.
    """

    def __init__(self, verifier: Any, score_fn: Any, key_cache_size: int = 50_000):
        self.verifier = verifier
        self.score_fn = score_fn
        self._keys: OrderedDict[int, Any] = OrderedDict()
        self._max = key_cache_size
        self._lock = threading.Lock()

    def encode(self, queries: Sequence[str]) -> list[Any]:
        return _get(self.verifier.encode.remote(list(queries)))

    def doc_keys(self, doc_ids: Sequence[int]) -> list[Any]:
        ids = [int(d) for d in doc_ids]
        with self._lock:
            missing = list(dict.fromkeys(d for d in ids if d not in self._keys))
        if missing:
            fetched = _get(self.verifier.doc_keys.remote(missing))
            with self._lock:
                for d, key in zip(missing, fetched):
                    self._keys[d] = key
                while len(self._keys) > self._max:
                    self._keys.popitem(last=False)
        with self._lock:
            out = []
            for d in ids:
                self._keys.move_to_end(d)
                out.append(self._keys[d])
            return out

    def score(self, query_rep: Any, keys: Sequence[Any]):
        return self.score_fn(query_rep, keys)


class VerifierKB:
    """:class:`~ralm.retrieval.base.Retriever` backed by a verifier actor."""

    def __init__(self, name: str, verifier: Any, scorer: RemoteScorer, cancelled: threading.Event | None = None):
        self.name = name
        self.verifier = verifier
        self.scorer: ExactScorer = scorer
        self.requester: str | None = None  # the request in flight, announced to the verifier
        self._sharing = 0  # announced requests at the verifier's last answer
        self.cancelled = cancelled or threading.Event()  # set by Coordinator.cancel: the next call raises

    def search(self, query: str, k: int) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        if self.cancelled.is_set():
            raise RequestCancelled("the request was cancelled")
        hits, self._sharing = _get(self.verifier.verify_shared.remote(list(queries), int(k), self.requester))
        return hits

    def sharing(self) -> int:
        """Requests that shared the verifier's batches at its last answer (this one included)."""
        return self._sharing

    def speculating(self) -> None:
        """The request opened a speculation window: the verifier need not hold a batch for it
        until its next call (:class:`~ralm.retrieval.base.SharedKB`); fire and forget."""
        if self.requester is not None:
            self.verifier.away.remote(self.requester)

    def begin(self, requester: str) -> None:
        """Announce a request (the verifier may then send a batch as soon as every announced
        request is waiting); fire and forget: batching never changes a result."""
        self.requester = requester
        self._sharing = 0
        self.verifier.begin.remote(requester)

    def end(self) -> None:
        if self.requester is not None:
            self.verifier.end.remote(self.requester)
            self.requester = None


class StreamDecoder:
    """Turns committed token chunks into text deltas whose concatenation is the full text."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        if not final and text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        if not text.startswith(self.sent):  # decoding is not prefix-stable: resend nothing
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


class Coordinator:
    """Runs requests one at a time (body of the coordinator actor)."""

    def __init__(
        self,
        generator: Any,
        verifiers: dict[str, Any],
        request_defaults: dict | None = None,
        spec_defaults: dict | None = None,
        verify_threads: int = 4,
        state: dict | None = None,
    ):
        """``state`` (optional): ``{"store": StateStoreConfig dict, "checkpoints": bool,
        "kb_cache": {kind: index_version}}`` - where to checkpoint requests (durable stores
        only) and which retrievers' verified KB results to cache across requests."""
        self.generator_handle = generator
        self.verifiers = dict(verifiers)
        self.request_defaults = RequestConfig.model_validate(request_defaults or {})
        self.spec_defaults = SpecConfig.model_validate(spec_defaults or {})
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
            tok = _get(h.tokenizer.remote())
            info = _get(h.info.remote())
            cfg = GeneratorConfig(max_prompt_tokens=info["max_prompt_tokens"], max_new_tokens=info["max_new_tokens"])
            self._gen = RemoteGenerator(h, tok, cfg, info["eos_token_id"], self.cancelled)
        return self._gen

    def _kb(self, kind: str) -> Retriever:
        if kind not in self.verifiers:
            raise ConfigError(f"unknown retriever {kind!r}: this server has {', '.join(sorted(self.verifiers))}")
        if kind not in self._kbs:
            from cache.speculative import SpeculativeCache

            v = self.verifiers[kind]
            scorer = RemoteScorer(v, _get(v.score_function.remote()))
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
    def _configs(self, request: dict) -> tuple[str, str, RequestConfig, SpecConfig]:
        kind = request.get("retriever") or next(iter(self.verifiers))
        method = request.get("method", "spec")
        method_info(method)  # RalmInputError for an unknown method
        req = self.request_defaults.model_copy(update=request.get("request") or {})
        req = RequestConfig.model_validate(req.model_dump())
        spec = self.spec_defaults.model_copy(update=request.get("spec") or {})
        spec = SpecConfig.model_validate(spec.model_dump())
        return kind, method, req, spec

    # ---------------------------------------------------------------- checkpoints
    @staticmethod
    def _job_digest(request: dict) -> str:
        import hashlib
        import json

        job = {k: v for k, v in request.items() if k != "request_id"}
        return hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()

    def _resume_point(self, rid: str, digest: str, q_tokens: list[int]):
        """The verified prefix checkpointed for request ``rid`` (same job), or None."""
        from ralm.results import VerifiedPrefix

        try:
            cp = self._store().load_checkpoint(rid)
        except Exception as e:
            log.warning("cannot load the checkpoint of request %s: %s", rid, e)
            return None
        if (
            cp is None
            or cp.meta.get("job") != digest
            or cp.prompt_len != len(q_tokens)
            or cp.tokens[: cp.prompt_len] != q_tokens
            or not cp.steps
        ):
            return None
        return VerifiedPrefix(cp.tokens[cp.prompt_len :], list(cp.doc_ids), bool(cp.meta.get("eos")))

    def _checkpointer(self, rid: str, digest: str, q_tokens: list[int]):
        from cache.state import RequestCheckpoint

        store = self._store()
        try:
            import ray

            me = ray.get_runtime_context().get_actor_name() or ""
        except Exception:
            me = ""

        def save(generated: list[int], doc_ids: list, eos: bool) -> None:
            cp = RequestCheckpoint(
                request_id=rid,
                tokens=list(q_tokens) + list(generated),
                doc_ids=list(doc_ids),
                steps=len(doc_ids),
                prompt_len=len(q_tokens),
                meta={"job": digest, "eos": bool(eos), "coordinator": me},
            )
            try:
                store.save_checkpoint(cp)
            except Exception as e:  # a checkpoint is an optimisation: never fail the request
                log.warning("cannot save the checkpoint of request %s: %s", rid, e)

        return save

    def _forget_checkpoint(self, rid: str | None) -> None:
        if not rid:
            return
        try:
            self._store().delete_checkpoint(rid)
        except Exception as e:
            log.warning("cannot delete the checkpoint of request %s: %s", rid, e)

    def _run(self, request: dict, on_commit=None) -> RalmResult:
        from actors.metrics import record_request
        from ralm.seq import run_seq
        from ralm.spec import run_spec

        kind, method, req, spec = self._configs(request)
        info = method_info(method)
        if info.knn:
            return self._run_knn(request, method, req, spec, on_commit)
        gen, kb = self._generator(), self._kb(kind)
        rid = request.get("request_id")
        resume = on_verified = None
        if rid and self.checkpoints:
            digest = self._job_digest(request)
            q_tokens = gen.encode_question(request["question"])
            resume = self._resume_point(rid, digest, q_tokens)
            if resume is not None:
                self.resumed += 1
                log.info("request %s resumes from a checkpoint of %d tokens", rid, len(resume.tokens))
            on_verified = self._checkpointer(rid, digest, q_tokens)
        self.busy = True
        self.cancelled.clear()  # shared with the generator and the KBs (made with it)
        vkb = self._vkbs[kind]
        session = f"{self._me}:{self.served}"  # this request, at the verifiers and the generator
        vkb.begin(session)
        gen.begin(session)
        try:
            if not info.speculative:
                res = run_seq(
                    request["question"], gen, kb, req, on_commit=on_commit, resume=resume, on_verified=on_verified
                )
            else:
                cache = self._caches[kind]
                res = run_spec(
                    request["question"],
                    gen,
                    kb,
                    req,
                    spec,
                    cache=cache,
                    executor=self.executor,
                    on_commit=on_commit,
                    resume=resume,
                    on_verified=on_verified,
                )
            if on_verified is not None:
                self._forget_checkpoint(rid)
            record_request(res.stats)
            return res
        except RequestCancelled:
            if on_verified is not None:  # nobody waits for it any more: do not keep its checkpoint
                self._forget_checkpoint(rid)
            raise
        finally:
            gen.end()
            vkb.end()
            for c in self._caches.values():
                c.clear()
            self.busy = False
            self.served += 1

    def _run_knn(self, request: dict, method: str, req: RequestConfig, spec: SpecConfig, on_commit=None) -> RalmResult:
        """A KNN-LM request: the token-level loop runs in a generator replica, next to the model
        and the token datastore (:class:`deployments.modes.KnnServer`); not checkpointed."""
        from actors.metrics import record_request

        self.busy = True
        try:
            res = _get(
                self.generator_handle.knn_generate.remote(
                    request["question"], method, request.get("knn") or {}, req.model_dump(), spec.model_dump()
                )
            )
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

    def run(self, request: dict) -> dict:
        """Answer one request: ``{question, retriever, method, request: {...}, spec: {...}}``.

        Returns :meth:`RalmResult.as_dict` plus ``prompt_tokens``.
        """
        res = self._run(request)
        out = res.as_dict()
        out["prompt_tokens"] = len(self._generator().encode_question(request["question"]))
        return out

    def run_stream(self, request: dict) -> Iterator[dict]:
        """Like :meth:`run`, yielding ``{"delta": text, "tokens": [...]}`` as tokens are verified,
        then ``{"done": True, "result": ...}``. Call with ``num_returns="streaming"``."""
        chunks: queue.Queue = queue.Queue()
        dec = StreamDecoder(self._generator().decode)
        box: dict = {}

        def work():
            try:
                box["result"] = self._run(request, on_commit=lambda toks: chunks.put(list(toks)))
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
        out["prompt_tokens"] = len(self._generator().encode_question(request["question"]))
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
