"""Ray actors: retrieval shards and their router, the cross-request verifier, coordinators and their pool.

Thin shells around the pure core (:mod:`ralm`): they own resources (indexes, a model
handle, a cache), batch and move data; the algorithms are :func:`ralm.seq.run_seq` and
:func:`ralm.spec.run_spec`, called as they are.
"""
