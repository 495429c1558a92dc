"""Paged attention on Triton: every sequence of a packed forward in one launch, through block tables.

:func:`paged_attention` is the batch-invariant attention of
:func:`ralm.batching.triton_kernels.attention` reading keys and values from the KV pool
(:mod:`ralm.batching.kv_pool`) instead of one contiguous tensor per sequence. The whole
iteration is one launch per layer: one program per (tile of up to ``ATTN_BLOCK_Q`` query
rows of one sequence, head), whatever mix of prefill chunks, decode tokens and drafted
windows the iteration holds; no Python loop over sequences or key blocks.

Same kernel, same bits: the launch is :data:`ralm.batching.triton_kernels.attention_kernel`
with ``PAGED`` set, the kernel the contiguous :func:`~ralm.batching.triton_kernels.attention`
launches. ``PAGED`` changes only where rows are read: a tile's query rows come from the tile
arrays instead of the program grid, and key block ``j`` from pool block ``table[s, j]``
instead of positions ``j*BLOCK_N ..`` of one tensor (``BLOCK_N`` equals the pool's block
size). The online-softmax step over a block is one piece of code, run with the same masks
and the same ``tl.dot`` shapes in both layouts, so a query's result is the contiguous
kernel's bit for bit, and so it is the same alone, in a batch of 64, or in any chunking
(the kernel's contract, module docstring of :mod:`ralm.batching.triton_kernels`).

Worked example (``BLOCK_N = 64``): sequence 0 has table ``[5, 9]`` and a decode row at
position 70; sequence 1 a 20-token prefill chunk at positions 100-119 with table ``[2, 3]``.
Tiles: ``(seq 0, row 0, 1 row)`` and ``(seq 1, row 1, 16 rows)``, ``(seq 1, row 17, 4 rows)``.
The first tile's program folds in block 5 (keys 0-63), then block 9 (keys 64-70 visible).
"""

from __future__ import annotations

import torch

from ralm.batching import triton_kernels as T


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
    if N == 0 or tiles[0].numel() == 0:
        return out
    if q_pos.device != q.device or q_pos.dtype != torch.int64:  # (a no-op `to` is still an op)
        q_pos = q_pos.to(device=q.device, dtype=torch.int64)
    _launch_paged(q, q.stride(), k_pool, v_pool, q_pos, out, out.stride(), tables, tiles, scaling)
    return out


def rotary_paged_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q_pos: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """A Llama-family layer's attention from its stacked projection, in two launches.

    ``qkv [1, N, (H + 2 Hkv) D]``: each packed row's query, key and value heads (rows with
    a unit column stride); ``cos, sin [1, N, D]``: transformers' rotary factors of the
    rows' positions, in ``qkv``'s dtype; ``slots = (blocks, offsets)`` (int64 ``[N]``):
    where each row's position lives in the pool. The first launch rotates the query heads
    in place and the key heads into the pool, and writes the value heads there
    (:data:`~ralm.batching.triton_kernels.rotary_kv_write_kernel`); the second is
    :func:`paged_attention`'s launch reading the queries where they are. Returns
    ``[1, N, H D]`` (the output projection's input), the bits of the rotation in torch
    followed by a pool write and :func:`paged_attention`."""
    _, N, W = qkv.shape
    D = W // (heads + 2 * kv_heads)
    out = qkv.new_empty(1, N, heads * D)
    if N == 0 or tiles[0].numel() == 0:
        return out
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    blocks, offsets = slots
    sqn = qkv.stride(1)
    with T.on_device(qkv):
        T.kernels()["rotary_kv_write"][(N, heads + 2 * kv_heads)](
            qkv,
            cos,
            sin,
            k_pool,
            v_pool,
            blocks,
            offsets,
            sqn,
            cos.stride(1),
            sin.stride(1),
            *_block_offset_head_dim(k_pool),
            *_block_offset_head_dim(v_pool),
            heads,
            kv_heads,
            D,
            HALF=D // 2,
            BLOCK_D=T.next_pow2(D),
            num_warps=1 if D <= 64 else 2,
            enable_fp_fusion=False,  # a * b + c as two roundings, as torch's separate ops round
        )
    # the queries read where they sit in qkv (row stride sqn, head stride D); out is [1, N, H D]
    _launch_paged(qkv, (sqn, D, 1), k_pool, v_pool, q_pos, out, (heads * D, D, 1), tables, tiles, scaling, heads)
    return out


def _launch_paged(
    q: torch.Tensor,
    q_strides: tuple[int, ...],
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    q_pos: torch.Tensor,
    out: torch.Tensor,
    out_strides: tuple[int, ...],
    tables: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scaling: float,
    heads: int | None = None,
) -> None:
    """The paged launch of :data:`~ralm.batching.triton_kernels.attention_kernel`: query row ``r``,
    head ``h``, column ``d`` of ``q`` at ``r*q_strides[0] + h*q_strides[1] + d*q_strides[2]``,
    the output likewise; ``heads`` query heads (default ``q.shape[1]``), one program per
    (tile, head)."""
    H = heads if heads is not None else q.shape[1]
    T.launch_attention(
        (tiles[0].numel(), H, 1),
        q,
        k_pool,
        v_pool,
        q_pos,
        out,
        (tables, *tiles),
        nq=0,
        L=tables.shape[1] * T.ATTN_BLOCK_N,
        group=H // k_pool.shape[0],
        scaling=scaling,
        q_strides=(0, *q_strides),
        k_strides=_block_offset_head_dim(k_pool),
        v_strides=_block_offset_head_dim(v_pool),
        pos_strides=(0, q_pos.stride(0)),
        table_strides=tables.stride(),
        out_strides=(0, *out_strides),
    )


def _block_offset_head_dim(t: torch.Tensor) -> tuple[int, int, int, int]:
    """The strides of a pool layer ``[Hkv, n_blocks, B, D]`` in the kernel's order (block,
    offset, head, column)."""
    sh, sb, sn, sd = t.stride()
    return sb, sn, sh, sd
