"""The generator side of a RaLM loop, as the loops see it.

The loops only need: tokenise a question, decode tokens, and run a step on a document
id. :class:`LocalGenerator` does that in-process with an :class:`~ralm.engine.LMEngine`
and a corpus; the serving layer provides the same methods over Ray
(:class:`actors.remote_proxies.RemoteGenerator`). Both turn a step into one
:class:`~ralm.step_request.StepRequest` and hand it to the engine's one entry,
:meth:`ralm.engine.LMEngine.submit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ralm.corpus import Corpus
from ralm.drafting import StepOptions
from ralm.step_output import StepOutput
from ralm.step_request import DocIds, StepRequest

if TYPE_CHECKING:  # annotations only: the loops (ralm.seq, ralm.spec) import this module without torch
    from ralm.engine import LMEngine

__all__ = ["DocIds", "Generator", "LocalGenerator"]


class Generator(Protocol):
    """What a RaLM loop needs from the generator (:class:`LocalGenerator`, or a remote one)."""

    eos_token_id: int | None

    def encode_question(self, question: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    def step(
        self,
        doc_id: DocIds,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
    ) -> StepOutput:
        """``f``: up to ``k`` greedy tokens after ``context`` conditioned on ``doc_id``.

        ``options=None`` is the plain step; callers pass it only for non-default generation
        (drafting, FLARE, several documents, IDGR).
        """
        ...


class LocalGenerator:
    """An engine plus the corpus that maps doc ids to text (attached to the engine)."""

    def __init__(self, engine: LMEngine, corpus: Corpus):
        self.engine = engine
        self.corpus = corpus
        engine.attach_corpus(corpus)
        self.eos_token_id = engine.eos_token_id

    def encode_question(self, question: str) -> list[int]:
        return self.engine.encode_question(question)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.engine.decode(tokens)

    def step(
        self,
        doc_id: DocIds,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
    ) -> StepOutput:
        """``f`` on corpus passage ``doc_id`` (None: no document; a tuple of ranked ids: several
        documents or IDGR, :func:`ralm.step_request.doc_texts`): one
        :class:`~ralm.step_request.StepRequest` through :meth:`ralm.engine.LMEngine.submit`."""
        req = StepRequest(tuple(context), k, doc_ids=doc_id, ignore_eos=ignore_eos, options=options)
        return self.engine.submit(req).result()
