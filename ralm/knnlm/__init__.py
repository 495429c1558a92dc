"""KNN-LM (token-level iterative RaLM) with exact speculative retrieval.

- :mod:`ralm.knnlm.datastore`: build/save/load the token datastore (keys = final hidden states).
- :mod:`ralm.knnlm.retriever`: the KB (FAISS flat or HNSW, L2) with exact float64 re-scoring.
- :mod:`ralm.knnlm.cache`: the speculative cache (retrieved entries + their n successors).
- :mod:`ralm.knnlm.loop`: :func:`run_knn_seq` (baseline) and :func:`run_knn_spec` (speculation).
"""

from ralm.knnlm.cache import KnnEntryCache
from ralm.knnlm.datastore import Datastore, DatastoreError, build_datastore, model_fingerprint
from ralm.knnlm.loop import choose_token, default_spec, knn_settings, new_cache, run_knn_seq, run_knn_spec
from ralm.knnlm.retriever import KnnRetriever, load_knn_retriever
from ralm.knnlm.stepper import BatchedKnnStepper, KnnStepper, stepper_for

__all__ = [
    "Datastore",
    "DatastoreError",
    "KnnEntryCache",
    "KnnRetriever",
    "BatchedKnnStepper",
    "KnnStepper",
    "stepper_for",
    "build_datastore",
    "choose_token",
    "default_spec",
    "knn_settings",
    "load_knn_retriever",
    "model_fingerprint",
    "new_cache",
    "run_knn_seq",
    "run_knn_spec",
]
