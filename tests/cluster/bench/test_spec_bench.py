"""`ralmspec bench spec` end to end on the fixture corpus: outputs, identity check, exit code."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from cluster.cli import main
from ralm.config import SpecConfig
from tests.conftest import FIXTURE_CORPUS, FIXTURE_QUESTIONS


def test_parse_config_names():
    assert SpecConfig.parse("s=4").stride == 4 and not SpecConfig.parse("s=4").adaptive_stride
    psa = SpecConfig.parse("PSA")
    assert psa.prefetch and psa.adaptive_stride and psa.async_verify
    assert SpecConfig.parse("PSA@0.9").gamma_max == 0.9 and SpecConfig.parse("PSA").gamma_max == 0.6
    with pytest.raises(ValueError):
        SpecConfig.parse("XYZ")


def test_bench_writes_json_table_and_chart(tmp_path, index_dirs, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "corpus": str(FIXTURE_CORPUS),
                "work_dir": str(tmp_path / "work"),
                "retriever": {"kind": "edr", "index_dir": str(index_dirs["edr"])},
            }
        )
    )
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "spec",
            "--config",
            str(cfg),
            "--questions",
            str(FIXTURE_QUESTIONS),
            "-n",
            "2",
            "--retrievers",
            "edr",
            "--configs",
            "base,PSA,s=2",
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    rows = {r["config"]: r for r in data["summary"]}
    assert set(rows) == {"RaLMSeq", "base", "PSA", "s=2"}
    assert all(r["requests"] == 2 and r["identical"] == 2 for r in rows.values())
    assert rows["RaLMSeq"]["speedup"] == pytest.approx(1.0)
    assert len(data["requests"]) == 2
    assert (out / "bench.png").stat().st_size > 1000
    md = (out / "bench.md").read_text()
    assert "| edr | PSA |" in md and "identical" in md


def test_bench_exits_nonzero_when_an_output_differs(tmp_path, index_dirs, monkeypatch, capsys):
    """A deliberately broken RaLMSpec (drops the last token) must fail the benchmark."""
    import ralm.spec

    real = ralm.spec.run_spec

    def broken(*a, **kw):
        r = real(*a, **kw)
        return dataclasses.replace(r, tokens=r.tokens[:-1])

    monkeypatch.setattr(ralm.spec, "run_spec", broken)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "corpus": str(FIXTURE_CORPUS),
                "work_dir": str(tmp_path / "work"),
                "retriever": {"kind": "edr", "index_dir": str(index_dirs["edr"])},
            }
        )
    )
    rc = main(
        [
            "bench",
            "spec",
            "--config",
            str(cfg),
            "--questions",
            str(FIXTURE_QUESTIONS),
            "-n",
            "1",
            "--retrievers",
            "edr",
            "--configs",
            "base",
            "--max-new-tokens",
            "8",
            "--warmup",
            "0",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert rc == 1
    assert "differ from RaLMSeq" in capsys.readouterr().err


def test_bench_concurrency_keeps_every_request_exact_and_in_order(tmp_path, index_dirs, capsys):
    """``--concurrency 4``: each configuration's 4 questions run at once through the shared
    engine; every RaLMSpec output equals RaLMSeq's, rows keep question order, and the report
    records the concurrency and each configuration's throughput."""
    from ralm.corpus import load_questions

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "corpus": str(FIXTURE_CORPUS),
                "work_dir": str(tmp_path / "work"),
                "retriever": {"kind": "edr", "index_dir": str(index_dirs["edr"])},
            }
        )
    )
    out = tmp_path / "out"
    argv = ["bench", "spec", "--config", str(cfg), "--questions", str(FIXTURE_QUESTIONS), "-n", "4", "--warmup", "0"]
    argv += ["--retrievers", "edr", "--configs", "base,PSA", "--max-new-tokens", "8", "--out", str(out)]
    assert main([*argv, "--concurrency", "4"]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["concurrency"] == 4
    assert [r["question"] for r in data["requests"]] == load_questions(FIXTURE_QUESTIONS, limit=4)
    assert all(r[c]["identical"] for r in data["requests"] for c in ("base", "PSA"))
    rows = {r["config"]: r for r in data["summary"]}
    assert set(rows) == {"RaLMSeq", "base", "PSA"}
    for r in rows.values():
        assert r["requests"] == r["identical"] == 4 and r["concurrency"] == 4
        assert r["wall_s"] > 0 and r["requests_per_s"] == pytest.approx(4 / r["wall_s"])
        assert r["tokens_per_s"] == pytest.approx(4 * r["tokens"] / r["wall_s"])
    assert data["batcher"]["steps_done"] > 0
    md = (out / "bench.md").read_text()
    assert "Concurrency: 4 requests at once" in md and "| requests/s | tokens/s |" in md


def test_bench_rejects_a_concurrency_below_one(tmp_path, index_dirs, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"corpus": str(FIXTURE_CORPUS), "work_dir": str(tmp_path / "work")}))
    argv = ["bench", "spec", "--config", str(cfg), "--retrievers", "edr", "--concurrency", "0", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "--concurrency must be at least 1" in capsys.readouterr().err


def test_no_timed_question_starts_after_the_deadline_and_the_rows_cover_those_run():
    """gpu-check's budget: a spent deadline still runs the warm-up and the first timed question
    (something to report), then stops; without one every question runs."""
    from types import SimpleNamespace

    from cluster.bench.spec_bench import run_retriever
    from ralm.config import RequestConfig
    from tests.factories import ScriptedGenerator, ScriptedKB

    gen, kb = ScriptedGenerator(), ScriptedKB(schedule={1: 7, 3: 2}, n_q=3, k=4)
    pipe = SimpleNamespace(
        retriever=lambda kind: kb,
        generator=gen,
        cfg=SimpleNamespace(request=RequestConfig(max_new_tokens=16, generation_stride=4)),
        engine=SimpleNamespace(clear_kv_caches=lambda: None),
    )
    questions = ["a b c", "d e f", "g h i", "j k l"]
    rows, per_request = run_retriever(pipe, "scripted", questions, ["PSA"], warmup=1, progress=False, deadline=0.0)
    assert [r["question"] for r in per_request] == ["d e f"]
    assert [(r.config, r.requests, r.identical) for r in rows] == [("RaLMSeq", 1, 1), ("PSA", 1, 1)]
    rows, per_request = run_retriever(pipe, "scripted", questions, ["PSA"], warmup=1, progress=False)
    assert len(per_request) == 3 and rows[1].requests == rows[1].identical == 3
