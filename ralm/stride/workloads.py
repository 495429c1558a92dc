"""Retrieval triggers and queries shared by RaLMSeq and RaLMSpec (RaLMSpec paper, appendix).

Both loops ask this module three things, so any workload is exact under RaLMSpec by
construction (both loops make the same queries from the same tokens and call the same
deterministic step):

- :func:`make_query_fn` -- the retrieval query for the current tokens ``X``;
- :func:`step_budget`  -- the most tokens the next step may generate;
- :func:`call_step`    -- the step itself (with drafting / FLARE / several documents).

Workloads (``RequestConfig.workload``):

- ``fixed``: retrieve before every ``generation_stride`` tokens; query = last
  ``query_window`` tokens (the default; exactly the original behaviour).
- ``flare`` (FLARE-style active retrieval): a step generates until a token's greedy
  probability falls below ``flare_threshold`` (that token is not emitted) or
  ``generation_stride`` tokens; then the loop re-retrieves with the query built from the
  current text. The first token of a step is always emitted, so every step progresses.
- ``iter_retgen`` (Iter-RetGen): ``iter_retgen_iterations`` iterations of
  ``ceil(max_new_tokens / iterations)`` tokens; the query of iteration ``i`` is the
  question plus iteration ``i-1``'s whole generation. (Generation continues the text
  rather than restarting it, so the loops' append-only exactness argument holds.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ralm.config import RequestConfig
from ralm.drafting import StepOptions


def _default_generation(req: RequestConfig) -> bool:
    return (
        req.drafting == "none"
        and req.workload != "flare"
        and req.num_docs == 1
        and not req.idgr
        and not req.allow_inexact_shifted_reuse
    )


def retrieval_depth(req: RequestConfig) -> int:
    """Hits needed per query: the prompt's documents plus IDGR's unrelated ids."""
    return req.num_docs + (req.idgr_unrelated if req.idgr else 0)


def doc_from_hits(hits: Sequence, req: RequestConfig):
    """The step's document: a doc id (or None) by default, else the tuple of ranked ids."""
    if req.num_docs == 1 and not req.idgr:
        return hits[0][0] if hits else None
    ids = tuple(int(h[0]) for h in hits[: retrieval_depth(req)])
    return ids or None


def iteration_length(req: RequestConfig) -> int:
    return max(1, math.ceil(req.max_new_tokens / req.iter_retgen_iterations))


def step_budget(req: RequestConfig, generated: int) -> int:
    remaining = req.max_new_tokens - generated
    if req.workload == "iter_retgen":
        L = iteration_length(req)
        return min(L - generated % L, remaining)
    return min(req.generation_stride, remaining)


def steps_left(req: RequestConfig, generated: int) -> int:
    """Steps of :func:`step_budget` tokens still to take after ``generated`` tokens."""
    n = 0
    while generated < req.max_new_tokens:
        generated += step_budget(req, generated)
        n += 1
    return n


def make_query_fn(gen, req: RequestConfig, n_q: int) -> Callable[[list[int]], str]:
    """``query(X) -> str`` for the workload (``n_q``: question length)."""
    if req.workload == "iter_retgen":
        L = iteration_length(req)

        def query(X: list[int]) -> str:
            g = len(X) - n_q
            start = n_q + max(0, (g - 1) // L * L) if g else n_q  # start of the previous iteration
            return gen.decode(X[:n_q] + X[start:])

        return query

    w = req.query_window
    return lambda X: gen.decode(X[-w:])


def call_step(gen, doc, X: list[int], k: int, req: RequestConfig):
    """Run the step; with default generation options exactly the original call (so any
    ``Generator``, local or remote, keeps working)."""
    if _default_generation(req):
        return gen.step(doc, X, k, ignore_eos=req.ignore_eos)
    return gen.step(doc, X, k, ignore_eos=req.ignore_eos, options=StepOptions.from_request(req))
