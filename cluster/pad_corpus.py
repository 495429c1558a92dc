"""``ralmspec pad-corpus``: write a corpus padded with generated passages (sparse and
approximate dense retrieval at the cost of a large KB; see :mod:`ralm.corpus_padding`).

Example: ``ralmspec pad-corpus --to 1000000 --out padded.jsonl.gz --vectors``, then
``ralmspec bench spec --corpus padded.jsonl.gz --retrievers sr,adr``. Unlike ``--pad-to`` (exact
dense padding that never changes a result), the padded passages take part in rankings.
``--vectors`` also puts the padded corpus' vectors in the embedding cache (the real
passages' own, synthesized ones for the rest: :mod:`ralm.retrieval.padded_vectors`), so
that its dense indexes build without encoding every generated passage.
"""

from __future__ import annotations

import argparse
import time

from cluster.flags import SHARED, Default, add_shared
from ralm.config import RalmConfig
from ralm.corpus import Corpus
from ralm.corpus_padding import TOPIC_SHARE, write_padded_corpus
from ralm.retrieval.padded_vectors import padded_corpus_vectors
from ralm.retrieval.passage_vectors import passage_vectors, save_vectors
from ralm.retrieval.shared_encoder import get_encoder


def add_pad_corpus_args(p: argparse.ArgumentParser) -> None:
    add_shared(p, corpus=Default(help="the corpus to pad: " + SHARED["corpus"].help, unset="the demo corpus"))
    p.add_argument("--to", type=int, required=True, help="passages in the padded corpus (real + generated)")
    add_shared(p, out=Default(help="the padded corpus: a JSONL(.gz) file", required=True), seed=0)
    p.add_argument(
        "--vectors",
        action="store_true",
        help="also cache dense vectors for the padded corpus (real ones + synthesized, calibrated on an encoded sample)",
    )
    add_shared(p, encoder=Default(help="--vectors' " + SHARED["encoder"].help, unset="the configured one"))
    p.add_argument(
        "--topic-share",
        type=float,
        default=TOPIC_SHARE,
        help="share of a generated passage's words drawn from its topic passage (the rest: corpus unigram)",
    )


def pad_corpus_main(args: argparse.Namespace) -> int:
    src = args.corpus if args.corpus is not None else RalmConfig().corpus
    corpus = Corpus.load(src)
    t0 = time.perf_counter()
    topics = write_padded_corpus(corpus, args.to, args.out, seed=args.seed, topic_share=args.topic_share)
    print(
        f"wrote {args.out}: {len(corpus):,} passages of {src} + {len(topics):,} generated "
        f"(seed {args.seed}, topic share {args.topic_share}) in {time.perf_counter() - t0:.0f} s; "
        "the generated passages take part in rankings (ralm/corpus_padding.py)"
    )
    if args.vectors:
        _cache_vectors(corpus, args, topics, RalmConfig().retriever.encoder if args.encoder is None else args.encoder)
    return 0


def _cache_vectors(corpus: Corpus, args: argparse.Namespace, topics, encoder_name: str) -> None:
    t0 = time.perf_counter()
    enc = get_encoder(encoder_name)
    real, _ = passage_vectors(corpus, enc)  # cached, shipped (the demo) or encoded once
    padded = Corpus.load(args.out)
    vectors, info = padded_corpus_vectors(padded, len(corpus), topics, real, enc, seed=args.seed)
    source = "synthesized: real passages' vectors + generated ones mixed around their topics " + str(info)
    path = save_vectors(padded, enc, vectors, source)
    print(
        f"cached {len(padded):,} x {vectors.shape[1]} vectors ({encoder_name}) in {path.parent} in "
        f"{time.perf_counter() - t0:.0f} s: topic weight c = {info['topic_weight']}, mean topic cosine "
        f"{info['encoded_cosine']} encoded ({info['sample']} generated passages) vs {info['mixed_cosine']} synthesized"
    )
