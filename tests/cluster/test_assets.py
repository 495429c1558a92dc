"""The demo assets the project builds itself: pydocs corpus, questions, generator, fixtures."""

from __future__ import annotations

import gzip
import json
import math
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "assets" / "corpus" / "pydocs.jsonl.gz"
CORPUS_README = REPO / "assets" / "corpus" / "README.md"
QUESTIONS = REPO / "assets" / "questions" / "pydocs-questions.jsonl"
MODEL = REPO / "assets" / "model" / "pydocs-gpt"
FIX_CORPUS = REPO / "tests" / "data" / "fixture_corpus.jsonl"
FIX_QUESTIONS = REPO / "tests" / "data" / "fixture_questions.jsonl"


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    return _jsonl(CORPUS)


@pytest.fixture(scope="module")
def built_python() -> str:
    """CPython version the shipped corpus was built with (from its README)."""
    m = re.search(r"Built with CPython (\d+\.\d+\.\d+)", CORPUS_README.read_text())
    assert m, "assets/corpus/README.md must state the Python version"
    return m.group(1)


def _check_records(records: list[dict], prefix: str, width: int) -> None:
    for i, r in enumerate(records):
        assert set(r) == {"id", "title", "contents"}, r
        assert r["id"] == f"{prefix}{i:0{width}d}", (i, r["id"])
        assert isinstance(r["title"], str) and r["title"].strip(), r
        assert isinstance(r["contents"], str) and r["contents"].strip(), r
        assert r["contents"] == " ".join(r["contents"].split()), f"unclean whitespace in {r['id']}"
    ids = [r["id"] for r in records]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    texts = [r["contents"] for r in records]
    assert len(set(texts)) == len(texts), "exact duplicate passages"
    keys = [r["title"] for r in records]
    assert keys == sorted(keys), "passages are not ordered by title"


# ------------------------------------------------------------------------ corpus


def test_corpus_format_and_size(corpus):
    assert len(corpus) >= 10_000
    _check_records(corpus, "pydoc-", 6)
    words = [len(r["contents"].split()) for r in corpus]
    assert 60 <= statistics.median(words) <= 140
    assert min(words) >= 15 and max(words) <= 250
    tops = {r["title"].split(".")[0] for r in corpus}
    assert {"json", "os", "re", "collections", "reference", "numpy"} <= tops
    assert len(tops) >= 150
    assert any(r["title"] == "json.dumps" for r in corpus)


def test_corpus_gzip_is_reproducible_bytes():
    head = CORPUS.read_bytes()[:10]
    assert head[:2] == b"\x1f\x8b" and head[4:8] == b"\0\0\0\0", "gzip mtime must be 0"
    readme = CORPUS_README.read_text()
    assert "python -m cluster.assets.build_corpus" in readme
    n = len(_jsonl(CORPUS))
    assert f"{n:,} passages" in readme


def _build(out: Path) -> bytes:
    cmd = [
        sys.executable,
        "-W",
        "ignore",
        "-m",
        "cluster.assets.build_corpus",
        "--modules",
        "json,heapq,textwrap",
        "--min-passages",
        "1",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=60)
    return out.read_bytes()


def test_rebuild_is_deterministic(tmp_path, corpus, built_python):
    a = _build(tmp_path / "a.jsonl.gz")
    b = _build(tmp_path / "b.jsonl.gz")
    assert a == b
    recs = _jsonl(tmp_path / "a.jsonl.gz")
    _check_records(recs, "pydoc-", 6)
    assert {r["title"].split(".")[0] for r in recs} == {"json", "heapq", "textwrap"}
    assert not (tmp_path / "README.md").exists()  # README only for the full build
    if platform.python_version() == built_python:  # same docstrings as the shipped corpus
        shipped = {(r["title"], r["contents"]) for r in corpus}
        assert all((r["title"], r["contents"]) in shipped for r in recs)


def test_min_passages_is_enforced(tmp_path):
    from cluster.assets import build_corpus

    out = tmp_path / "x.jsonl.gz"
    assert build_corpus.main(["--modules", "heapq", "--min-passages", "100000", "--out", str(out)]) == 1
    assert not out.exists()


def test_chunking_respects_bounds():
    from cluster.assets.build_corpus import MIN_WORDS, chunk

    para = " ".join(f"Sentence number {i} says something short." for i in range(60))
    parts = chunk([para, "A tail paragraph."])
    assert len(parts) >= 3
    assert all(MIN_WORDS <= len(p.split()) <= 160 for p in parts)
    assert " ".join(parts).split() == (para + " A tail paragraph.").split()


# --------------------------------------------------------------------- questions


def _check_questions(questions: list[dict], records: list[dict]) -> None:
    title_of = {r["id"]: r["title"] for r in records}
    for q in questions:
        assert set(q) == {"question", "doc_id", "title"}, q
        assert isinstance(q["question"], str) and len(q["question"].split()) >= 3, q
        assert q["question"].endswith(("?", ".")), q
        assert q["doc_id"] in title_of, q
        assert q["title"] == title_of[q["doc_id"]], q
        assert q["title"].split(".")[-1].replace("-", " ") in q["question"], q
    assert len({q["question"] for q in questions}) == len(questions)


def test_questions(corpus):
    qs = _jsonl(QUESTIONS)
    assert len(qs) >= 200
    _check_questions(qs, corpus)
    assert len({q["title"].split(".")[0] for q in qs}) >= 50  # spread over modules
    assert len({q["question"].split()[0] for q in qs}) >= 4  # several templates


def test_question_builder_is_deterministic():
    from cluster.assets.build_questions import make_questions

    recs = _jsonl(FIX_CORPUS)
    a = make_questions(recs, 30, seed=0)
    assert a == make_questions(recs, 30, seed=0)
    assert a != make_questions(recs, 30, seed=1)
    _check_questions(a, recs)


# ------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def model_and_tokenizer():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One thread: a 4M-parameter model gains nothing from more, and on a busy 2-core
    # machine a second thread makes each tiny forward pass wait (100x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(MODEL)
    yield model, tok
    torch.set_num_threads(threads)


def test_model_loads_and_is_small(model_and_tokenizer):
    model, tok = model_and_tokenizer
    cfg = model.config
    assert cfg.n_positions >= 896
    assert cfg.eos_token_id is not None and cfg.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.pad_token_id == tok.eos_token_id
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"
    assert cfg.vocab_size == len(tok)
    size = sum(f.stat().st_size for f in MODEL.iterdir() if f.is_file())
    assert size < 15 * 2**20
    from safetensors import safe_open

    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.float16"}


def test_tokenizer_round_trip(model_and_tokenizer):
    _, tok = model_and_tokenizer
    text = "json.dumps\nSerialize ``obj`` to a JSON formatted str.  Ünïcode → ok\ttab"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert 5 < len(ids) < len(text)
    assert tok.decode(ids) == text
    assert max(ids) < len(tok)


def test_greedy_generation(model_and_tokenizer):
    import torch

    model, tok = model_and_tokenizer
    ids = tok("json.dumps\nSerialize obj", return_tensors="pt", add_special_tokens=False).input_ids

    def greedy(n: int) -> list[int]:
        x = ids
        out = []
        with torch.no_grad():
            for _ in range(n):
                nxt = int(model(input_ids=x).logits[0, -1].argmax())
                out.append(nxt)
                x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
        return out

    a = greedy(20)
    assert a == greedy(20)
    text = tok.decode(a, skip_special_tokens=True)
    assert sum(ch.isalpha() for ch in text) >= 10, text
    # It also runs at the far end of its positions (doc 256 + prompt 512 + 128 new).
    far = torch.randint(0, len(tok), (1, 896), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=far).logits).all()


def test_training_record():
    rec = json.loads((MODEL / "training.json").read_text())
    ppl = rec["heldout_perplexity"]
    assert isinstance(ppl, (int, float)) and math.isfinite(ppl)
    # A uniform guess over the 4096-token vocabulary scores 4096 and a unigram model
    # ~830; a few CPU minutes of training reach well below 500.
    assert 1.0 < ppl < 500.0
    assert rec["steps"] > 0 and rec["tokens_seen"] == rec["steps"] * rec["tokens_per_step"]
    for key in (
        "seed",
        "torch",
        "train_wall_s",
        "hyperparameters",
        "train_loss_last50",
        "heldout_passages",
        "corpus_sha256",
    ):
        assert key in rec, key
    assert rec["hyperparameters"]["n_positions"] >= 896
    assert rec["corpus_sha256"] == __import__("hashlib").sha256(CORPUS.read_bytes()).hexdigest()


def test_training_script_smoke(tmp_path):
    pytest.importorskip("torch")
    from cluster.assets import train_generator

    src = tmp_path / "c.jsonl"
    src.write_text(FIX_CORPUS.read_text())
    out = tmp_path / "m"
    import torch

    threads = torch.get_num_threads()
    try:
        rc = train_generator.main(
            [
                "--corpus",
                str(src),
                "--out",
                str(out),
                "--steps",
                "2",
                "--vocab-size",
                "400",
                "--n-embd",
                "32",
                "--n-layer",
                "1",
                "--n-head",
                "2",
                "--block-size",
                "64",
                "--batch-size",
                "2",
                "--heldout-per-mille",
                "100",
            ]
        )
    finally:
        torch.set_num_threads(threads)  # main() sets 1 thread for the whole process
    assert rc == 0
    rec = json.loads((out / "training.json").read_text())
    assert rec["steps"] == 2 and rec["heldout_passages"] > 0
    assert math.isfinite(rec["heldout_perplexity"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    t = AutoTokenizer.from_pretrained(out)
    assert m.config.n_positions == 1024 and t.eos_token_id == m.config.eos_token_id


# ---------------------------------------------------------------------- fixtures


def test_fixture_corpus(corpus):
    recs = _jsonl(FIX_CORPUS)
    assert 250 <= len(recs) <= 350
    _check_records(recs, "fx-", 4)
    mods = {r["title"].split(".")[0] for r in recs}
    assert len(mods) >= 15 and {"json", "re", "collections", "shutil", "os"} <= mods
    shipped = {(r["title"], r["contents"]) for r in corpus}
    assert all((r["title"], r["contents"]) in shipped for r in recs)


def test_fixture_questions():
    recs = _jsonl(FIX_CORPUS)
    qs = _jsonl(FIX_QUESTIONS)
    assert len(qs) >= 24
    _check_questions(qs, recs)
    assert len({q["title"].split(".")[0] for q in qs}) >= 10


def test_fixtures_rebuild_identically(tmp_path, built_python):
    if platform.python_version() != built_python:
        pytest.skip(f"fixtures were built with CPython {built_python}")
    from cluster.assets import make_fixtures

    assert make_fixtures.main(["--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "fixture_corpus.jsonl").read_bytes() == FIX_CORPUS.read_bytes()
    assert (tmp_path / "fixture_questions.jsonl").read_bytes() == FIX_QUESTIONS.read_bytes()
