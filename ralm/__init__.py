"""ralmspec's pure core: configs, corpus, retrievers, LM engine, RaLMSeq/RaLMSpec loops.

Nothing in this package imports Ray; the Ray layers (``actors``, ``deployments``)
only own resources and I/O around it.
"""
