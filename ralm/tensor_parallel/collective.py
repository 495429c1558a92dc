"""The collective a tensor-parallel forward needs: an all-gather, with no arithmetic in it.

A row-parallel layer's partial sums must be added in the same order whatever the batch, on
every rank (docs/tensor-parallel.md): an all-reduce lets the transport choose the order (NCCL
picks ring or tree, chunks and channels from the message size, which grows with the batch),
an all-gather only copies. So the forward asks for :meth:`Collective.all_gather` and adds the
parts itself, in rank order.

Two implementations of one protocol:

- :class:`ThreadGroup`: ``R`` ranks as threads of one process (torch's kernels release the
  GIL); what the tests use, and a way to check a split without starting processes;
- :class:`TorchDistributed`: a ``torch.distributed`` process group (gloo between CPU
  processes, NCCL between GPUs), one process per rank, as Ray's rank actors form it.

Both count their gathers, the bytes each rank received and the seconds spent waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


@dataclass
class CollectiveStats:
    """One rank's collective work since it started."""

    gathers: int = 0
    bytes_received: int = 0  # the other ranks' parts
    seconds: float = 0.0  # inside all_gather (transport and waiting for the slowest rank)

    def as_dict(self) -> dict:
        return {"gathers": self.gathers, "bytes_received": self.bytes_received, "seconds": round(self.seconds, 6)}


class Collective(Protocol):
    """One rank's view of its group."""

    rank: int
    ranks: int
    stats: CollectiveStats

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype on every rank), in rank order; this rank's
        own entry may be ``t`` itself."""
        ...


def _count(stats: CollectiveStats, t: torch.Tensor, ranks: int, t0: float) -> None:
    stats.gathers += 1
    stats.bytes_received += t.numel() * t.element_size() * (ranks - 1)
    stats.seconds += time.perf_counter() - t0


class ThreadGroup:
    """``ranks`` ranks as threads of this process: :meth:`run` runs a function per rank,
    :meth:`member` gives rank ``r``'s collective.

    The ranks take turns: a rank computes only while it holds the group's turn, which it lets
    go while it waits in a gather. Two threads computing at once would share torch's intra-op
    threads, and a BLAS product may then split its work differently and give other bits
    (measured: the attention probe of ``make_invariant`` fails when two ranks run it at once);
    one at a time, each rank's kernels run as they would alone.

    A gather waits at a barrier until every rank has put its part, reads all parts, and waits
    again before anyone may put the next one (so a fast rank cannot overwrite a part a slow
    one has not read). A rank that fails breaks the barrier: the others raise
    ``threading.BrokenBarrierError`` instead of waiting forever."""

    def __init__(self, ranks: int, timeout_s: float = 600.0):
        if ranks < 1:
            raise ValueError(f"a group needs at least one rank, not {ranks}")
        self.ranks = ranks
        self._parts: list[torch.Tensor | None] = [None] * ranks
        self._barrier = threading.Barrier(ranks, timeout=timeout_s)
        self._turn = threading.Lock()

    def run(self, fn: Callable[[int], T], timeout_s: float = 600.0) -> list[T]:
        """``[fn(0), ..., fn(ranks - 1)]``, each rank on its own thread (they must run together:
        each waits for the others in every gather). The first failing rank's exception is
        raised here, after the others have stopped."""
        out: list[Any] = [None] * self.ranks
        errors: list[BaseException] = []
        # a new thread starts with OpenMP's default thread count, not the caller's, and a
        # product split over another number of threads may give other bits
        n_threads = torch.get_num_threads()

        def run(r: int) -> None:
            try:
                torch.set_num_threads(n_threads)
                with self._turn:
                    out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors.append(e)
                self.abort()

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(self.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        if errors:  # the failing rank's own error, not a neighbour's broken barrier
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        if any(t.is_alive() for t in threads):
            self.abort()
            raise TimeoutError(f"a rank did not finish within {timeout_s:g} s")
        return out

    def member(self, rank: int) -> ThreadRank:
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not one of 0..{self.ranks - 1}")
        return ThreadRank(self, rank)

    def abort(self) -> None:
        """Break the barrier: every rank waiting in a gather raises (a failed rank calls this)."""
        self._barrier.abort()


class ThreadRank:
    """Rank ``rank`` of a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.ranks = group, rank, group.ranks
        self.stats = CollectiveStats()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        g = self.group
        g._parts[self.rank] = t
        held = g._turn.locked()
        if held:  # let the other ranks compute while this one waits
            g._turn.release()
        try:
            g._barrier.wait()
            parts = [p for p in g._parts if p is not None]
            g._barrier.wait()
        finally:
            if held:
                g._turn.acquire()
        if len(parts) != self.ranks or any(p.shape != t.shape or p.dtype != t.dtype for p in parts):
            raise RuntimeError(
                f"rank {self.rank}: the ranks gathered different shapes {[tuple(p.shape) for p in parts]}"
            )
        _count(self.stats, t, self.ranks, t0)
        return parts


class TorchDistributed:
    """This process's rank of a ``torch.distributed`` group (gloo or NCCL), already initialised
    (``torch.distributed.init_process_group``)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
        self._dist, self._group = dist, group
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_world_size(group)
        self.stats = CollectiveStats()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.ranks)]
        self._dist.all_gather(parts, t, group=self._group)
        parts[self.rank] = t
        _count(self.stats, t, self.ranks, t0)
        return parts
