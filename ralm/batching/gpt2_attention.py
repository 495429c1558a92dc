"""GPT-2's attention run straight on a packed batch: the same bits in fewer host ops.

transformers' ``GPT2Attention.forward`` splits the fused ``c_attn`` product ``[1, N, 3 d]``
into q, k, v, views and transposes each to ``[1, H, N, D]``, calls the attention interface
(which turns the layout back for the packed batch), then reshapes the output and makes it
contiguous: about 14 dispatched ops per layer around the attention itself. On a packed batch
(``ralm_batch=``, :class:`~ralm.batching.packed.PackedBatch`) :func:`use_packed_gpt2_attention`'s
forward does the same arithmetic in row layout:

- ``c_attn(x).view(N, 3H, D).split(H, dim=1)``: ``q, k, v [N, H, D]``, views of the product;
- ``k, v`` transposed to the KV's head-major layout (views) for
  :meth:`PackedBatch.attend_rows`, which writes them and attends every sequence;
- the output ``[N, H, D]`` reshaped to ``[1, N, d]`` for ``c_proj``.

Every value is the one transformers' path computes (views of the same product, the same
attention call, the same contiguous input to ``c_proj``), so the logits are its bits;
``tests/ralm/batching/test_gpt2_attention.py`` compares them. Any other call (a lone step with
transformers' cache, cross-attention) runs transformers' forward unchanged. The model is in
eval mode: the residual dropout is the identity, and is not called.
"""

from __future__ import annotations

import types

import torch
from torch import nn


def _packed_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    batch = kwargs.get("ralm_batch")
    past = (kwargs.get(k) for k in ("cache", "past_key_values", "layer_past"))  # the name varies by version
    if batch is None or args or kwargs.get("encoder_hidden_states") is not None or any(p is not None for p in past):
        return self._ralm_hf_forward(hidden_states, *args, **kwargs)
    n = hidden_states.shape[1]  # [1, N, d]: one packed row of tokens
    H, D = self.num_heads, self.head_dim
    q, k, v = self.c_attn(hidden_states).view(n, 3 * H, D).split(H, dim=1)  # [N, H, D] each
    out = batch.attend_rows(self.layer_idx, q, k.transpose(0, 1), v.transpose(0, 1), float(self.scaling))
    return self.c_proj(out.reshape(1, n, -1)), None


def use_packed_gpt2_attention(model) -> int:
    """Give every GPT-2 self-attention module of ``model`` the packed forward (idempotent);
    returns how many modules have it."""
    n = 0
    for m in model.modules():
        if (
            type(m).__name__ != "GPT2Attention"
            or not isinstance(m, nn.Module)
            or getattr(m, "is_cross_attention", False)
        ):
            continue
        if not all(hasattr(m, a) for a in ("c_attn", "c_proj", "num_heads", "head_dim", "layer_idx", "scaling")):
            continue
        if getattr(m, "_ralm_hf_forward", None) is None:
            object.__setattr__(m, "_ralm_hf_forward", m.forward)  # a bound method, not a submodule
            object.__setattr__(m, "forward", types.MethodType(_packed_forward, m))
        n += 1
    return n
