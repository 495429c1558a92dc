"""The batching policy: which steps one batched forward advances, by how many tokens, and
which of its rows give logits.

:meth:`ralm.batching.engine.BatchEngine.iterate` asks :func:`plan_iteration` for every
forward and runs the :class:`IterationPlan` it returns. The policy is pure (no model, no
tensors): it reads each step's ``done``, ``pending`` and ``verify``; the engine turns the
plan into one packed forward, and emits tokens where the plan says rows give logits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Protocol, TypeVar


class PlannedStep(Protocol):
    """What the policy reads of a step (:class:`~ralm.batching.engine.ActiveStep`)."""

    done: bool  # finished: nothing to feed
    pending: list[int]  # tokens still to feed (one: a decode step; more: a prefill)
    verify: list[int] | None  # a draft to check: the whole of ``pending`` is fed at once


S = TypeVar("S", bound=PlannedStep)


class ChunkKind(Enum):
    """What a planned chunk is."""

    DECODE = "decode"  # one pending token: its next-token logits
    VERIFY = "verify"  # a drafted window fed whole: logits at every position
    PREFILL = "prefill"  # prompt tokens; the last chunk of a prefill gives next-token logits


@dataclass(frozen=True)
class PlannedChunk(Generic[S]):
    """One step's share of an iteration: ``tokens`` of its pending tokens, fed at packed rows
    ``start .. start+tokens-1``; ``logit_rows`` of them (the last ones) give logits."""

    step: S
    kind: ChunkKind
    start: int
    tokens: int
    logit_rows: int  # VERIFY: tokens; DECODE and a prefill's last chunk: 1; an earlier chunk: 0


@dataclass(frozen=True)
class IterationPlan(Generic[S]):
    """One forward: decode steps and drafted windows first, then prefill chunks, in the
    order the policy took them (packed rows follow it)."""

    chunks: tuple[PlannedChunk[S], ...]

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[PlannedChunk[S]]:
        return iter(self.chunks)

    @property
    def tokens(self) -> int:
        """Tokens fed (packed rows)."""
        return sum(c.tokens for c in self.chunks)

    @property
    def logit_rows(self) -> list[int]:
        """The packed rows whose logits the forward returns, chunk by chunk."""
        return [c.start + c.tokens - c.logit_rows + i for c in self.chunks for i in range(c.logit_rows)]


def plan_iteration(active: Sequence[S], token_budget: int, max_sequences: int) -> IterationPlan[S]:
    """The plan of one iteration: decode steps first, then prefill chunks.

    Decode steps (one pending token, or a drafted chunk to verify) come first, then the
    steps still prefilling, each in ``active``'s order (arrival order). Steps are taken
    while tokens are left in ``token_budget`` and fewer than ``max_sequences`` are planned;
    a prefill takes as many of its pending tokens as the budget has left (a chunk), a
    drafted chunk is fed whole. Finished steps are skipped.

    Example: a 5-token prefill P and a decode step D with a budget of 4: D's token at row 0
    (its logits), then P's first 3 tokens at rows 1-3 (no logits: P has 2 more to feed).
    """
    budget = token_budget
    chunks: list[PlannedChunk[S]] = []
    start = 0
    decoding = [a for a in active if not a.done and (len(a.pending) == 1 or a.verify is not None)]
    prefilling = [a for a in active if not a.done and len(a.pending) > 1 and a.verify is None]
    for a in decoding + prefilling:
        if budget <= 0 or len(chunks) >= max_sequences:
            break
        if a.verify is not None:  # a draft is fed whole, with logits at every position
            kind, n = ChunkKind.VERIFY, len(a.pending)
            rows = n
        else:
            kind = ChunkKind.DECODE if len(a.pending) == 1 else ChunkKind.PREFILL
            n = min(len(a.pending), budget)
            rows = 1 if n == len(a.pending) else 0  # the chunk ends the pending tokens: next-token logits
        chunks.append(PlannedChunk(a, kind, start, n, rows))
        start += n
        budget -= n
    return IterationPlan(tuple(chunks))
