"""Causal attention with a fixed reduction order: the invariant forward's attention.

Registered through transformers' ``AttentionInterface`` by
:func:`~ralm.batching.invariant.make_invariant`. Per sequence, queries in tiles of
``query_tile`` rows against keys in blocks of ``key_block`` positions: every matrix product
has one fixed shape. Softmax uses the exact row max, ``exp`` and a *deferred* sum: values
carry an extra column of ones, so ``p @ [V | 1]`` yields the numerator and the denominator
in one product, and block partials are added in block order. A key a query may not see gets
``exp(-inf) = 0`` and adds an exact zero, so a longer padded key range (the same row inside
a bigger prefill) changes no bit. This is the ``torch`` attention backend's kernel; on CUDA
the same contract is kept by :func:`ralm.batching.triton_kernels.attention` (the ``triton``
backend; both behind :mod:`ralm.batching.attention_backend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ralm import constants as C


def attend(
    q: torch.Tensor,
    k_pad: torch.Tensor,
    v_aug: torch.Tensor,
    q_pos: torch.Tensor,
    scaling: float,
    query_tile: int = C.INVARIANT_QUERY_TILE,
    key_block: int = C.INVARIANT_KEY_BLOCK,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``S`` sequences at once, with a fixed reduction order.

    ``q [S, H, nq, D]``: the queries; ``k_pad [S, Hkv, nb*key_block, D]``: keys at positions
    ``0..``, padded to whole blocks (pad content is never seen); ``v_aug [S, Hkv, nb*key_block,
    D+1]``: values with a last column of ones; ``q_pos [S, nq]`` (long): each query's position
    (query ``i`` sees keys ``j <= q_pos[s, i]``; a padded query row may repeat a position).
    ``H`` is a multiple of ``Hkv`` (grouped-query attention: query heads ``g*G .. g*G+G-1``
    read kv head ``g``). Returns ``[S, nq, H, D]``. ``mask``: :func:`hidden_keys` of these
    arguments, when the caller already has it (it is the same for every layer).

    Scores: one product per (sequence, kv head), ``[G*rows, D] @ [D, nb*key_block]``: the
    reduction is over ``D`` only, rows are padded to a multiple of ``query_tile`` (at least
    4: one GEMM path per row) and the key range to whole blocks, and a score's bits do not
    depend on the row count or the key range (checked at load, :func:`check_attention_invariance`).
    Softmax: the exact row max, ``exp``, and the denominator carried as a column of ones in
    ``v_aug``. Values: one ``[rows, key_block] @ [key_block, D+1]`` product per block (a
    fixed-length reduction), the block partials added in block order; a masked key adds an
    exact zero. Example: a query at position 70 with ``key_block=64`` gets the partials of
    block 0 (keys 0-63) and block 1 (keys 64-70 visible, 71-127 masked), added in that
    order, inside a 100-token prefill, as a single decode token or next to a 900-token
    sequence (whose extra blocks are masked for it: exact zeros).
    """
    S, H, nq, D = q.shape
    hkv = k_pad.shape[1]
    G = H // hkv
    QT, KB = query_tile, key_block
    L = k_pad.shape[2]
    nb = L // KB
    if nb * KB != L or v_aug.shape[2] != L:
        raise ValueError("keys/values must be padded to whole key blocks")
    rows = -(-nq // QT) * QT
    # scaling is element-wise (the same bits for a row wherever it sits); zero rows pad to the tile
    qp = F.pad(q * scaling, (0, 0, 0, rows - nq)).reshape(S, hkv, G * rows, D)
    # head-major: query head g*G+i is rows i*rows.. of kv head g
    s = torch.matmul(qp, k_pad.transpose(-1, -2))  # [S, Hkv, G*rows, L]
    if mask is None:
        mask = hidden_keys(q_pos, nq, nb, G, QT, KB)
    s.masked_fill_(mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # exact row max
    e = s.sub_(m).exp_().view(S, hkv, G * rows, nb, KB).transpose(2, 3)  # [S, Hkv, nb, G*rows, KB]
    o = torch.matmul(e, v_aug.view(S, hkv, nb, KB, D + 1))  # [S, Hkv, nb, G*rows, D+1]
    # the block partials added in block order: a masked block adds an exact zero, so extra
    # blocks change nothing. On the CPU one cumsum call (each line a sequential float64
    # running sum) whatever the number of blocks; elsewhere (a GPU's cumsum is a parallel
    # scan, whose grouping depends on the length) one add per block.
    if o.device.type == "cpu":
        acc = o.cumsum(dim=2)[:, :, -1]  # [S, Hkv, G*rows, D+1]
    else:
        acc = o[:, :, 0]
        for j in range(1, nb):
            acc = acc + o[:, :, j]
    out = torch.div(*acc.split([D, 1], dim=-1))  # [S, Hkv, G*rows, D], contiguous: [S, H, rows, D]
    # the first nq rows of each head, as [S, nq, H, D]: one strided view (not reshape, slice, transpose)
    return out.as_strided((S, nq, H, D), (H * rows * D, D, rows * D, 1), out.storage_offset())


def hidden_keys(
    q_pos: torch.Tensor,
    nq: int,
    nb: int,
    groups: int,
    query_tile: int = C.INVARIANT_QUERY_TILE,
    key_block: int = C.INVARIANT_KEY_BLOCK,
) -> torch.Tensor:
    """The keys each query may not see, shaped for :func:`attend`'s scores:
    ``[S, 1, groups*rows, nb*key_block]`` (bool; ``rows`` is ``nq`` padded to the query
    tile, and padded query rows repeat the last real position)."""
    S = q_pos.shape[0]
    rows = -(-nq // query_tile) * query_tile
    pos = q_pos[:, -1:].repeat(1, rows)
    pos[:, :nq] = q_pos
    kpos = torch.arange(nb * key_block, device=q_pos.device).view(1, 1, -1)
    hidden = kpos > pos.view(S, rows, 1)  # [S, rows, nb*KB]
    if groups > 1:
        hidden = hidden.repeat(1, groups, 1)
    return hidden.unsqueeze(1)


def pad_kv(k: torch.Tensor, v: torch.Tensor, key_block: int = C.INVARIANT_KEY_BLOCK):
    """``k, v [..., L, D]`` -> ``(k_pad [..., nb*B, D], v_aug [..., nb*B, D+1])`` (copies)."""
    L, D = k.shape[-2:]
    n = -(-L // key_block) * key_block
    k_pad = k.new_zeros(*k.shape[:-2], n, D)
    k_pad[..., :L, :] = k
    v_aug = v.new_zeros(*v.shape[:-2], n, D + 1)
    v_aug[..., :L, :D] = v
    v_aug[..., D] = 1.0
    return k_pad, v_aug
