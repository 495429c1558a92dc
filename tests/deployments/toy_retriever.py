"""A retriever kind registered from outside the package (a plugin of :mod:`ralm.retrievers`).

``toy``: a dense kind whose index is FAISS's generic flat inner-product index, answered by FAISS
alone (no low-precision scan, no GPU), built after the built-in kinds. Its module is named in
``RALMSPEC_RETRIEVER_PLUGINS`` so that every Ray worker registers it too.
"""

from __future__ import annotations

from ralm import retrievers
from ralm.retrieval.kinds import DENSE


def _toy_index(dim: int, cfg):
    import faiss

    return faiss.IndexFlat(dim, faiss.METRIC_INNER_PRODUCT)


TOY = retrievers.register(
    retrievers.RetrieverEntry(
        kind="toy",
        family=DENSE,
        exact=True,
        description="toy: FAISS's generic flat inner-product index, no scans",
        build_order=9,
        build_params=("encoder",),
        index_params=lambda cfg: {"metric": "inner_product", "faiss_index": "IndexFlat"},
        new_index=_toy_index,
    ),
    replace=True,
)
