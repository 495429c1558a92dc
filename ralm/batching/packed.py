"""Several sequences in one forward pass: packed tokens, each sequence's KV paged.

A batched forward is a *single* row of tokens, ``input_ids [1, N]``: the new tokens of
every sequence one after another (a prefill chunk of one, the decode token of another),
with each token's own position in ``position_ids``. The model runs without a Hugging Face
cache (``use_cache=False``), so every layer sees the keys and values of exactly these N
tokens; the invariant attention (:mod:`ralm.batching.invariant`) receives the
:class:`PackedBatch` through the forward's keyword arguments, writes each sequence's new
keys/values into that sequence's blocks (:class:`~ralm.batching.paged_kv.PagedKV`: one
write per layer when every sequence is in one pool, the serving default), and attends each
sequence to its own KV.

Nothing in a sequence's computation depends on its neighbours: linear layers and norms
are row-invariant, positions are per token, attention is per sequence. Example: sequences
A (3 prefill tokens at positions 7-9) and B (one decode token at position 41) give
``input_ids = [a7 a8 a9 b41]``, ``position_ids = [7 8 9 41]``; at every layer rows 0-2
attend to A's 10 keys and row 3 to B's 42 keys.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ralm import constants as C
from ralm.batching.attention import hidden_keys
from ralm.batching.attention_backend import BACKENDS, AttentionBackend, attention_backend
from ralm.batching.invariant import row_multiple
from ralm.batching.metadata import IterationMetadata
from ralm.batching.paged_kv import FixedLayout, PagedKV, PagedPlan


class _PaddedRowsNeedNoMask(logging.Filter):
    """transformers warns (once per process) that a forward whose first or last token is the pad
    token should be given an attention mask. A packed forward's padding rows are token 0 (the
    pad token of many models) in no sequence, and its attention (``ralm_batch``) never reads
    them: every engine load printed the warning, and it does not apply."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "passing in an `attention_mask` since your input_ids may be padded" not in record.getMessage()


logging.getLogger("transformers.modeling_utils").addFilter(_PaddedRowsNeedNoMask())


def model_max_positions(config) -> int:
    """The positions a model's config allows (``n_positions``, ``max_position_embeddings`` or
    ``n_ctx``; unbounded when it names none)."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1 << 30


@dataclass
class Segment:
    """One sequence's share of a packed forward: ``n`` tokens from row ``start`` on."""

    start: int
    n: int
    kv: PagedKV


class _Group:
    """Segments attended together: their indices, and the sections of the iteration's
    metadata that hold their query-row gather, positions and output-scatter maps."""

    def __init__(
        self, segments: Sequence[Segment], idx: list[int], gi: int, meta: IterationMetadata, sections: bool = True
    ):
        segs = [segments[i] for i in idx]
        self.idx = idx
        self.n_max = n_max = max(s.n for s in segs)
        self.name = f"group{gi}"
        # every segment has n_max tokens and they follow one another from row 0: the packed
        # rows are the group's [S, n_max] queries as they are (no gather, no scatter)
        self.in_order = all(sg.n == n_max and sg.start == j * n_max for j, sg in enumerate(segs))
        self.meta = meta
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        if not sections:  # a backend that attends the pool in one launch reads none of them
            return
        gather, pos, valid, rows = [], [], [], []
        for j, s in enumerate(segs):
            base = len(s.kv)  # the sequence's length before this forward (every layer)
            for t in range(n_max):
                tt = min(t, s.n - 1)  # padded query rows repeat the last real one
                gather.append(s.start + tt)
                pos.append(base + tt)
                if t < s.n:
                    valid.append(j * n_max + t)
                    rows.append(s.start + t)
        meta.add(f"{self.name}.pos", pos, (len(segs), n_max))
        if not self.in_order:
            meta.add(f"{self.name}.gather", gather)
            meta.add(f"{self.name}.valid", valid)
            meta.add(f"{self.name}.rows", rows)

    @property
    def pos(self) -> torch.Tensor:
        return self.meta[f"{self.name}.pos"]

    def index(self, what: str) -> torch.Tensor:
        return self.meta[f"{self.name}.{what}"]

    def mask(self, nb: int, groups: int) -> torch.Tensor:
        """The attention mask over ``nb`` key blocks (the same at every layer: computed once)."""
        key = (nb, groups)
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = hidden_keys(self.pos, self.n_max, nb, groups)
        return m


class PackedBatch:
    """The plan of one packed forward; passed to the model as ``ralm_batch=``.

    Built before the forward: the segments' groups, and (every sequence paged in one
    allocated pool) the KV pool's plan with its reserved blocks; all their indices, with
    the forward's token ids and positions, are sections of one :class:`IterationMetadata`,
    sent to the device in one copy. ``backend``: the attention backend
    (:mod:`ralm.batching.attention_backend`; the torch one by default); ``layout``: the sizes
    of a captured forward's indices (:class:`~ralm.batching.paged_kv.FixedLayout`)."""

    def __init__(
        self,
        segments: Sequence[Segment],
        device=None,
        backend: AttentionBackend | None = None,
        meta=None,
        layout: FixedLayout | None = None,
    ):
        self.segments = list(segments)
        self.n_tokens = sum(s.n for s in self.segments)
        self.device = device
        self.backend = backend if backend is not None else BACKENDS["torch"]
        self.meta = meta if meta is not None else IterationMetadata(device)
        # every sequence paged in one pool: one write per layer, keys read through block tables
        paged = [seg.kv for seg in self.segments if isinstance(seg.kv, PagedKV)]
        pools = {id(kv.pool) for kv in paged}
        self.pool = paged[0].pool if len(paged) == len(self.segments) and len(pools) == 1 else None
        planned = self.pool is not None and self.pool.allocated  # the usual case: the plan's indices ship with the rest
        by_tiles: dict[int, list[int]] = {}
        for i, seg in enumerate(self.segments):
            by_tiles.setdefault(-(-seg.n // C.INVARIANT_QUERY_TILE), []).append(i)
        sections = not (planned and self.backend.paged_launch)
        self.groups = [_Group(self.segments, idx, gi, self.meta, sections) for gi, idx in enumerate(by_tiles.values())]
        self._plan: PagedPlan | None = None
        if planned:
            assert self.pool is not None
            self._plan = PagedPlan(self.pool, self.segments, self.groups, device, self.backend, self.meta, layout)

    def ship(self, into: torch.Tensor | None = None, staging: torch.Tensor | None = None) -> None:
        """Send the iteration's metadata to the device (one copy; ``into``, ``staging``: the
        buffers of a captured forward, :meth:`IterationMetadata.ship`)."""
        self.meta.ship(into, staging)

    def finish(self) -> None:
        """After the forward: the paged sequences hold their new positions."""
        if self._plan is not None:
            for seg in self.segments:
                seg.kv.advance(seg.n)

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """transformers' attention interface: ``query [1, H, N, D]``, ``key/value [1, Hkv, N, D]``
        (this layer's new tokens) -> ``[1, N, H, D]``; see :meth:`attend_rows`."""
        q = query[0].transpose(0, 1)  # [N, H, D], a view
        return self.attend_rows(int(module.layer_idx), q, key[0], value[0], scaling).unsqueeze(0)

    def attend_rows(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """One layer's attention for every sequence of the batch: ``q [N, H, D]`` (row layout),
        ``k, v [Hkv, N, D]`` (head-major: the KV's layout) -> ``[N, H, D]``; appends each
        segment's keys/values to its sequence first.

        Segments with the same number of query tiles attend together (one stacked call):
        typically every decode token of the iteration in one call, each prefill chunk alone.
        Shorter sequences of a group are attended over the group's longest key range; their
        extra blocks are masked and add exact zeros."""
        n_rows = q.shape[0]
        if n_rows != self.n_tokens:  # padding rows (row_multiple): attended by nobody, written nowhere
            N = self.n_tokens
            out = self._attend(layer, q[:N], k[:, :N], v[:, :N], scaling)
            return F.pad(out, (0, 0, 0, 0, 0, n_rows - N))
        return self._attend(layer, q, k, v, scaling)

    def fused_rotary(self, n_rows: int) -> bool:
        """Whether a Llama-family layer can hand this forward its stacked projection and rotary
        factors (:meth:`rotary_attention`): a backend that fuses the rotation, every sequence
        in the allocated pool, no padding rows."""
        return self.backend.fuses_rotary and self._plan is not None and n_rows == self.n_tokens

    def rotary_attention(
        self,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        scaling: float,
    ) -> torch.Tensor:
        """One layer's rotation, KV write and attention for every sequence of the batch, from
        the stacked projection ``qkv [1, N, (H + 2 Hkv) D]`` and transformers' rotary factors
        ``cos, sin [1, N, D]`` (when :meth:`fused_rotary`): ``[1, N, H D]``, two launches."""
        assert self._plan is not None
        out = self.backend.rotary_pool(self._plan, layer, qkv, cos, sin, heads, kv_heads, scaling)
        assert out is not None  # fused_rotary checked the backend
        return out

    def _attend(self, layer: int, q_rows, key, value, scaling: float) -> torch.Tensor:
        if self.pool is not None:
            if self._plan is None:  # the pool's first forward: allocated now, the plan's indices in a copy of their own
                self.pool.ensure(key[:, :1])
                self._plan = PagedPlan(self.pool, self.segments, self.groups, self.device, self.backend)
            self._plan.write(layer, key, value)
            pooled = self.backend.attend_pool(self._plan, layer, q_rows, scaling)
            if pooled is not None:  # every sequence in one call (the Triton backend's paged launch)
                return pooled
        else:
            for seg in self.segments:
                seg.kv.append(layer, key[:, seg.start : seg.start + seg.n], value[:, seg.start : seg.start + seg.n])
        H, D = q_rows.shape[1], q_rows.shape[2]
        if len(self.groups) == 1 and self.groups[0].in_order:  # e.g. every row a decode token
            g = self.groups[0]
            q = q_rows.view(len(g.idx), g.n_max, H, D).transpose(1, 2)  # [S, H, n, D], a view
            return self._attend_group(0, layer, q, scaling).reshape(self.n_tokens, H, D)
        out = q_rows.new_empty(self.n_tokens, H, D)
        for gi, g in enumerate(self.groups):
            if g.in_order:
                q = q_rows[: len(g.idx) * g.n_max].view(len(g.idx), g.n_max, H, D).transpose(1, 2)
                o = self._attend_group(gi, layer, q, scaling)
                out[: len(g.idx) * g.n_max] = o.reshape(-1, H, D)
                continue
            q = q_rows.index_select(0, g.index("gather")).view(len(g.idx), g.n_max, H, D).transpose(1, 2)
            o = self._attend_group(gi, layer, q, scaling)
            out.index_copy_(0, g.index("rows"), o.reshape(-1, H, D).index_select(0, g.index("valid")))
        return out

    def _attend_group(self, gi: int, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Group ``gi``'s queries ``q [S, H, n_max, D]`` against its sequences' KV at ``layer``,
        laid out one tensor per sequence, by the backend: ``[S, n_max, H, D]``."""
        KB = C.INVARIANT_KEY_BLOCK
        g = self.groups[gi]
        segs = [self.segments[i] for i in g.idx]
        if self._plan is not None:
            k_pad, v_aug = self._plan.gather(layer, gi)
            span = k_pad.shape[2]
        else:
            span = max(-(-s.kv.layer_len[layer] // KB) * KB for s in segs)
            ks, vs = zip(*(s.kv.span(layer, span) for s in segs))
            k_pad = ks[0].unsqueeze(0) if len(ks) == 1 else torch.stack(ks)
            v_aug = vs[0].unsqueeze(0) if len(vs) == 1 else torch.stack(vs)
        return self.backend.attend_contiguous(
            q, k_pad, v_aug, g.pos, scaling, lambda: g.mask(span // KB, q.shape[1] // k_pad.shape[1])
        )


def pack(
    model,
    chunks: Sequence[tuple[PagedKV, Sequence[int]]],
    logits_rows: Sequence[int] | None = None,
    layout: FixedLayout | None = None,
) -> PackedBatch:
    """The plan of one packed forward over ``chunks`` (``(kv, new token ids)`` pairs), its
    metadata built on the host and not yet shipped: token ids, positions, the kept rows
    ``logits_rows`` (default: each chunk's last token), the groups' and the pool's indices
    (room for the new tokens reserved). ``layout``: the sizes of a captured forward's indices
    (:mod:`ralm.batching.iteration_graphs`)."""
    device = next(model.parameters()).device
    ids: list[int] = []
    pos: list[int] = []
    segs: list[Segment] = []
    for kv, toks in chunks:
        if not toks:
            raise ValueError("a packed chunk needs at least one token")
        segs.append(Segment(len(ids), len(toks), kv))
        base = len(kv)
        ids.extend(int(t) for t in toks)
        pos.extend(range(base, base + len(toks)))
    if logits_rows is None:
        logits_rows = [s.start + s.n - 1 for s in segs]
    # padding rows (token 0 at position 0, in no sequence) up to the linear layers' row tile:
    # every layer then runs on the rows as they are, and each real row gets its bits whatever
    # the padding holds (row invariance); the attention writes and reads real rows only
    m = row_multiple(model)
    pad = max(-(-len(ids) // m) * m, m) - len(ids) if m > 1 else 0
    meta = IterationMetadata(device)
    meta.add("ids", ids + [0] * pad, (1, len(ids) + pad))
    meta.add("pos", pos + [0] * pad, (1, len(pos) + pad))
    meta.add("keep", [int(r) for r in logits_rows])
    return PackedBatch(segs, device, attention_backend(model), meta, layout)


def run_packed(model, batch: PackedBatch, with_hidden: bool = False):
    """The model's forward on a shipped :class:`PackedBatch`: its output (``.logits [1, R,
    vocab]`` of the kept rows; with ``with_hidden``, ``.hidden_states``). Builds no tensor
    from Python data and reads nothing back, so it can be captured in a CUDA graph."""
    meta = batch.meta
    return model(
        input_ids=meta["ids"],
        position_ids=meta["pos"],
        use_cache=False,
        logits_to_keep=meta["keep"],
        output_hidden_states=with_hidden,
        ralm_batch=batch,
    )


@torch.inference_mode()
def packed_forward(
    model,
    chunks: Sequence[tuple[PagedKV, Sequence[int]]],
    logits_rows: Sequence[int] | None = None,
    with_hidden: bool = False,
):
    """One forward over several sequences: ``chunks`` = ``(kv, new token ids)`` pairs.

    Appends every chunk's KV to its sequence and returns the logits of the packed rows
    ``logits_rows`` (indices into the concatenated tokens; default: each chunk's last
    token), ``[len(logits_rows), vocab]``; with ``with_hidden``, also the final hidden states
    of those rows (``[len(logits_rows), d]``, the KNN-LM query), as a pair.

    The iteration's metadata (token ids, positions, kept rows, the groups' and the pool's
    indices) is built on the host first and sent to the device in one copy
    (:class:`~ralm.batching.metadata.IterationMetadata`); the model's forward then builds no
    tensor from Python data and reads nothing back.
    """
    batch = pack(model, chunks, logits_rows)
    batch.ship()
    out = run_packed(model, batch, with_hidden)
    batch.finish()
    if with_hidden:
        return out.logits[0], out.hidden_states[-1][0].index_select(0, batch.meta["keep"])
    return out.logits[0]
