"""The attention seam: one protocol, one backend per kernel family, chosen once per model.

Every attention the invariant forward runs goes through an :class:`AttentionBackend`:

- :meth:`~AttentionBackend.attend_alone`: transformers' attention interface on a lone step
  (:func:`invariant_attention`, registered by :func:`~ralm.batching.invariant.make_invariant`):
  ``query [B, H, nq, D]`` against the whole unpadded ``key, value [B, Hkv, L, D]``;
- :meth:`~AttentionBackend.attend_contiguous`: a group of sequences of a packed forward
  against their keys laid out one tensor per sequence (a sequence's run of blocks read in
  place, or the pool's blocks gathered);
- :meth:`~AttentionBackend.pool_sections` and :meth:`~AttentionBackend.attend_pool`: what a
  backend reads of the KV pool, put in the iteration's metadata before the forward, and the
  attention of every sequence of the forward straight from the pool (None: the backend
  gathers per group instead);
- :meth:`~AttentionBackend.rotary_pool` (where :attr:`~AttentionBackend.fuses_rotary`): a
  Llama-family layer's rotation, KV write and attention from its stacked q/k/v product.

Two backends, registered in :data:`BACKENDS`:

``torch`` (:class:`TorchAttention`)
    :func:`ralm.batching.attention.attend`: fixed-shape products in torch (BLAS, oneDNN), the
    softmax denominator as a column of ones in the values (a pool for it stores the column;
    :attr:`~AttentionBackend.value_ones`). On the pool it gathers each group
    of sequences through their block tables into that layout.
``triton`` (:class:`TritonAttention`)
    The batch-invariant Triton kernels (:mod:`ralm.batching.triton_kernels`): one paged launch
    per layer for every sequence of an iteration, and the rotation with the KV write fused.

:func:`attention_backend` is the one place that reads which a model runs (the flag
:func:`ralm.batching.triton_forward.use_triton` sets). A new attention kernel is a new backend
here: the packed forward, the pool and the proof stay as they are, and the whole-model proof
checks the new backend's bits before the engine batches with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ralm.batching.attention import attend, pad_kv
from ralm.errors import InvariantUnavailable


class PagedPlan(Protocol):
    """What a backend reads of :class:`ralm.batching.paged_kv.PagedPlan` (a protocol here:
    the plan module takes a backend, so this one does not import it)."""

    pool: Any  # the KVPool
    segments: list  # the forward's segments (.kv a PagedKV, .start, .n)
    meta: Any  # the iteration's IterationMetadata
    reads: dict[int, tuple]
    layout: Any  # a captured forward's FixedLayout, or None

    def blocks_after(self, idx: Sequence[int]) -> int: ...

    def section(self, name: str, device: torch.device) -> torch.Tensor: ...

    def padded_table(self, i: int, nb: int) -> list[int]: ...


class AttentionBackend(Protocol):
    """One family of attention kernels (see the module docstring)."""

    #: the name in :data:`BACKENDS` (and in op counts and benchmark headers)
    name: str
    #: whether :meth:`rotary_pool` runs a Llama-family layer's rotation, KV write and attention
    fuses_rotary: bool
    #: whether :meth:`attend_pool` attends every sequence of a pooled forward in one launch
    #: (then the packed batch's per-group indices are never read, and not built)
    paged_launch: bool
    #: whether the KV's values carry a last column of ones (``D + 1`` wide), which the kernel
    #: reads as its softmax denominator; a pool made for this backend lays its values out so
    #: (:class:`~ralm.batching.kv_pool.KVPool`'s ``value_ones``)
    value_ones: bool

    def attend_alone(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pos: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """``query [B, H, nq, D]`` (the last ``nq`` positions of each row), ``key, value [B, Hkv,
        L, D]`` unpadded, ``pos [B, nq]`` -> ``[B, nq, H, D]``."""
        ...

    def attend_contiguous(
        self,
        q: torch.Tensor,
        k_pad: torch.Tensor,
        v_aug: torch.Tensor,
        pos: torch.Tensor,
        scaling: float,
        mask: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """``q [S, H, n, D]`` against ``k_pad [S, Hkv, nb*B, D]`` and ``v_aug [S, Hkv, nb*B,
        D + value_ones]`` (whole key blocks; with :attr:`value_ones`, the last value column is
        ones), ``pos [S, n]`` -> ``[S, n, H, D]``; ``mask()`` gives :func:`~ralm.batching.attention.hidden_keys` (made once per group,
        for a backend that needs it)."""
        ...

    def pool_sections(self, plan: PagedPlan, groups: Sequence) -> None:
        """Put what this backend reads of the pool for ``plan``'s forward (block tables, query
        tiles, rows to gather) in the plan's metadata, before it ships."""
        ...

    def attend_pool(self, plan: PagedPlan, layer: int, q_rows: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """Every sequence's queries ``q_rows [N, H, D]`` against its pooled KV at ``layer`` (the
        new keys already written) -> ``[N, H, D]``; None: gather per group instead."""
        ...

    def rotary_pool(
        self,
        plan: PagedPlan,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        scaling: float,
    ) -> torch.Tensor | None:
        """A Llama-family layer's rotation, KV write and attention from its stacked projection
        ``qkv [1, N, (H + 2 Hkv) D]`` and rotary factors ``cos, sin [1, N, D]`` -> ``[1, N, H D]``;
        None where the backend does not fuse the rotation (:attr:`fuses_rotary` says so ahead)."""
        ...


class TorchAttention:
    """:func:`ralm.batching.attention.attend` in torch; gathers pooled KV per group."""

    name = "torch"
    fuses_rotary = False
    paged_launch = False
    # the denominator rides in the value product; stored with the values (not added when a
    # group is gathered) so that a lone sequence's run of blocks is read in place, with no
    # copy of its values at every layer of every iteration
    value_ones = True

    def attend_alone(self, query, key, value, pos, scaling):
        k_pad, v_aug = pad_kv(key, value)
        return attend(query, k_pad, v_aug, pos, scaling)

    def attend_contiguous(self, q, k_pad, v_aug, pos, scaling, mask):
        return attend(q, k_pad, v_aug, pos, scaling, mask=mask())

    def pool_sections(self, plan: PagedPlan, groups: Sequence) -> None:
        """The pool rows each group gathers (:meth:`PagedPlan.gather`): a lone sequence whose
        blocks follow one another in the pool is read in place, otherwise by one gather."""
        pool = plan.pool
        hkv, n_blocks = pool.k[0].shape[0], pool.n_blocks
        for gi, g in enumerate(groups):
            nb = plan.blocks_after(g.idx)
            table = plan.segments[g.idx[0]].kv.table[:nb]
            if len(g.idx) == 1 and len(table) == nb and table == list(range(table[0], table[0] + nb)):
                plan.reads[gi] = ("run", table[0], nb)
                continue
            # a layer viewed as rows [Hkv * n_blocks, B * Dx] has (head h, block b) at row
            # h * n_blocks + b; listed in [S, Hkv, nb] order
            rows = [b + h * n_blocks for i in g.idx for h in range(hkv) for b in plan.padded_table(i, nb)]
            plan.meta.add(f"paged.rows{gi}", rows)
            plan.reads[gi] = ("rows", len(g.idx), nb)

    def attend_pool(self, plan, layer, q_rows, scaling):
        return None

    def rotary_pool(self, plan, layer, qkv, cos, sin, heads, kv_heads, scaling):
        return None  # rotates in torch (rotary_attention.RotaryTables), then writes and attends as above


def _triton() -> tuple[Any, Any]:
    """``(triton_kernels, triton_paged)``, imported on first use."""
    from ralm.batching import triton_kernels, triton_paged  # lazy: triton is optional (CUDA only)

    return triton_kernels, triton_paged


class TritonAttention:
    """The batch-invariant Triton kernels: one paged launch per layer, the rotation fused."""

    name = "triton"
    fuses_rotary = True
    paged_launch = True
    value_ones = False  # the kernels keep the softmax sum in registers

    def attend_alone(self, query, key, value, pos, scaling):
        return _triton()[0].attention(query, key, value, pos, scaling)

    def attend_contiguous(self, q, k_pad, v_aug, pos, scaling, mask):
        return _triton()[0].attention(q, k_pad, v_aug[..., : q.shape[-1]], pos, scaling)

    def pool_sections(self, plan: PagedPlan, groups: Sequence) -> None:
        """The paged kernel's block tables, query tiles and row positions (with a fixed
        layout, ``plan.layout``: the tables' rows and the tiles padded to its sizes, the extra
        tiles empty)."""
        ATTN_BLOCK_Q = _triton()[0].ATTN_BLOCK_Q
        segs = plan.segments
        nb = plan.blocks_after(range(len(segs)))
        rows = max(len(segs), plan.layout.seqs) if plan.layout is not None else len(segs)
        tables = [b for i in range(len(segs)) for b in plan.padded_table(i, nb)]
        plan.meta.add("paged.tables", tables + [plan.pool.zero_block] * (rows - len(segs)) * nb, (rows, nb))
        # each sequence's packed rows cut into tiles of ATTN_BLOCK_Q rows from its first row
        # (the contiguous kernel's tiling of the same queries)
        seq, row, n = [], [], []
        for i, seg in enumerate(segs):
            for r in range(0, seg.n, ATTN_BLOCK_Q):
                seq.append(i)
                row.append(seg.start + r)
                n.append(min(ATTN_BLOCK_Q, seg.n - r))
        if plan.layout is not None and len(seq) < plan.layout.tiles:  # empty tiles: their programs store nothing
            pad = plan.layout.tiles - len(seq)
            seq, row, n = seq + [0] * pad, row + [0] * pad, n + [0] * pad
        plan.meta.add("paged.tile_seq", seq)
        plan.meta.add("paged.tile_row", row)
        plan.meta.add("paged.tile_n", n)
        plan.meta.add("paged.pos", [len(s.kv) + t for s in segs for t in range(s.n)])

    def _tiles(self, plan: PagedPlan, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            plan.section("paged.tile_seq", dev),
            plan.section("paged.tile_row", dev),
            plan.section("paged.tile_n", dev),
        )

    def attend_pool(self, plan, layer, q_rows, scaling):
        dev = plan.pool.layer_device(layer)
        return _triton()[1].paged_attention(
            q_rows,
            plan.pool.k[layer],
            plan.pool.v[layer],
            plan.section("paged.tables", dev),
            self._tiles(plan, dev),
            plan.section("paged.pos", dev),
            scaling,
        )

    def rotary_pool(self, plan, layer, qkv, cos, sin, heads, kv_heads, scaling):
        dev = plan.pool.layer_device(layer)
        return _triton()[1].rotary_paged_attention(
            qkv,
            cos,
            sin,
            heads,
            kv_heads,
            plan.pool.k[layer],
            plan.pool.v[layer],
            (plan.section("paged.blocks", dev), plan.section("paged.offsets", dev)),
            plan.section("paged.tables", dev),
            self._tiles(plan, dev),
            plan.section("paged.pos", dev),
            scaling,
        )


#: the attention backends by name
BACKENDS: dict[str, AttentionBackend] = {"torch": TorchAttention(), "triton": TritonAttention()}


def attention_backend(module_or_model) -> AttentionBackend:
    """The backend a model (or one of its attention modules) runs: the one place that reads
    the flag :func:`ralm.batching.triton_forward.use_triton` sets."""
    return BACKENDS["triton" if getattr(module_or_model, "_ralm_triton", False) else "torch"]


def invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``AttentionInterface`` entry point. ``query [B, H, nq, D]``, ``key/value [B, Hkv, Lk,
    D]`` (after the cache update). With ``ralm_batch`` (a packed batch of sequences, see
    :mod:`ralm.batching.packed`) the batch attends each of its sequences; otherwise each row
    of the batch is one unpadded sequence whose queries are its last ``nq`` positions, attended
    by the module's backend."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    packed = kwargs.get("ralm_batch")
    if packed is not None:
        return packed.attend(module, query, key, value, float(scaling)), None
    if attention_mask is not None:
        raise InvariantUnavailable("the invariant forward takes no padding mask: run sequences unpadded")
    nq, lk = query.shape[2], key.shape[2]
    pos = torch.arange(lk - nq, lk, device=query.device).expand(query.shape[0], nq)
    return attention_backend(module).attend_alone(query, key, value, pos, float(scaling)), None
