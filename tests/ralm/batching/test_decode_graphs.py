"""The decode iterations' fixed layout (ralm.batching.decode_graphs), run on a CPU.

A CUDA graph cannot be captured without a GPU (the GPU check, ``ralmspec gpu-check``,
replays real graphs). Here ``replay="eager"`` runs everything else: the sequences padded to
a bucket with scratch rows, the block tables padded to a width bucket, the metadata copied
into the buffer the bucket was captured with, and the forward run again *with the batch it
was captured with*, reading only that buffer, as a graph replay would. A forward that read
anything of the iteration from Python instead of the buffer would give the captured
iteration's tokens and fail these comparisons. The kernels are the Triton ones, in triton's
interpreter (``TRITON_INTERPRET=1``, set by the test suite's conftest before triton loads).
"""

from __future__ import annotations

import random

import pytest
import torch

from ralm import constants as C
from ralm.batching.decode_graphs import DecodeGraphs, seq_bucket, width_bucket
from ralm.batching.engine import BatchEngine, StepCall
from ralm.batching.invariant import make_invariant
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV
from ralm.batching.sessions import SessionStore
from tests.factories import tiny_causal_lm


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def triton_model(request):
    from ralm.batching import triton_kernels as T

    assert T.triton_available(), "triton is a dev dependency (pip install -e '.[dev]')"
    return make_invariant(tiny_causal_lm(request.param, vocab_size=300, eos_token_id=0, seed=3), kernels="triton")


def test_buckets():
    assert [seq_bucket(n) for n in (1, 3, 5, 17, 64, 65)] == [1, 4, 8, 24, 64, 96]
    assert seq_bucket(10_000) is None
    assert [width_bucket(n) for n in (1, 4, 5, 9, 33)] == [4, 4, 8, 16, 64]


def _prefilled(model, pool, lengths, seed):
    rng = random.Random(seed)
    kvs = []
    for n in lengths:
        kv = PagedKV(pool)
        packed_forward(model, [(kv, [rng.randrange(1, 299) for _ in range(n)])], [])
        kvs.append(kv)
    return kvs


@torch.inference_mode()
def test_a_replayed_decode_iteration_is_the_eager_one_bit_for_bit(triton_model, monkeypatch):
    """Decode iterations through the runner equal eager ones on twin sequences, across a
    block boundary that is also a width bucket boundary (64 -> 65 positions: 1 -> 2 blocks,
    tables of width 1 from at least 1), a change of bucket (5 sequences, then 3), and a growth
    of the pool (which drops every graph)."""
    monkeypatch.setattr(C, "DECODE_GRAPH_MIN_BLOCKS", 1)  # a short sequence crosses a width bucket
    model = triton_model
    lengths = [3, 60, 62, 20, 30]
    pool_g = KVPool.for_model(model, initial_blocks=16)
    pool_e = KVPool.for_model(model, initial_blocks=16)
    graphed, eager = _prefilled(model, pool_g, lengths, 1), _prefilled(model, pool_e, lengths, 1)
    graphs = DecodeGraphs(model, pool_g, replay="eager")
    rng = random.Random(2)
    for it in range(6):
        toks = [rng.randrange(1, 299) for _ in lengths]
        n = 5 if it < 4 else 3  # then a smaller bucket
        got = graphs.forward([(kv, [t]) for kv, t in zip(graphed[:n], toks)], range(n))
        want = packed_forward(model, [(kv, [t]) for kv, t in zip(eager[:n], toks)])
        assert got is not None and got.shape == want.shape
        assert torch.equal(got, want), it
    assert [len(kv) for kv in graphed] == [len(kv) for kv in eager] == [9, 66, 68, 24, 34]
    # buckets met: (8, 1) twice, (8, 2) twice once the 62-position sequence passed 64, (4, 2) twice
    assert graphs.captures == 3 and graphs.replays == 3, graphs.stats()
    scratch = graphs._scratch.table[0]
    assert all(scratch not in kv.table for kv in graphed)
    # more blocks than the pool holds: it grows, its tensors move, every graph is dropped
    held = pool_g.allocate(len(pool_g._free) + 1)
    assert pool_g.grows == 1
    before = graphs.captures
    got = graphs.forward([(graphed[0], [7]), (graphed[1], [8])], range(2))
    want = packed_forward(model, [(eager[0], [7]), (eager[1], [8])])
    assert torch.equal(got, want)
    assert graphs.captures == before + 1 and graphs.stats()["graphs"] == 1
    pool_g.decref(held)
    free = len(pool_g._free)
    graphs.close()
    assert len(pool_g._free) == free + 1  # the scratch block went back


@torch.inference_mode()
def test_iterations_a_graph_does_not_replay_are_left_to_the_eager_forward(triton_model):
    model = triton_model
    pool = KVPool.for_model(model)
    kvs = _prefilled(model, pool, [5, 9], 4)
    graphs = DecodeGraphs(model, pool, replay="eager")
    assert graphs.forward([(kvs[0], [1, 2]), (kvs[1], [3])], [1, 2]) is None  # a chunk of two tokens
    assert graphs.forward([(kvs[0], [1]), (kvs[1], [3])], [1]) is None  # not every row's logits
    other = PagedKV(KVPool.for_model(model))
    packed_forward(model, [(other, [4, 5])], [])
    assert graphs.forward([(kvs[0], [1]), (other, [3])], [0, 1]) is None  # another pool
    assert graphs.captures == 0 and [len(kv) for kv in kvs] == [5, 9]


def _run(engine: BatchEngine, calls: list[StepCall]) -> list[tuple[list[int], bool]]:
    active = [engine.start(c) for c in calls]
    while not all(a.done for a in active):
        engine.iterate([a for a in active if not a.done])
    return [(o.tokens, o.eos) for o in (engine.finish(a) for a in active)]


@pytest.fixture(scope="module")
def triton_llama():
    return make_invariant(tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3), kernels="triton")


@torch.inference_mode()
def test_the_batched_engine_with_decode_graphs_returns_the_same_tokens(triton_llama):
    """Steps of several lengths through the engine, with decode iterations replayed and
    without: the same tokens, and the replays did happen (mixed iterations stay eager).
    One family: the layout was checked on both above."""
    model = triton_llama
    rng = random.Random(7)
    calls = [
        StepCall((), [rng.randrange(1, 299) for _ in range(rng.randint(1, 70))], rng.randint(3, 8), ignore_eos=True)
        for _ in range(5)
    ]

    def engine(graphs: bool) -> BatchEngine:
        pool = KVPool.for_model(model)
        return BatchEngine(
            model,
            0,
            lambda docs: (None, None),
            SessionStore(0),
            pool=pool,
            graphs=DecodeGraphs(model, pool, replay="eager") if graphs else None,
        )

    with_graphs = engine(True)
    got = _run(with_graphs, calls)
    assert got == _run(engine(False), calls)
    assert with_graphs.graphs is not None and with_graphs.graphs.replays > 0, with_graphs.graphs.stats()
    assert all(len(toks) == c.k for (toks, _), c in zip(got, calls))


def test_the_forward_benchmark_times_the_replayed_forward_and_checks_its_bits(triton_model):
    """``forward_cost(graphs=...)`` (the GPU check's ``forward`` section): every rep's
    replayed logits equal the eager forward's of the same rep."""
    from cluster.bench.batch_bench import forward_cost

    plain = tiny_causal_lm("llama" if hasattr(triton_model, "model") else "gpt2", 300, 0, seed=3)
    r = forward_cost(plain, triton_model, 10, 1, (2,), graphs="eager")["batch2"]
    assert r["graph_identical"] == "3/3" and r["graph_ms"] > 0
    assert (r["graph_stats"]["captures"], r["graph_stats"]["replays"]) == (1, 2)
