"""Packed forwards, KV sessions, batched steps and the continuous batcher: every output
equals the one the step gives alone, recomputed from scratch."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ralm.batching.engine import StepCall, event_span_s
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV
from ralm.batching.sessions import Session, SessionStore
from ralm.errors import RalmInputError
from ralm.step_request import StepRequest
from tests.factories import tiny_engine

pytestmark = pytest.mark.unit


@torch.inference_mode()
def test_packed_batches_of_2_to_32_equal_each_sequence_alone(family_model):
    family, model = family_model
    rng = random.Random(11)
    L = model.config.num_hidden_layers
    seqs = [[rng.randrange(1, 290) for _ in range(rng.randint(3, 90))] for _ in range(32)]
    alone = [model(input_ids=torch.tensor([s])).logits[0] for s in seqs]
    for n_batch in (2, 5, 32):
        order = rng.sample(range(32), n_batch)  # sequences at random positions of the batch
        kvs = {i: PagedKV.standalone(L) for i in order}
        done = dict.fromkeys(order, 0)
        got: dict[int, list] = {i: [] for i in order}
        while any(done[i] < len(seqs[i]) for i in order):
            live = [i for i in order if done[i] < len(seqs[i])]
            rng.shuffle(live)
            chunks, rows, spans, off = [], [], [], 0
            for i in live[: rng.randint(1, len(live))]:
                n = min(rng.choice([1, 1, 2, 7, 33]), len(seqs[i]) - done[i])  # mixed prefill/decode
                chunks.append((kvs[i], seqs[i][done[i] : done[i] + n]))
                rows.extend(range(off, off + n))
                spans.append((i, n))
                off += n
            logits = packed_forward(model, chunks, rows)
            r = 0
            for i, n in spans:
                got[i].append(logits[r : r + n])
                r, done[i] = r + n, done[i] + n
        for i in order:
            assert torch.equal(torch.cat(got[i]), alone[i]), (family, n_batch, i)


def test_session_store_takes_the_longest_common_prefix_and_evicts_by_bytes():
    kv = PagedKV.standalone(1)
    kv.append(0, torch.zeros(1, 10, 4), torch.zeros(1, 10, 4))
    size = kv.nbytes
    store = SessionStore(capacity_bytes=3 * size)
    store.put(Session((("d",),), 2, [1, 2, 3], kv, owner="a"))
    store.put(Session((("d",),), 2, [1, 2, 9, 9], _kv(), owner="b"))
    s, n = store.take((("d",),), [1, 2, 9, 5])
    assert (s.owner, n) == ("b", 3)
    assert store.take((("other",),), [1]) == (None, 0)
    store.put(s)
    store.put(Session((("e",),), 0, [4], _kv(), owner="a"))
    store.put(Session((("f",),), 0, [4], _kv(), owner="c"))  # over budget: the oldest goes
    assert store.stats.evictions == 1 and store.stats.bytes_used <= 3 * size
    assert store.release("a") == 1 and store.held("a") == 0 and store.held("c") == 1
    assert SessionStore(0).take((), [1]) == (None, 0)


def _kv():
    kv = PagedKV.standalone(1)
    kv.append(0, torch.zeros(1, 10, 4), torch.zeros(1, 10, 4))
    return kv


@pytest.fixture(scope="module")
def engines():
    """Two engines over one model: with KV sessions, and recomputing every step."""
    with_sessions = tiny_engine("llama", seed=4)
    without = type(with_sessions)(
        with_sessions.model, with_sessions.tokenizer, with_sessions.cfg.model_copy(update={"kv_session_bytes": 0})
    )
    return with_sessions, without


DOCS = [
    "shutil.copytree copies a whole directory tree.",
    "json.dumps serialises an object to a JSON string.",
    "os.path.join joins path components.",
]


def test_session_reuse_equals_recompute_through_rollbacks_and_document_switches(engines):
    fast, slow = engines
    rng = random.Random(5)
    from ralm.results import RequestStats

    ctx = fast.encode_question("how do I copy files?")
    reused = 0
    stats = RequestStats()
    for _ in range(25):
        docs = [rng.choice(DOCS)] if rng.random() < 0.8 else [DOCS[0], DOCS[2]]
        if rng.random() < 0.25 and len(ctx) > 6:  # a rollback: drop some generated tokens
            ctx = ctx[: rng.randint(5, len(ctx) - 1)]
        a = fast.step(docs, ctx, 4, owner="req")
        b = slow.step(docs, ctx, 4)
        assert (a.tokens, a.eos) == (b.tokens, b.eos)
        reused += a.context_reused
        stats.record_step(a)
        assert b.context_reused == 0 and b.context_computed == len(ctx)
        ctx = ctx + a.tokens if not a.eos else ctx + [rng.randrange(5, 50)]
    assert reused > 0  # sessions were actually reused
    assert stats.context_tokens_reused == reused > 0 and stats.context_tokens_computed > 0  # up to the response
    assert fast.release("req") >= 1 and fast.release("req") == 0


def test_steps_submitted_together_equal_each_step_alone(engines):
    fast, slow = engines
    rng = random.Random(9)
    calls = []
    for i in range(20):
        q = fast.encode_question(f"question number {i} about {rng.choice(['json', 'files', 'paths'])}")
        docs = tuple(rng.sample(DOCS, rng.randint(0, 2)))
        ctx = q + [rng.randrange(5, 60) for _ in range(rng.randint(0, 30))]
        calls.append(StepRequest(tuple(ctx), rng.randint(1, 9), doc_texts=docs))
    batched = [f.result() for f in [fast.submit(c) for c in calls]]
    for c, out in zip(calls, batched):
        alone = slow.submit(c).result()
        assert (out.tokens, out.eos) == (alone.tokens, alone.eos)


def test_concurrent_steps_from_threads_are_batched_and_exact(engines):
    fast, slow = engines
    questions = [fast.encode_question(f"tell me about module {i}") for i in range(16)]
    results: dict[int, list[int]] = {}

    def run(i):
        ctx = list(questions[i])
        for _ in range(3):
            ctx += fast.step(DOCS[i % 3], ctx, 5, ignore_eos=True, owner=f"t{i}").tokens
        results[i] = ctx

    before = fast.batcher.iterations
    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(16):
        ctx = list(questions[i])
        for _ in range(3):
            ctx += slow.step(DOCS[i % 3], ctx, 5, ignore_eos=True).tokens
        assert results[i] == ctx
    m = fast.batcher.metrics()
    assert m["max_batch"] > 1  # steps really shared forwards
    assert fast.batcher.iterations - before < 16 * 3 * 5  # fewer forwards than steps x tokens
    assert m["generated_tokens_per_s"] > 0 and sum(m["batch_size_histogram"].values()) == m["iterations"]
    # each iteration's host time: the loop's time outside the forward, measured and reported
    assert 0 < m["forward_s"] <= m["busy_s"] and m["host_s"] > 0
    assert 0 < m["host_share"] < 1
    assert m["host_ms_per_iteration"] == pytest.approx(m["host_s"] * 1e3 / m["iterations"])
    assert 0 < m["host_ms_p50"] <= m["host_ms_p99"]


def test_host_time_is_reported_per_iteration_to_a_hook(engines):
    fast, _ = engines
    seen: list[float] = []
    fast.batcher.on_host_time = seen.append
    try:
        out = fast.step(None, fast.encode_question("how long does the host take?"), 4, ignore_eos=True)
    finally:
        fast.batcher.on_host_time = None
    assert len(out.tokens) == 4
    assert len(seen) >= 4 and all(h >= 0 for h in seen)  # one per iteration (prefill, then decodes)


def test_a_bad_step_fails_alone_and_the_batcher_keeps_serving(engines):
    fast, _ = engines
    bad = fast.batcher.submit(StepCall((), [], 3))
    with pytest.raises(RalmInputError, match="at least one token"):
        bad.result(timeout=30)
    ok = fast.step(None, fast.encode_question("still there?"), 2)
    assert len(ok.tokens) + int(ok.eos) >= 1


def test_without_the_invariant_forward_steps_run_alone_on_a_worker_thread():
    eng = tiny_engine("gpt2", seed=2, invariant=False)
    assert eng.batcher is None
    ctx = tuple(eng.encode_question("plain forward"))
    futures = [eng.submit(StepRequest(ctx, 3)) for _ in range(3)]  # the plain engine still steps
    outs = [f.result(timeout=60) for f in futures]
    assert outs[0].forward_passes >= 1 and all(o.tokens == outs[0].tokens for o in outs)
    with pytest.raises(RalmInputError, match="at least one token"):
        eng.submit(StepRequest((), 3)).result()
    assert eng.submit(StepRequest(ctx, 0)).result().tokens == []


def test_knn_feeds_through_the_batcher_equal_a_lone_stepper(engines):
    """KNN-LM's (h, p_lm) from batched feeds, interleaved with other requests' steps, are the
    bits of a plain single-cache stepper on the same invariant model, through crops too."""
    import numpy as np

    from ralm.knnlm.stepper import BatchedKnnStepper, KnnStepper, stepper_for

    fast, _ = engines
    assert isinstance(stepper_for(fast), BatchedKnnStepper)
    ids = fast.encode_question("which module joins paths?")
    a, b = stepper_for(fast), KnnStepper(fast.model)
    other = fast.batcher.submit(StepCall((), fast.encode_question("meanwhile another request"), 8))
    a.prefill(ids)
    b.prefill(ids)
    for t in [7, 9, 11, 13]:
        ha, pa = a.query()
        hb, pb = b.query()
        assert np.array_equal(ha, hb) and np.array_equal(pa, pb)
        a.feed(t)
        b.feed(t)
    a.crop(len(ids) + 2)
    b.crop(len(ids) + 2)
    a.feed(5)
    b.feed(5)
    assert np.array_equal(a.query()[0], b.query()[0]) and np.array_equal(a.query()[1], b.query()[1])
    assert len(other.result(timeout=60).tokens) >= 1


@pytest.mark.parametrize("flare", [None, 0.0045])
def test_batched_ngram_drafting_and_flare_equal_the_single_sequence_loop(engines, flare):
    """n-gram drafting checks several tokens per sequence inside the batched forward; on the
    invariant forward it returns plain greedy decoding's tokens, and it matches the
    single-sequence drafted loop (``drafted_decode``) token for token, FLARE stop included."""
    from ralm.drafting import StepOptions

    fast, _ = engines
    drafted = StepOptions(drafting="ngram", flare_threshold=flare)
    plain = StepOptions(flare_threshold=flare) if flare is not None else None
    rounds = stops = 0
    calls = []
    for i, doc in enumerate(DOCS * 2):
        ctx = fast.encode_question(f"{doc} again {i}")  # the document's words: drafts hit
        docs = [fast.doc_tokens(doc)]
        one = fast.batcher.call(lambda d=docs, c=ctx: fast._step_one(d, c, 12, False, drafted)).result()
        calls.append(StepRequest(tuple(ctx), 12, doc_texts=(doc,), options=drafted))
        ref = fast.step(doc, ctx, 12, options=plain)
        assert (one.tokens, one.eos, one.low_confidence) == (ref.tokens, ref.eos, ref.low_confidence)
        got = fast.step(doc, ctx, 12, options=drafted)
        assert (got.tokens, got.eos, got.low_confidence) == (ref.tokens, ref.eos, ref.low_confidence)
        rounds += got.draft_rounds
        stops += got.low_confidence
    if flare is None:
        assert rounds > 0 and stops == 0  # drafts were really checked in batched forwards
    else:
        assert stops > 0  # FLARE really stopped steps (this random model's top probabilities are below 0.0045)
    together = [f.result() for f in [fast.submit(c) for c in calls]]  # all drafted steps in shared forwards
    for c, out in zip(calls, together):
        alone = fast.submit(c).result()
        assert (out.tokens, out.eos) == (alone.tokens, alone.eos)


def test_the_forward_timer_never_reads_an_unfinished_cuda_event():
    """An iteration in which no row emits has no synchronisation: its end event may not have
    completed, and ``elapsed_time`` would raise "device not ready". The timer falls back to the
    host's time then. (CUDA events stand in as objects with their two methods: no GPU here.)"""

    class Event:
        def __init__(self, done: bool):
            self.done = done

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end) -> float:
            if not end.done:
                raise RuntimeError("device not ready")
            return 12.0  # ms

    assert event_span_s((Event(True), Event(False)), 0.5) == 0.5
    assert event_span_s((Event(True), Event(True)), 0.5) == pytest.approx(0.012)
