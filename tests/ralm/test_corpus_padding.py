"""The padded corpus (ralm/corpus_padding.py): generated passages drawn from the corpus'
own term statistics, deterministic per seed; a real Lucene index over it ranks padding
passages among the real ones, and RaLMSpec still equals RaLMSeq on it."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.corpus_padding import PADDING_ID_PREFIX, TITLE_WORDS, padding_passages, write_padded_corpus


def _words(corpus: Corpus) -> set[str]:
    return {w for t, c in zip(corpus.titles, corpus.contents) for w in f"{t} {c}".split()}


def test_the_same_seed_gives_the_same_passages(fixture_corpus):
    a = list(padding_passages(fixture_corpus, 50, seed=3))
    assert a == list(padding_passages(fixture_corpus, 50, seed=3))
    assert a != list(padding_passages(fixture_corpus, 50, seed=4))


def test_passages_are_made_of_corpus_words_with_corpus_lengths(fixture_corpus):
    vocab = _words(fixture_corpus)
    lengths = {len(c.split()) for c in fixture_corpus.contents}
    recs = list(padding_passages(fixture_corpus, 200, seed=0))
    assert len({r["id"] for r in recs}) == 200 and all(r["id"].startswith(PADDING_ID_PREFIX) for r in recs)
    for r in recs:
        words = r["contents"].split()
        assert len(words) in lengths
        assert set(words) <= vocab
        assert len(r["title"].split()) == TITLE_WORDS and set(r["title"].split()) <= vocab


def test_topic_share_one_draws_every_word_from_one_real_passage(fixture_corpus):
    passages = [set(f"{t} {c}".split()) for t, c in zip(fixture_corpus.titles, fixture_corpus.contents)]
    for r in padding_passages(fixture_corpus, 40, seed=1, topic_share=1.0):
        words = set(r["contents"].split())
        assert any(words <= p for p in passages)


def test_topic_share_zero_follows_the_unigram_distribution(fixture_corpus):
    counts = Counter(w for t, c in zip(fixture_corpus.titles, fixture_corpus.contents) for w in f"{t} {c}".split())
    total = sum(counts.values())
    top, n_top = counts.most_common(1)[0]
    drawn = Counter(
        w for r in padding_passages(fixture_corpus, 400, seed=2, topic_share=0.0) for w in r["contents"].split()
    )
    share = drawn[top] / sum(drawn.values())
    assert abs(share - n_top / total) < 0.25 * n_top / total  # tens of thousands of draws
    # and no passage is a copy of its topic: the single-passage check above fails here
    passages = [set(f"{t} {c}".split()) for t, c in zip(fixture_corpus.titles, fixture_corpus.contents)]
    recs = list(padding_passages(fixture_corpus, 20, seed=2, topic_share=0.0))
    assert sum(any(set(r["contents"].split()) <= p for p in passages) for r in recs) < 5


def test_bad_arguments_are_refused(fixture_corpus, tmp_path):
    with pytest.raises(ValueError, match=">= 0"):
        list(padding_passages(fixture_corpus, -1))
    with pytest.raises(ValueError, match="topic_share"):
        list(padding_passages(fixture_corpus, 3, topic_share=1.5))
    with pytest.raises(ValueError, match="smaller than the corpus"):
        write_padded_corpus(fixture_corpus, len(fixture_corpus) - 1, tmp_path / "x.jsonl")


@pytest.mark.parametrize("name", ["padded.jsonl", "padded.jsonl.gz"])
def test_the_written_corpus_holds_the_real_passages_first(fixture_corpus, tmp_path, name):
    out = tmp_path / name
    topics = write_padded_corpus(fixture_corpus, len(fixture_corpus) + 25, out, seed=5, progress=False)
    assert len(topics) == 25 and topics.max() < len(fixture_corpus) and not (tmp_path / (name + ".tmp")).exists()
    padded = Corpus.load(out)
    assert len(padded) == len(fixture_corpus) + 25
    assert padded.ids[: len(fixture_corpus)] == fixture_corpus.ids
    assert padded.contents[: len(fixture_corpus)] == fixture_corpus.contents
    opener = gzip.open if name.endswith(".gz") else open
    with opener(out, "rt") as fh:
        tail = [json.loads(line) for line in fh][len(fixture_corpus) :]
    assert tail == list(padding_passages(fixture_corpus, 25, seed=5))


def test_pad_corpus_command(fixture_corpus, tmp_path, capsys):
    from cluster.cli import main

    out = tmp_path / "p.jsonl.gz"
    assert (
        main(["pad-corpus", "--corpus", fixture_corpus.path, "--to", str(len(fixture_corpus) + 10), "--out", str(out)])
        == 0
    )
    assert len(Corpus.load(out)) == len(fixture_corpus) + 10
    assert "take part in rankings" in capsys.readouterr().out
    assert main(["pad-corpus", "--corpus", fixture_corpus.path, "--to", "1", "--out", str(out)]) == 2


def test_bm25_on_a_padded_corpus_ranks_padding_and_speculation_stays_exact(
    fixture_corpus, fixture_questions, project_engine, tmp_path
):
    """Real Lucene over the fixture corpus padded 4x: padding passages appear in the top
    documents (the padding changes rankings, as documented), and PSA / a fixed stride
    still return RaLMSeq's tokens and documents on that KB."""
    from ralm.retrieval.factory import build_index, load_retriever
    from tests.factories import padding_hits_with_exact_speculation

    path = tmp_path / "padded.jsonl"
    write_padded_corpus(fixture_corpus, 4 * len(fixture_corpus), path, progress=False)
    padded = Corpus.load(path)
    cfg = RetrieverConfig(kind="sr")
    build_index("sr", padded, tmp_path / "sr", cfg, progress=False)
    kb = load_retriever(cfg, padded, tmp_path / "sr")
    n_real = len(fixture_corpus)
    assert padding_hits_with_exact_speculation(kb, padded, n_real, project_engine, fixture_questions[:6]) > 0
