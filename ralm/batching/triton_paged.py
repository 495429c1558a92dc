"""Paged attention on Triton: every sequence of a packed forward in one launch, through block tables.

:func:`paged_attention` is the batch-invariant attention of
:func:`ralm.batching.triton_kernels.attention` reading keys and values from the KV pool
(:mod:`ralm.batching.kv_pool`) instead of one contiguous tensor per sequence. The whole
iteration is one launch per layer: one program per (tile of up to ``ATTN_BLOCK_Q`` query
rows of one sequence, head), whatever mix of prefill chunks, decode tokens and drafted
windows the iteration holds; no Python loop over sequences or key blocks.

Same reduction order, same bits: a program walks its sequence's key blocks ``0 .. max_pos
// BLOCK_N`` in order; block ``j`` is pool block ``table[s, j]``, and ``BLOCK_N`` equals the
pool's block size, so each step folds in exactly the keys the contiguous kernel's step
``j`` folds in (positions ``j*BLOCK_N ..``), with the same masks, the same online-softmax
update and the same ``tl.dot`` shapes. A query's result is therefore the contiguous
kernel's, bit for bit, and so it is the same alone, in a batch of 64, or in any chunking
(the contiguous kernel's contract, module docstring of :mod:`ralm.batching.triton_kernels`).

Worked example (``BLOCK_N = 64``): sequence 0 has table ``[5, 9]`` and a decode row at
position 70; sequence 1 a 20-token prefill chunk at positions 100-119 with table ``[2, 3]``.
Tiles: ``(seq 0, row 0, 1 row)`` and ``(seq 1, row 1, 16 rows)``, ``(seq 1, row 17, 4 rows)``.
The first tile's program folds in block 5 (keys 0-63), then block 9 (keys 64-70 visible).
"""

from __future__ import annotations

from typing import Any

import torch

from ralm.batching import triton_kernels as T
from ralm.batching.triton_kernels import tl, triton


def _build() -> dict[str, Any]:
    @triton.jit
    def paged_attention_kernel(
        q_ptr,  # [N, H, D] packed query rows
        k_ptr,  # one layer of the pool: block b, offset n, kv head h at b*skb + n*skn + h*skh
        v_ptr,  # the same for the values (Dv >= D columns, the first D are read)
        tab_ptr,  # [S, max_blocks] int32 block tables
        tile_seq_ptr,  # [T] int32: the tile's sequence
        tile_row_ptr,  # [T] int32: its first packed row
        tile_n_ptr,  # [T] int32: its rows (1 .. BLOCK_Q)
        pos_ptr,  # [N] int64: each packed row's position in its sequence
        o_ptr,  # [N, H, D], q's dtype
        D,
        GROUP,  # H // Hkv
        scaling,
        sqn,
        sqh,
        sqd,
        skb,
        skn,
        skh,
        skd,
        svb,
        svn,
        svh,
        svd,
        sts,
        stb,
        son,
        soh,
        sod,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        s = tl.load(tile_seq_ptr + t).to(tl.int64)
        r0 = tl.load(tile_row_ptr + t).to(tl.int64)
        nr = tl.load(tile_n_ptr + t)
        rq = tl.arange(0, BLOCK_Q)
        rows = r0 + rq  # [BLOCK_Q] packed rows
        rd = tl.arange(0, BLOCK_D)
        qmask = rq < nr
        dmask = rd < D
        q = tl.load(
            q_ptr + rows[:, None] * sqn + h * sqh + rd[None, :] * sqd,
            mask=qmask[:, None] & dmask[None, :],
            other=0.0,
        )  # [BLOCK_Q, BLOCK_D]
        pos = tl.load(pos_ptr + rows, mask=qmask, other=0)
        m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
        lsum = tl.zeros((BLOCK_Q,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
        max_pos = tl.max(pos, axis=0)
        n_blocks = max_pos // BLOCK_N + 1
        rb = tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of a block
        for j in range(0, n_blocks):  # the contiguous kernel's blocks, in the same order
            blk = tl.load(tab_ptr + s * sts + j * stb).to(tl.int64)
            rk = j * BLOCK_N + rb  # [BLOCK_N] key positions
            kvmask = (rk[:, None] <= max_pos) & dmask[None, :]
            k = tl.load(
                k_ptr + blk * skb + rb[:, None] * skn + kvh * skh + rd[None, :] * skd, mask=kvmask, other=0.0
            )  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + blk * svb + rb[:, None] * svn + kvh * svh + rd[None, :] * svd, mask=kvmask, other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling  # [BLOCK_Q, BLOCK_N] float32
            seen = rk[None, :] <= pos[:, None]
            sc = tl.where(seen, sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.where(m_new == m, 1.0, tl.exp(m - m_new))  # exactly 1 for a wholly hidden block
            p = tl.where(seen, tl.exp(sc - m_new[:, None]), 0.0)  # exact zeros for hidden keys
            lsum = lsum * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m = m_new
        out = acc / lsum[:, None]
        tl.store(
            o_ptr + rows[:, None] * son + h * soh + rd[None, :] * sod,
            out.to(o_ptr.dtype.element_ty),
            mask=qmask[:, None] & dmask[None, :],
        )

    return {"paged_attention": paged_attention_kernel}


def query_tiles(starts: list[int], counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tile_seq, tile_row, tile_n)`` (int32 ``[T]``): each sequence's packed rows
    ``starts[s] .. starts[s]+counts[s]-1`` cut into tiles of ``ATTN_BLOCK_Q`` rows, from its
    first row (the contiguous kernel's tiling of the same queries)."""
    seq, row, n = [], [], []
    for s, (a, c) in enumerate(zip(starts, counts)):
        for r in range(0, c, T.ATTN_BLOCK_Q):
            seq.append(s)
            row.append(a + r)
            n.append(min(T.ATTN_BLOCK_Q, c - r))
    return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (seq, row, n))  # type: ignore[return-value]


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q_pos: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Causal attention of packed query rows against their sequences' pooled KV.

    ``q [N, H, D]``: every sequence's new rows, one after another; ``k_pool [Hkv, n_blocks,
    B, D]`` and ``v_pool [Hkv, n_blocks, B, Dv]`` (``Dv >= D``): one layer of the pool,
    ``B == ATTN_BLOCK_N``; ``tables [S, max_blocks]`` (int32): each sequence's blocks
    (covering its last query's position); ``tiles``: :func:`query_tiles`; ``q_pos [N]``
    (int64): each row's position (row ``i`` sees its sequence's keys ``0 .. q_pos[i]``).
    Returns ``[N, H, D]`` in ``q.dtype``.
    """
    N, H, D = q.shape
    hkv, nblk, B, Dk = k_pool.shape
    if B != T.ATTN_BLOCK_N or Dk != D or v_pool.shape[:3] != k_pool.shape[:3] or v_pool.shape[3] < D or H % hkv:
        raise ValueError(
            f"paged attention shapes: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}"
            f" (blocks of {T.ATTN_BLOCK_N} positions)"
        )
    if D > 256:
        raise ValueError(f"head dimension {D} > 256")
    out = q.new_empty(N, H, D)
    tile_seq, tile_row, tile_n = tiles
    if N == 0 or tile_seq.numel() == 0:
        return out
    q_pos = q_pos.to(device=q.device, dtype=torch.int64)
    block_d = max(16, T.next_pow2(D))
    grid = (tile_seq.numel(), H)
    with T.on_device(q):
        T.built("paged", _build)["paged_attention"][grid](
            q,
            k_pool,
            v_pool,
            tables,
            tile_seq,
            tile_row,
            tile_n,
            q_pos,
            out,
            D,
            H // hkv,
            float(scaling),
            *q.stride(),
            *_block_offset_head_dim(k_pool),
            *_block_offset_head_dim(v_pool),
            *tables.stride(),
            *out.stride(),
            BLOCK_Q=T.ATTN_BLOCK_Q,
            BLOCK_N=T.ATTN_BLOCK_N,
            BLOCK_D=block_d,
            PRECISION=T.dot_precision(q.dtype),
            num_warps=4 if block_d <= 64 else 8,
        )
    return out


def _block_offset_head_dim(t: torch.Tensor) -> tuple[int, int, int, int]:
    """The strides of a pool layer ``[Hkv, n_blocks, B, D]`` in the kernel's order (block,
    offset, head, column)."""
    sh, sb, sn, sd = t.stride()
    return sb, sn, sh, sd
