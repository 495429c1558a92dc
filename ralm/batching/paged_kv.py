"""One sequence's KV in the pool (:mod:`ralm.batching.kv_pool`): a block table and a length.

:class:`PagedKV` is the one KV representation of the batched engine: every sequence it runs
(a step's session, a document's cached KV, a KNN-LM request's sequence, the invariance
proof's references) is a block table in a pool. When every sequence of a forward is paged
in one pool, :class:`~ralm.batching.packed.PackedBatch` writes the new keys and values of
all of them with one copy per layer and reads their keys through the block tables
(:class:`PagedPlan`). A sequence may also own a pool of its own
(:meth:`PagedKV.standalone`: ``generator.kv_pool: false``, and the proof's references);
its blocks are then handed out in order, so its table is one run of consecutive blocks
that the attention reads in place, as it would read a contiguous buffer (contiguous KV is
the one-run case of the paged layout). Such sequences are appended one at a time
(:meth:`PagedKV.append`, :meth:`PagedKV.span`).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ralm.batching.kv_pool import ZERO_BLOCK, KVPool
from ralm.batching.metadata import IterationMetadata

if TYPE_CHECKING:
    from ralm.batching.attention_backend import AttentionBackend


class PagedKV:
    """The KV of one sequence in ``pool``; free it with :meth:`free` (forks share blocks)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.table: list[int] = []
        self._run_len: int | None = None  # leading blocks of the table that follow one another (None: not known)
        self.layer_len = [0] * pool.n_layers
        self._freed = False
        self._slots: tuple | None = None  # (start, n, device, blocks, offsets): append's indices, reused by every layer

    @classmethod
    def standalone(
        cls, n_layers: int, devices: Sequence[torch.device] | None = None, value_ones: bool = True
    ) -> PagedKV:
        """A sequence in a pool of its own (2 blocks to start, doubling as it grows): each
        layer's KV on ``devices[layer]`` (None: the device of the first write); ``value_ones``:
        the attention backend's value layout (``AttentionBackend.value_ones``)."""
        return cls(KVPool.of_one_sequence(n_layers, devices, value_ones))

    def __len__(self) -> int:
        return self.layer_len[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence references (shared ones included)."""
        return len(self.table) * self.pool.block_bytes

    def own_bytes(self) -> int:
        """Bytes of the blocks only this sequence holds (what freeing it gives back); for a
        :meth:`standalone` sequence, its whole pool."""
        if self.pool.private:
            return self.pool.nbytes
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
                    self._run_len = None
            need = -(-(n + n_new) // B) - len(self.table)
            if need > 0:
                self.table.extend(self.pool.allocate(need))
                self._run_len = None

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
            self._run_len = None
            self.layer_len = [0] * len(self.layer_len)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (a rollback); blocks past them are released."""
        if length < 0 or length > len(self):
            raise ValueError(f"cannot crop a {len(self)}-position KV to {length}")
        keep = -(-length // self.pool.block_size)
        if keep < len(self.table):
            # last block first: the free list hands them out again in table order
            self.pool.decref(self.table[keep:][::-1])
            del self.table[keep:]
            self._run_len = None
        self.layer_len = [length] * len(self.layer_len)

    # ------------------------------------------------------------------ one sequence at a time
    def _run_start(self, nb: int) -> int | None:
        """The pool block of the table's first entry when its first ``nb`` blocks follow one
        another in the pool (one run: positions ``0 .. nb*B-1`` are one stretch of the pool's
        storage), else None."""
        t = self.table
        if self._run_len is None:  # worked out once per change of the table, not per layer
            m = min(1, len(t))
            while m < len(t) and t[m] == t[0] + m:
                m += 1
            self._run_len = m
        return t[0] if 0 < nb <= self._run_len else None

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Append ``k_new, v_new [Hkv, n, D]`` to ``layer`` (one sequence at a time, as a
        forward whose sequences are in different pools does; the packed forward writes every
        sequence of one pool at once instead). A sequence whose blocks are one run (a
        :meth:`standalone` one) is written as one slice of the pool's storage; otherwise by
        index, the slots' indices built at the first layer and reused by the others."""
        a, n = self.layer_len[layer], k_new.shape[1]
        if layer == 0 or a + n > len(self.table) * self.pool.block_size:
            self.reserve(a + n - len(self), like=k_new)
        B = self.pool.block_size
        first = self._run_start(-(-(a + n) // B))
        if first is not None:
            self.pool.write_run(layer, first * B + a, k_new, v_new)
        else:
            dev = k_new.device
            got = self._slots
            if layer == 0 or got is None or got[:3] != (a, n, dev):  # the table is settled at layer 0
                blocks, offsets = (torch.tensor(x, dtype=torch.long, device=dev) for x in self.slots(a, n))
                got = self._slots = (a, n, dev, blocks, offsets)
            self.pool.write(layer, got[3], got[4], k_new, v_new)
        self.layer_len[layer] = a + n

    def span(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [Hkv, n, D], v_aug [Hkv, n, D + value_ones])``: the first ``n`` positions (``n``
        a multiple of the block, at least the length). Views in place when those blocks follow
        one another in the pool: a :meth:`standalone` sequence first takes blocks up to ``n``
        from its own pool (room it grows into, as a doubling buffer keeps); otherwise copies,
        blocks past the table reading the zero block."""
        B = self.pool.block_size
        nb = n // B
        if self.pool.private and nb > len(self.table):
            with self.pool.lock:
                self.table.extend(self.pool.allocate(nb - len(self.table)))
                self._run_len = None
        first = self._run_start(nb)
        if first is not None:
            return self.pool.run_span(layer, first, nb)
        k, v = self.pool.gather(layer, block_tables([self], nb, self.pool.layer_device(layer)))
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
        slots = kv.slots(0, n)
        where: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # the slots on each layer's device
        for i, layer in enumerate(layers):
            dev = layer.keys.device
            if dev not in where:
                where[dev] = (
                    torch.tensor(slots[0], dtype=torch.long, device=dev),
                    torch.tensor(slots[1], dtype=torch.long, device=dev),
                )
            blocks, offsets = where[dev]
            pool.write(i, blocks, offsets, layer.keys[0], layer.values[0])
        kv.advance(n)
        return kv


def block_tables(kvs: Sequence[PagedKV], nb: int, device, dtype=torch.long) -> torch.Tensor:
    """``[len(kvs), nb]``: each sequence's first ``nb`` blocks, padded with the zero block."""
    return torch.tensor([padded_table(kv, nb) for kv in kvs], dtype=dtype, device=device)


def padded_table(kv: PagedKV, nb: int) -> list[int]:
    """The sequence's first ``nb`` blocks, padded with the zero block."""
    return (kv.table + [ZERO_BLOCK] * nb)[:nb]


@dataclass(frozen=True)
class FixedLayout:
    """The sizes a captured forward's indices keep whatever its iteration holds
    (:mod:`ralm.batching.iteration_graphs`): block tables of ``seqs`` rows (at least) and
    ``blocks`` columns, ``tiles`` query tiles of the paged kernel (the extra ones empty)."""

    seqs: int
    blocks: int
    tiles: int


class PagedPlan:
    """A packed forward over paged sequences: where each new token goes, which blocks each
    sequence reads. Built before the forward (at its first layer when the pool is allocated
    by it); reserves room for every segment's new tokens, so the forward allocates nothing
    after, and puts every index it needs in the iteration's metadata (``meta``; None: its
    own, shipped here).

    ``segments``: the forward's segments (``.kv`` a :class:`PagedKV`, ``.n`` new tokens, in
    row order); ``groups``: the attention's groups of segments (``.idx``); ``backend``: the
    attention backend (:mod:`ralm.batching.attention_backend`), which adds the sections it
    reads (:meth:`~ralm.batching.attention_backend.AttentionBackend.pool_sections`: the torch
    backend's rows to gather per group, the Triton backend's block tables, query tiles and
    row positions); ``layout``: a captured forward's sizes (:class:`FixedLayout`). Sections of its own: ``paged.blocks, paged.offsets [N]`` (where each
    packed token's KV goes)."""

    def __init__(
        self,
        pool: KVPool,
        segments: Sequence,
        groups: Sequence,
        device,
        backend: AttentionBackend,
        meta: IterationMetadata | None = None,
        layout: FixedLayout | None = None,
    ):
        if backend.value_ones and not pool.value_ones:
            raise ValueError(
                f"the {backend.name} attention reads a column of ones with the values, and this KV pool "
                "was made without it (KVPool(value_ones=False), the Triton backend's layout)"
            )
        self.pool = pool
        self.segments = list(segments)
        self.device = device
        self.layout = layout
        own = meta is None
        self.meta = meta if meta is not None else IterationMetadata(device)
        blocks: list[int] = []
        offsets: list[int] = []
        for seg in self.segments:
            seg.kv.reserve(seg.n)
            b, o = seg.kv.slots(len(seg.kv), seg.n)
            blocks += b
            offsets += o
        # where each new token goes, one index write per layer whatever the batch (a slice
        # write of a lone sequence's run of slots took 8 host ops, the index write takes 3;
        # the Triton backend writes from its rotary kernel, row by row, with the same sections)
        self.meta.add("paged.blocks", blocks)
        self.meta.add("paged.offsets", offsets)
        #: group -> ("run", first block, nb) | ("rows", S, nb): how :meth:`gather` reads it
        self.reads: dict[int, tuple] = {}
        backend.pool_sections(self, groups)
        self._moved: dict[tuple[str, torch.device], torch.Tensor] = {}  # sections on other devices
        if own:
            self.meta.ship()

    def section(self, name: str, device: torch.device) -> torch.Tensor:
        """Section ``name`` on ``device``: the shipped view on the plan's device, else one copy
        per forward (the layers of a model spread over several GPUs)."""
        t = self.meta[name]
        if t.device == device:
            return t
        key = (name, device)
        moved = self._moved.get(key)
        if moved is None:
            moved = self._moved[key] = t.to(device)
        return moved

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """This layer's new ``key/value [Hkv, N, D]`` of every sequence, in one copy each."""
        dev = key.device
        self.pool.write(layer, self.section("paged.blocks", dev), self.section("paged.offsets", dev), key, value)

    def blocks_after(self, idx: Sequence[int]) -> int:
        """Blocks covering the longest of segments ``idx`` after this forward (at least the
        fixed layout's width: a captured forward's tables keep one width)."""
        B = self.pool.block_size
        least = self.layout.blocks if self.layout is not None else 0
        return max(least, *(-(-(len(self.segments[i].kv) + self.segments[i].n) // B) for i in idx))

    def padded_table(self, i: int, nb: int) -> list[int]:
        """Segment ``i``'s first ``nb`` blocks, padded with the zero block."""
        return padded_table(self.segments[i].kv, nb)

    def gather(self, layer: int, gi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_pad [S, Hkv, nb*B, D], v_aug [S, Hkv, nb*B, D+1])`` of group ``gi``'s segments at
        ``layer`` (new tokens included): the torch backend's input. A lone sequence whose
        blocks follow one another in the pool is read in place; otherwise one copy."""
        how = self.reads[gi]
        if how[0] == "run":
            return self.pool.read_run(layer, how[1], how[2])
        rows = self.section(f"paged.rows{gi}", self.pool.layer_device(layer))
        return self.pool.read_rows(layer, rows, how[1], how[2])
