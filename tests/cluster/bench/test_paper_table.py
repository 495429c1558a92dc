"""`ralmspec bench paper-table`: the paper's grid run end to end on the fixture indexes, and the
table's rows put each of our measurements beside the paper's number for the same cell."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from cluster.bench.paper_table import PAPER_DOC, PAPER_KNN_BEST, PAPER_KNN_K1024, markdown, paper_rows
from cluster.cli import main
from tests.conftest import FIXTURE_CORPUS, FIXTURE_QUESTIONS, KINDS, TEST_HNSW


def _row(config, speedup, share, **where):
    return {
        **where,
        "config": config,
        "requests": 2,
        "identical": 2,
        "mean_latency_s": 1.0,
        "generation_s": 1.0 - share,
        "retrieval_s": share,
        "retrieval_share": share,
        "speedup": speedup,
        "retrieval_eliminated": 0.5,
        "gamma": None,
        "speculation_accuracy": None,
        "kb_calls": 3.0,
        "rollbacks": 0.0,
    }


def test_rows_pair_each_cell_with_the_papers_number_and_its_own_baseline_share():
    doc = [
        _row("RaLMSeq", 1.0, 0.62, retriever="edr"),
        _row("PSA@0.6", 1.9, 0.3, retriever="edr"),
        _row("RaLMSeq", 1.0, 0.10, retriever="sr"),
        _row("S", 1.05, 0.08, retriever="sr"),
        _row("s=8", 1.2, 0.2, retriever="sr"),
    ]
    knn = [
        _row("baseline", 1.0, 0.7, index="flat(pad 1,000,000)", k=1024),
        _row("S@0.6", 3.0, 0.2, index="flat(pad 1,000,000)", k=1024),
        _row("baseline", 1.0, 0.5, index="hnsw", k=16),
        _row("S", 2.0, 0.2, index="hnsw", k=16),
    ]
    rows = {(r["workload"], r["retriever"], r["config"]): r for r in paper_rows(doc, knn)}
    assert len(rows) == 5  # baselines are not rows of their own
    psa = rows[("doc", "edr", "PSA@0.6")]
    assert psa["baseline_retrieval_share"] == 0.62 and psa["speedup"] == 1.9
    assert tuple(psa["paper"].values()) == PAPER_DOC[("edr", "PSA")]
    assert psa["scheduler"] == "OS3, gamma cap 0.6"
    s = rows[("doc", "sr", "S")]
    assert s["baseline_retrieval_share"] == 0.10 and tuple(s["paper"].values()) == PAPER_DOC[("sr", "S")]
    assert s["scheduler"] == "default (no cap)"
    assert rows[("doc", "sr", "s=8")]["paper"] is None  # a fixed stride the paper did not run
    flat = rows[("knn k=1024", "flat(pad 1,000,000)", "S@0.6")]
    assert flat["paper"] == {"k=1024": PAPER_KNN_K1024["flat"]} and flat["baseline_retrieval_share"] == 0.7
    hnsw = rows[("knn k=16", "hnsw", "S")]
    assert hnsw["paper"] == {"best k": PAPER_KNN_BEST["hnsw"]}
    md = markdown(list(rows.values()), ["a note"])
    assert "| 62.00% |" in md and "2.39x / 2.32x / 1.75x" in md and "up to 2.45x (best k)" in md


def test_padded_corpus_rows_are_their_own_blocks_with_the_papers_numbers():
    from cluster.bench.paper_table import _padded_rows, padded_work_dir

    doc = [_row("RaLMSeq", 1.0, 0.10, retriever="sr"), _row("PSA", 1.02, 0.1, retriever="sr")]
    doc += _padded_rows([_row("RaLMSeq", 1.0, 0.7, retriever="sr"), _row("PSA", 1.6, 0.4, retriever="sr")], 1_000_000)
    rows = {(r["retriever"], r["config"]): r for r in paper_rows(doc, [])}
    padded = rows[("sr (padded 1,000,000)", "PSA")]
    assert padded["baseline_retrieval_share"] == 0.7 and padded["speedup"] == 1.6
    assert tuple(padded["paper"].values()) == PAPER_DOC[("sr", "PSA")]
    assert rows[("sr", "PSA")]["baseline_retrieval_share"] == 0.10
    assert padded_work_dir(Path("/x/padded.jsonl.gz")) == Path("/x/padded.work")


def _fixture_config(tmp_path, index_dirs) -> Path:
    """A config whose work dir holds the fixture indexes, with their small HNSW parameters."""
    work = tmp_path / "work"
    (work / "indexes").mkdir(parents=True)
    for kind in KINDS:
        (work / "indexes" / kind).symlink_to(index_dirs[kind])
    cfg = tmp_path / "cfg.yaml"
    # the fixture ADR index's small HNSW parameters (the other kinds ignore them)
    cfg.write_text(
        yaml.safe_dump(
            {"corpus": str(FIXTURE_CORPUS), "work_dir": str(work), "retriever": {"kind": "edr", **TEST_HNSW}}
        )
    )
    return cfg


def test_the_command_runs_the_grid_and_every_output_is_exact(tmp_path, index_dirs, capsys):
    cfg = _fixture_config(tmp_path, index_dirs)
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "paper-table",
            "--config",
            str(cfg),
            "--questions",
            str(FIXTURE_QUESTIONS),
            "-n",
            "1",
            "--max-new-tokens",
            "6",
            "--pad-to",
            "2000",
            "--configs",
            "base,PSA@0.6,PSA",
            "--knn-configs",
            "S@0.6",
            "--knn-ks",
            "16",
            "--knn-max-new-tokens",
            "4",
            "--knn-passages",
            "20",
            "--knn-pad-to",
            "0",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "paper_table.json").read_text())
    cells = {(r["workload"], r["retriever"].split("(")[0], r["config"]) for r in data["rows"]}
    assert cells == {("doc", k, c) for k in KINDS for c in ("base", "PSA@0.6", "PSA")} | {
        ("knn k=16", i, "S@0.6") for i in ("flat", "hnsw")
    }
    assert all(r["identical"] == "1/1" for r in data["rows"])
    assert all(r["paper"] for r in data["rows"])  # every cell of this grid is one the paper ran
    assert all(0 < r["baseline_retrieval_share"] < 1 for r in data["rows"])
    assert (out / "doc" / "bench.json").exists() and (out / "knn" / "knn_bench.json").exists()
    assert "| doc | sr | PSA@0.6 |" in (out / "paper_table.md").read_text()


def test_the_command_adds_adr_and_sr_blocks_on_a_padded_corpus(tmp_path, index_dirs, dense_encoder):
    """`--padded-corpus`: ADR and SR run again on a padded corpus (real Lucene and HNSW
    indexes built beside it, from its cached synthesized vectors), as blocks of their own."""
    import numpy as np

    from ralm.corpus import Corpus
    from ralm.corpus_padding import write_padded_corpus
    from ralm.retrieval.padded_vectors import padded_corpus_vectors
    from ralm.retrieval.passage_vectors import save_vectors

    fixture = Corpus.load(FIXTURE_CORPUS)
    path = tmp_path / "padded.jsonl"
    topics = write_padded_corpus(fixture, 2 * len(fixture), path, progress=False)
    padded = Corpus.load(path)
    real = np.load(index_dirs["edr"] / "vectors.npy")
    vectors, _ = padded_corpus_vectors(padded, len(fixture), topics, real, dense_encoder, sample=8)
    save_vectors(padded, dense_encoder, vectors, "synthesized (test)")
    cfg = _fixture_config(tmp_path, index_dirs)
    out = tmp_path / "out"
    argv = ["bench", "paper-table", "--config", str(cfg), "--questions", str(FIXTURE_QUESTIONS), "-n", "1"]
    argv += ["--max-new-tokens", "6", "--pad-to", "2000", "--configs", "PSA", "--skip-knn"]
    argv += ["--padded-corpus", str(path), "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads((out / "paper_table.json").read_text())["rows"]
    label = f"(padded {2 * len(fixture):,})"
    assert {(r["retriever"], r["config"]) for r in rows} == {(k, "PSA") for k in KINDS} | {
        (f"{k} {label}", "PSA") for k in ("adr", "sr")
    }
    assert all(r["identical"] == "1/1" and r["paper"] for r in rows)
    built = json.loads((tmp_path / "padded.work" / "indexes" / "adr" / "manifest.json").read_text())
    assert built["vectors"]["from"] == "synthesized (test)" and built["n_docs"] == 2 * len(fixture)
