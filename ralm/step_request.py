"""What one generator step asks for: the typed request that travels from a RaLM loop to the engine.

A :class:`StepRequest` is built once, by the caller of the step (the coordinator's
:class:`~actors.remote_proxies.RemoteGenerator`, an in-process
:class:`~ralm.generator.LocalGenerator`, a benchmark), and reaches the engine's one entry,
:meth:`ralm.engine.LMEngine.submit`, unchanged: over Ray it is the generator deployment's
argument. The engine resolves the documents, checks that the prompt fits, and decides once
whether the step joins the continuous batcher or runs alone.

The documents are named either by corpus ids (``doc_ids``: the engine maps them to text
with its corpus, :func:`doc_texts`) or by their text (``doc_texts``: an in-process caller
that has the text already). Example: ``StepRequest((464, 3290), 4, doc_ids=(7, 2),
options=StepOptions(num_docs=2))`` asks for up to 4 greedy tokens after
``[doc 7][doc 2][464 3290]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast

from ralm.drafting import StepOptions
from ralm.drafting.idgr import idgr_block

#: What a step is conditioned on: one corpus id, a tuple of ranked ids (several documents
#: or IDGR), or None (no document).
DocIds: TypeAlias = int | Sequence[int] | None


class TextOf(Protocol):
    """What :func:`doc_texts` needs of a corpus (:class:`ralm.corpus.Corpus`)."""

    def text(self, doc_id: int) -> str: ...


@dataclass(frozen=True)
class StepRequest:
    """One step ``f(docs, context, k)``: up to ``k`` greedy tokens after ``[docs][context]``.

    ``doc_ids`` and ``doc_texts`` are exclusive (both None: no document). ``options=None``
    is the plain greedy step. ``owner`` tags the request's KV session, so that
    :meth:`ralm.engine.LMEngine.release` frees it when the request ends (over Serve: the
    request's session key, which is also its multiplexed model id).
    """

    context: tuple[int, ...]
    k: int
    doc_ids: DocIds = None
    doc_texts: tuple[str, ...] | None = None
    ignore_eos: bool = False
    options: StepOptions | None = None
    owner: str | None = None

    def __post_init__(self) -> None:
        # normalised once here, so every receiver sees plain ints and tuples
        object.__setattr__(self, "context", tuple(int(t) for t in self.context))
        object.__setattr__(self, "k", int(self.k))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        if self.doc_ids is not None and not isinstance(self.doc_ids, int) and hasattr(self.doc_ids, "__len__"):
            object.__setattr__(self, "doc_ids", tuple(int(d) for d in self.doc_ids))
        elif self.doc_ids is not None:
            object.__setattr__(self, "doc_ids", int(cast(int, self.doc_ids)))  # also a numpy integer
        if self.doc_texts is not None:
            if self.doc_ids is not None:
                raise ValueError("a step names its documents by ids or by text, not both")
            object.__setattr__(self, "doc_texts", tuple(str(t) for t in self.doc_texts))


def doc_texts(corpus: TextOf, doc_ids: DocIds, options: StepOptions | None = None) -> list[str]:
    """The prompt's document texts for ``doc_ids`` (empty: no document).

    ``doc_ids`` may be a tuple of ranked ids (``RequestConfig.num_docs`` > 1 or IDGR): the
    first ``options.num_docs`` are the prompt's documents, the rest are only listed as
    unrelated in the IDGR block. Without options, every id is a prompt document.
    """
    if doc_ids is None:
        ids: list[int] = []
    elif isinstance(doc_ids, int) or not hasattr(doc_ids, "__len__"):  # also a numpy integer
        ids = [int(cast(int, doc_ids))]
    else:
        ids = [int(d) for d in doc_ids]
    n = options.num_docs if options is not None else len(ids)
    texts = [corpus.text(d) for d in ids[:n]]
    if options is not None and options.idgr:
        texts.append(idgr_block(ids[:n], ids[n:]))
    return texts
