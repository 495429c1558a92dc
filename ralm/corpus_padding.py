"""A padded corpus: the real passages plus generated ones drawn from the corpus' own term
statistics, so that a sparse (BM25) or approximate dense KB costs what a Wikipedia-size
index costs while the answers stay text a generator can read.

Why: on the 10k-passage demo corpus a BM25 query takes about 2 ms and an HNSW query about
15 ms, so retrieval is 6% and 33% of RaLMSeq's time and speculation has little to remove.
The RaLMSpec paper's sparse and approximate dense numbers come from a 21M-passage index.
The exact dense retriever can be padded with vectors that never outrank a real passage
(``RetrieverConfig.pad_to``), which changes costs and nothing else. A sparse index cannot:
Lucene's cost comes from the posting lists of the query's terms, so the padding passages
must contain those terms, and then they compete in the ranking. **A padded corpus changes
rankings**: RaLMSeq's answers on it differ from the ones on the real corpus (both are
still computed exactly, and RaLMSpec's outputs still equal RaLMSeq's on the same KB).

How a padding passage is generated (:func:`padding_passages`, deterministic for a seed):

* its length (words) is the length of a real passage drawn uniformly;
* it has a *topic*: a real passage drawn uniformly; each word is, with probability
  ``topic_share`` (default 0.5), a word of the topic passage drawn uniformly, else a word
  drawn from the whole corpus' word frequencies (the unigram distribution);
* its title is three words of the topic passage's title and contents.

Topic words keep what a unigram sample would lose: real passages repeat their own terms
(bursty term frequencies) and are about something, so a padding passage is about as close
to a query as a real passage of the same topic, and posting lists grow the way they grow in
a larger collection (a term's document frequency roughly in proportion to the collection).
Worked example: topic "Return a sorted list of the keys", unigram "the of a to in", length
6, topic_share 0.5 -> e.g. "sorted the keys of list in".

Words are whitespace-separated tokens of ``title`` and ``contents``, punctuation kept,
so the analyser sees the same kinds of tokens as in the real passages.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ralm.corpus import Corpus

PADDING_ID_PREFIX = "pad-"
TOPIC_SHARE = 0.5  # a padding passage's words: this share from its topic passage, the rest unigram
TITLE_WORDS = 3


class _Vocabulary:
    """The corpus' words as integer codes, with their unigram distribution."""

    def __init__(self, corpus: Corpus):
        counts: Counter[str] = Counter()
        self.passages: list[np.ndarray] = []  # per passage: its words' codes, in order
        code: dict[str, int] = {}
        for title, contents in zip(corpus.titles, corpus.contents):
            words = f"{title} {contents}".split()
            counts.update(words)
            self.passages.append(np.fromiter((code.setdefault(w, len(code)) for w in words), np.int64, len(words)))
        self.words = np.array(list(code), dtype=object)  # code -> word
        freq = np.zeros(len(code), dtype=np.float64)
        for w, c in counts.items():
            freq[code[w]] = c
        self.cdf = np.cumsum(freq / freq.sum())  # inverse-CDF sampling of the unigram
        self.lengths = np.array([len(c.split()) for c in corpus.contents], dtype=np.int64)


def padding_with_topics(
    corpus: Corpus, n: int, seed: int = 0, topic_share: float = TOPIC_SHARE
) -> Iterator[tuple[int, dict]]:
    """``(topic row, record)`` for each of :func:`padding_passages`' passages: the real
    passage each one was drawn around (used to place its vector near the topic's)."""
    if n < 0:
        raise ValueError(f"the number of padding passages must be >= 0, got {n}")
    if not 0.0 <= topic_share <= 1.0:
        raise ValueError(f"topic_share must be in [0, 1], got {topic_share}")
    if n == 0:
        return
    voc = _Vocabulary(corpus)
    rng = np.random.default_rng(seed)
    width = max(7, len(str(n - 1)))
    for i in range(n):
        row = int(rng.integers(len(voc.passages)))
        topic = voc.passages[row]
        length = int(voc.lengths[int(rng.integers(len(voc.lengths)))])
        from_topic = rng.random(length) < topic_share if len(topic) else np.zeros(length, dtype=bool)
        codes = np.searchsorted(voc.cdf, rng.random(length), side="right").clip(max=len(voc.cdf) - 1)
        if from_topic.any():
            codes[from_topic] = topic[rng.integers(len(topic), size=int(from_topic.sum()))]
        title = topic[rng.integers(len(topic), size=TITLE_WORDS)] if len(topic) else codes[:TITLE_WORDS]
        yield (
            row,
            {
                "id": f"{PADDING_ID_PREFIX}{i:0{width}d}",
                "title": " ".join(voc.words[title]),
                "contents": " ".join(voc.words[codes]),
            },
        )


def padding_passages(corpus: Corpus, n: int, seed: int = 0, topic_share: float = TOPIC_SHARE) -> Iterator[dict]:
    """``n`` generated passages (JsonCollection records ``id``, ``title``, ``contents``) from
    ``corpus``' term statistics (module docstring); ids ``pad-0000000``, ... The same
    (corpus, n, seed, topic_share) always gives the same passages."""
    for _, rec in padding_with_topics(corpus, n, seed, topic_share):
        yield rec


def write_padded_corpus(
    corpus: Corpus, total: int, out: str | Path, seed: int = 0, topic_share: float = TOPIC_SHARE, progress: bool = True
) -> np.ndarray:
    """Write ``corpus``' passages, then generated ones up to ``total`` passages, to ``out``
    (JsonCollection, gzipped when it ends in ``.gz``; written aside and renamed). Returns the
    topic row of each padding passage (``(total - len(corpus),)`` int64)."""
    if total < len(corpus):
        raise ValueError(f"--to {total} is smaller than the corpus ({len(corpus)} passages)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    n_pad = total - len(corpus)
    topics = np.empty(n_pad, dtype=np.int64)
    opener = (lambda p: gzip.open(p, "wt", encoding="utf-8", compresslevel=1)) if out.suffix == ".gz" else None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="writing padded corpus", unit="passage")
    with opener(tmp) if opener else open(tmp, "w", encoding="utf-8") as fh:
        for pid, title, contents in zip(corpus.ids, corpus.titles, corpus.contents):
            fh.write(json.dumps({"id": pid, "title": title, "contents": contents}) + "\n")
        if bar is not None:
            bar.update(len(corpus))
        for j, (row, rec) in enumerate(padding_with_topics(corpus, n_pad, seed, topic_share)):
            topics[j] = row
            fh.write(json.dumps(rec) + "\n")
            if bar is not None and j % 10000 == 9999:
                bar.update(10000)
    if bar is not None:
        bar.update(total - bar.n)
        bar.close()
    tmp.replace(out)
    return topics
