"""The stride scheduler: what a request's loop does next, step by step.

RaLMSeq and RaLMSpec (document level, :mod:`ralm.spec`; token level, :mod:`ralm.knnlm.loop`)
ask this package every decision that shapes a request's steps and never its tokens:

- **What a step generates and what it queries** (:mod:`ralm.stride.workloads`): the most tokens
  the next step may generate (:func:`step_budget`, :func:`steps_left`), its retrieval query
  (:func:`make_query_fn`) and the step call itself (:func:`call_step`); both loops ask the same
  functions, so they make the same queries.
- **The next window's stride** (:class:`StrideScheduler`, OS3, :mod:`ralm.stride.os3`):
  ``s >= 1`` speculates ``s`` steps from the cache and verifies them in one KB call;
  ``s = 0`` takes one direct step, RaLMSeq's own. The choice maximises verified steps per
  second from the measured step latency ``a``, the KB call's cost ``b(s)``
  (:mod:`ralm.stride.batch_cost`) and the speculation accuracy gamma (a Beta posterior,
  :mod:`ralm.stride.beta_posterior`, per position in the request,
  :mod:`ralm.stride.position_gamma`, started from recent requests' evidence,
  :mod:`ralm.stride.gamma_prior`).
- **Direct steps under shared load** (:class:`SharedLoadGate`, :mod:`ralm.stride.load_gate`): on a KB
  that batches several requests' calls, a direct step when speculation's extra queries would
  cost more than its saved calls.
- **Whether a direct step asks the cache for a guess** (:class:`ShadowBudget`,
  :mod:`ralm.stride.shadow_budget`): such probes keep gamma current and are rationed to a share
  of the direct steps' KB time.

Every decision only chooses which exact computation runs next (a direct step is the
baseline's step; a window's steps are verified), so outputs never depend on it.
"""

from __future__ import annotations

from ralm.stride.gamma_prior import PROCESS_PRIOR, GammaPrior
from ralm.stride.load_gate import SharedLoadGate
from ralm.stride.os3 import StrideScheduler
from ralm.stride.shadow_budget import ShadowBudget
from ralm.stride.workloads import call_step, doc_from_hits, make_query_fn, retrieval_depth, step_budget, steps_left

__all__ = [
    "PROCESS_PRIOR",
    "GammaPrior",
    "SharedLoadGate",
    "ShadowBudget",
    "StrideScheduler",
    "call_step",
    "doc_from_hits",
    "make_query_fn",
    "retrieval_depth",
    "step_budget",
    "steps_left",
]
