"""One iteration's integer metadata: built on the host once, sent to the device in one copy.

A batched forward needs many small index tensors: the packed token ids and positions, the
rows whose logits are kept, where each new token's KV goes in the pool, each sequence's
block table (or the pool rows the CPU attention gathers), the Triton kernel's query tiles.
Each ``torch.tensor(list, device=cuda)`` is a host-to-device copy from pageable memory, a
synchronisation. :class:`IterationMetadata` collects all of them as named sections of one
list of integers, makes one tensor of it (pinned memory on CUDA) and copies it to the
device once, without blocking; every section is then a view of that one device tensor.
Given the metadata, the forward builds no tensor from Python data.

Example: sections ``ids = [5, 9, 2]`` and ``pos = [40, 41, 7]`` are one host tensor
``[5, 9, 2, 40, 41, 7]``; on the device ``ids`` is its view ``[0:3]`` and ``pos`` ``[3:6]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class IterationMetadata:
    """Named int64 sections of one host list, shipped to ``device`` by :meth:`ship`."""

    def __init__(self, device: torch.device | str | None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._data: list[int] = []
        self._spans: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._tensors: dict[str, torch.Tensor] | None = None

    def add(self, name: str, values: Sequence[int], shape: tuple[int, ...] | None = None) -> None:
        """Add section ``name`` (``values`` laid out as ``shape``; default: flat)."""
        if self._tensors is not None:
            raise RuntimeError("the metadata was already shipped")
        if name in self._spans:
            raise KeyError(f"section {name!r} added twice")
        n = len(values)
        self._spans[name] = (len(self._data), n, shape if shape is not None else (n,))
        self._data.extend(values)

    def __contains__(self, name: str) -> bool:
        return name in self._spans

    @property
    def layout(self) -> tuple:
        """The sections' names, offsets and shapes: two iterations with the same layout read
        the same views of one buffer (a captured forward's, :meth:`ship` ``into``)."""
        return tuple((name, a, shape) for name, (a, _, shape) in self._spans.items())

    def __len__(self) -> int:
        return len(self._data)

    def ship(self, into: torch.Tensor | None = None, staging: torch.Tensor | None = None) -> None:
        """The one copy: the host list as one tensor (pinned on CUDA), copied to the device
        without blocking; the sections become views of it.

        ``into``: an int64 device buffer of exactly this many values to copy into instead
        of a new tensor (a captured forward reads its views where they were at capture);
        ``staging``: a pinned host buffer of the same size to copy through (reused; the
        caller makes sure the previous copy out of it has finished)."""
        host = torch.tensor(self._data, dtype=torch.long)
        if into is not None:
            if into.numel() != host.numel() or into.dtype != torch.long:
                raise ValueError(f"metadata of {host.numel()} values shipped into a buffer of {into.numel()}")
            if staging is not None:
                staging.copy_(host)
                host = staging
            into.copy_(host, non_blocking=host.is_pinned())
            dev = into
        elif self.device.type == "cuda":
            dev = host.pin_memory().to(self.device, non_blocking=True)
        else:
            dev = host if self.device.type == "cpu" else host.to(self.device)
        self._tensors = {name: dev[a : a + n].view(shape) for name, (a, n, shape) in self._spans.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._tensors is None:
            self.ship()
        assert self._tensors is not None
        return self._tensors[name]
