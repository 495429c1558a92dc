"""CUDA graphs of the batched iteration: a whole packed forward in one replay.

On a GPU the invariant forward is host-bound: a batch-64 decode forward of a 16-layer model
runs about 3 ms of kernels and about 20 ms of Python (transformers' modules, the launches of
about 150 Triton kernels). A CUDA graph records the forward's kernels once and replays them
with one call, so the host's part shrinks to building the iteration's metadata.

A graph replays fixed shapes at fixed addresses, so an iteration is run in a fixed *layout*
of four sizes, each the smallest of :data:`~ralm.constants.GRAPH_BUCKETS` that holds it:

- ``Nb`` packed rows for its ``N`` tokens. The ``Nb - N`` extra rows are one *scratch*
  sequence's tokens: token 0 at positions ``0 .. Nb-N-1``, written into blocks the runner
  holds and no sequence's table lists; no logits are read from them;
- ``Kb`` kept rows (logits) for its ``K``; the extra ones repeat row 0 and are not read;
- ``Sb`` block-table rows for its sequences and the scratch one; extra rows name the zero block;
- block tables ``W`` blocks wide, a power of two (at least :data:`~ralm.constants.GRAPH_MIN_BLOCKS`);
  the paged kernel's query tiles are padded to ``Nb`` with empty tiles, whose programs store
  nothing.

Every integer the forward reads (token ids, positions, kept rows, KV slots, block tables,
query tiles) is a view of the iteration's one metadata tensor
(:class:`~ralm.batching.metadata.IterationMetadata`). A layout's graph is captured with that
tensor at a fixed address, and each later iteration of the layout copies its metadata there
(one copy) and replays. Worked example: 5 decode tokens of sequences at lengths 100-300 and
one 20-token prefill chunk are ``N = 25`` rows, ``K = 6``, 6 sequences: layout ``(Nb, Kb, Sb,
W) = (32, 8, 8, 8)``, the scratch sequence holding rows 25-31 at positions 0-6. A decode
iteration of 5 sequences is ``(8, 8, 8, 8)``.

Exact by construction: the replay runs the kernels the eager forward runs. A real row's bits
do not depend on the other rows (the kernels are row- and batch-invariant, which the load-time
proof checks for 1 to 64 sequences), nor on the table width or the empty tiles (the attention
kernel reads keys up to each row's own position, block by block, whatever the table's width);
the scratch rows write only the scratch blocks. Tests run the same layouts on a CPU with the
Triton interpreter (``replay="eager"``: the captured forward run again in Python, reading the
same buffer), and compare every token with the forward without graphs.

Graphs are captured lazily, one per layout met (at most ``max_graphs``, the oldest dropped);
all are dropped when the KV pool grows (its tensors move). The graphs share one memory pool.
Only the Triton backend on the pool runs them: it attends every sequence in one launch, so its
indices' sizes follow the layout alone (:attr:`~ralm.batching.attention_backend.AttentionBackend.paged_launch`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any, Literal

import torch

from ralm import constants as C
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import PackedBatch, pack, packed_forward, run_packed
from ralm.batching.paged_kv import FixedLayout, PagedKV

log = logging.getLogger(__name__)

Replay = Literal["cuda", "eager"]


class _ScratchKV(PagedKV):
    """The padding rows' sequence: positions from 0 in the runner's scratch blocks, never advanced."""

    def __init__(self, pool: KVPool, blocks: list[int]):
        super().__init__(pool)
        self.table = list(blocks)

    def reserve(self, n_new: int, like: torch.Tensor | None = None) -> None:
        pass  # positions 0 .. n-1 of its blocks, rewritten by every forward it pads

    def advance(self, n: int) -> None:
        pass


def bucket(n: int, buckets: Sequence[int] = C.GRAPH_BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` (None: more than the largest)."""
    return next((b for b in buckets if b >= n), None)


def width_bucket(blocks: int) -> int:
    """The block tables' width for sequences of up to ``blocks`` blocks: a power of two,
    at least :data:`~ralm.constants.GRAPH_MIN_BLOCKS`."""
    w = C.GRAPH_MIN_BLOCKS
    while w < blocks:
        w *= 2
    return w


class _Captured:
    """One layout's forward: its metadata buffer, the batch it was captured with, the graph
    and its output (``replay="eager"``: the batch's forward run again instead)."""

    def __init__(self, model, batch: PackedBatch, replay: Replay, mempool):
        self.model = model
        self.layout = batch.meta.layout
        n = len(batch.meta)
        cuda = replay == "cuda"
        self.buffer = torch.empty(n, dtype=torch.long, device=batch.device)
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
        """Run ``batch`` (this layout) through the captured forward: ``[1, Kb, vocab]``, valid
        until this layout's next replay."""
        self._ship(batch)
        if self.graph is not None:
            self.graph.replay()
            assert self.logits is not None
            return self.logits
        return run_packed(self.model, self.batch).logits  # eager: the captured batch, the new buffer


class IterationGraphs:
    """The batched engine's iterations as graph replays (see the module docstring).

    ``model``: the invariant model on the Triton kernels; ``pool``: the engine's KV pool;
    ``replay``: ``"cuda"`` (CUDA graphs) or ``"eager"`` (the captured layout run again in
    Python: the CPU test of everything but the graph itself)."""

    def __init__(self, model, pool: KVPool, replay: Replay = "cuda", max_graphs: int = 128):
        self.model = model
        self.pool = pool
        self.replay_mode: Replay = replay
        self.max_graphs = int(max_graphs)
        self._graphs: dict[tuple[int, int, int, int], _Captured] = {}
        self._grows = -1
        self._scratch: _ScratchKV | None = None
        self._mempool: Any = None  # torch.cuda.graph_pool_handle() (a fresh one per empty set of graphs)
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
        """An iteration this runner replays: every sequence in the pool, at most the largest
        bucket of tokens."""
        n = sum(len(t) for _, t in chunks)
        return (
            self.disabled_reason is None
            and self.pool.allocated
            and 0 < n <= C.GRAPH_BUCKETS[-1]
            and len(logits_rows) <= n
            and all(kv.pool is self.pool for kv, _ in chunks)
        )

    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[tuple[PagedKV, Sequence[int]]], logits_rows: Sequence[int]
    ) -> torch.Tensor | None:
        """The logits of rows ``logits_rows`` ``[K, vocab]`` (``packed_forward``'s), every
        chunk's KV appended; None when the iteration is not :meth:`eligible` (run it eagerly)."""
        if not self.eligible(chunks, logits_rows):
            return None
        n = sum(len(t) for _, t in chunks)
        k = len(logits_rows)
        nb, kb = bucket(n), bucket(max(k, 1))
        assert nb is not None and kb is not None
        B = self.pool.block_size
        if self._scratch is None:
            with self.pool.lock:
                self._scratch = _ScratchKV(self.pool, self.pool.allocate(-(-C.GRAPH_BUCKETS[-1] // B)))
        pad = [(self._scratch, [0] * (nb - n))] if nb > n else []
        sb = bucket(len(chunks) + len(pad))
        assert sb is not None  # sequences <= rows <= the largest bucket
        width = width_bucket(max(-(-(nb - n) // B), *(-(-(len(kv) + len(t)) // B) for kv, t in chunks)))
        layout = FixedLayout(sb, width, nb)
        rows = [*logits_rows, *[0] * (kb - k)]
        batch = pack(self.model, [*chunks, *pad], rows, layout)  # reserves room: the pool may grow
        if self.pool.grows != self._grows:  # the pool's tensors moved: every graph reads the old ones
            self._graphs.clear()
            self._grows = self.pool.grows
        key = (nb, kb, sb, width)
        cap = self._graphs.get(key)
        if cap is not None and cap.layout == batch.meta.layout:
            logits = cap.replay(batch)
            self.replays += 1
        else:
            logits = self._capture(key, batch)
        batch.finish()
        return logits[0, :k]

    def _capture(self, key: tuple[int, int, int, int], batch: PackedBatch) -> torch.Tensor:
        if len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))  # the oldest layout
        if not self._graphs and self.replay_mode == "cuda":
            # a memory pool is released with the last graph that used it: capturing into it
            # again fails an internal assertion of torch's allocator (seen on an H200 after
            # the KV pool grew and every graph was dropped), so a fresh one
            self._mempool = torch.cuda.graph_pool_handle()
        try:
            cap = _Captured(self.model, batch, self.replay_mode, self._mempool)
        except Exception as e:  # a capture the device refused: this iteration eagerly, then no graphs
            self.disabled_reason = f"graph capture failed ({type(e).__name__}: {e})"
            log.warning("CUDA graphs of the batched iteration are off: %s", self.disabled_reason)
            batch.ship()
            return run_packed(self.model, batch).logits
        self._graphs[key] = cap
        self.captures += 1
        return cap.first

    @torch.inference_mode()
    def check(self, lengths: tuple[int, int, int] = (5, 70, 130)) -> str | None:
        """Prove the replay on this device before the engine uses it: on twin sequences in the
        pool (``lengths`` positions), a decode iteration and a mixed one (a 20-token prefill
        chunk beside decode tokens), each run twice through the graphs (the second run a
        replay), against the eager forward. A difference, or a capture the device refuses, turns graphs
        off (:attr:`disabled_reason`, returned); the sequences' blocks go back either way."""
        rng = random.Random(C.PROOF_SEED)
        vocab = int(self.model.config.vocab_size)
        twins = [(PagedKV(self.pool), PagedKV(self.pool)) for _ in range(3)]
        try:
            for n, (a, b) in zip(lengths, twins):
                prompt = [rng.randrange(1, vocab) for _ in range(n)]
                packed_forward(self.model, [(a, prompt)], [])
                packed_forward(self.model, [(b, prompt)], [])
            replays = self.replays
            for shape in ([1, 1, 1], [20, 1, 1], [1, 1, 1], [20, 1, 1]):
                feeds = [[rng.randrange(1, vocab) for _ in range(n)] for n in shape]
                rows = list(range(sum(shape)))
                got = self.forward([(a, t) for (a, _), t in zip(twins, feeds)], rows)
                want = packed_forward(self.model, [(b, t) for (_, b), t in zip(twins, feeds)], rows)
                if self.disabled_reason is not None:
                    return self.disabled_reason
                if got is None or not torch.equal(got, want):
                    self.disabled_reason = f"a replayed iteration ({shape} tokens) differs from the eager forward"
                    log.warning("CUDA graphs of the batched iteration are off: %s", self.disabled_reason)
                    return self.disabled_reason
            if self.replays - replays < 2:
                self.disabled_reason = "the check's iterations were not replayed"
                return self.disabled_reason
            return None
        finally:
            for a, b in twins:
                a.free()
                b.free()

    def close(self) -> None:
        """Drop the graphs and give the scratch blocks back."""
        self._graphs.clear()
        if self._scratch is not None:
            self.pool.decref(self._scratch.table)
            self._scratch = None
