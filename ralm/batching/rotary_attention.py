"""Llama-family attention layers run straight on a packed batch: the same bits in fewer host ops.

transformers' ``LlamaAttention.forward`` (Mistral's and Qwen2's are the same code) projects
``hidden [1, N, d]`` to ``q [1, H, N, D]`` and ``k, v [1, Hkv, N, D]`` (a view and a transpose
each), rotates q and k with ``x * cos + rotate_half(x) * sin`` (``rotate_half``: two slices, a
negation and a concatenation per tensor; ``cos`` and ``sin`` unsqueezed at every layer), then
calls the attention interface, which turns the layout back. On a decode iteration those are
about 30 of a layer's torch ops, each a round trip through the dispatcher that a GPU waits
for (docs/batching.md, "Host cost").

:func:`use_packed_rotary_attention` gives each such module a forward that, when the model
runs on a :class:`~ralm.batching.packed.PackedBatch` (``ralm_batch=``), does the same
arithmetic in row layout and hands q, k, v to :meth:`PackedBatch.attend_rows` directly
(any other call runs transformers' forward unchanged):

- ``q [N, H, D]``, ``k, v [N, Hkv, D]``: one view each of the projections, no transposes;
- ``rotate_half(x) * sin`` is ``x[..., perm] * sin_signed``, where ``perm`` swaps the two
  halves and ``sin_signed = [-sin_1 | sin_2]``. ``(-a) * s`` and ``a * (-s)`` are the same
  float (IEEE multiplication is symmetric in sign; negation is exact), so one index and
  one product replace four ops per tensor, and every element gets transformers' bits.
  ``cos``, ``sin_signed`` and ``perm`` are made once per forward (the first layer), not per
  layer.

Worked example, ``D = 4``, ``x = [a b c d]``: ``rotate_half(x) = [-c -d a b]``; ``perm = [2 3
0 1]``, ``x[perm] = [c d a b]``, ``sin_signed = [-s0 -s1 s2 s3]``, so ``x[perm] * sin_signed =
[-c*s0, -d*s1, a*s2, b*s3]``: ``rotate_half(x) * sin`` element for element.

**One projection for q, k and v** (:mod:`ralm.batching.fused_projection`). The three projections read the same
input, so they run as one product over the stacked weight ``[Wq; Wk; Wv]`` (``[(H + 2 Hkv) D,
d]``): one linear layer (one kernel launch on a GPU) instead of three. The packed forward
views its output as ``[N, H + 2 Hkv, D]``, rotates the ``H + Hkv`` query and key heads in one
go (the rotary factors are per row and dimension, the same for every head) and splits off
v. transformers' own forward, which the lone path runs, keeps calling ``q_proj``, ``k_proj``
and ``v_proj``: those are now column slices of the same product (the first call computes it,
the next two reuse it for the same input), so both paths get the same bits from the same
kernel. The stacked product's rows are invariant like any other
linear layer's (the same load-time probe and proof).

The KV writes, the attention and the output layout are the packed batch's (one write per
layer for the whole batch, one attention call per group of segments).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ralm.batching.fused_projection import fuse

#: attention classes whose forward is LlamaAttention's (projections, rotate_half rotary, no
#: q/k norm); a model of another kind keeps transformers' forward
ROTARY_ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention")


class RotaryTables:
    """One forward's rotary factors in row layout: ``cos, sin_signed [N, 1, D]`` and ``perm [D]``
    (see the module docstring), made from transformers' ``position_embeddings`` once."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        D = cos.shape[-1]
        half = D // 2
        self.source = cos  # the forward's tensor these were made from (the same object at every layer)
        self.cos = cos[0].unsqueeze(1)  # [N, 1, D]
        s = sin[0].unsqueeze(1)
        self.sin_signed = torch.cat((-s[..., :half], s[..., half:]), dim=-1)
        self.perm = torch.cat((torch.arange(half, D, device=cos.device), torch.arange(0, half, device=cos.device)))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, heads, D]`` rotated: ``x * cos + rotate_half(x) * sin``, bit for bit."""
        return x * self.cos + x.index_select(-1, self.perm) * self.sin_signed


def _tables(batch, position_embeddings) -> RotaryTables:
    cos, sin = position_embeddings
    t = getattr(batch, "rotary", None)
    if t is None or t.source is not cos:
        t = batch.rotary = RotaryTables(cos, sin)
    return t


def _packed_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    batch = kwargs.get("ralm_batch")
    if batch is None or position_embeddings is None:
        return self._ralm_hf_forward(hidden_states, position_embeddings, attention_mask, **kwargs)
    n = hidden_states.shape[1]  # [1, N, d]: one packed row of tokens
    D = self.head_dim
    fused = self.qkv_proj  # a FusedProjection (q, k, v)
    h, hkv = fused.widths[0] // D, fused.widths[1] // D
    if batch.fused_rotary(n):  # the Triton backend on the pool: rotation, write, attention in two launches
        cos, sin = position_embeddings
        out = batch.rotary_attention(self.layer_idx, fused(hidden_states), cos, sin, h, hkv, float(self.scaling))
        return self.o_proj(out), None
    rot = _tables(batch, position_embeddings)
    qk, v = fused(hidden_states).view(n, h + 2 * hkv, D).split([h + hkv, hkv], dim=1)
    q, k = rot.rotate(qk).split([h, hkv], dim=1)  # [N, H, D], [N, Hkv, D]: one rotation for both
    out = batch.attend_rows(self.layer_idx, q, k.transpose(0, 1), v.transpose(0, 1), float(self.scaling))
    return self.o_proj(out.reshape(1, n, -1)), None


def use_packed_rotary_attention(model) -> int:
    """Give every Llama-family attention module of ``model`` the packed forward and one fused
    q/k/v projection (:func:`ralm.batching.fused_projection.fuse`; idempotent); returns how many modules have them."""
    n = 0
    for m in model.modules():
        if type(m).__name__ not in ROTARY_ATTENTIONS or not isinstance(m, nn.Module):
            continue
        if not all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "scaling")):
            continue
        if getattr(m, "_ralm_hf_forward", None) is None:
            object.__setattr__(m, "_ralm_hf_forward", m.forward)  # a bound method, not a submodule
            object.__setattr__(m, "forward", types.MethodType(_packed_forward, m))
        if fuse(m, ("q_proj", "k_proj", "v_proj"), "qkv_proj") is None:
            raise ValueError(f"{type(m).__name__}: q, k and v projections that cannot be stacked")
        n += 1
    return n
