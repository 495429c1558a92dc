"""The KV pool: every sequence's keys and values in fixed-size blocks of one preallocated store.

Layout, for all layers at once (one tensor each, so growing or copying a block is one op):

- ``k [n_layers, Hkv, n_blocks, B, D]``: keys, ``B`` positions per block, head-major (a
  head's block is one contiguous ``[B, D]`` run, so a sequence's keys are gathered into the
  attention's ``[S, Hkv, L, D]`` layout in one row copy per (head, block), and a sequence
  whose blocks follow one another in the pool is read in place, without a copy);
- ``v [n_layers, Hkv, n_blocks, B, D+1]``: values with a last column of ones (the CPU
  attention's softmax denominator, :func:`ralm.batching.attention.attend`; the Triton
  kernels read the first ``D`` columns only).

A sequence (:class:`~ralm.batching.paged_kv.PagedKV`) owns a *block table*: block ``j`` of
its table holds its positions ``j*B .. j*B+B-1``. Position ``p`` of a sequence lives in
block ``table[p // B]`` at offset ``p % B``. Example with ``B = 64``: a sequence whose table
is ``[7, 2]`` keeps position 70 in block 2, offset 6.

Blocks are reference counted: a document's KV is held by the doc-block cache and shared,
block by block, by every sequence that starts from it (a fork increments the counts).
Writing into a block somebody else also holds copies it first (copy on write,
:meth:`KVPool.copy_block`), so a sequence's bits never depend on who else reads its blocks.

Block 0 is the *zero block*: all zeros, never handed out, the padding entry of block tables
(a padded key block is masked by the attention; zeros keep its masked products finite).
Every other block is zero-initialised when the pool grows, so a stale position is always
a finite number (the attention multiplies masked positions by exact zeros).

The pool is allocated on the first write (then it knows ``Hkv``, ``D``, the dtype and the
device) with ``initial_blocks`` blocks, and doubles when a sequence in flight needs a block
and none is free: a step never fails or waits for memory that idle sessions hold, because
:meth:`KVPool.reclaim` first asks the owners of idle blocks (the session store, the
doc-block cache) to drop their least recently used ones. It never shrinks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from ralm import constants as C

ZERO_BLOCK = 0


class KVPool:
    """Reference-counted KV blocks of ``block_size`` positions for ``n_layers`` layers."""

    def __init__(
        self, n_layers: int, block_size: int = C.INVARIANT_KEY_BLOCK, initial_blocks: int = C.KV_POOL_INITIAL_BLOCKS
    ):
        if block_size < 1 or initial_blocks < 2:
            raise ValueError("a KV pool needs a block size >= 1 and at least 2 blocks (block 0 is the zero block)")
        self.n_layers = int(n_layers)
        self.block_size = int(block_size)
        self.initial_blocks = int(initial_blocks)
        self.k: torch.Tensor | None = None  # [n_layers, Hkv, n_blocks, B, D]
        self.v: torch.Tensor | None = None  # [n_layers, Hkv, n_blocks, B, D+1]
        self.refs: list[int] = []
        self._free: list[int] = []
        self.lock = threading.RLock()
        self.grows = 0
        self.copies = 0  # copy-on-write block copies
        #: callbacks that free idle blocks (LRU sessions, cached documents); each returns
        #: whether it freed anything. Called when no block is free, before the pool grows.
        self.reclaimers: list[Callable[[], bool]] = []

    # ------------------------------------------------------------------ allocation
    @property
    def n_blocks(self) -> int:
        return len(self.refs)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (keys and values, the ones column excluded)."""
        if self.k is None:
            return 0
        _, hkv, _, B, D = self.k.shape
        return self.n_layers * 2 * B * hkv * D * self.k.element_size()

    def ensure(self, like: torch.Tensor) -> None:
        """Allocate the pool for keys shaped like ``like [Hkv, n, D]`` (dtype, device) on first
        use; afterwards check that ``like`` fits it."""
        hkv, _, D = like.shape
        if self.k is None:
            with self.lock:
                if self.k is None:
                    self._allocate(self.initial_blocks, hkv, D, like.dtype, like.device)
            return
        if (self.k.shape[1], self.k.shape[4]) != (hkv, D) or self.k.dtype != like.dtype or self.k.device != like.device:
            raise ValueError(
                f"KV of shape {tuple(like.shape)} ({like.dtype}, {like.device}) does not fit the pool "
                f"(Hkv={self.k.shape[1]}, D={self.k.shape[4]}, {self.k.dtype}, {self.k.device})"
            )

    @torch.inference_mode()  # inference tensors: every write runs under inference mode (_writable)
    def _allocate(self, n: int, hkv: int, D: int, dtype, device) -> None:
        B, L = self.block_size, self.n_layers
        k = torch.zeros(L, hkv, n, B, D, dtype=dtype, device=device)
        v = torch.zeros(L, hkv, n, B, D + 1, dtype=dtype, device=device)
        v[..., D] = 1.0
        old = self.n_blocks
        if self.k is not None and self.v is not None:
            k[:, :, :old] = self.k
            v[:, :, :old] = self.v
        self.k, self.v = k, v
        self.refs.extend([0] * (n - old))
        # low ids first out (a LIFO of free ids): recently used memory is reused first
        self._free.extend(range(n - 1, max(old, 1) - 1, -1))
        if old == 0:
            self.refs[ZERO_BLOCK] = 1  # never freed, never handed out

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (reference count 1 each); frees idle blocks or grows the pool if
        needed. Their content is stale (finite) until written."""
        if self.k is None:
            raise RuntimeError("the pool is allocated by the first write (KVPool.ensure)")
        with self.lock:
            while len(self._free) < n and any(r() for r in self.reclaimers):
                pass
            if len(self._free) < n:
                _, hkv, _, _, D = self.k.shape
                need = self.n_blocks - len(self._free) + n  # blocks in use after this allocation
                size = self.n_blocks
                while size < need + 1:
                    size *= 2
                self._allocate(size, hkv, D, self.k.dtype, self.k.device)
                self.grows += 1
            out = [self._free.pop() for _ in range(n)]
            for b in out:
                self.refs[b] = 1
            return out

    def incref(self, blocks: list[int]) -> None:
        with self.lock:
            for b in blocks:
                self.refs[b] += 1

    def decref(self, blocks: list[int]) -> None:
        """Drop one reference of each block; a block nobody holds is free again."""
        with self.lock:
            for b in blocks:
                if b == ZERO_BLOCK:
                    continue
                r = self.refs[b] - 1
                if r < 0:
                    raise RuntimeError(f"KV block {b} freed twice")
                self.refs[b] = r
                if r == 0:
                    self._free.append(b)

    def copy_block(self, src: int) -> int:
        """A private copy of block ``src`` (every layer); drops the caller's reference to ``src``."""
        with self.lock:
            (dst,) = self.allocate(1)
            assert self.k is not None and self.v is not None
            with _writable():
                self.k[:, :, dst] = self.k[:, :, src]
                self.v[:, :, dst] = self.v[:, :, src]
            self.copies += 1
            self.decref([src])
            return dst

    # ------------------------------------------------------------------ access
    def write(
        self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> None:
        """Store ``k_new, v_new [Hkv, n, D]`` at ``(blocks[i], offsets[i])`` (long ``[n]``, on the
        pool's device) of ``layer``: one copy each for every sequence of a forward."""
        assert self.k is not None and self.v is not None
        D = k_new.shape[-1]
        with _writable():
            self.k[layer][:, blocks, offsets] = k_new
            self.v[layer][:, blocks, offsets, :D] = v_new

    def write_run(self, layer: int, block: int, offset: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store ``k_new, v_new [Hkv, n, D]`` at offsets ``offset .. offset+n-1`` of one block
        (a slice assignment: a lone sequence's decode token or short chunk)."""
        assert self.k is not None and self.v is not None
        n, D = k_new.shape[1], k_new.shape[2]
        with _writable():
            self.k[layer][:, block, offset : offset + n] = k_new
            self.v[layer][:, block, offset : offset + n, :D] = v_new

    def read_run(self, layer: int, first: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``first .. first+nb-1`` (one sequence whose blocks follow one another) at
        ``layer`` as ``(k [1, Hkv, nb*B, D], v_aug [1, Hkv, nb*B, D+1])``: views, no copy."""
        assert self.k is not None and self.v is not None
        _, hkv, _, B, _ = self.k.shape
        k, v = (t[layer][:, first : first + nb].reshape(1, hkv, nb * B, t.shape[-1]) for t in (self.k, self.v))
        return k, v

    def rows_of(self, tables: torch.Tensor) -> torch.Tensor:
        """The rows :meth:`read_rows` copies for ``tables [S, nb]`` (long): a layer viewed as
        rows ``[Hkv * n_blocks, B * Dx]`` has (head h, block b) at row ``h * n_blocks + b``;
        they are listed in ``[S, Hkv, nb]`` order (long ``[S*Hkv*nb]``)."""
        assert self.k is not None
        S, nb = tables.shape
        _, hkv, n_blocks, _, _ = self.k.shape
        heads = torch.arange(hkv, device=tables.device).view(1, hkv, 1) * n_blocks
        return (tables.view(S, 1, nb) + heads).view(-1)

    def read_rows(self, layer: int, rows: torch.Tensor, S: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_pad [S, Hkv, nb*B, D], v_aug [S, Hkv, nb*B, D+1])``, the layout
        :func:`ralm.batching.attention.attend` takes, from :meth:`rows_of`'s ``rows``: one
        contiguous row copy per (sequence, head, block); element ``[s, h, j*B + b]`` is head
        ``h`` of the sequence's ``j``-th block, offset ``b``."""
        assert self.k is not None and self.v is not None
        _, hkv, _, B, _ = self.k.shape
        out = []
        for t in (self.k[layer], self.v[layer]):
            dx = t.shape[-1]
            g = t.reshape(-1, B * dx).index_select(0, rows)  # [S*Hkv*nb, B*Dx]
            out.append(g.view(S, hkv, nb * B, dx))
        return out[0], out[1]

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`read_rows` of ``tables [S, nb]`` (long): copies."""
        return self.read_rows(layer, self.rows_of(tables), *tables.shape)

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        """Blocks in the pool and in use, of which shared, and their bytes."""
        with self.lock:
            used = sum(1 for r in self.refs[1:] if r > 0)
            shared = sum(1 for r in self.refs[1:] if r > 1)
            return {
                "block_size": self.block_size,
                "blocks": max(0, self.n_blocks - 1),
                "blocks_used": used,
                "blocks_shared": shared,
                "bytes": max(0, self.n_blocks - 1) * self.block_bytes,
                "bytes_used": used * self.block_bytes,
                "grows": self.grows,
                "copy_on_write": self.copies,
            }


def _writable():
    """Inference mode for a write, unless it is on already (the pool's tensors are made
    under it, so every in-place write must run under it too)."""
    return contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode()
