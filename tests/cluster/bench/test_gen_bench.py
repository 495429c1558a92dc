"""`ralmspec bench gen` part (a): prefill per step with vs without doc-KV reuse."""

from __future__ import annotations

import pytest

from cluster.bench.gen_bench import StepLog, forward_overhead_ms, measure_prefill, one_forward_s
from cluster.bench.gen_report import gen_bench_markdown
from ralm.config import RequestConfig
from ralm.generator import LocalGenerator
from tests.factories import tiny_engine


class ToyKB:
    """Deterministic hits that change every few steps (the query grows with the text)."""

    name = "toy"

    def __init__(self):
        self.calls = 0

    def search(self, query, k):
        self.calls += 1
        d = (len(query) // 40) % 7
        return [(d + i, 1.0 - 0.1 * i) for i in range(k)]


@pytest.fixture(scope="module")
def gens(fixture_corpus):
    eng = tiny_engine("gpt2", seed=4, max_doc_tokens=48, kv_session_bytes=0)  # measures the doc-KV prefill
    nocache = type(eng)(eng.model, eng.tokenizer, eng.cfg.model_copy(update={"doc_kv_cache_bytes": 0}))
    return LocalGenerator(eng, fixture_corpus), LocalGenerator(nocache, fixture_corpus)


@pytest.mark.parametrize("nd", [1, 3])
@pytest.mark.parametrize("scope", ["request", "run"])
def test_measure_prefill_times_every_step_of_both_arms(gens, fixture_questions, nd, scope):
    gen, gen_nc = gens
    req = RequestConfig(max_new_tokens=24, generation_stride=4, ignore_eos=True, num_docs=nd)
    r = measure_prefill(gen, gen_nc, ToyKB(), fixture_questions[:2], req, reps=2, scope=scope)
    assert r["identical"] == r["requests"] == 2
    assert r["steps"] == 2 * 6  # every step of every request
    assert r["docs_reused"] + r["docs_computed"] == r["steps"] * nd
    assert r["docs_reused"] > 0 and 0 < r["full_hit_steps"] < r["steps"]
    assert r["speedup"] > 0 and r["prefill_ms_per_step_with"] > 0 and r["prefill_ms_per_step_without"] > 0
    assert r["prefill_ms_per_step_one_forward"] > 0 and r["speedup_vs_one_forward"] > 0
    assert r["token_ratio"] > 1 and r["doc_tokens_per_step"] == pytest.approx(48 * nd)
    assert r["hit_steps_ms_with"] is not None and r["miss_steps_ms_without"] is not None


def test_cold_request_scope_clears_the_cache_between_requests(gens, fixture_questions):
    gen, gen_nc = gens
    req = RequestConfig(max_new_tokens=8, generation_stride=4, ignore_eos=True)
    q = fixture_questions[:1] * 2  # the same request twice
    cold = measure_prefill(gen, gen_nc, ToyKB(), q, req, reps=1, scope="request")
    warm = measure_prefill(gen, gen_nc, ToyKB(), q, req, reps=1, scope="run")
    assert cold["docs_computed"] == 2 and warm["docs_computed"] == 1  # across requests only with 'run'


def test_step_log_and_markdown(gens, fixture_questions):
    gen, _ = gens
    log = StepLog(gen)
    out = log.step(3, gen.encode_question(fixture_questions[0]), 2)
    assert len(log.steps) == 1 and log.steps[0][0] is out and log.steps[0][2] == 48 and log.steps[0][3] is None
    timed = StepLog(gen, one_forward=True)
    assert timed.step(3, gen.encode_question(fixture_questions[0]), 2).tokens == out.tokens
    assert timed.steps[0][3] > 0
    assert one_forward_s(gen.engine, [1, 2, 3]) > 0
    assert forward_overhead_ms(gen.engine, reps=2) > 0
    md = gen_bench_markdown(
        {
            "prefill": {
                "forward_overhead_ms": 1.0,
                "1_docs/request": {
                    "steps": 4,
                    "doc_tokens_per_step": 10.0,
                    "context_tokens_per_step": 5.0,
                    "prefill_ms_per_step_with": 1.0,
                    "prefill_ms_per_step_without": 2.5,
                    "speedup": 2.5,
                    "token_ratio": 3.0,
                    "docs_reused": 3,
                    "docs_computed": 1,
                    "full_hit_steps": 3,
                    "hit_steps_ms_with": 0.5,
                    "hit_steps_ms_without": 2.5,
                    "miss_steps_ms_with": 2.5,
                    "miss_steps_ms_without": 2.5,
                    "identical": 1,
                    "requests": 1,
                },
            }
        }
    )
    assert "**2.50x**" in md and "(b)" not in md


class WindowKB(ToyKB):
    """Records the query lengths (in characters) it was asked."""

    def __init__(self):
        super().__init__()
        self.lengths = []

    def search(self, query, k):
        self.lengths.append(len(query))
        return super().search(query, k)


def test_the_query_window_sets_the_retrieval_query_and_is_recorded(gens, fixture_questions):
    gen, gen_nc = gens
    out = {}
    for w in (2, 64):
        kb = WindowKB()
        req = RequestConfig(max_new_tokens=12, generation_stride=4, ignore_eos=True, query_window=w)
        out[w] = (measure_prefill(gen, gen_nc, kb, fixture_questions[:1], req, reps=1), max(kb.lengths))
    assert out[2][0]["query_window"] == 2 and out[64][0]["query_window"] == 64
    assert out[2][1] < out[64][1]  # a 2-token query is shorter


def test_gen_bench_main_measures_every_window_of_the_workload_and_writes_them(tmp_path, fixture_corpus):
    """End to end through the CLI entry point with the project's model and a real BM25 index."""
    import argparse

    from cluster.bench.gen_bench import add_gen_bench_args, gen_bench_main

    p = argparse.ArgumentParser()
    add_gen_bench_args(p)
    args = p.parse_args(
        [
            "-n",
            "1",
            "--max-new-tokens",
            "8",
            "--parts",
            "a",
            "--retriever",
            "sr",
            "--query-window",
            "4,32",
            "--prefill-docs",
            "1",
            "--prefill-scopes",
            "request",
            "--workload",
            "flare",
            "--prefill-reps",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert gen_bench_main(args) == 0  # 0: every request identical
    import json

    pre = json.loads((tmp_path / "gen_bench.json").read_text())["prefill"]
    assert {k: v["query_window"] for k, v in pre.items() if isinstance(v, dict)} == {
        "1_docs/request/window_4": 4,
        "1_docs/request/window_32": 32,
    }
    assert {v["workload"] for v in pre.values() if isinstance(v, dict)} == {"flare"}
    md = (tmp_path / "gen_bench.md").read_text()
    assert "| 1_docs/request/window_4 | 4 |" in md and "`query_window=4,32`" in md
