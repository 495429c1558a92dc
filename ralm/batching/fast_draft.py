"""Decode fast, verify exactly: draft a window with the plain kernels, then let one invariant
forward over the window decide.

With ``generator.fast_draft = m`` the batched engine, before each iteration, takes the steps
that are decoding (one pending token, at least two tokens still to make, no other drafter)
and runs up to ``m`` *draft forwards* over all of them together with the linear layers on
torch's own kernels (``F.linear``: on a GPU, cuBLAS with whatever tiles and split-K it likes;
fast, not batch-invariant). Each draft forward feeds every step's latest token and takes its
greedy successor. The sequences are then cropped back: the draft KV is never kept. The
window ``[next, d1 .. dm]`` becomes the step's next chunk with ``verify = [d1 .. dm]``, and
the engine's invariant forward checks it as it checks any draft
(:meth:`~ralm.batching.engine.BatchEngine._emit_verified`): the draft is accepted while each
token equals the invariant argmax, and the first invariant token after the accepted prefix
is emitted. Every token the step returns therefore comes from invariant logits: exact by
construction, whatever the plain kernels compute (a wrong draft costs time, never a token).

Worked example (m = 3): a step decoding after ``[..., 42]`` drafts ``7, 9, 9`` with three
plain forwards; the invariant forward over ``[42, 7, 9, 9]`` gives argmaxes ``7, 9, 5, x``:
``7, 9`` are accepted, ``5`` (the invariant token where the draft said ``9``) is emitted,
and the KV of the rejected ``9`` is dropped: three tokens for three cheap forwards and one
invariant forward of four rows. It pays where a forward's cost barely grows with its rows
(a memory-bound GPU decode) and the plain kernels are faster than the invariant ones.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ralm.batching.invariant import InvariantLinear
from ralm.batching.packed import packed_forward
from ralm.drafting import greedy_tokens


@contextlib.contextmanager
def plain_kernels(model) -> Iterator[None]:
    """Run ``model``'s invariant linear layers on ``F.linear`` inside the block."""
    layers = [m for m in model.modules() if isinstance(m, InvariantLinear)]
    for m in layers:
        m.plain = True
    try:
        yield
    finally:
        for m in layers:
            m.plain = False


def draftable(a: Any) -> bool:
    """A step that is decoding and can take a draft: a token to feed, at least two still to
    make (one drafted, one emitted after the verification), no n-gram drafter."""
    return (
        not a.done
        and not a.is_feed
        and a.verify is None
        and a.drafter is None
        and len(a.pending) == 1
        and bool(a.tokens)
        and a.call.k - len(a.tokens) - 1 >= 1
    )


@torch.inference_mode()
def draft_round(model, steps: Sequence[Any], m: int, eos_token_id: int | None) -> float:
    """Draft up to ``m`` tokens for each of ``steps`` (:func:`draftable` ones) with plain
    forwards over all of them at once; set each step's ``pending``/``verify`` to its window.
    Returns the seconds spent in the forwards (a GPU synchronised after the last one)."""
    lens = [len(a.session.kv) for a in steps]
    budget = [min(m, a.call.k - len(a.tokens) - 1) for a in steps]
    cur = [a.pending[0] for a in steps]
    drafts: list[list[int]] = [[] for _ in steps]
    live = list(range(len(steps)))
    t0 = time.perf_counter()
    with plain_kernels(model):
        while live:
            logits = packed_forward(model, [(steps[i].session.kv, [cur[i]]) for i in live])
            masked = [j for j, i in enumerate(live) if steps[i].call.ignore_eos]
            preds = greedy_tokens(logits, eos_token_id, masked)  # one transfer per draft forward
            nxt = []
            for j, i in enumerate(live):
                steps[i].forward_passes += 1
                if eos_token_id is not None and preds[j] == eos_token_id:
                    continue  # the draft ends before an end of sequence; the verification decides
                drafts[i].append(preds[j])
                cur[i] = preds[j]
                if len(drafts[i]) < budget[i]:
                    nxt.append(i)
            live = nxt
    seconds = time.perf_counter() - t0
    for a, n, d in zip(steps, lens, drafts):
        a.session.kv.crop(n)  # the draft's KV goes; the verification writes the window's own
        if d:
            a.pending, a.verify = [a.pending[0], *d], d
    return seconds
