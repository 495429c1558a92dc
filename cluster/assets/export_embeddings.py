"""Write a corpus' passage embeddings in float16 to ``assets/embeddings/`` (the shipped demo
vectors), hash-listed in its ``manifest.json``.

With the defaults it ships the demo corpus under the default encoder, so that ``make serve``
on a fresh clone builds its dense indexes without encoding (about 20 minutes on two cores).
The vectors come from the embedding cache when present, else they are encoded::

    ralmspec assets embeddings [--corpus PATH] [--encoder NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys

from cluster.flags import SHARED, Default, HelpFormatter, add_shared
from ralm import constants as C
from ralm.config import RetrieverConfig
from ralm.corpus import Corpus
from ralm.retrieval.passage_vectors import SHIPPED_DIR, export_shipped
from ralm.retrieval.shared_encoder import get_encoder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ralmspec assets embeddings", description=__doc__, formatter_class=HelpFormatter)
    add_shared(
        ap,
        corpus=Default(C.DEMO_CORPUS, unset="the demo corpus"),
        encoder=Default(RetrieverConfig().encoder, unset="the retriever's default"),
        out=Default(help=SHARED["out"].help, unset="assets/embeddings"),
    )
    args = ap.parse_args(argv)

    corpus = Corpus.load(args.corpus)
    entry = export_shipped(corpus, get_encoder(args.encoder), args.out or SHIPPED_DIR)
    print(
        f"wrote {entry['file']}: {entry['shape'][0]} x {entry['shape'][1]} float16, sha256 {entry['sha256']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
