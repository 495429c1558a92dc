"""The KV pool: every sequence's keys and values in fixed-size blocks of one preallocated store.

Layout, one tensor pair per layer (each on its layer's device, so a model spread over several
GPUs with ``device_map="auto"`` keeps each layer's KV next to the layer):

- ``k[layer] [Hkv, n_blocks, B, D]``: keys, ``B`` positions per block, head-major (a head's
  block is one contiguous ``[B, D]`` run, so a sequence's keys are gathered into the
  attention's ``[S, Hkv, L, D]`` layout in one row copy per (head, block), and a sequence
  whose blocks follow one another in the pool is read in place, without a copy);
- ``v[layer] [Hkv, n_blocks, B, D + value_ones]``: values; for the torch attention backend
  with a last column of ones (its softmax denominator, :func:`ralm.batching.attention.attend`,
  stored so that a sequence's run of blocks is read in place), for the Triton backend ``D``
  wide (``AttentionBackend.value_ones`` says which; the engine asks its model's backend).

A sequence (:class:`~ralm.batching.paged_kv.PagedKV`) owns a *block table*: block ``j`` of
its table holds its positions ``j*B .. j*B+B-1`` at every layer. Position ``p`` of a
sequence lives in block ``table[p // B]`` at offset ``p % B``. Example with ``B = 64``: a
sequence whose table is ``[7, 2]`` keeps position 70 in block 2, offset 6.

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

Growth is bounded by the device's free memory, and its transient is one layer: each layer's
tensors are reallocated and copied in turn, the old ones freed before the next layer's are
made, so the peak is the old pool plus one layer's new tensors (not the old pool plus the
whole new one). When doubling does not fit in the free memory, the pool grows by what the
sequences in flight need; when even that does not fit, :class:`KVPoolFull` says so.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import torch

from ralm import constants as C
from ralm.batching.attention_backend import attention_backend

ZERO_BLOCK = 0


class KVPoolFull(MemoryError):
    """The pool needs more blocks than the device's free memory holds."""


def layer_devices(model) -> list[torch.device] | None:
    """The device of each decoder layer's attention (the modules with a ``layer_idx``), in
    layer order; None when the model does not name its layers that way."""
    n = int(model.config.num_hidden_layers)
    found: dict[int, torch.device] = {}
    for m in model.modules():
        i = getattr(m, "layer_idx", None)
        if isinstance(i, int) and 0 <= i < n and i not in found:
            p = next(m.parameters(recurse=True), None)
            if p is not None:
                found[i] = p.device
    return [found[i] for i in range(n)] if len(found) == n else None


def free_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: the CUDA allocator's view of the GPU, the
    kernel's ``MemAvailable`` for the CPU; None when unknown (no bound)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # the caching allocator's reserved-but-unused bytes are free for torch too
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


class KVPool:
    """Reference-counted KV blocks of ``block_size`` positions for ``n_layers`` layers.

    ``devices``: each layer's device (None: every layer on the device of the first write);
    ``free_memory``: the bytes a device has free (:func:`free_bytes`), which bounds growth;
    ``private``: the pool of one sequence (:meth:`PagedKV.standalone
    <ralm.batching.paged_kv.PagedKV.standalone>`), whose bytes are all that sequence's;
    ``value_ones``: the values carry a last column of ones (the torch attention backend's
    layout, ``AttentionBackend.value_ones``).
    """

    #: the block every padded table entry names (:data:`ZERO_BLOCK`)
    zero_block = ZERO_BLOCK

    def __init__(
        self,
        n_layers: int,
        block_size: int = C.INVARIANT_KEY_BLOCK,
        initial_blocks: int = C.KV_POOL_INITIAL_BLOCKS,
        devices: Sequence[torch.device] | None = None,
        free_memory: Callable[[torch.device], int | None] = free_bytes,
        private: bool = False,
        value_ones: bool = True,
    ):
        if block_size < 1 or initial_blocks < 2:
            raise ValueError("a KV pool needs a block size >= 1 and at least 2 blocks (block 0 is the zero block)")
        if devices is not None and len(devices) != n_layers:
            raise ValueError(f"{len(devices)} layer devices for {n_layers} layers")
        self.n_layers = int(n_layers)
        self.block_size = int(block_size)
        self.initial_blocks = int(initial_blocks)
        self.devices = [torch.device(d) for d in devices] if devices is not None else None
        self.free_memory = free_memory
        self.private = bool(private)
        self.value_ones = bool(value_ones)
        self.k: list[torch.Tensor] = []  # per layer [Hkv, n_blocks, B, D] (empty until the first write)
        self.v: list[torch.Tensor] = []  # per layer [Hkv, n_blocks, B, D + value_ones]
        # the same storage viewed as one run of positions, [Hkv, n_blocks * B, D(+1)]: block b's
        # offset o is position b * B + o (a sequence whose blocks follow one another is a slice)
        self.k_run: list[torch.Tensor] = []
        self.v_run: list[torch.Tensor] = []
        self.refs: list[int] = []
        self._free: list[int] = []
        self.lock = threading.RLock()
        self.grows = 0
        self.copies = 0  # copy-on-write block copies
        #: callbacks that free idle blocks (LRU sessions, cached documents); each returns
        #: whether it freed anything. Called when no block is free, before the pool grows.
        self.reclaimers: list[Callable[[], bool]] = []

    @classmethod
    def for_model(cls, model, **kw) -> KVPool:
        """The pool a model's batched forwards use: its layer count, each layer's KV on the
        layer's device (:func:`layer_devices`) and the values laid out for its attention
        backend (``AttentionBackend.value_ones``); ``kw`` go to the constructor."""
        kw.setdefault("devices", layer_devices(model))
        return cls(int(model.config.num_hidden_layers), value_ones=attention_backend(model).value_ones, **kw)

    @classmethod
    def of_one_sequence(
        cls, n_layers: int, devices: Sequence[torch.device] | None = None, value_ones: bool = True
    ) -> KVPool:
        """A private pool for one sequence: 2 blocks to start (the zero block and one),
        doubling as the sequence grows; its blocks are handed out in order, so the sequence's
        table is one run that the attention reads in place."""
        return cls(n_layers, initial_blocks=2, devices=devices, private=True, value_ones=value_ones)

    # ------------------------------------------------------------------ allocation
    @property
    def allocated(self) -> bool:
        """Whether the first write has allocated the pool."""
        return bool(self.k)

    @property
    def n_blocks(self) -> int:
        return len(self.refs)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer as stored (keys, and values with any ones column)."""
        if not self.k:
            return 0
        hkv, _, B, D = self.k[0].shape
        return hkv * B * (2 * D + self.value_ones) * self.k[0].element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (keys and values, the ones column excluded)."""
        if not self.k:
            return 0
        hkv, _, B, D = self.k[0].shape
        return self.n_layers * 2 * B * hkv * D * self.k[0].element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of every block the pool holds, in use or free (keys and values, the ones
        column excluded)."""
        return max(0, self.n_blocks - 1) * self.block_bytes

    def layer_device(self, layer: int) -> torch.device:
        return self.k[layer].device

    def ensure(self, like: torch.Tensor) -> None:
        """Allocate the pool for keys shaped like ``like [Hkv, n, D]`` (dtype; the device of
        layer 0 when no layer devices were given) on first use; afterwards check that
        ``like`` fits it."""
        hkv, _, D = like.shape
        if not self.k:
            with self.lock:
                if not self.k:
                    devices = self.devices or [like.device] * self.n_layers
                    self._grow(self.initial_blocks, hkv, D, like.dtype, devices)
            return
        k0 = self.k[0]
        if (k0.shape[0], k0.shape[3]) != (hkv, D) or k0.dtype != like.dtype:
            raise ValueError(
                f"KV of shape {tuple(like.shape)} ({like.dtype}) does not fit the pool "
                f"(Hkv={k0.shape[0]}, D={k0.shape[3]}, {k0.dtype})"
            )

    @torch.inference_mode()  # inference tensors: every write runs under inference mode (_writable)
    def _grow(self, n: int, hkv: int, D: int, dtype, devices: Sequence[torch.device]) -> None:
        """Make the pool ``n`` blocks long, one layer at a time: a layer's new tensors are
        made and filled, then its old ones are dropped, before the next layer's are made."""
        B, old = self.block_size, self.n_blocks
        for i, dev in enumerate(devices):
            k = torch.zeros(hkv, n, B, D, dtype=dtype, device=dev)
            v = torch.zeros(hkv, n, B, D + self.value_ones, dtype=dtype, device=dev)
            if self.value_ones:
                v[..., D] = 1.0
            if old:
                k[:, :old] = self.k[i]
                v[:, :old] = self.v[i]
                self.k[i], self.v[i] = k, v
                self.k_run[i], self.v_run[i] = k.view(hkv, n * B, D), v.view(hkv, n * B, v.shape[-1])
            else:
                self.k.append(k)
                self.v.append(v)
                self.k_run.append(k.view(hkv, n * B, D))
                self.v_run.append(v.view(hkv, n * B, v.shape[-1]))
            del k, v
        self.refs.extend([0] * (n - old))
        # A LIFO of free ids: the blocks already free stay on top (recently used memory is
        # reused first), the new ones go under them, low ids first out. So a sequence that
        # grows its own pool (``PagedKV.standalone``) gets its blocks in order, one run: with
        # 2 blocks, block 1 free and 3 needed, it takes 1, 2, 3, not 2, 3, 1.
        self._free[:0] = range(n - 1, max(old, 1) - 1, -1)
        if old == 0:
            self.refs[ZERO_BLOCK] = 1  # never freed, never handed out

    def _grown_size(self, need: int) -> int:
        """The pool's size after a growth that leaves ``need`` blocks in use: doubled while that
        fits in every device's free memory, else just enough; :class:`KVPoolFull` when even
        that does not fit."""
        size = self.n_blocks
        while size < need + 1:
            size *= 2
        smallest = need
        for target in (size, smallest):
            if self._fits(target):
                return target
        raise KVPoolFull(
            f"the KV pool needs {smallest} blocks of {self.layer_block_bytes * self.n_layers} bytes "
            f"(it has {self.n_blocks}), more than the free memory of its devices holds"
        )

    def _fits(self, size: int) -> bool:
        """Whether growing to ``size`` blocks fits in each device's free memory: the new
        blocks of its layers plus one layer's whole new tensors (the growth's transient)."""
        per_layer = self.layer_block_bytes
        layers_on: dict[torch.device, int] = {}
        for t in self.k:
            layers_on[t.device] = layers_on.get(t.device, 0) + 1
        for dev, n_layers in layers_on.items():
            free = self.free_memory(dev)
            if free is None:
                continue
            need = n_layers * (size - self.n_blocks) * per_layer + self.n_blocks * per_layer
            if need > free:
                return False
        return True

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (reference count 1 each); frees idle blocks or grows the pool if
        needed. Their content is stale (finite) until written."""
        if not self.k:
            raise RuntimeError("the pool is allocated by the first write (KVPool.ensure)")
        with self.lock:
            while len(self._free) < n and any(r() for r in self.reclaimers):
                pass
            if len(self._free) < n:
                hkv, _, _, D = self.k[0].shape
                need = self.n_blocks - len(self._free) + n  # blocks in use after this allocation
                size = self._grown_size(need)
                self._grow(size, hkv, D, self.k[0].dtype, [t.device for t in self.k])
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
            with _writable():
                for k, v in zip(self.k, self.v):
                    k[:, dst] = k[:, src]
                    v[:, dst] = v[:, src]
            self.copies += 1
            self.decref([src])
            return dst

    # ------------------------------------------------------------------ access
    def write(
        self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> None:
        """Store ``k_new, v_new [Hkv, n, D]`` at ``(blocks[i], offsets[i])`` (long ``[n]``, on the
        pool's device) of ``layer``: one copy each for every sequence of a forward."""
        D = k_new.shape[-1]
        with _writable():
            self.k[layer][:, blocks, offsets] = k_new
            self.v[layer][:, blocks, offsets, :D] = v_new

    def write_run(self, layer: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store ``k_new, v_new [Hkv, n, D]`` at positions ``start .. start+n-1`` of ``layer``
        viewed as one run ``[Hkv, n_blocks*B, D]`` (a sequence whose blocks follow one another:
        position ``p`` of a sequence starting at block ``b0`` is ``b0*B + p``): one slice copy each."""
        n, D = k_new.shape[1], k_new.shape[-1]
        with _writable():
            self.k_run[layer][:, start : start + n] = k_new
            self.v_run[layer][:, start : start + n, :D] = v_new

    def run_span(self, layer: int, first: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``first .. first+nb-1`` (one run) at ``layer`` as ``(k [Hkv, nb*B, D], v_aug
        [Hkv, nb*B, Dv])``: one slice of each run view, no copy."""
        B = self.block_size
        return self.k_run[layer][:, first * B : (first + nb) * B], self.v_run[layer][:, first * B : (first + nb) * B]

    def read_run(self, layer: int, first: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``first .. first+nb-1`` (one sequence whose blocks follow one another) at
        ``layer`` as ``(k [1, Hkv, nb*B, D], v_aug [1, Hkv, nb*B, Dv])`` (``Dv = D + value_ones``): views, no copy."""
        k, v = self.run_span(layer, first, nb)
        return k.unsqueeze(0), v.unsqueeze(0)

    def rows_of(self, tables: torch.Tensor) -> torch.Tensor:
        """The rows :meth:`read_rows` copies for ``tables [S, nb]`` (long): a layer viewed as
        rows ``[Hkv * n_blocks, B * Dx]`` has (head h, block b) at row ``h * n_blocks + b``;
        they are listed in ``[S, Hkv, nb]`` order (long ``[S*Hkv*nb]``)."""
        S, nb = tables.shape
        hkv, n_blocks, _, _ = self.k[0].shape
        heads = torch.arange(hkv, device=tables.device).view(1, hkv, 1) * n_blocks
        return (tables.view(S, 1, nb) + heads).view(-1)

    def read_rows(self, layer: int, rows: torch.Tensor, S: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_pad [S, Hkv, nb*B, D], v_aug [S, Hkv, nb*B, Dv])``, the layout
        :func:`ralm.batching.attention.attend` takes, from :meth:`rows_of`'s ``rows``: one
        contiguous row copy per (sequence, head, block); element ``[s, h, j*B + b]`` is head
        ``h`` of the sequence's ``j``-th block, offset ``b``."""
        hkv, _, B, _ = self.k[layer].shape
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
