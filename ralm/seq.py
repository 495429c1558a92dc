"""RaLMSeq: the plain iterative RaLM loop, the baseline and the definition of the right answer.

``X = question``; until EOS or ``max_new_tokens``: ``d = KB.top1(query(X)); X += f(d, X, k)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ralm.config import RequestConfig
from ralm.generator import Generator
from ralm.results import RalmResult, RequestStats, VerifiedPrefix
from ralm.retrieval.base import Retriever
from ralm.stride.workloads import call_step, doc_from_hits, make_query_fn, retrieval_depth, step_budget


def finish(
    gen: Generator, question_len: int, tokens: list[int], eos: bool, stats: RequestStats, t_start: float
) -> RalmResult:
    """The request's result: the tokens after the question, decoded, and the timing split
    (total since ``t_start``; retrieval = everything that was not generation)."""
    stats.total_time_s = time.perf_counter() - t_start
    stats.retrieval_time_s = max(0.0, stats.total_time_s - stats.gen_time_s)
    out = tokens[question_len:]
    return RalmResult(gen.decode(out), out, stats, "stop" if eos else "length")


def apply_resume(
    resume: VerifiedPrefix, tokens: list[int], stats: RequestStats, max_new_tokens: int
) -> tuple[list[int], bool]:
    """Start a request from a verified prefix (steps are deterministic, so the rest of the
    run is the same as from scratch): returns (question + prefix tokens, eos) and records
    the prefix's steps and documents in ``stats``."""
    resume.check(max_new_tokens)
    tokens = tokens + [int(t) for t in resume.tokens]
    stats.steps = stats.resumed_steps = len(resume.doc_ids)
    stats.doc_ids = list(resume.doc_ids)
    stats.resumed_tokens = len(resume.tokens)
    return tokens, bool(resume.eos)


def run_seq(
    question: str,
    gen: Generator,
    kb: Retriever,
    req: RequestConfig | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
    resume: VerifiedPrefix | None = None,
    on_verified: Callable[[list[int], list, bool], None] | None = None,
) -> RalmResult:
    """Answer ``question`` with RaLMSeq: one KB retrieval before every ``k`` tokens.

    ``on_commit(tokens)``, if given, is called with each step's tokens as soon as they
    are final (used to stream a response). ``on_verified(generated, doc_ids, eos)``, if
    given, is called after each step with the whole verified prefix (to checkpoint it);
    ``resume`` starts from such a prefix instead of from the question alone.
    """
    req = req or RequestConfig()
    t_start = time.perf_counter()
    X = gen.encode_question(question)
    n_q = len(X)
    stats = RequestStats(method="seq", retriever=getattr(kb, "name", "")).set_request(req)
    query = make_query_fn(gen, req, n_q)  # workload's query (default: last query_window tokens)
    eos = False
    if resume is not None:
        X, eos = apply_resume(resume, X, stats, req.max_new_tokens)
    while not eos and len(X) - n_q < req.max_new_tokens:
        hits = kb.search(query(X), retrieval_depth(req))
        stats.kb_calls += 1
        stats.kb_queries += 1
        doc_id = doc_from_hits(hits, req)  # no hit (e.g. a BM25 query of stopwords): no document
        k = step_budget(req, len(X) - n_q)
        t0 = time.perf_counter()
        out = call_step(gen, doc_id, X, k, req)
        stats.gen_time_s += time.perf_counter() - t0
        stats.doc_kv_hits += int(out.doc_kv_hit)
        stats.record_step(out)
        stats.steps += 1
        stats.doc_ids.append(doc_id)
        X = X + out.tokens
        eos = out.eos
        if on_commit is not None and out.tokens:
            on_commit(list(out.tokens))
        if on_verified is not None:
            on_verified(X[n_q:], list(stats.doc_ids), eos)
    return finish(gen, n_q, X, eos, stats, t_start)
