"""Counting the host's work in a forward: torch ops, kernel launches, host reads, tensors from Python data.

A decode iteration on a GPU is host-bound when the host issues more operations than the
device needs time to run (docs/batching.md, "Host cost"). :func:`count_ops` runs a function
under a ``TorchDispatchMode`` and counts every aten op that reaches the dispatcher (views
included: each one is a Python-to-C++ round trip), and separately:

- ``python_tensors``: tensors built from Python data (``torch.tensor(list)``: the
  dispatcher's ``lift_fresh``), each a host-to-device copy on a GPU;
- ``host_reads``: scalars read back to the host (``int(t)``, ``t.item()``:
  ``_local_scalar_dense``), each a synchronisation on a GPU (``tolist`` on a CPU tensor
  does not reach the dispatcher; on a GPU it is a ``_to_copy`` to the CPU, counted too);
- ``launches``: Triton kernel launches, with :func:`record_triton_launches` active.

For the Triton backend on a machine without a GPU, :func:`record_triton_launches` replaces
each kernel launch with a record of it (the outputs stay uninitialised), so that a count
holds the launches and the torch ops around them and none of the interpreter's own copies.

Example: ``with record_triton_launches() as launches: c = count_ops(lambda: forward())``
gives ``c.ops + launches.n`` operations for the Triton backend's forward.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ralm.batching.attention_backend import attention_backend
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV

_PYTHON_DATA = {"lift_fresh", "lift_fresh_copy"}
_HOST_READS = {"_local_scalar_dense"}


@dataclass
class OpCount:
    """What :func:`count_ops` saw."""

    ops: int = 0  # aten ops dispatched (Triton launches not included)
    python_tensors: int = 0  # tensors made from Python data
    host_reads: int = 0  # values read back to the host
    by_name: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {
            "ops": self.ops,
            "python_tensors": self.python_tensors,
            "host_reads": self.host_reads,
            "top": dict(self.by_name.most_common(12)),
        }


class _Counting(TorchDispatchMode):
    def __init__(self, count: OpCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        c = self.count
        c.ops += 1
        c.by_name[name] += 1
        if name in _PYTHON_DATA:
            c.python_tensors += 1
        elif name in _HOST_READS:
            c.host_reads += 1
        elif name == "_to_copy" and (kwargs or {}).get("device") is not None:
            src = args[0] if args else None
            if (
                isinstance(src, torch.Tensor)
                and src.device.type != "cpu"
                and torch.device(kwargs["device"]).type == "cpu"
            ):
                c.host_reads += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> tuple[OpCount, Any]:
    """``(count, fn())``: the aten ops ``fn`` dispatches, run under a dispatch mode."""
    count = OpCount()
    with _Counting(count):
        out = fn()
    return count, out


@dataclass
class Launches:
    """Kernel launches recorded by :func:`record_triton_launches`."""

    n: int = 0
    by_kernel: Counter[str] = field(default_factory=Counter)


class _RecordedKernel:
    """Stands for one jitted kernel: ``kernel[grid](*args)`` records the launch, runs nothing."""

    def __init__(self, name: str, launches: Launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            self.launches.n += 1
            self.launches.by_kernel[self.name] += 1

        return launch


class _RecordedFamily(dict):
    def __init__(self, launches: Launches):
        super().__init__()
        self.launches = launches

    def __missing__(self, name: str) -> _RecordedKernel:
        k = self[name] = _RecordedKernel(name, self.launches)
        return k


@contextlib.contextmanager
def record_triton_launches() -> Iterator[Launches]:
    """Inside the block every batch-invariant Triton kernel launch is recorded, not run
    (:func:`ralm.batching.triton_kernels.kernels` hands out recorders): for counting a forward's
    launches without a GPU. The kernels' outputs are left uninitialised."""
    from ralm.batching import triton_kernels  # lazy: triton is optional

    launches = Launches()
    real = triton_kernels.kernels
    recorded = _RecordedFamily(launches)
    triton_kernels.kernels = lambda: recorded
    try:
        yield launches
    finally:
        triton_kernels.kernels = real


def decode_iteration_ops(model, batch: int, context: int, seed: int = 0) -> dict:
    """The host's work in one pooled decode iteration of ``batch`` sequences, each with a
    ``context``-position KV: torch ops (and Triton launches, recorded instead of run, when
    the model is on the Triton kernels), tensors made from Python data and host reads,
    counted over :func:`~ralm.batching.packed.packed_forward` (the metadata's one copy
    included), and per decoder layer."""
    g = torch.Generator().manual_seed(seed)
    layers = int(model.config.num_hidden_layers)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(1, vocab, (batch, context + 1), generator=g).tolist()
    pool = KVPool.for_model(model)  # the layout the engine gives this model
    kvs = [PagedKV(pool) for _ in range(batch)]
    triton = attention_backend(model).name == "triton"
    with contextlib.ExitStack() as stack:
        launches = stack.enter_context(record_triton_launches()) if triton else Launches()
        with torch.inference_mode():
            for kv, row in zip(kvs, ids):
                packed_forward(model, [(kv, row[:context])], [])
            packed_forward(model, [(kv, [row[context]]) for kv, row in zip(kvs, ids)])  # warm: caches, growth
            for kv in kvs:
                kv.crop(context)
            before = launches.n
            count, _ = count_ops(lambda: packed_forward(model, [(kv, [row[context]]) for kv, row in zip(kvs, ids)]))
            n_launch = launches.n - before
    for kv in kvs:
        kv.free()
    total = count.ops + n_launch
    return {
        "batch": batch,
        "context": context,
        "backend": "triton" if triton else "cpu",
        "ops": total,
        "ops_per_layer": total / layers,
        "torch_ops": count.ops,
        "launches": n_launch,
        "python_tensors": count.python_tensors,
        "host_reads": count.host_reads,
        "top": dict(count.by_name.most_common(10)),
    }
