"""Retrievers behind one protocol: EDR (flat), ADR (HNSW), SR (BM25 via pyserini)."""

from ralm.retrieval.base import ExactScorer, Hit, Retriever, rank_hits

__all__ = ["Hit", "Retriever", "ExactScorer", "rank_hits"]
