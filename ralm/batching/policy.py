"""The batching policy: which steps one batched forward advances, and by how many tokens.

:meth:`ralm.batching.engine.BatchEngine.iterate` asks :func:`plan_iteration` for every
forward. The policy is pure (no model, no tensors): it reads each step's ``done``,
``pending`` and ``verify`` and returns the plan; the engine feeds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class PlannedStep(Protocol):
    """What the policy reads of a step (:class:`~ralm.batching.engine.ActiveStep`)."""

    done: bool  # finished: nothing to feed
    pending: list[int]  # tokens still to feed (one: a decode step; more: a prefill)
    verify: list[int] | None  # a draft to check: the whole of ``pending`` is fed at once


S = TypeVar("S", bound=PlannedStep)


def plan_iteration(active: Sequence[S], token_budget: int, max_sequences: int) -> list[tuple[S, int]]:
    """(step, tokens to feed) for one iteration: decode steps first, then prefill chunks.

    Decode steps (one pending token, or a drafted chunk to verify) come first, then the
    steps still prefilling, each in ``active``'s order (arrival order). Steps are taken
    while tokens are left in ``token_budget`` and fewer than ``max_sequences`` are planned;
    a prefill takes as many of its pending tokens as the budget has left (a chunk), a
    drafted chunk is fed whole. Finished steps are skipped.

    >>> from types import SimpleNamespace as Step
    >>> prefill = Step(done=False, pending=[1, 2, 3, 4, 5], verify=None)
    >>> decode = Step(done=False, pending=[7], verify=None)
    >>> [(s is decode, n) for s, n in plan_iteration([prefill, decode], token_budget=4, max_sequences=8)]
    [(True, 1), (False, 3)]
    >>> plan_iteration([prefill, decode], token_budget=4, max_sequences=1) == [(decode, 1)]
    True
    """
    budget = token_budget
    plan: list[tuple[S, int]] = []
    decoding = [a for a in active if not a.done and (len(a.pending) == 1 or a.verify is not None)]
    prefilling = [a for a in active if not a.done and len(a.pending) > 1 and a.verify is None]
    for a in decoding + prefilling:
        if budget <= 0 or len(plan) >= max_sequences:
            break
        n = len(a.pending) if a.verify is not None else min(len(a.pending), budget)  # a draft is fed whole
        plan.append((a, n))
        budget -= n
    return plan
