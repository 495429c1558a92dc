"""One sequence's KV in the pool (:mod:`ralm.batching.kv_pool`): a block table and a length.

:class:`PagedKV` offers what :class:`~ralm.batching.packed.SeqKV` offers (``append``,
``span``, ``crop``, ``len``), so the packed forward takes either; when every sequence of a
forward is paged in one pool, :class:`~ralm.batching.packed.PackedBatch` writes the new
keys and values of all of them with one copy per layer and reads their keys through the
block tables (:class:`PagedPlan`).

Before a forward, :meth:`PagedKV.reserve` makes room for the new tokens: it copies a shared
last block first (copy on write) and takes fresh blocks for the rest, so nothing is
allocated while the model runs. After it, :meth:`PagedKV.advance` moves the length on.
A *fork* shares every block by reference (the documents' KV under each request's session).

Exact by construction: a position's keys and values are the bits the model wrote, whatever
block they sit in; the attention reads a sequence's positions in order through its table,
and a padded or stale position is masked (an exact zero), as with per-sequence buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ralm.batching.kv_pool import ZERO_BLOCK, KVPool


class PagedKV:
    """The KV of one sequence in ``pool``; free it with :meth:`free` (forks share blocks)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.table: list[int] = []
        self.layer_len = [0] * pool.n_layers
        self._freed = False

    def __len__(self) -> int:
        return self.layer_len[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence references (shared ones included)."""
        return len(self.table) * self.pool.block_bytes

    def own_bytes(self) -> int:
        """Bytes of the blocks only this sequence holds (what freeing it gives back)."""
        with self.pool.lock:
            return sum(1 for b in self.table if self.pool.refs[b] == 1) * self.pool.block_bytes

    def bytes_per_position(self) -> int:
        """KV bytes one position takes over all layers (keys and values, the ones column excluded)."""
        return self.pool.block_bytes // self.pool.block_size

    # ------------------------------------------------------------------ blocks
    def reserve(self, n_new: int, like: torch.Tensor | None = None) -> None:
        """Room for ``n_new`` more positions: copy the last block if it is shared and will be
        written, then add fresh blocks. ``like [Hkv, n, D]`` allocates the pool on first use."""
        if like is not None:
            self.pool.ensure(like)
        B = self.pool.block_size
        n = len(self)
        with self.pool.lock:
            if n % B and n_new > 0:
                j = n // B
                if self.pool.refs[self.table[j]] > 1:
                    self.table[j] = self.pool.copy_block(self.table[j])
            need = -(-(n + n_new) // B) - len(self.table)
            if need > 0:
                self.table.extend(self.pool.allocate(need))

    def slots(self, start: int, n: int) -> tuple[list[int], list[int]]:
        """``(blocks, offsets)`` of positions ``start .. start+n-1`` (reserved)."""
        B, t = self.pool.block_size, self.table
        return [t[p // B] for p in range(start, start + n)], [p % B for p in range(start, start + n)]

    def advance(self, n: int) -> None:
        """The forward wrote ``n`` new positions at every layer."""
        self.layer_len = [len(self) + n] * len(self.layer_len)

    def fork(self) -> PagedKV:
        """A sequence with this one's positions, sharing its blocks (written ones get copied)."""
        other = PagedKV(self.pool)
        other.table = list(self.table)
        other.layer_len = list(self.layer_len)
        self.pool.incref(other.table)
        return other

    def free(self) -> None:
        """Give the blocks back (once)."""
        if not self._freed:
            self._freed = True
            self.pool.decref(self.table)
            self.table = []
            self.layer_len = [0] * len(self.layer_len)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (a rollback); blocks past them are released."""
        if length < 0 or length > len(self):
            raise ValueError(f"cannot crop a {len(self)}-position KV to {length}")
        keep = -(-length // self.pool.block_size)
        if keep < len(self.table):
            self.pool.decref(self.table[keep:])
            del self.table[keep:]
        self.layer_len = [length] * len(self.layer_len)

    # ------------------------------------------------------------------ SeqKV's interface
    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Append ``k_new, v_new [Hkv, n, D]`` to ``layer`` (one sequence at a time; the packed
        forward writes every paged sequence at once instead)."""
        a, n = self.layer_len[layer], k_new.shape[1]
        if layer == 0 or a + n > len(self.table) * self.pool.block_size:
            self.reserve(a + n - len(self), like=k_new)
        blocks, offsets = (torch.tensor(x, dtype=torch.long, device=k_new.device) for x in self.slots(a, n))
        self.pool.write(layer, blocks, offsets, k_new, v_new)
        self.layer_len[layer] = a + n

    def span(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [Hkv, n, D], v_aug [Hkv, n, D+1])``: copies of the first ``n`` positions (``n`` a
        multiple of the block, at least the length; blocks past the table read the zero block)."""
        assert self.pool.k is not None
        k, v = self.pool.gather(layer, block_tables([self], n // self.pool.block_size, self.pool.k.device))
        return k[0], v[0]

    @classmethod
    def from_cache(cls, pool: KVPool, cache) -> PagedKV:
        """A copy of a Hugging Face cache of batch size 1 (e.g. the documents' KV); None: empty."""
        kv = cls(pool)
        if cache is None:
            return kv
        layers = list(cache.layers)
        n = int(layers[0].keys.shape[-2])
        kv.reserve(n, like=layers[0].keys[0])
        blocks, offsets = (torch.tensor(x, dtype=torch.long, device=layers[0].keys.device) for x in kv.slots(0, n))
        for i, layer in enumerate(layers):
            pool.write(i, blocks, offsets, layer.keys[0], layer.values[0])
        kv.advance(n)
        return kv


def block_tables(kvs: Sequence[PagedKV], nb: int, device, dtype=torch.long) -> torch.Tensor:
    """``[len(kvs), nb]``: each sequence's first ``nb`` blocks, padded with the zero block."""
    rows = [(kv.table + [ZERO_BLOCK] * nb)[:nb] for kv in kvs]
    return torch.tensor(rows, dtype=dtype, device=device)


class PagedPlan:
    """A packed forward over paged sequences: where each new token goes, which blocks each
    sequence reads. Built at the forward's first layer (the pool may be allocated then);
    reserves room for every segment's new tokens, so the forward allocates nothing after.

    ``segments``: the forward's segments (``.kv`` a :class:`PagedKV`, ``.n`` new tokens, in
    row order); ``blocks, offsets [N]`` (long): where each packed token's KV goes."""

    def __init__(self, pool: KVPool, segments: Sequence, like: torch.Tensor, device):
        self.pool = pool
        self.segments = list(segments)
        self.device = device
        pool.ensure(like)
        blocks: list[int] = []
        offsets: list[int] = []
        for seg in self.segments:
            seg.kv.reserve(seg.n)
            b, o = seg.kv.slots(len(seg.kv), seg.n)
            blocks += b
            offsets += o
        # the new tokens in one block, in order (a lone decode token or short chunk): a slice write
        self.run = (
            (blocks[0], offsets[0])
            if len(set(blocks)) == 1 and offsets == list(range(offsets[0], offsets[0] + len(offsets)))
            else None
        )
        if self.run is None:
            self.blocks = torch.tensor(blocks, dtype=torch.long, device=device)
            self.offsets = torch.tensor(offsets, dtype=torch.long, device=device)
        self._tables: dict[tuple, torch.Tensor] = {}  # (segment indices, dtype) -> tables
        self._reads: dict[tuple[int, ...], tuple] = {}
        self._triton: tuple | None = None

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """This layer's new ``key/value [1, Hkv, N, D]`` of every sequence, in one copy each."""
        if self.run is not None:
            self.pool.write_run(layer, self.run[0], self.run[1], key[0], value[0])
        else:
            self.pool.write(layer, self.blocks, self.offsets, key[0], value[0])

    def _nb(self, idx: Sequence[int]) -> int:
        """Blocks covering the longest of segments ``idx`` after this forward."""
        B = self.pool.block_size
        return max(-(-(len(self.segments[i].kv) + self.segments[i].n) // B) for i in idx)

    def tables(self, idx: Sequence[int], dtype=torch.long) -> torch.Tensor:
        """Block tables ``[len(idx), nb]`` of segments ``idx`` (the same for every layer: computed once)."""
        key = (tuple(idx), dtype)
        t = self._tables.get(key)
        if t is None:
            kvs = [self.segments[i].kv for i in idx]
            t = self._tables[key] = block_tables(kvs, self._nb(idx), self.device, dtype)
        return t

    def gather(self, layer: int, idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_pad [S, Hkv, nb*B, D], v_aug [S, Hkv, nb*B, D+1])`` of segments ``idx`` at
        ``layer`` (new tokens included): the CPU attention's input. A lone sequence whose
        blocks follow one another in the pool is read in place; otherwise one copy."""
        key = tuple(idx)
        how = self._reads.get(key)
        if how is None:
            nb = self._nb(idx)
            table = self.segments[idx[0]].kv.table[:nb]
            if len(idx) == 1 and len(table) == nb and table == list(range(table[0], table[0] + nb)):
                how = ("run", table[0], nb)
            else:
                how = ("rows", self.pool.rows_of(self.tables(idx)), len(idx), nb)
            self._reads[key] = how
        if how[0] == "run":
            return self.pool.read_run(layer, how[1], how[2])
        return self.pool.read_rows(layer, how[1], how[2], how[3])

    def triton_attention(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Every segment's queries ``query [1, H, N, D]`` against its blocks in one Triton
        launch (:func:`ralm.batching.triton_paged.paged_attention`): ``[1, N, H, D]``."""
        # lazy: keeps triton (optional, only the CUDA path uses it) out of CPU processes
        from ralm.batching import triton_paged

        if self._triton is None:
            starts = [s.start for s in self.segments]
            counts = [s.n for s in self.segments]
            pos = [len(s.kv) + t for s in self.segments for t in range(s.n)]
            self._triton = (
                self.tables(range(len(self.segments)), torch.int32),
                triton_paged.query_tiles(starts, counts, self.device),
                torch.tensor(pos, dtype=torch.long, device=self.device),
            )
        tables, tiles, pos_t = self._triton
        k, v = self.pool.k[layer], self.pool.v[layer]  # type: ignore[index]
        out = triton_paged.paged_attention(query[0].transpose(0, 1), k, v, tables, tiles, pos_t, scaling)
        return out.unsqueeze(0)
