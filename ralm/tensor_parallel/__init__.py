"""Exact tensor parallelism: one model's layers split over R ranks, the same bits at any batch.

A Llama-family model over ``R`` ranks (Megatron's split, docs/tensor-parallel.md):

- :mod:`~ralm.tensor_parallel.plan`: which slice of each weight a rank holds (heads, MLP
  columns, vocabulary), the model's numbers it splits (``ModelShape``), and the counts R must
  divide;
- :mod:`~ralm.tensor_parallel.collective`: the one collective the forward needs, an
  all-gather, over threads in one process or over ``torch.distributed`` (gloo on CPUs, NCCL
  on GPUs);
- :mod:`~ralm.tensor_parallel.shard`: a rank's model, built from a whole model or from a
  checkpoint's safetensors slices, whose row-parallel layers gather the partials and sum
  them in rank order (no arithmetic in the transport), and whose LM head gathers the
  vocabulary's logits;
- :mod:`~ralm.tensor_parallel.capacity`: what one rank needs (weights, KV pool, bytes
  gathered per decode step) and whether it fits a device, before renting GPUs
  (``ralmspec gpu-check --plan``).

Every rank then runs the invariant forward (:func:`ralm.batching.invariant.make_invariant`)
on its shard and holds the same logits, bit for bit; a request's tokens are the same alone
or in any batch on the same deployment (checkpoint, dtype and R).
"""
