"""CUDA graphs of the decode iteration: a whole batched decode forward in one replay.

On a GPU the invariant decode forward is host-bound: a batch-64 forward of a 16-layer model
runs about 3 ms of kernels and about 20 ms of Python (transformers' modules, the launches of
about 150 Triton kernels). A CUDA graph records the forward's kernels once and replays them
with one call, so the host's part shrinks to building the iteration's metadata.

A graph replays fixed shapes at fixed addresses, so a decode forward is run in a fixed
*layout*, chosen by two buckets:

- the sequences ``S`` are padded to the smallest of :data:`~ralm.constants.DECODE_GRAPH_SEQUENCES`
  ``>= S`` with *scratch* sequences: each feeds token 0 at position 0 into a block that the
  runner holds and no sequence's table lists, and its logits are never read;
- the block tables are padded to ``W`` blocks, a power of two (at least
  :data:`~ralm.constants.DECODE_GRAPH_MIN_BLOCKS`), with the zero block.

Every integer the forward reads (token ids, positions, kept rows, KV slots, block tables,
query tiles) is a view of the iteration's one metadata tensor
(:class:`~ralm.batching.metadata.IterationMetadata`); a bucket's graph is captured with that
tensor at a fixed address, and each later iteration of the bucket copies its metadata there
(one copy) and replays. Worked example: 5 sequences at lengths 100-300 use bucket ``(8, 8)``:
rows 5-7 are scratch rows, tables are ``[8, 8]`` (sequences of 300 positions use 5 blocks, 3
padded); a sixth sequence still replays the same graph, a sequence past 512 positions makes
bucket ``(8, 16)``.

Exact by construction: the replay runs the kernels the eager forward runs. A real row's bits
do not depend on the other rows (the kernels are row- and batch-invariant, which the load-time
proof checks for 1 to 64 sequences), nor on the table width (the attention kernel reads keys up
to each row's own position, key block by key block, whatever the table's width); the scratch
rows write only the scratch block. Tests run the same layout on a CPU with the Triton
interpreter (``replay="eager"``: the captured forward run again in Python, reading the same
buffer), and compare every token with the forward without graphs.

Graphs are captured lazily, one per bucket met; they are dropped when the KV pool grows (its
tensors move). The graphs share one memory pool.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import torch

from ralm import constants as C
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import PackedBatch, pack, run_packed
from ralm.batching.paged_kv import PagedKV

log = logging.getLogger(__name__)

Replay = Literal["cuda", "eager"]


class _ScratchKV(PagedKV):
    """A padding sequence: one position (0) in the runner's scratch block, never advanced."""

    def __init__(self, pool: KVPool, block: int):
        super().__init__(pool)
        self.table = [block]

    def reserve(self, n_new: int, like: torch.Tensor | None = None) -> None:
        pass  # position 0 of its block, rewritten by every forward it pads

    def advance(self, n: int) -> None:
        pass


def seq_bucket(n: int, buckets: Sequence[int] = C.DECODE_GRAPH_SEQUENCES) -> int | None:
    """The smallest bucket holding ``n`` sequences (None: more than the largest)."""
    return next((b for b in buckets if b >= n), None)


def width_bucket(blocks: int) -> int:
    """The block tables' width for sequences of up to ``blocks`` blocks: a power of two,
    at least :data:`~ralm.constants.DECODE_GRAPH_MIN_BLOCKS`."""
    w = C.DECODE_GRAPH_MIN_BLOCKS
    while w < blocks:
        w *= 2
    return w


class _Captured:
    """One bucket's forward: its metadata buffer, the batch it was captured with, the graph
    and its output (``replay="eager"``: the batch's forward run again instead)."""

    def __init__(self, model, batch: PackedBatch, replay: Replay, mempool):
        self.model = model
        self.layout = batch.meta.layout
        n = len(batch.meta)
        dev = batch.device
        cuda = replay == "cuda"
        self.buffer = torch.empty(n, dtype=torch.long, device=dev)
        self.staging = torch.empty(n, dtype=torch.long, pin_memory=True) if cuda else None
        self.copied = torch.cuda.Event() if cuda else None
        self.batch = batch
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self._ship(batch)
        # this iteration's own forward, run eagerly: it compiles what it launches first, and
        # its logits are the iteration's result
        self.first = run_packed(model, batch).logits
        if cuda:
            g = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a device retrieval scan) may run meanwhile
            with torch.cuda.graph(g, pool=mempool, capture_error_mode="thread_local"):
                self.logits = run_packed(model, batch).logits
            self.graph = g

    def _ship(self, batch: PackedBatch) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy out of the staging buffer is done
        batch.ship(self.buffer, self.staging)
        if self.copied is not None:
            self.copied.record()

    def replay(self, batch: PackedBatch) -> torch.Tensor:
        """Run ``batch`` (this bucket's layout) through the captured forward: ``[1, R, vocab]``,
        valid until the bucket's next replay."""
        self._ship(batch)
        if self.graph is not None:
            self.graph.replay()
            assert self.logits is not None
            return self.logits
        return run_packed(self.model, self.batch).logits  # eager: the captured batch, the new buffer


class DecodeGraphs:
    """The decode iterations of a batched engine as graph replays (see the module docstring).

    ``model``: the invariant model on the Triton kernels; ``pool``: the engine's KV pool;
    ``replay``: ``"cuda"`` (CUDA graphs) or ``"eager"`` (the captured layout run again in
    Python: the CPU test of everything but the graph itself)."""

    def __init__(self, model, pool: KVPool, replay: Replay = "cuda", max_graphs: int = 64):
        self.model = model
        self.pool = pool
        self.replay_mode: Replay = replay
        self.max_graphs = int(max_graphs)
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._grows = -1
        self._scratch: _ScratchKV | None = None
        self._mempool = torch.cuda.graph_pool_handle() if replay == "cuda" else None
        self.captures = 0
        self.replays = 0
        self.disabled_reason: str | None = None

    def stats(self) -> dict:
        """Graphs held, captured and replayed; why graphs are off (None: on)."""
        return {
            "graphs": len(self._graphs),
            "captures": self.captures,
            "replays": self.replays,
            "disabled_reason": self.disabled_reason,
        }

    def eligible(self, chunks: Sequence[tuple[PagedKV, Sequence[int]]], logits_rows: Sequence[int]) -> bool:
        """A decode iteration this runner replays: one token per sequence, every sequence in
        the pool, each row's logits kept in order, at most the largest bucket."""
        S = len(chunks)
        return (
            self.disabled_reason is None
            and self.pool.allocated
            and seq_bucket(S) is not None
            and S > 0
            and all(len(t) == 1 and kv.pool is self.pool for kv, t in chunks)
            and list(logits_rows) == list(range(S))
        )

    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[tuple[PagedKV, Sequence[int]]], logits_rows: Sequence[int]
    ) -> torch.Tensor | None:
        """The logits ``[S, vocab]`` of a decode iteration (``packed_forward``'s), each sequence's
        KV appended; None when the iteration is not :meth:`eligible` (run it eagerly)."""
        if not self.eligible(chunks, logits_rows):
            return None
        S = len(chunks)
        sb = seq_bucket(S)
        assert sb is not None
        B = self.pool.block_size
        width = width_bucket(max(-(-(len(kv) + 1) // B) for kv, _ in chunks))
        if self._scratch is None:
            with self.pool.lock:
                self._scratch = _ScratchKV(self.pool, self.pool.allocate(1)[0])
        pad = [(self._scratch, [0])] * (sb - S)
        batch = pack(self.model, [*chunks, *pad], range(sb), min_blocks=width)  # reserves room: the pool may grow
        if self.pool.grows != self._grows:  # the pool's tensors moved: every graph reads the old ones
            self._graphs.clear()
            self._grows = self.pool.grows
        key = (sb, width)
        cap = self._graphs.get(key)
        if cap is not None and cap.layout == batch.meta.layout:
            logits = cap.replay(batch)
            self.replays += 1
        else:
            logits = self._capture(key, batch)
        batch.finish()
        return logits[0, :S]

    def _capture(self, key: tuple[int, int], batch: PackedBatch) -> torch.Tensor:
        if len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))  # the oldest bucket
        if not self._graphs and self.replay_mode == "cuda":
            # a memory pool is released with the last graph that used it: capturing into it
            # again fails an internal assertion of torch's allocator (seen on an H200 after
            # the KV pool grew and every graph was dropped), so a fresh one
            self._mempool = torch.cuda.graph_pool_handle()
        try:
            cap = _Captured(self.model, batch, self.replay_mode, self._mempool)
        except Exception as e:  # a capture the device refused: this iteration eagerly, then no graphs
            self.disabled_reason = f"decode graph capture failed ({type(e).__name__}: {e})"
            log.warning("CUDA graphs of the decode iteration are off: %s", self.disabled_reason)
            batch.ship()
            return run_packed(self.model, batch).logits
        self._graphs[key] = cap
        self.captures += 1
        return cap.first

    def close(self) -> None:
        """Drop the graphs and give the scratch block back."""
        self._graphs.clear()
        if self._scratch is not None:
            self.pool.decref(self._scratch.table)
            self._scratch = None
