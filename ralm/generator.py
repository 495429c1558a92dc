"""The generator side of a RaLM loop, as the loops see it.

The loops only need: tokenise a question, decode tokens, and run a step on a document
id. :class:`LocalGenerator` does that in-process with an :class:`~ralm.engine.LMEngine`
and a corpus; the serving layer provides the same methods over Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, cast

from ralm.corpus import Corpus
from ralm.drafting import StepOptions
from ralm.drafting.idgr import idgr_block
from ralm.step_output import StepOutput

if TYPE_CHECKING:  # annotations only: the loops (ralm.seq, ralm.spec) import this module without torch
    from ralm.batching.engine import StepCall
    from ralm.engine import LMEngine

#: What a step is conditioned on: one corpus id, a tuple of ranked ids (several documents
#: or IDGR), or None (no document).
DocIds: TypeAlias = int | Sequence[int] | None


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
        (drafting, FLARE, several documents, IDGR), so a generator may route the two apart.
        """
        ...


class LocalGenerator:
    """An engine plus the corpus that maps doc ids to text."""

    def __init__(self, engine: LMEngine, corpus: Corpus):
        self.engine = engine
        self.corpus = corpus
        self.eos_token_id = engine.eos_token_id

    def encode_question(self, question: str) -> list[int]:
        return self.engine.encode_question(question)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.engine.decode(tokens)

    def doc_texts(self, doc_id: DocIds, options: StepOptions | None = None) -> str | list[str] | None:
        """The prompt's document text(s) for ``doc_id`` (None: no document).

        ``doc_id`` may be a tuple of ranked ids (``RequestConfig.num_docs`` > 1 or IDGR): the
        first ``options.num_docs`` are the prompt's documents, the rest are only listed as
        unrelated in the IDGR block.
        """
        ids: list[int]
        if doc_id is None or isinstance(doc_id, (int,)) or not hasattr(doc_id, "__len__"):
            one = cast("int | None", doc_id)  # also a numpy integer: no __len__
            if options is None:
                return self.corpus.text(one) if one is not None else None
            ids = [one] if one is not None else []
        else:
            ids = [int(d) for d in doc_id]
        n = options.num_docs if options is not None else len(ids)
        texts = [self.corpus.text(d) for d in ids[:n]]
        if options is not None and options.idgr:
            texts.append(idgr_block(ids[:n], ids[n:]))
        return texts

    def step_call(
        self,
        doc_id: DocIds,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
        owner: str | None = None,
    ) -> StepCall | None:
        """The continuous batcher's :class:`~ralm.batching.engine.StepCall` for this step
        (``engine.batcher.submit``), or None when the step is not a batched one (see
        :meth:`ralm.engine.LMEngine.step_call`); bad input raises as :meth:`step` does."""
        return self.engine.step_call(self.doc_texts(doc_id, options), context, k, ignore_eos, options, owner)

    def step_alone(
        self,
        doc_id: DocIds,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
    ) -> StepOutput:
        """The step on the calling thread, outside the batcher (:meth:`ralm.engine.LMEngine.step_alone`:
        with a batcher, call it on the batcher's thread through ``engine.batcher.call``)."""
        return self.engine.step_alone(self.doc_texts(doc_id, options), context, k, ignore_eos, options)

    def step(
        self,
        doc_id: DocIds,
        context: Sequence[int],
        k: int,
        ignore_eos: bool = False,
        options: StepOptions | None = None,
    ) -> StepOutput:
        """``f`` on corpus passage ``doc_id`` (None: no document; a tuple of ranked ids: several
        documents or IDGR, see :meth:`doc_texts`). ``options``: :class:`ralm.drafting.StepOptions`.
        A plain step runs through the continuous batcher (:meth:`step_call`), others alone."""
        return self.engine.step(self.doc_texts(doc_id, options), context, k, ignore_eos=ignore_eos, options=options)
