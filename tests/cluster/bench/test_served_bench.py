"""The served benchmark's in-process reference: same config, one request at a time, and
the 1-request served-vs-in-process rows built from it."""

from __future__ import annotations

import pytest

from cluster.bench.served_bench import _label, _parse_methods, in_process_latencies, one_request_rows, to_markdown
from ralm.config import RalmConfig, RequestConfig
from ralm.pipeline import Pipeline
from tests.conftest import FIXTURE_CORPUS


def test_in_process_reference_runs_the_same_requests(tmp_path, gen_model_dir, fixture_questions):
    ralm = RalmConfig(corpus=FIXTURE_CORPUS, work_dir=tmp_path, generator={"model": gen_model_dir}).model_dump(
        mode="json"
    )
    questions = fixture_questions[:2]
    methods = [("seq", None), ("spec", "PS")]
    ref = in_process_latencies(ralm, questions, ["edr"], methods, max_new=12)
    assert set(ref) == {("edr", "seq"), ("edr", "spec[PS]")}
    assert all(v["mean_s"] > 0 for v in ref.values())
    # RaLMSpec's tokens equal RaLMSeq's, and both equal a fresh pipeline's answers
    assert ref[("edr", "spec[PS]")]["tokens"] == ref[("edr", "seq")]["tokens"]
    pipe = Pipeline.from_config(RalmConfig.model_validate(ralm), progress=False)
    req = RequestConfig(max_new_tokens=12)
    assert [list(pipe.answer(q, "edr", "seq", req=req).tokens) for q in questions] == ref[("edr", "seq")]["tokens"]

    rows = [
        {"retriever": "edr", "method": "seq", "concurrency": 1, "batching": True, "mean_s": 2.0},
        {"retriever": "edr", "method": "seq", "concurrency": 4, "batching": True, "mean_s": 9.0},
        {"retriever": "edr", "method": "spec[PS]", "concurrency": 1, "batching": False, "mean_s": 9.0},
    ]
    fake = {("edr", "seq"): {"mean_s": 1.6}}
    one = one_request_rows(rows, fake, questions)
    assert len(one) == 1 and abs(one[0]["served_over_in_process"] - 1.25) < 1e-12
    md = to_markdown([], {"url": "u", "model": "m", "requests": 2, "max_new_tokens": 12}, [], one)
    assert "| edr | RaLMSeq | 2.00 | 1.60 | 1.25x |" in md


def test_methods_are_named_in_the_one_configuration_grammar():
    """A method's configuration is sent as written: the server parses the same grammar
    (SpecConfig.parse, ``;FIELD=VALUE`` included), so the benchmark has no second parser."""
    methods = _parse_methods("seq,spec:PSA,spec:PS@0.9,spec:s=4,spec:PSA;shared_kb_direct_at=0")
    assert methods == [
        ("seq", None),
        ("spec", "PSA"),
        ("spec", "PS@0.9"),
        ("spec", "s=4"),
        ("spec", "PSA;shared_kb_direct_at=0"),
    ]
    assert [_label(m, s) for m, s in methods] == [
        "seq",
        "spec[PSA]",
        "spec[PS@0.9]",
        "spec[s=4]",
        "spec[PSA;shared_kb_direct_at=0]",
    ]
    with pytest.raises(ValueError, match="bad setting 'nope=1'"):
        _parse_methods("spec:PSA;nope=1")
    with pytest.raises(ValueError, match="shared_kb_direct_at"):
        _parse_methods("spec:PSA;shared_kb_direct_at=x")


def test_the_time_breakdown_splits_latency_into_queue_loop_and_overhead():
    from cluster.bench.served_report import time_breakdown

    outs = [
        {"stats": {"queue_s": 1.0, "total_time_s": 3.0, "gen_time_s": 2.0, "retrieval_time_s": 1.0}},
        {"stats": {"queue_s": 0.0, "total_time_s": 5.0, "gen_time_s": 4.0, "retrieval_time_s": 1.0}},
    ]
    b = time_breakdown(outs, [4.5, 5.5])
    assert b == {"queue_s": 0.5, "gen_s": 3.0, "kb_s": 1.0, "overhead_s": 5.0 - 0.5 - 4.0}
    assert time_breakdown([{"stats": {}}], [2.0])["overhead_s"] == 2.0  # an older server: no queue_s
    row = {
        "retriever": "edr",
        "method": "seq",
        "gen_batching": True,
        "batching": True,
        "concurrency": 16,
        "requests": 2,
        "identical": 2,
        "throughput_rps": 1.0,
        "tokens_per_s": 9.0,
        "p50_s": 5.0,
        "p95_s": 5.5,
        "mean_s": 5.0,
        "queries_per_search": None,
        "requests_per_batch": None,
        **b,
    }
    md = to_markdown([row], {"url": "u", "model": "m", "requests": 2, "max_new_tokens": 12}, [])
    assert "| edr | RaLMSeq | on | 16 | 5.00 | 0.50 | 3.00 | 1.00 | 0.50 |" in md
