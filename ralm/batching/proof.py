"""A whole-model proof of batch and chunk invariance, run before batching is turned on.

Continuous batching and KV sessions keep the exactness contract only if a sequence's
logits and KV are the same bits alone as packed with others, prefilled in one pass as in
chunks, and decoded one token at a time as when several drafted tokens are verified in one
forward. Whether that holds is a property of the kernels the machine runs, not of the
design: on an H200, single linear layers passed a probe at a few rows while whole batched
answers differed (cuBLAS switched kernels at 64 rows in bfloat16; the attention's batched
products and the norms' reductions changed with shape too). So the engine proves the
**whole model**, on its own device and dtype, at the shapes it will run, through the same
:func:`~ralm.batching.packed.packed_forward` the batcher uses:

1. *packed vs alone*: random sequences of mixed lengths are prefilled and decoded one token
   alone (the reference), then again packed ``b`` at a time for ``b`` = 2, 3, 5, 8, 16, 32
   and ``batch_max_sequences``, their prefills in forwards of up to ``batch_token_budget``
   tokens, the decode tokens of all ``b`` in one forward next to one larger prefill chunk
   (the rest of the token budget). Every sequence's logits and KV must equal the reference;
2. *chunked vs one pass*: a long sequence prefilled in one pass, and in chunks of 37 tokens
   and then token by token: the last logits and the KV must be equal;
3. *drafted vs one at a time*: ``k + 1`` tokens fed in one forward (logits at each row, as a
   drafted verification does, alone and packed with decode tokens) must give the logits of
   feeding them one at a time;
4. *the KV pool vs alone* (the serving default, ``generator.kv_pool``): sequences paged in
   one pool that fork a document's KV (sharing its blocks, the partly filled last one
   copied on write) are prefilled together, then decoded next to a drafted window and a
   KNN-LM feed (final hidden states at its row) in one forward; where the model's positions
   allow, a sequence past position 2,048 is decoded in the same forward. Logits, hidden
   states and every layer's KV must equal sequences in pools of their own, run alone.

Any difference refuses batching, with a reason naming the first check that failed and
the largest logit difference seen there. Worked example: on a machine whose GEMM changes a
row's bits above 24 rows, every check at 2-16 sequences passes, the 32-sequence packed
decode differs (``max |dlogit| 3e-07``), and the engine serves one step at a time.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ralm import constants as C
from ralm.batching.attention_backend import attention_backend
from ralm.batching.kv_pool import KVPool, layer_devices
from ralm.batching.packed import model_max_positions, packed_forward
from ralm.batching.paged_kv import PagedKV
from ralm.batching.proof_cache import load_verdict, proof_key, store_verdict


@dataclass
class InvarianceProof:
    """The verdict of :func:`prove_invariance`: ``ok``, and else the first failing check."""

    ok: bool
    reason: str | None
    checks: list[str] = field(default_factory=list)  # the checks that passed, in order
    comparisons: int = 0  # logit rows and KV tensors compared bit for bit
    forwards: int = 0
    seconds: float = 0.0
    device: str = ""
    dtype: str = ""
    reused: bool = False  # the verdict of an earlier proof of this very model object (same shapes)
    cached: bool = False  # a passed verdict kept on disk by an earlier load (ralm.batching.proof_cache)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "checks": list(self.checks),
            "comparisons": self.comparisons,
            "forwards": self.forwards,
            "seconds": round(self.seconds, 3),
            "device": self.device,
            "dtype": self.dtype,
            "reused": self.reused,
            "cached": self.cached,
        }


class _Mismatch(Exception):
    def __init__(self, what: str, diff: float):
        super().__init__(what)
        self.what, self.diff = what, diff


class _Prover:
    def __init__(self, model, max_sequences: int, token_budget: int, seed: int):
        self.model = model
        self.n_layers = int(model.config.num_hidden_layers)
        self.vocab = int(model.config.vocab_size)
        self.max_sequences = max(1, int(max_sequences))
        self.token_budget = max(2, int(token_budget))
        self.rng = random.Random(seed)
        self.comparisons = 0
        self.forwards = 0
        self.max_positions = model_max_positions(model.config)
        self.devices = layer_devices(model)
        self.value_ones = attention_backend(model).value_ones

    def own(self) -> PagedKV:
        """A sequence in a pool of its own (the references, and the checks without the shared pool)."""
        return PagedKV.standalone(self.n_layers, self.devices, self.value_ones)

    # ------------------------------------------------------------------ helpers
    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(n)]

    def forward(self, chunks, rows=None, with_hidden: bool = False):
        self.forwards += 1
        if with_hidden:
            return packed_forward(self.model, chunks, rows, with_hidden=True)
        return packed_forward(self.model, chunks, rows)

    def prefill(self, kv, toks: Sequence[int]) -> torch.Tensor:
        """Feed ``toks`` in chunks of at most the token budget (as the engine does); the last
        token's logits."""
        out = None
        for s in range(0, len(toks), self.token_budget):
            out = self.forward([(kv, list(toks[s : s + self.token_budget]))])[0]
        assert out is not None
        return out

    def equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        self.comparisons += 1
        if not torch.equal(got, want):
            diff = float((got.float() - want.float()).abs().max()) if got.shape == want.shape else float("inf")
            raise _Mismatch(what, diff)

    def equal_kv(self, got: PagedKV, want: PagedKV, what: str) -> None:
        if len(got) != len(want):
            raise _Mismatch(f"{what}: KV length {len(got)} != {len(want)}", float("inf"))
        n = len(want)
        span = -(-n // C.INVARIANT_KEY_BLOCK) * C.INVARIANT_KEY_BLOCK
        for layer in range(self.n_layers):
            wk, wv = want.span(layer, span)
            gk, gv = got.span(layer, span)
            D = wk.shape[-1]
            self.equal(gk[:, :n], wk[:, :n], f"{what}: keys of layer {layer}")
            self.equal(gv[:, :n, :D], wv[:, :n, :D], f"{what}: values of layer {layer}")

    def alone(self, ctx: Sequence[int], nxt: int) -> tuple[torch.Tensor, torch.Tensor, PagedKV]:
        """The reference: ``ctx`` prefilled in one pass, then ``nxt`` decoded, alone."""
        kv = self.own()
        pre = self.forward([(kv, list(ctx))])[0]
        dec = self.forward([(kv, [nxt])])[0]
        return pre, dec, kv

    # ------------------------------------------------------------------ checks
    def packed_vs_alone(self, checks: list[str]) -> None:
        n = self.max_sequences
        # mixed lengths whose sum fills about one token budget (at least 1, at most 48 each)
        mean = max(1, min(48, self.token_budget // n))
        limit = max(1, min(2 * mean, self.max_positions // 4))
        ctxs = [self.tokens(self.rng.randint(1, limit)) for _ in range(n)]
        nxts = self.tokens(n)
        ref = [self.alone(c, t) for c, t in zip(ctxs, nxts)]
        sizes = sorted({b for b in (2, 3, 5, 8, 16, 32) if b < n} | {n})
        for b in sizes:
            start = (7 * b) % n  # another first sequence at every size: rows move
            idx = [(start + j) % n for j in range(b)]
            kvs = {i: self.own() for i in idx}
            # prefills, packed in forwards of up to token_budget tokens (a longer one is chunked
            # as the engine does: its last chunk carries the logits)
            pending = [(i, list(ctxs[i])) for i in idx]
            while pending:
                chunks: list[tuple[PagedKV, list[int]]] = []
                owners: list[tuple[int, bool]] = []
                budget = self.token_budget
                while pending and budget > 0 and len(chunks) < self.max_sequences:
                    i, toks = pending[0]
                    take = toks[:budget]
                    chunks.append((kvs[i], take))
                    owners.append((i, len(take) == len(toks)))
                    budget -= len(take)
                    if len(take) == len(toks):
                        pending.pop(0)
                    else:
                        pending[0] = (i, toks[len(take) :])
                logits = self.forward(chunks)
                for row, (i, last) in enumerate(owners):
                    if last:
                        self.equal(logits[row], ref[i][0], f"prefill logits of a sequence packed with {b - 1} others")
            # the decode tokens of all b, then one larger prefill chunk of a fresh sequence
            room = min(self.token_budget - b, self.max_positions // 2)
            extra = self.tokens(room) if room > 0 and b < self.max_sequences else []
            chunks = [(kvs[i], [nxts[i]]) for i in idx]
            extra_kv = self.own()
            if extra:
                chunks.append((extra_kv, extra))
            logits = self.forward(chunks)
            for row, i in enumerate(idx):
                self.equal(logits[row], ref[i][1], f"decode logits of a sequence packed with {b - 1} others")
                self.equal_kv(kvs[i], ref[i][2], f"the KV of a sequence packed with {b - 1} others")
            if extra:
                solo = self.own()
                want = self.forward([(solo, extra)])[0]
                self.equal(logits[b], want, f"a {len(extra)}-token prefill chunk packed with {b} decode tokens")
                self.equal_kv(extra_kv, solo, f"the KV of a {len(extra)}-token prefill packed with {b} decode tokens")
            checks.append(f"packed x{b}")

    def chunked_vs_one_pass(self, checks: list[str]) -> None:
        n = max(2, min(self.token_budget, self.max_positions // 2))
        toks = self.tokens(n)
        one = self.own()
        want = self.forward([(one, toks)])[0]
        chunked = self.own()
        tail = min(3, n - 1)  # the last tokens one at a time, as decode steps
        body = toks[: n - tail]
        for s in range(0, len(body), C.PROOF_PREFILL_CHUNK):
            self.forward([(chunked, body[s : s + C.PROOF_PREFILL_CHUNK])])
        got = None
        for t in toks[n - tail :]:
            got = self.forward([(chunked, [t])])[0]
        assert got is not None
        self.equal(got, want, f"a {n}-token prefill in chunks of {C.PROOF_PREFILL_CHUNK} vs one pass")
        self.equal_kv(chunked, one, f"the KV of a {n}-token prefill in chunks vs one pass")
        checks.append(f"chunked prefill ({n} tokens)")

    def drafted_vs_one_at_a_time(self, checks: list[str]) -> None:
        k1 = C.PROOF_DRAFT_TOKENS
        ctx, draft = self.tokens(self.rng.randint(5, 40)), self.tokens(k1)
        one = self.own()
        self.forward([(one, ctx)])
        want = torch.stack([self.forward([(one, [t])])[0] for t in draft])
        for neighbours in (0, min(7, self.max_sequences - 1)):
            kv = self.own()
            self.forward([(kv, ctx)])
            others = []
            for _ in range(neighbours):
                o = self.own()
                self.forward([(o, self.tokens(self.rng.randint(1, 20)))])
                others.append((o, self.tokens(1)))
            # the drafted chunk first, logits at every one of its rows, then each neighbour's
            rows = list(range(k1 + neighbours))
            got = self.forward([(kv, draft), *others], rows)[:k1]
            self.equal(
                got,
                want,
                f"{k1} drafted tokens verified in one forward (with {neighbours} decode tokens) vs one at a time",
            )
            self.equal_kv(kv, one, f"the KV of {k1} drafted tokens in one forward vs one at a time")
        checks.append(f"drafted verification ({k1} tokens)")

    def pooled_vs_alone(self, checks: list[str]) -> None:
        """Check 4: the KV pool with forks, copy on write, a drafted window, a KNN-LM feed and
        (where the model allows) a position past 2,048, against sequences alone in pools of their own."""
        k1 = C.PROOF_DRAFT_TOKENS
        if self.max_sequences < 5 or self.token_budget < k1 + 6:
            return  # the engine never packs the check's decode forward (5 sequences, k1 + 5 tokens)
        pool = KVPool.for_model(self.model, devices=self.devices)
        doc = self.tokens(max(2, min(C.INVARIANT_KEY_BLOCK + 27, self.max_positions // 4)))  # a partial last block
        ctxs = [self.tokens(self.rng.randint(1, max(1, min(12, self.token_budget // 4)))) for _ in range(3)]
        nxts, draft = self.tokens(3), self.tokens(k1)
        # the references, alone in their own buffers
        refs = []
        for i, (c, t) in enumerate(zip(ctxs, nxts)):
            kv = self.own()
            pre = self.prefill(kv, doc + c)
            if i == 2:  # the drafted window: logits at every one of its rows
                dec = self.forward([(kv, [t, *draft])], list(range(k1 + 1)))
            else:
                dec = self.forward([(kv, [t])])[0]
            refs.append((pre, dec, kv))
        feed_ctx, feed_next = self.tokens(self.rng.randint(2, 20)), self.tokens(1)
        feed_ref = self.own()
        self.prefill(feed_ref, feed_ctx)
        feed_logits, feed_hidden = self.forward([(feed_ref, feed_next)], with_hidden=True)
        long_len = 2 * 1024 + 40
        long_ref = None
        if long_len + 2 <= self.max_positions:
            long_toks = self.tokens(long_len + 1)
            long_ref = self.own()
            self.prefill(long_ref, long_toks[:long_len])
            long_want = self.forward([(long_ref, long_toks[long_len:])])[0]
        # the pooled run: a document forked three times, prefilled together
        held: list[PagedKV] = []

        def paged() -> PagedKV:
            held.append(PagedKV(pool))
            return held[-1]

        try:
            base = paged()
            self.prefill(base, doc)
            forks = [base.fork() for _ in ctxs]
            held += forks
            logits = self.forward([(f, c) for f, c in zip(forks, ctxs)])
            for row, r in enumerate(refs):
                self.equal(logits[row], r[0], "the prefill logits of a pooled fork of a document")
            feed = paged()
            self.prefill(feed, feed_ctx)
            chunks = [(forks[0], [nxts[0]]), (forks[1], [nxts[1]]), (forks[2], [nxts[2], *draft]), (feed, feed_next)]
            rows = [0, 1, *range(2, 3 + k1), 3 + k1]
            long_kv = None
            if long_ref is not None:
                long_kv = paged()
                self.prefill(long_kv, long_toks[:long_len])
                chunks.append((long_kv, long_toks[long_len:]))
                rows.append(rows[-1] + 1)
            logits, hidden = self.forward(chunks, rows, with_hidden=True)
            self.equal(logits[0], refs[0][1], "pooled decode logits next to a drafted window and a feed")
            self.equal(logits[1], refs[1][1], "pooled decode logits next to a drafted window and a feed")
            self.equal(logits[2 : 3 + k1], refs[2][1], f"a pooled drafted window of {k1} tokens")
            self.equal(logits[3 + k1], feed_logits[0], "the logits of a KNN-LM feed next to pooled steps")
            self.equal(hidden[3 + k1], feed_hidden[0], "the hidden state of a KNN-LM feed next to pooled steps")
            if long_kv is not None and long_ref is not None:
                self.equal(logits[4 + k1], long_want, f"a pooled decode at position {long_len}")
                self.equal_kv(long_kv, long_ref, f"the pooled KV of a {long_len + 1}-position sequence")
            for f, r in zip(forks, refs):
                self.equal_kv(f, r[2], "the pooled KV of a fork of a document")
            self.equal_kv(feed, feed_ref, "the pooled KV of a KNN-LM feed")
        finally:
            for pooled in held:
                pooled.free()
        checks.append("kv pool: forks, drafted window, feed" + (f", position {long_len}" if long_ref else ""))


def prove_invariance(
    model,
    max_sequences: int = C.BATCH_MAX_SEQUENCES,
    token_budget: int = C.BATCH_TOKEN_BUDGET,
    seed: int = C.PROOF_SEED,
    cache_dir: Path | None = None,
) -> InvarianceProof:
    """Prove that ``model`` (rewritten by :func:`~ralm.batching.invariant.make_invariant`)
    gives every sequence the same logits and KV bits packed as alone, chunked as in one
    pass, and drafted as one token at a time, at up to ``max_sequences`` sequences and
    ``token_budget`` tokens per forward. Never raises for a mismatch: the verdict says why.

    The verdict is kept on the model object: another engine over the same model (same
    budget, sequences, seed and torch thread count) gets it back (``reused``) instead of
    running the proof again. With ``cache_dir``, a passed verdict is also kept on disk under a
    key of the weights, shapes, kernels, software and machine, and a later process with the
    same key takes it back (``cached``) (:mod:`ralm.batching.proof_cache`).
    """
    key = (int(max_sequences), int(token_budget), int(seed), torch.get_num_threads())
    memo: dict = model.__dict__.setdefault("_ralm_proofs", {})
    if key in memo:
        return dataclasses.replace(memo[key], reused=True)
    disk_key = None
    if cache_dir is not None:
        disk_key = proof_key(model, max_sequences, token_budget, seed)
        kept = load_verdict(cache_dir, disk_key)
        if kept is not None:
            fields = {f.name for f in dataclasses.fields(InvarianceProof)}
            memo[key] = proof = InvarianceProof(**{**{k: v for k, v in kept.items() if k in fields}, "cached": True})
            return proof
    p = next(model.parameters())
    t0 = time.perf_counter()
    prover = _Prover(model, max_sequences, token_budget, seed)
    checks: list[str] = []
    reason = None
    try:
        with torch.inference_mode():
            prover.chunked_vs_one_pass(checks)
            prover.drafted_vs_one_at_a_time(checks)
            prover.pooled_vs_alone(checks)
            prover.packed_vs_alone(checks)
    except _Mismatch as m:
        reason = (
            f"the whole-model invariance proof failed on {p.device} in {str(p.dtype).removeprefix('torch.')}: "
            f"{m.what} differs (max |difference| {m.diff:.3g})"
        )
    except Exception as e:  # a kernel that cannot run a shape, a placement it does not handle, ...
        reason = (
            f"the whole-model invariance proof could not run on {p.device} in "
            f"{str(p.dtype).removeprefix('torch.')}: {type(e).__name__}: {e}"
        )
    memo[key] = proof = InvarianceProof(
        reason is None,
        reason,
        checks,
        prover.comparisons,
        prover.forwards,
        time.perf_counter() - t0,
        str(p.device),
        str(p.dtype).removeprefix("torch."),
    )
    if cache_dir is not None and disk_key is not None:
        store_verdict(cache_dir, disk_key, proof.as_dict(), model)
    return proof
