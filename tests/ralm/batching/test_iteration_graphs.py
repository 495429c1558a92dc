"""The batched iterations' fixed layouts (ralm.batching.iteration_graphs), run on a CPU.

A CUDA graph cannot be captured without a GPU (the GPU check, ``ralmspec gpu-check``,
replays real graphs). Here ``replay="eager"`` runs everything else: the rows padded to a
bucket with a scratch sequence, the kept rows, tables and tiles padded to theirs, the
metadata copied into the buffer the layout was captured with, and the forward run again *with the batch it
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
from ralm.batching.engine import BatchEngine, StepCall
from ralm.batching.invariant import make_invariant
from ralm.batching.iteration_graphs import IterationGraphs, bucket, width_bucket
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


@pytest.fixture(scope="module")
def triton_llama():
    return make_invariant(tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3), kernels="triton")


def test_buckets():
    assert [bucket(n) for n in (1, 3, 5, 17, 64, 65, 500)] == [1, 4, 8, 24, 64, 96, 512]
    assert bucket(513) is None
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
def test_a_replayed_decode_iteration_is_the_eager_one_bit_for_bit(triton_llama, monkeypatch):
    """Decode iterations through the runner equal eager ones on twin sequences, across a
    block boundary that is also a width bucket boundary (64 -> 65 positions: 1 -> 2 blocks,
    tables of width 1 from at least 1), a change of bucket (5 sequences, then 3), and a growth
    of the pool (which drops every graph)."""
    monkeypatch.setattr(C, "GRAPH_MIN_BLOCKS", 1)  # a short sequence crosses a width bucket
    model = triton_llama
    lengths = [3, 60, 62, 20, 30]
    pool_g = KVPool.for_model(model, initial_blocks=16)
    pool_e = KVPool.for_model(model, initial_blocks=16)
    graphed, eager = _prefilled(model, pool_g, lengths, 1), _prefilled(model, pool_e, lengths, 1)
    graphs = IterationGraphs(model, pool_g, replay="eager")
    rng = random.Random(2)
    for it in range(6):
        toks = [rng.randrange(1, 299) for _ in lengths]
        n = 5 if it < 4 else 3  # then a smaller bucket
        got = graphs.forward([(kv, [t]) for kv, t in zip(graphed[:n], toks)], range(n))
        want = packed_forward(model, [(kv, [t]) for kv, t in zip(eager[:n], toks)])
        assert got is not None and got.shape == want.shape
        assert torch.equal(got, want), it
    assert [len(kv) for kv in graphed] == [len(kv) for kv in eager] == [9, 66, 68, 24, 34]
    # layouts met (rows, logit rows, table rows, width): (8, 8, 8, 1) twice, (8, 8, 8, 2) twice
    # once the 62-position sequence passed 64, (4, 4, 4, 2) twice
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
    assert len(pool_g._free) == free + -(-C.GRAPH_BUCKETS[-1] // pool_g.block_size)  # the scratch blocks went back


@torch.inference_mode()
def test_iterations_with_prefill_chunks_and_drafted_windows_replay_the_eager_bits(triton_model):
    """Mixed iterations (a prefill chunk next to decode tokens, a drafted window whose every
    row keeps its logits, a chunk that keeps none) through the runner equal eager ones on twin
    sequences, and a repeated shape replays its graph."""
    model = triton_model
    pool_g, pool_e = KVPool.for_model(model), KVPool.for_model(model)
    graphed, eager = _prefilled(model, pool_g, [5, 40, 9], 5), _prefilled(model, pool_e, [5, 40, 9], 5)
    graphs = IterationGraphs(model, pool_g, replay="eager")
    rng = random.Random(6)

    def tokens(n):
        return [rng.randrange(1, 299) for _ in range(n)]

    shapes = [  # (sequence, tokens) per chunk, and the kept rows
        ([(0, 1), (1, 20), (2, 1)], [0, 20, 21]),
        ([(0, 1), (1, 20), (2, 1)], [0, 20, 21]),
        ([(0, 5), (1, 1)], [0, 1, 2, 3, 4, 5]),
        ([(2, 10)], []),
        ([(0, 5), (1, 1)], [0, 1, 2, 3, 4, 5]),
    ]
    for it, (chunks, rows) in enumerate(shapes):
        toks = [tokens(n) for _, n in chunks]
        got = graphs.forward([(graphed[i], t) for (i, _), t in zip(chunks, toks)], rows)
        want = packed_forward(model, [(eager[i], t) for (i, _), t in zip(chunks, toks)], rows)
        assert got is not None and got.shape == want.shape == (len(rows), 300), it
        assert torch.equal(got, want), it
    assert [len(kv) for kv in graphed] == [len(kv) for kv in eager] == [17, 82, 21]
    assert graphs.replays == 2 and graphs.captures == 3, graphs.stats()
    # the kernels read keys only up to each row's position: the scratch rows' blocks stay theirs
    assert all(b not in kv.table for kv in graphed for b in graphs._scratch.table)


@torch.inference_mode()
def test_iterations_a_graph_does_not_replay_are_left_to_the_eager_forward(triton_llama):
    model = triton_llama
    pool = KVPool.for_model(model)
    kvs = _prefilled(model, pool, [5, 9], 4)
    graphs = IterationGraphs(model, pool, replay="eager")
    other = PagedKV(KVPool.for_model(model))
    packed_forward(model, [(other, [4, 5])], [])
    assert graphs.forward([(kvs[0], [1]), (other, [3])], [0, 1]) is None  # another pool
    assert graphs.forward([(kvs[0], [1] * 300), (kvs[1], [2] * 213)], [299]) is None  # past the largest bucket
    assert graphs.captures == 0 and [len(kv) for kv in kvs] == [5, 9]


def _run(engine: BatchEngine, calls: list[StepCall]) -> list[tuple[list[int], bool]]:
    active = [engine.start(c) for c in calls]
    while not all(a.done for a in active):
        engine.iterate([a for a in active if not a.done])
    return [(o.tokens, o.eos) for o in (engine.finish(a) for a in active)]


@torch.inference_mode()
def test_the_batched_engine_with_graphs_returns_the_same_tokens(triton_llama):
    """Steps of several lengths through the engine, with iterations replayed and without: the
    same tokens, and the replays did happen.
    One family: the layout was checked on both above."""
    model = triton_llama
    rng = random.Random(7)
    calls = [
        StepCall((), [rng.randrange(1, 299) for _ in range(rng.randint(1, 40))], rng.randint(3, 6), ignore_eos=True)
        for _ in range(4)
    ]

    def engine(graphs: bool) -> BatchEngine:
        pool = KVPool.for_model(model)
        return BatchEngine(
            model,
            0,
            lambda docs: (None, None),
            SessionStore(0),
            pool=pool,
            graphs=IterationGraphs(model, pool, replay="eager") if graphs else None,
        )

    with_graphs = engine(True)
    iterations: list = []
    with_graphs.on_iteration = iterations.append
    got = _run(with_graphs, calls)
    assert got == _run(engine(False), calls)
    graphs = with_graphs.graphs
    assert graphs is not None and graphs.replays > 0, graphs.stats()
    # every iteration, prefills too, but the first: its forward allocates the pool, eagerly
    assert graphs.replays + graphs.captures == len(iterations) - 1
    assert all(len(toks) == c.k for (toks, _), c in zip(got, calls))


def test_the_forward_benchmark_times_the_replayed_forward_and_checks_its_bits(triton_llama):
    """``forward_cost(graphs=...)`` (the GPU check's ``forward`` section): every rep's
    replayed logits equal the eager forward's of the same rep."""
    from cluster.bench.batch_bench import forward_cost

    plain = tiny_causal_lm("llama", 300, 0, seed=3)
    r = forward_cost(plain, triton_llama, 10, 1, (2,), graphs="eager")["batch2"]
    assert r["graph_identical"] == "3/3" and r["graph_ms"] > 0
    assert (r["graph_stats"]["captures"], r["graph_stats"]["replays"]) == (1, 2)


def test_the_load_time_check_replays_against_eager_and_turns_graphs_off_on_a_difference(triton_llama, monkeypatch):
    """``IterationGraphs.check`` (run when a CUDA engine loads): passes on the real forward and
    gives its blocks back; a replay whose bits differ turns graphs off with the reason."""
    pool = KVPool.for_model(triton_llama)
    graphs = IterationGraphs(triton_llama, pool, replay="eager")
    assert graphs.check((3, 9, 5)) is None and graphs.replays == 2 and graphs.disabled_reason is None
    in_use = pool.n_blocks - len(pool._free)
    assert in_use == 1 + len(graphs._scratch.table)  # the zero block and the scratch blocks only
    from ralm.batching import iteration_graphs as IG

    real = IG._Captured.replay
    monkeypatch.setattr(IG._Captured, "replay", lambda self, batch: real(self, batch) + 1)  # a broken replay
    broken = IterationGraphs(triton_llama, pool, replay="eager")
    assert "differs from the eager forward" in (broken.check((1, 2, 1)) or "")
    assert broken.eligible([(PagedKV(pool), [1])], [0]) is False  # off from now on
