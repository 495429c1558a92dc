"""Exact continuous batching: an invariant forward, per-request KV sessions, batched steps.

:mod:`~ralm.batching.invariant` makes a model's forward batch- and chunk-invariant,
:mod:`~ralm.batching.packed` runs several sequences in one forward,
:mod:`~ralm.batching.sessions` keeps each request's KV between steps,
:mod:`~ralm.batching.engine` advances many steps together,
:mod:`~ralm.batching.policy` picks what each batched forward feeds, and
:mod:`~ralm.batching.continuous_batcher` batches continuously on one model thread.
"""
