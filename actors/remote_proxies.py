"""The coordinator's local stand-ins for the remote generator and KB, over Ray.

A :class:`~actors.coordinator.Coordinator` runs the core loops (:func:`ralm.seq.run_seq`,
:func:`ralm.spec.run_spec`) with these plugged in through the core's protocols:

- :class:`RemoteGenerator` (the :class:`~ralm.generator.Generator` protocol): tokenising and
  decoding run locally with the generator's own tokenizer, and each step ``f(doc, X, k)`` is
  a call to the generator deployment, sent with the request's session key as Serve's
  multiplexed model id;
- :class:`VerifierKB` (the :class:`~ralm.retrieval.base.Retriever` protocol): KB searches
  and verifications go to a verifier actor, which batches them with other requests';
- :class:`RemoteScorer`: the KB's exact scorer, with query encodings and document keys from
  the verifier and the score function run here (for the local speculative cache);
- :class:`StreamDecoder`: turns the token chunks a request commits into text deltas;
- :func:`remote_result`: the value of an ObjectRef or a Serve DeploymentResponse.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from ralm import tokens
from ralm.config import GeneratorConfig
from ralm.errors import RequestCancelled
from ralm.retrieval.base import ExactScorer, Hit
from ralm.step_output import StepOutput
from ralm.step_request import StepRequest

log = logging.getLogger(__name__)


def remote_result(ref_or_response, timeout: float | None = None):
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
        self.tokenizer = tokenizer  # the generator's own (ralm.tokens: the engine's encode/decode)
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

    def encode_question(self, question: str) -> list[int]:
        return tokens.encode_question(self.tokenizer, question, self.cfg.max_prompt_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return tokens.decode(self.tokenizer, ids)

    def step(
        self, doc_id: Any, context: Sequence[int], k: int, ignore_eos: bool = False, options: Any = None
    ) -> StepOutput:
        """``f`` on the generator deployment: one :class:`~ralm.step_request.StepRequest`, which
        reaches the engine unchanged (``doc_id`` may be a tuple of ranked ids and ``options``
        a :class:`ralm.drafting.StepOptions`; the owner is the request's session key).
        Raises :class:`~ralm.errors.RequestCancelled` once the request was cancelled."""
        if self.cancelled.is_set():
            raise RequestCancelled("the request was cancelled")
        self.calls += 1
        req = StepRequest(tuple(context), k, doc_ids=doc_id, ignore_eos=ignore_eos, options=options, owner=self.session)
        return remote_result(self._steps.step.remote(req))


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
        return remote_result(self.verifier.encode.remote(list(queries)))

    def doc_keys(self, doc_ids: Sequence[int]) -> list[Any]:
        ids = [int(d) for d in doc_ids]
        with self._lock:
            missing = list(dict.fromkeys(d for d in ids if d not in self._keys))
        if missing:
            fetched = remote_result(self.verifier.doc_keys.remote(missing))
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

    def __init__(
        self,
        name: str,
        verifier: Any,
        scorer: RemoteScorer,
        cancelled: threading.Event | None = None,
        batch_cost_curve: dict[int, float] | None = None,
    ):
        """``batch_cost_curve``: the shards' start-up timings of a batch against one query
        (``Verifier.cost_curve``), for the stride scheduler."""
        self.name = name
        self.verifier = verifier
        self.scorer: ExactScorer = scorer
        self.batch_cost_curve = batch_cost_curve
        self.requester: str | None = None  # the request in flight, announced to the verifier
        self._sharing = 0  # announced requests at the verifier's last answer
        self._others: deque[int] = deque(maxlen=4)  # other requests' queries in recent answering searches
        self.cancelled = cancelled or threading.Event()  # set by Coordinator.cancel: the next call raises

    def search(self, query: str, k: int) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        if self.cancelled.is_set():
            raise RequestCancelled("the request was cancelled")
        hits, self._sharing, searched = remote_result(
            self.verifier.verify_shared.remote(list(queries), int(k), self.requester)
        )
        self._others.append(max(0, searched - len(set(queries))))  # other requests' queries in that search
        return hits

    def sharing(self) -> int:
        """Requests that shared the verifier's batches at its last answer (this one included)."""
        return self._sharing

    def others_per_search(self) -> float | None:
        """Other requests' queries in the searches that answered this request's last calls
        (mean of the last few; None before any call)."""
        return sum(self._others) / len(self._others) if self._others else None

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
        self._others.clear()
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
