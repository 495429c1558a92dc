"""FLARE and Iter-RetGen workloads (and n documents, drafting): RaLMSpec == RaLMSeq with real retrievers."""

from __future__ import annotations

import pytest

from ralm.config import RequestConfig, SpecConfig
from ralm.seq import run_seq
from ralm.spec import run_spec
from ralm.stride.workloads import make_query_fn, step_budget

CASES = [
    ("edr", dict(workload="flare", flare_threshold=0.3, generation_stride=8)),
    ("sr", dict(workload="flare", flare_threshold=0.3, generation_stride=8)),
    ("edr", dict(workload="iter_retgen", iter_retgen_iterations=4)),
    ("sr", dict(workload="iter_retgen", iter_retgen_iterations=3)),
    ("edr", dict(num_docs=2)),
    ("adr", dict(num_docs=2, drafting="ngram")),
    ("edr", dict(idgr=True)),
]


@pytest.mark.parametrize("kind,over", CASES)
def test_spec_equals_seq(kind, over, retrievers, fixture_generator, fixture_questions):
    req = RequestConfig(max_new_tokens=24, **over)
    for q in fixture_questions[:2]:
        base = run_seq(q, fixture_generator, retrievers[kind], req)
        for spec in (SpecConfig(stride=3), SpecConfig.named("PSA")):
            out = run_spec(q, fixture_generator, retrievers[kind], req, spec)
            assert out.tokens == base.tokens, (kind, over, spec)
        if over.get("workload") == "flare":
            assert base.stats.steps >= 1
        if over.get("workload") == "iter_retgen":
            assert base.stats.steps <= req.iter_retgen_iterations


def test_iter_retgen_query_is_question_plus_previous_iteration():
    class G:
        def decode(self, toks):
            return " ".join(map(str, toks))

    req = RequestConfig(max_new_tokens=12, workload="iter_retgen", iter_retgen_iterations=3)
    q = make_query_fn(G(), req, 2)
    assert q([1, 2]) == "1 2"
    assert q([1, 2, 10, 11, 12, 13]) == "1 2 10 11 12 13"
    assert q([1, 2] + list(range(10, 18))) == "1 2 14 15 16 17"
    assert step_budget(req, 0) == 4 and step_budget(req, 4) == 4 and step_budget(req, 10) == 2


def test_default_request_unchanged_path(fixture_generator, retrievers, fixture_questions):
    out = run_seq(fixture_questions[0], fixture_generator, retrievers["edr"], RequestConfig(max_new_tokens=8))
    assert out.stats.forward_passes >= 1 and out.stats.generated_tokens == len(out.tokens)
