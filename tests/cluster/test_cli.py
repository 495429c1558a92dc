"""The ``ralmspec`` CLI end to end, in-process, on the fixture corpus and real indexes."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster.cli import main
from tests.conftest import FIXTURE_CORPUS, TEST_HNSW


@pytest.fixture(scope="module")
def config_for(tmp_path_factory, index_dirs):
    root = tmp_path_factory.mktemp("cli")

    def make(kind: str) -> str:
        path = root / f"{kind}.yaml"
        retr = {"kind": kind, "index_dir": str(index_dirs[kind])}
        if kind == "adr":
            retr.update(TEST_HNSW)
        path.write_text(
            yaml.safe_dump({"corpus": str(FIXTURE_CORPUS), "work_dir": str(root / "work"), "retriever": retr})
        )
        return str(path)

    return make


@pytest.mark.parametrize("kind", ["edr", "adr", "sr"])
def test_generate_prints_answer_and_statistics(kind, config_for, capsys):
    rc = main(
        [
            "generate",
            "--config",
            config_for(kind),
            "--retriever",
            kind,
            "--max-new-tokens",
            "12",
            "What does json.dumps do?",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- statistics ---" in out and f"retriever={kind}" in out and "kb_calls=" in out


def test_generate_json_seq_equals_spec(config_for, capsys):
    cfg = config_for("edr")
    q = "How do I copy a directory tree?"
    assert main(["generate", "--config", cfg, "--json", "--method", "seq", "--max-new-tokens", "16", q]) == 0
    seq = json.loads(capsys.readouterr().out)
    assert main(["generate", "--config", cfg, "--json", "--spec", "PSA", "--max-new-tokens", "16", q]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert seq["tokens"] == spec["tokens"]
    assert seq["stats"]["method"] == "seq" and spec["stats"]["method"] == "spec[PSA]"


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--retriever", "xyz", "question"], "unknown retriever 'xyz'"),
        (["--retriever", "edr", "   "], "question is empty"),
        (["--retriever", "edr", "word " * 2000], "limit is 512 tokens"),
        (["--retriever", "edr", "--spec", "PQ", "question"], "unknown RaLMSpec configuration"),
    ],
)
def test_generate_bad_input_is_a_clear_error(argv, msg, config_for, capsys):
    rc = main(["generate", "--config", config_for("edr")] + argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert msg in err


def test_missing_corpus_is_a_clear_error(tmp_path, capsys):
    rc = main(["generate", "--corpus", str(tmp_path / "nope.jsonl"), "--work-dir", str(tmp_path), "q?"])
    assert rc == 2 and "corpus file not found" in capsys.readouterr().err
