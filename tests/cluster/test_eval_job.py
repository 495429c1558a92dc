"""``ralmspec eval``: resumable batch evaluation.

* The bookkeeping (skip recorded items, first write wins, reports from the store, exit
  codes, refusing to resume with another setup) runs in-process with a scripted backend.
* The kill test runs the real job (fixture corpus, EDR index, a tiny GPT-2) in a
  subprocess against a real redis-server, SIGKILLs it once some items are recorded,
  reruns it with the same job id, and checks that no recorded item was recomputed, that
  nothing recorded was lost or changed, and that the final results are complete.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cache.state import open_state_store
from cluster import eval_backends, eval_job
from cluster.eval_backends import register_backend
from cluster.eval_job import EvalItem, make_items
from ralm.config import RequestConfig
from tests.cache.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


# ====================================================================== scripted backend
class ScriptedBackend:
    """Tokens depend on the question only; ``wrong`` configs get a different last token;
    ``crash_after`` raises after that many results (a killed process, in-process)."""

    name = "scripted"
    crash_after: int | None = None
    wrong: set[str] = set()
    computed: list[str] = []

    def __init__(self, *args):
        pass

    def describe(self):
        return "scripted"

    def run(self, items):
        for n, item in enumerate(items):
            if self.crash_after is not None and n >= self.crash_after:
                raise KeyboardInterrupt("simulated kill")
            ScriptedBackend.computed.append(item.key)
            toks = [len(item.question) + i for i in range(5)]
            if item.config in self.wrong:
                toks[-1] += 1
            if "EMPTY" in item.question:
                yield item, {"error": "question is empty"}
                continue
            stats = {
                "method": item.method,
                "retriever": item.retriever,
                "steps": 2,
                "kb_calls": 2 if item.method == "seq" else 1,
                "gen_time_s": 0.01,
                "retrieval_time_s": 0.02 if item.method == "seq" else 0.005,
                "total_time_s": 0.03 if item.method == "seq" else 0.015,
                "strides": [2],
                "gamma": 0.5,
                "matched_steps": 1,
                "rollbacks": 0,
                "speculation_accuracy": 1.0,
            }
            yield item, {"text": "x", "tokens": toks, "finish_reason": "length", "stats": stats}

    def close(self):
        pass


register_backend("scripted", lambda cfg, kinds, args, warm: ScriptedBackend())


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(ScriptedBackend, "crash_after", None)
    monkeypatch.setattr(ScriptedBackend, "wrong", set())
    monkeypatch.setattr(ScriptedBackend, "computed", [])
    monkeypatch.delenv("RALMSPEC_STATE_URL", raising=False)
    return ScriptedBackend


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    argv = [
        "--questions",
        str(DATA / "fixture_questions.jsonl"),
        "-n",
        "4",
        "--retrievers",
        "edr,sr",
        "--configs",
        "base,PSA",
        "--out",
        str(tmp_path / "out"),
        "--backend",
        "scripted",
        "--no-progress",
        "--corpus",
        str(DATA / "fixture_corpus.jsonl"),
        "--model",
        "tiny",
        *extra,
    ]
    return eval_job.build_parser().parse_args(argv)


def test_items_and_keys():
    items = make_items(["q one", "q two"], ["edr"], ["base", "PSA"])
    assert [(i.qid, i.config) for i in items] == [
        (0, "seq"),
        (0, "base"),
        (0, "PSA"),
        (1, "seq"),
        (1, "base"),
        (1, "PSA"),
    ]
    assert len({i.key for i in items}) == 6
    assert EvalItem(0, "q one", "edr", "seq").key != EvalItem(0, "q one (edited)", "edr", "seq").key
    req = RequestConfig(max_new_tokens=7)
    assert items[2].job(req).spec.prefetch and items[0].job(req).method == "seq"
    assert items[2].job(req).request == req and items[2].job(req).retriever == items[2].retriever
    assert EvalItem.from_dict(items[1].as_dict()) == items[1]


def test_resume_after_crash_skips_recorded_items(tmp_path, scripted, capsys):
    scripted.crash_after = 7
    with pytest.raises(KeyboardInterrupt):
        eval_job.eval_main(_args(tmp_path))
    job_id = capsys.readouterr().err.split("job ", 1)[1].split(":", 1)[0]
    assert job_id.startswith("eval-")  # derived from the setup: a rerun resumes it
    with open_state_store(f"sqlite://{tmp_path / 'out' / 'state.sqlite'}") as st:
        first = st.job_results(job_id)
    assert len(first) == 7 and sorted(first) == sorted(scripted.computed)

    scripted.crash_after, scripted.computed = None, []
    assert eval_job.eval_main(_args(tmp_path)) == 0
    total = 4 * 2 * 3
    assert len(scripted.computed) == total - 7 and not set(scripted.computed) & set(first)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == total
    for r in rows:  # nothing recorded before was changed
        if r["key"] in first:
            assert {k: r[k] for k in first[r["key"]]} == first[r["key"]]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"] == {
        "items": 24,
        "recorded": 24,
        "missing": 0,
        "errors": 0,
        "compared": 16,
        "identical": 16,
        "different": 0,
    }
    assert len(summary["runs"]) == 2
    psa = next(r for r in summary["summary"] if r["retriever"] == "edr" and r["config"] == "PSA")
    assert {"mean_latency_s", "generation_s", "retrieval_s", "speedup", "retrieval_eliminated"} <= set(psa)
    assert not {"T", "G", "R", "Tb", "E"} & set(psa)  # spelled-out fields only
    assert psa["requests"] == psa["identical"] == 4
    assert (tmp_path / "out" / "latency.png").stat().st_size > 1000
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| edr | PSA |" in md and "| sr | RaLMSeq |" in md and "4/4" in md
    assert "| mean latency ms | generation ms | retrieval ms |" in md

    scripted.computed = []  # a third run computes nothing
    assert eval_job.eval_main(_args(tmp_path)) == 0 and scripted.computed == []
    assert "computed 0, skipped 24" in capsys.readouterr().out


def test_differences_fail_the_job(tmp_path, scripted):
    scripted.wrong = {"PSA"}
    assert eval_job.eval_main(_args(tmp_path, "--state-url", "memory://")) == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"]["different"] == 8 and summary["counts"]["identical"] == 8
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    bad = [r for r in rows if r["identical"] is False]
    assert len(bad) == 8 and all(r["config"] == "PSA" and r["first_difference"] == 4 for r in bad)


def test_errors_are_recorded_not_retried(tmp_path, scripted):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question": "fine question"}) + "\n" + json.dumps({"question": "EMPTY one"}) + "\n")
    args = _args(tmp_path, "--questions", str(q), "--retrievers", "edr", "--job-id", "errs")
    assert eval_job.eval_main(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"]["errors"] == 3 and summary["counts"]["missing"] == 0
    scripted.computed = []
    assert eval_job.eval_main(args) == 0 and scripted.computed == []


def test_resume_with_other_setup_is_refused(tmp_path, scripted):
    assert eval_job.eval_main(_args(tmp_path, "--job-id", "j1")) == 0
    with pytest.raises(eval_job.JobMismatch, match="different setup .*request"):
        eval_job.eval_main(_args(tmp_path, "--job-id", "j1", "--max-new-tokens", "8"))
    # more questions or configs under the same job id are fine: only the new items run
    scripted.computed = []
    assert eval_job.eval_main(_args(tmp_path, "--job-id", "j1", "--configs", "base,PSA,s=2")) == 0
    assert len(scripted.computed) == 4 * 2


def test_unreachable_state_store_is_a_clear_error(tmp_path, scripted, capsys):
    from tests.cache.redis_server import free_port

    assert eval_job.eval_main(_args(tmp_path, "--state-url", f"redis://127.0.0.1:{free_port()}/0")) == 2
    assert "cannot reach the Redis state store" in capsys.readouterr().err


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(eval_backends.RAY_JOB_ENV, raising=False)
    assert eval_backends.choose_backend("auto") == "local"
    monkeypatch.setenv(eval_backends.RAY_JOB_ENV, "{}")
    assert eval_backends.choose_backend("auto") == "ray"
    with pytest.raises(ValueError, match="unknown eval backend"):
        eval_backends.choose_backend("nope")


def test_request_fn_backend_runs_concurrently():
    import threading

    seen = set()

    def fn(req):
        seen.add(threading.current_thread().name)
        time.sleep(0.05)
        assert req.request.max_new_tokens == 5  # the job's generation options reach every request
        return {"tokens": [1], "text": req.question, "stats": {}}

    be = eval_backends.RequestFnBackend(fn, RequestConfig(max_new_tokens=5), concurrency=4)
    items = make_items([f"q{i}" for i in range(4)], ["edr"], ["PSA"])
    t0 = time.perf_counter()
    out = list(be.run(items))
    assert sorted(i.key for i, _ in out) == sorted(i.key for i in items)
    assert time.perf_counter() - t0 < 0.35 and len(seen) > 1


# ====================================================================== the real job, killed
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.factories import tiny_causal_lm, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny-gpt2")
    tok = tiny_tokenizer()
    tiny_causal_lm("gpt2", len(tok), tok.eos_token_id, seed=3).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_local_backend_concurrency_is_exact_and_reports_throughput(tmp_path, tiny_model_dir, index_dirs, capsys):
    """``--concurrency 4`` on the local backend: each (retriever, config) runs its 4 items at
    once through the shared engine; every RaLMSpec output equals RaLMSeq's, the RaLMSeq
    outputs equal a one-at-a-time run's, results keep item order, and the report records
    the concurrency and a throughput per configuration."""
    import yaml

    from ralm.config import RalmConfig
    from ralm.corpus import load_questions
    from ralm.pipeline import Pipeline

    cfg = tmp_path / "ralmspec.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "corpus": str(DATA / "fixture_corpus.jsonl"),
                "work_dir": str(tmp_path / "work"),
                "retriever": {"kind": "edr", "index_dir": str(index_dirs["edr"])},
                "generator": {"model": str(tiny_model_dir), "torch_threads": 1},
                "request": {"max_new_tokens": 12},
            }
        )
    )
    out = tmp_path / "out"
    argv = ["--config", str(cfg), "--questions", str(DATA / "fixture_questions.jsonl"), "-n", "4"]
    argv += ["--retrievers", "edr", "--configs", "base,PSA", "--state-url", "memory://", "--out", str(out)]
    argv += ["--backend", "local", "--warmup", "0", "--no-progress", "--concurrency", "4"]
    assert eval_job.main(argv) == 0
    questions = load_questions(DATA / "fixture_questions.jsonl", limit=4)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["qid"], r["config"]) for r in rows] == [(q, c) for q in range(4) for c in ("seq", "base", "PSA")]
    assert all(r["identical"] is True for r in rows)
    pipe = Pipeline.from_config(RalmConfig.from_yaml(cfg), kinds=("edr",), progress=False)
    alone = [pipe.answer(q, kind="edr", method="seq").tokens for q in questions]
    assert [r["tokens"] for r in rows if r["config"] == "seq"] == alone
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["identical"] == summary["counts"]["compared"] == 8
    for r in summary["summary"]:
        assert r["concurrency"] == 4 and r["requests_per_s"] > 0 and r["tokens_per_s"] > 0 and r["wall_s"] > 0
    run = json.loads(next((out / "runs").glob("*.json")).read_text())
    assert run["concurrency"] == 4
    assert {(t["retriever"], t["config"], t["requests"]) for t in run["throughput"]} == {
        ("edr", c, 4) for c in ("seq", "base", "PSA")
    }
    md = (out / "summary.md").read_text()
    assert "Concurrency: 4 requests at once" in md and "| requests/s | tokens/s |" in md


def test_killed_job_resumes_without_recomputing(tmp_path, tiny_model_dir, index_dirs):
    srv = RedisServer(tmp_path / "redis").start()
    try:
        _killed_job_resumes(tmp_path, tiny_model_dir, index_dirs, srv)
    finally:
        srv.stop()


def _killed_job_resumes(tmp_path, model_dir, index_dirs, srv: RedisServer):
    import yaml

    cfg = tmp_path / "ralmspec.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "corpus": str(DATA / "fixture_corpus.jsonl"),
                "work_dir": str(tmp_path / "work"),
                "retriever": {"kind": "edr", "index_dir": str(index_dirs["edr"])},
                "generator": {"model": str(model_dir), "max_new_tokens_limit": 16, "torch_threads": 1},
                "request": {"max_new_tokens": 16},
            }
        )
    )
    out = tmp_path / "out"
    n_q, configs = 6, ["base", "PSA", "s=2"]
    total = n_q * (1 + len(configs))
    cmd = [
        sys.executable,
        "-m",
        "cluster.eval_job",
        "--config",
        str(cfg),
        "--questions",
        str(DATA / "fixture_questions.jsonl"),
        "-n",
        str(n_q),
        "--retrievers",
        "edr",
        "--configs",
        ",".join(configs),
        "--state-url",
        srv.url,
        "--job-id",
        "kill-test",
        "--out",
        str(out),
        "--warmup",
        "0",
        "--no-progress",
    ]
    env = {**srv.env(), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    store = open_state_store(srv.url)

    # run 1: SIGKILL once a few items are recorded
    log1 = open(tmp_path / "run1.log", "w")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log1, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while store.count_items("kill-test") < 3:
        assert p.poll() is None, f"run 1 ended early: {(tmp_path / 'run1.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, "run 1 recorded nothing in time"
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    log1.close()
    before = store.job_results("kill-test")
    assert 3 <= len(before) < total, f"kill came too late: {len(before)}/{total} recorded"
    assert not (out / "results.jsonl").exists()

    # run 2: same job id; only the missing items are computed
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = [json.loads(f.read_text()) for f in (out / "runs").glob("*.json")]
    assert len(runs) == 1
    run2 = runs[0]
    assert run2["skipped"] == len(before) and run2["computed"] == total - len(before)
    assert not set(run2["computed_keys"]) & set(before), "a finished item was recomputed"

    after = store.job_results("kill-test")
    assert len(after) == total
    assert all(after[k] == v for k, v in before.items()), "an item recorded by run 1 changed or was lost"
    assert {v["run_id"] for v in after.values()} == {next(iter(before.values()))["run_id"], run2["run_id"]}

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == total and len({r["key"] for r in rows}) == total
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {
        "items": total,
        "recorded": total,
        "missing": 0,
        "errors": 0,
        "compared": n_q * len(configs),
        "identical": n_q * len(configs),
        "different": 0,
    }
    assert all(r["identical"] for r in rows)
    seq = {r["qid"]: r["tokens"] for r in rows if r["config"] == "seq"}
    assert all(r["tokens"] == seq[r["qid"]] for r in rows)
    assert f"computed {total - len(before)}, skipped {len(before)}" in r.stdout
    store.close()


def test_ray_backend_matches_local(tmp_path, tiny_model_dir, index_dirs):
    """The ray backend (what a Ray job uses) on a local Ray instance with two pipeline actors:
    every item is recorded and RaLMSpec equals RaLMSeq across actors. In a subprocess so
    it does not share a Ray instance with other tests."""
    import yaml

    cfg = tmp_path / "ralmspec.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "corpus": str(DATA / "fixture_corpus.jsonl"),
                "work_dir": str(tmp_path / "work"),
                "retriever": {"kind": "edr", "index_dir": str(index_dirs["edr"])},
                "generator": {"model": str(tiny_model_dir), "max_new_tokens_limit": 12, "torch_threads": 1},
                "request": {"max_new_tokens": 12},
            }
        )
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "cluster.eval_job",
        "--config",
        str(cfg),
        "--questions",
        str(DATA / "fixture_questions.jsonl"),
        "-n",
        "2",
        "--retrievers",
        "edr",
        "--configs",
        "base,PSA",
        "--out",
        str(out),
        "--backend",
        "ray",
        "--workers",
        "2",
        "--worker-cpus",
        "0.5",
        "--warmup",
        "0",
        "--no-progress",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0"}
    env.pop("RALMSPEC_STATE_URL", None)
    # a fresh local Ray instance and two actors each importing torch and transformers: 4 min on
    # the 2-core machine beside a CPU-bound process (measured), hence the bound
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "backend: ray (2 actors" in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["recorded"] == 6 and summary["counts"]["identical"] == 4
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["worker"] for r in rows)
