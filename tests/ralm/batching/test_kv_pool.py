"""The KV pool (ralm.batching.kv_pool), pooled sequences (paged_kv), the pooled documents'
KV (doc_blocks) and the batched engine on them: blocks are counted, shared and copied on
write; every forward's bits equal those of sequences alone in pools of their own; a document's KV is held once."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ralm.batching.doc_blocks import DocBlockCache
from ralm.batching.kv_pool import ZERO_BLOCK, KVPool, KVPoolFull, layer_devices
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV
from ralm.batching.sessions import Session, SessionStore
from ralm.step_request import StepRequest
from tests.factories import tiny_causal_lm, tiny_engine

pytestmark = pytest.mark.unit


def _filled(pool: KVPool, n: int, seed: int = 0) -> PagedKV:
    """A pooled sequence of ``n`` random positions (1 layer, Hkv=2, D=4)."""
    g = torch.Generator().manual_seed(seed)
    kv = PagedKV(pool)
    kv.append(0, torch.randn(2, n, 4, generator=g), torch.randn(2, n, 4, generator=g))
    return kv


def test_blocks_are_counted_handed_out_once_and_the_zero_block_never():
    pool = KVPool(1, block_size=4, initial_blocks=4)
    a = _filled(pool, 10)  # 3 blocks: the pool has exactly 3 besides the zero block
    assert ZERO_BLOCK not in a.table and len(set(a.table)) == 3 and pool.grows == 0
    b = _filled(pool, 1, seed=1)  # none free: the pool doubles, a's positions stay where they were
    assert pool.grows == 1 and pool.n_blocks == 8 and not set(b.table) & set(a.table)
    k0, _ = a.span(0, 12)
    assert pool.stats()["blocks_used"] == 4
    a.crop(5)  # a rollback releases the third block
    assert len(a.table) == 2 and pool.stats()["blocks_used"] == 3
    assert torch.equal(a.span(0, 8)[0][:, :5], k0[:, :5])
    a.free()
    a.free()  # once only
    assert pool.stats()["blocks_used"] == 1
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.decref(b.table * 2)
    assert torch.equal(pool.k[0][:, ZERO_BLOCK], torch.zeros_like(pool.k[0][:, ZERO_BLOCK]))


def test_a_fork_shares_blocks_and_a_write_copies_only_the_shared_partial_block():
    pool = KVPool(1, block_size=4, initial_blocks=8)
    doc = _filled(pool, 6)  # blocks [x, y], y half full
    k_doc, v_doc = doc.span(0, 8)
    twin = doc.fork()
    assert twin.table == doc.table and pool.stats()["blocks_shared"] == 2
    twin.append(0, torch.full((2, 3, 4), 7.0), torch.full((2, 3, 4), 7.0))  # positions 6-8
    assert twin.table[0] == doc.table[0] and twin.table[1] != doc.table[1] and pool.copies == 1
    k_d, v_d = doc.span(0, 8)
    assert torch.equal(k_d, k_doc) and torch.equal(v_d, v_doc)  # the original's bits are untouched
    k_t, _ = twin.span(0, 12)
    assert torch.equal(k_t[:, :6], k_doc[:, :6]) and (k_t[:, 6:9] == 7).all()
    assert torch.equal(v_d[..., 4], torch.ones(2, 8))  # the ones column of the values survives


def test_no_free_block_reclaims_idle_blocks_before_growing():
    pool = KVPool(1, block_size=4, initial_blocks=3)  # 2 usable blocks
    store = SessionStore(capacity_bytes=1 << 20)
    pool.reclaimers = [store.evict_one]
    store.put(Session((), 0, [1], _filled(pool, 8), owner="idle"))  # both blocks, idle
    fresh = _filled(pool, 4, seed=2)
    assert pool.grows == 0 and store.stats.evictions == 1 and len(store) == 0
    assert fresh.table and pool.stats()["blocks_used"] == 1


def test_sessions_count_their_own_blocks_and_give_them_back():
    pool = KVPool(1, block_size=4, initial_blocks=16)
    doc = _filled(pool, 8)
    sess_kv = doc.fork()
    sess_kv.append(0, torch.ones(2, 4, 4), torch.ones(2, 4, 4))  # one block of its own
    store = SessionStore(capacity_bytes=1 << 20)
    store.put(Session((("d",),), 8, [1, 2, 3, 4], sess_kv, owner="r"))
    assert store.stats.bytes_used == pool.block_bytes  # the shared document blocks are not its own
    used = pool.stats()["blocks_used"]
    assert store.release("r") == 1 and pool.stats()["blocks_used"] == used - 1
    assert len(doc) == 8 and pool.refs[doc.table[0]] == 1
    big = SessionStore(capacity_bytes=1)  # over budget: dropped at once, blocks back
    big.put(Session((), 0, [1], _filled(pool, 4, seed=3)))
    assert pool.stats()["blocks_used"] == used - 1


def test_the_document_cache_holds_one_copy_and_evicts_by_bytes():
    pool = KVPool(1, block_size=4, initial_blocks=16)
    cache = DocBlockCache(capacity_bytes=3 * 4 * 2 * 2 * 4 * 4)  # three blocks of 1 layer, Hkv 2, D 4, fp32
    assert cache.fork(("a",)) is None
    cache.put(("a",), _filled(pool, 8))
    forks = [cache.fork(("a",)) for _ in range(10)]
    assert all(f is not None and len(f) == 8 for f in forks)
    assert pool.stats()["blocks_used"] == 2 and cache.stats.hits == 10  # ten sequences, one copy
    cache.put(("b",), _filled(pool, 8, seed=1))  # 4 blocks > 3: "a", the oldest, goes
    assert cache.stats.evictions == 1 and cache.fork(("a",)) is None
    assert pool.stats()["blocks_used"] == 4  # ... but its blocks stay while the forks hold them
    for f in forks:
        f.free()  # type: ignore[union-attr]
    assert pool.stats()["blocks_used"] == 2
    cache.clear()
    assert pool.stats()["blocks_used"] == 0 and len(cache) == 0


@torch.inference_mode()
def test_pooled_forwards_equal_standalone_sequences_through_forks_and_rollbacks(family_model):
    family, model = family_model
    L = model.config.num_hidden_layers
    rng = random.Random(3)
    pool = KVPool(L, initial_blocks=2)
    doc = [rng.randrange(1, 290) for _ in range(70)]
    ref_doc, pooled_doc = PagedKV.standalone(L), PagedKV(pool)
    assert torch.equal(packed_forward(model, [(ref_doc, doc)]), packed_forward(model, [(pooled_doc, doc)]))
    refs = [PagedKV.standalone(L) for _ in range(4)]
    pooled = [pooled_doc.fork() for _ in range(4)]
    for r in refs:
        packed_forward(model, [(r, doc)])
    for it in range(6):
        chunks = [[rng.randrange(1, 290) for _ in range(rng.choice([1, 1, 3, 9]))] for _ in refs]
        want = packed_forward(model, list(zip(refs, chunks)))
        got = packed_forward(model, list(zip(pooled, chunks)))
        assert torch.equal(got, want), (family, it)
        j = rng.randrange(4)
        cut = rng.randrange(60, len(refs[j]) + 1)  # a rollback, sometimes into the shared blocks
        refs[j].crop(cut)
        pooled[j].crop(cut)
    # a mixed forward (a sequence in a pool of its own next to pooled sequences) takes the generic path
    extra = [5, 6, 7]
    mixed = packed_forward(model, [(PagedKV.standalone(L), extra), (pooled[0], [8])])
    assert torch.equal(mixed[0], packed_forward(model, [(PagedKV.standalone(L), extra)])[0])
    assert torch.equal(mixed[1], packed_forward(model, [(refs[0], [8])])[0])
    assert pool.copies >= 4  # each fork copied the document's partial last block on its first write


def _engine(pool: bool):
    eng = tiny_engine("llama", seed=4)
    if pool:
        return eng
    return type(eng)(eng.model, eng.tokenizer, eng.cfg.model_copy(update={"kv_pool": False}))


def test_requests_on_one_document_share_its_kv_and_get_the_per_buffer_tokens():
    pooled, buffers = _engine(True), _engine(False)
    assert pooled.kv_pool is not None and buffers.kv_pool is None
    doc = "shutil.copytree copies a whole directory tree, with its files and subdirectories, recursively. " * 2
    questions = [pooled.encode_question(f"what does copytree do with file {i}?") for i in range(12)]
    out: dict[int, list[int]] = {}
    blocks_seen: list[int] = []

    def run(i):
        ctx = list(questions[i])
        for _ in range(3):
            ctx += pooled.step(doc, ctx, 4, ignore_eos=True, owner=f"q{i}").tokens
            blocks_seen.append(pooled.kv_pool.stats()["blocks_shared"])  # type: ignore[union-attr]
        out[i] = ctx

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(12):
        ctx = list(questions[i])
        for _ in range(3):
            ctx += buffers.step(doc, ctx, 4, ignore_eos=True, owner=f"q{i}").tokens
        assert out[i] == ctx, i
    n_doc = len(pooled.doc_tokens(doc))
    assert n_doc > 64  # the document fills at least one whole block, shared by every request
    # the document's KV was computed once; every other first step forked it (or took another
    # request's session on the same document, which shares the same blocks)
    docs_stats = pooled.doc_blocks.stats  # type: ignore[union-attr]
    assert max(blocks_seen) >= 1 and docs_stats.misses == 1 and docs_stats.hits >= 1
    used = pooled.kv_pool.stats()["blocks_used"]  # type: ignore[union-attr]
    for i in range(12):
        pooled.release(f"q{i}")
    after = pooled.kv_pool.stats()  # type: ignore[union-attr]
    assert after["blocks_used"] < used and after["blocks_used"] == -(-n_doc // 64)  # the cached document only
    pooled.clear_kv_caches()
    assert pooled.kv_pool.stats()["blocks_used"] == 0  # type: ignore[union-attr]


def test_with_the_pool_a_documents_kv_is_held_once_and_document_prefixes_are_shared():
    pooled, buffers = _engine(True), _engine(False)
    d1, d2, d3 = (f"{w} " * 50 for w in ("shutil.copytree", "json.dumps", "argparse.ArgumentParser"))
    ctx = pooled.encode_question("which function copies a tree?")
    first = pooled.step([d1, d2], ctx, 4, ignore_eos=True)
    assert (first.docs_reused, first.docs_computed) == (0, 2)
    # the one-step-at-a-time path's prefix tree holds nothing: the pool's blocks are the only copy
    assert pooled.doc_kv.stats.bytes_used == 0 and len(pooled.doc_blocks) == 2  # type: ignore[arg-type]
    second = pooled.step([d1, d3], ctx, 4, ignore_eos=True)  # forks (d1,), computes d3 only
    assert (second.docs_reused, second.docs_computed) == (1, 1) and second.kv_bytes_reused > 0
    third = pooled.step([d1, d2], ctx + [5], 4, ignore_eos=True)  # another context: the whole sequence forked
    assert (third.docs_reused, third.docs_computed) == (2, 0) and third.doc_kv_hit
    for out, docs, c in ((first, [d1, d2], ctx), (second, [d1, d3], ctx), (third, [d1, d2], ctx + [5])):
        assert out.tokens == buffers.step(docs, c, 4, ignore_eos=True).tokens
    # an entry is charged the blocks its prefix does not hold
    B, per_block = pooled.kv_pool.block_size, pooled.kv_pool.block_bytes  # type: ignore[union-attr]
    n1 = len(pooled.doc_tokens(d1))
    n12 = n1 + len(pooled.doc_tokens(d2))
    assert (
        pooled.doc_blocks.stats.bytes_used
        == (  # type: ignore[union-attr]
            -(-n1 // B) + (-(-n12 // B) - n1 // B) + (-(-(n1 + len(pooled.doc_tokens(d3))) // B) - n1 // B)
        )
        * per_block
    )


def test_a_failed_forward_gives_its_blocks_back(monkeypatch):
    eng = _engine(True)
    ctx = eng.encode_question("will this forward fail?")
    eng.step(None, ctx, 2, owner="warm")
    eng.clear_kv_caches()
    before = eng.kv_pool.stats()["blocks_used"]  # type: ignore[union-attr]
    import ralm.batching.engine as batch_engine

    real = batch_engine.packed_forward

    def broken(*a, **k):  # the KV is written (blocks reserved), then the device fails
        real(*a, **k)
        raise RuntimeError("device lost")

    monkeypatch.setattr(batch_engine, "packed_forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step(None, ctx, 2, owner="x")
    with pytest.raises(RuntimeError, match="device lost"):
        eng.submit(StepRequest(tuple(ctx), 2)).result()
    assert eng.kv_pool.stats()["blocks_used"] == before  # type: ignore[union-attr]
    monkeypatch.undo()
    assert len(eng.step(None, ctx, 2).tokens) >= 1  # and the batcher keeps serving


def test_the_pool_is_written_in_and_out_of_inference_mode():
    """The batcher's forwards run under inference mode, a step's document KV is copied in
    outside it: either may allocate the pool first."""
    pool = KVPool(1, block_size=4, initial_blocks=2)
    with torch.inference_mode():
        first = _filled(pool, 3)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g)
    second = PagedKV(pool)
    second.append(0, k, v)  # grows the pool and copies a block, outside inference mode
    twin = first.fork()
    twin.append(0, k[:, :1], v[:, :1])
    got_k, got_v = second.span(0, 8)
    assert torch.equal(got_k[:, :6], k) and torch.equal(got_v[:, :6, :4], v) and pool.copies == 1


def test_a_busy_owner_of_idle_blocks_makes_the_pool_grow_instead_of_waiting():
    """The pool asks for blocks holding its lock; a store or cache busy in another thread
    (whose own operations take the pool's lock) frees nothing this time: no deadlock."""
    pool = KVPool(1, block_size=4, initial_blocks=3)
    store, docs = SessionStore(capacity_bytes=1 << 20), DocBlockCache(capacity_bytes=1 << 20)
    pool.reclaimers = [store.evict_one, docs.evict_one]
    store.put(Session((), 0, [1], _filled(pool, 8)))  # both usable blocks, idle
    busy = threading.Event()
    done = threading.Event()

    def hold():
        with store._lock, docs._lock:
            busy.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    busy.wait(10)
    try:
        fresh = _filled(pool, 4, seed=4)  # returns at once: the pool grows
        assert pool.grows == 1 and len(store) == 1 and fresh.table
    finally:
        done.set()
        t.join()
    assert store.evict_one() and pool.stats()["blocks_used"] == 1  # free again: it evicts


def test_growth_is_bounded_by_the_free_memory_of_the_device():
    """Doubling when it fits, else just the blocks in use, else a clear KVPoolFull; a layer's
    block is 2 heads x 4 positions x (4 + 5) columns x 4 bytes = 288 bytes."""
    free = {"bytes": 10**9}
    pool = KVPool(1, block_size=4, initial_blocks=4, free_memory=lambda device: free["bytes"])
    a = _filled(pool, 12)  # the 3 blocks besides the zero block
    assert pool.layer_block_bytes == 288 and pool.grows == 0
    # growing 4 -> 8 needs 4 new blocks plus the layer's new tensors' transient: 8 x 288 bytes
    free["bytes"] = 8 * 288 - 1
    b = _filled(pool, 1, seed=1)  # too little for a doubling: grown to the 5 blocks in use only
    assert pool.grows == 1 and pool.n_blocks == 5 and pool.stats()["blocks_used"] == 4
    free["bytes"] = 10  # nothing fits: the pool says so instead of the device running out
    with pytest.raises(KVPoolFull, match="free memory"):
        _filled(pool, 1, seed=2)
    free["bytes"] = 10**9
    k_a = a.span(0, 12)[0]
    c = _filled(pool, 8, seed=3)  # doubles again (5 -> 10); the earlier sequences' bits stay
    assert pool.n_blocks == 10 and torch.equal(a.span(0, 12)[0], k_a) and len(b) == 1 and len(c) == 8


def test_each_layer_keeps_its_kv_on_its_own_device():
    """A model spread over devices (``device_map="auto"``): the pool puts layer i's blocks on
    layer i's device and writes each layer's keys there ("meta" stands for a second device)."""
    model = tiny_causal_lm("llama", vocab_size=50, eos_token_id=0, seed=1)
    assert layer_devices(model) == [torch.device("cpu")] * model.config.num_hidden_layers
    model.model.layers[1].to("meta")
    devices = layer_devices(model)
    assert devices is not None and devices[1].type == "meta" and devices[0].type == "cpu"
    pool = KVPool(2, block_size=4, initial_blocks=2, devices=devices[:2])
    kv = PagedKV(pool)
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g)
    kv.append(0, k0, v0)
    kv.append(1, k0.to("meta"), v0.to("meta"))
    assert pool.k[0].device.type == "cpu" and pool.k[1].device.type == "meta"
    assert torch.equal(kv.span(0, 8)[0][:, :6], k0) and kv.span(1, 8)[0].device.type == "meta"


def test_a_standalone_sequence_is_one_run_read_in_place_and_stays_one_after_a_rollback():
    kv = PagedKV.standalone(1)
    g = torch.Generator().manual_seed(5)
    B = kv.pool.block_size
    k, v = torch.randn(2, 3 * B + 5, 4, generator=g), torch.randn(2, 3 * B + 5, 4, generator=g)
    kv.append(0, k[:, :7], v[:, :7])
    kv.append(0, k[:, 7:], v[:, 7:])  # the pool doubles twice on the way
    assert kv.pool.grows >= 1 and kv.table == list(range(kv.table[0], kv.table[0] + 4))
    span_k, span_v = kv.span(0, 4 * B)
    pool_k = kv.pool.k[0]
    # in place: a view of the pool's storage, not a copy
    assert span_k.untyped_storage().data_ptr() == pool_k.untyped_storage().data_ptr()
    assert torch.equal(span_k[:, : 3 * B + 5], k) and torch.equal(span_v[:, : 3 * B + 5, :4], v)
    kv.crop(B + 3)  # the last two blocks go back, last first ...
    kv.append(0, k[:, B + 3 :], v[:, B + 3 :])  # ... and come back in table order
    assert kv.table == list(range(kv.table[0], kv.table[0] + 4))
    assert torch.equal(kv.span(0, 4 * B)[0][:, : 3 * B + 5], k)
    assert kv.own_bytes() == kv.pool.nbytes > len(kv.table) * kv.pool.block_bytes - 1
    # read past its table (a group's longer key range), it takes room from its own pool and
    # is still read in place, as a doubling buffer would be
    longer = kv.span(0, 5 * B)[0]
    assert len(kv.table) == 5 and len(kv) == 3 * B + 5
    assert longer.untyped_storage().data_ptr() == kv.pool.k[0].untyped_storage().data_ptr()
    assert torch.equal(longer[:, : 3 * B + 5], k) and not longer[:, 4 * B :].any()
    # a first write that outgrows the pool while a block is still free: the free block comes
    # first and the new ones follow it, one run (the pool used to hand out 2, 3, 1)
    fresh = PagedKV.standalone(1)
    fresh.append(0, k[:, : 2 * B + 1], v[:, : 2 * B + 1])
    assert fresh.pool.grows == 1 and fresh.table == [1, 2, 3]
    assert fresh.span(0, 3 * B)[0].untyped_storage().data_ptr() == fresh.pool.k[0].untyped_storage().data_ptr()
    # a sequence of a shared pool reads the zero block past its table instead: a copy
    shared = PagedKV(KVPool(1, initial_blocks=8))
    shared.append(0, k[:, :7], v[:, :7])
    past = shared.span(0, 2 * B)[0]
    assert len(shared.table) == 1 and torch.equal(past[:, :7], k[:, :7]) and not past[:, B:].any()
    assert past.untyped_storage().data_ptr() != shared.pool.k[0].untyped_storage().data_ptr()


def test_the_torch_attention_reads_a_ones_column_and_refuses_a_pool_without_one():
    from ralm.batching.invariant import make_invariant

    model = make_invariant(tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3))
    L = model.config.num_hidden_layers
    with pytest.raises(ValueError, match="column of ones"):
        packed_forward(model, [(PagedKV(KVPool(L, value_ones=False)), [1, 2, 3])])
    eng = tiny_engine("llama", seed=4)  # the engine lays its pool out for its model's backend
    eng.step(None, eng.encode_question("how wide are the values?"), 1)
    assert eng.kv_pool.v[0].shape[-1] == eng.kv_pool.k[0].shape[-1] + 1  # type: ignore[union-attr]


def test_a_block_copied_on_write_ends_a_run_and_reads_follow_the_table():
    pool = KVPool(1, initial_blocks=8)
    g = torch.Generator().manual_seed(9)
    B = pool.block_size
    k, v = torch.randn(2, B + 3, 4, generator=g), torch.randn(2, B + 3, 4, generator=g)
    doc = PagedKV(pool)
    doc.append(0, k, v)
    twin = doc.fork()
    assert torch.equal(twin.span(0, 2 * B)[0][:, : B + 3], k)  # one run of two blocks, read in place
    k2, v2 = torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g)
    twin.append(0, k2, v2)  # copies the shared partial block: the table is no longer one run
    assert twin.table[0] == doc.table[0] and twin.table[1] != doc.table[1]
    got_k, got_v = twin.span(0, 2 * B)
    assert torch.equal(got_k[:, : B + 3], k) and torch.equal(got_k[:, B + 3 : B + 4], k2)
    assert torch.equal(got_v[:, B + 3 : B + 4, :4], v2)
    assert not doc.span(0, 2 * B)[0][:, B + 3 :].any()  # the document's block was not written
