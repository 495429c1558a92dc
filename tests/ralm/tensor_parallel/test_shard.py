"""Tensor-parallel ranks (ralm/tensor_parallel): a Llama split over R ranks computes the model's
function, every rank holds the same logits, and a sequence's logits are the same bits alone or
in a batch, for R = 2 and 4 on threads and R = 2 over gloo between two processes."""

from __future__ import annotations

import pytest
import torch

from ralm.batching.invariant import make_invariant
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV
from ralm.tensor_parallel.collective import ThreadGroup
from ralm.tensor_parallel.plan import ShardPlan, TensorParallelUnavailable
from ralm.tensor_parallel.shard import ModelWeights, SafetensorsWeights, fixed_order_sum, rank_model

pytestmark = pytest.mark.unit


def _llama(heads=4, kv=2, layers=2, vocab=301, tie=False):
    """A random Llama (width 64, heads of 16; a vocabulary that 2 and 4 do not divide)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).eval()


SEQS = [list(range(3, 40)), list(range(50, 59)), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


def _batched_and_alone(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sequence's prefill and 2 decode steps: all sequences packed in one forward per
    step, then each sequence alone; the logits of every step's last token."""
    L = model.config.num_hidden_layers

    def run(groups):
        pool = KVPool(L)
        kvs = [PagedKV(pool) for _ in SEQS]
        out = {i: [] for i in range(len(SEQS))}
        for idx in groups:
            chunks = [(kvs[i], SEQS[i]) for i in idx]
            for i, row in zip(idx, packed_forward(model, chunks)):
                out[i].append(row)
            for t in (5, 6):
                for i, row in zip(idx, packed_forward(model, [(kvs[i], [t + i]) for i in idx])):
                    out[i].append(row)
        return [torch.stack(out[i]) for i in range(len(SEQS))]

    return run([[0, 1, 2]]), run([[0], [1], [2]])


@pytest.mark.parametrize("ranks, kv", [(2, 2), (4, 4)], ids=["R2-gqa", "R4"])
def test_ranks_compute_the_model_agree_bit_for_bit_and_batching_changes_no_bit(ranks, kv):
    full = _llama(kv=kv)
    ref_batched, _ = _batched_and_alone(make_invariant(_llama(kv=kv)))
    group = ThreadGroup(ranks)

    def rank(r):
        model = make_invariant(rank_model(ModelWeights(full), full.config, ranks, group.member(r)))
        return _batched_and_alone(model)

    results = group.run(rank)
    batched0, alone0 = results[0]
    for batched, alone in results:
        for b, a, b0 in zip(batched, alone, batched0):
            assert torch.equal(b, a)  # a sequence alone or in the batch: the same bits
            assert torch.equal(b, b0)  # every rank holds the same logits
    for b, ref in zip(batched0, ref_batched):  # the split computes the model (other sums: close, not equal)
        assert torch.allclose(b, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(b.argmax(-1), ref.argmax(-1))


def test_a_checkpoint_is_read_a_slice_at_a_time(tmp_path):
    full = _llama(kv=4, tie=True)
    full.save_pretrained(tmp_path, safe_serialization=True)
    src = SafetensorsWeights(tmp_path)
    plan = ShardPlan.for_config(full.config, 4)
    q = src.get("model.layers.1.self_attn.q_proj.weight", "rows", plan.span("q", 2))
    assert torch.equal(q, full.model.layers[1].self_attn.q_proj.weight[32:48])
    o = src.get("model.layers.0.self_attn.o_proj.weight", "cols", plan.span("q", 3))
    assert torch.equal(o, full.model.layers[0].self_attn.o_proj.weight[:, 48:64])
    group = ThreadGroup(2)

    def rank(r):
        from_disk = rank_model(src, full.config, 2, group.member(r))
        in_memory = rank_model(ModelWeights(full), full.config, 2, group.member(r))
        a, b = from_disk.state_dict(), in_memory.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        # a tied checkpoint: the LM head is the rank's rows of the embedding
        span = ShardPlan.for_config(full.config, 2).span("vocab", r)
        assert torch.equal(a["lm_head.linear.weight"], full.model.embed_tokens.weight[span[0] : span[1]])
        return a["model.layers.0.mlp.gate_proj.weight"].shape

    assert group.run(rank) == [(64, 64), (64, 64)]  # half of 128 MLP columns each


def test_a_split_the_shapes_do_not_allow_is_refused_with_the_reason(tmp_path):
    cfg = _llama(heads=8, kv=2).config
    with pytest.raises(TensorParallelUnavailable, match="4 ranks do not divide the model's 2 key/value heads"):
        ShardPlan.for_config(cfg, 4)
    with pytest.raises(TensorParallelUnavailable, match="3 ranks do not divide the model's 8 attention heads"):
        ShardPlan.for_config(cfg, 3)
    with pytest.raises(ValueError, match="whole number of ranks"):
        ShardPlan.for_config(cfg, 0)
    from transformers import GPT2Config

    with pytest.raises(TensorParallelUnavailable, match="not 'gpt2'"):
        ShardPlan.for_config(GPT2Config(), 2)
    with pytest.raises(TensorParallelUnavailable, match="no .safetensors files"):
        SafetensorsWeights(tmp_path)


def test_the_sum_is_in_rank_order_and_a_failed_rank_stops_the_others():
    a, b, c = (torch.tensor([1e8, 1.0], dtype=torch.float32) for _ in range(3))
    c = torch.tensor([-1e8, 0.5])
    # ((a + b) + c) in float32: 1e8 + 1e8 - 1e8 = 1e8 and 1 + 1 + 0.5; another order is other bits
    assert torch.equal(fixed_order_sum([a, b, c], torch.float32), torch.tensor([1e8, 2.5]))
    assert fixed_order_sum([a.bfloat16(), b.bfloat16()], torch.bfloat16).dtype == torch.bfloat16
    group = ThreadGroup(3, timeout_s=30)

    def rank(r):
        if r == 1:
            raise RuntimeError("rank 1 lost its device")
        group.member(r).all_gather(torch.zeros(2))

    with pytest.raises(RuntimeError, match="rank 1 lost its device"):
        group.run(rank, timeout_s=60)


def _gloo_rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist

    from ralm.tensor_parallel.collective import TorchDistributed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path)
        coll = TorchDistributed()
        model = make_invariant(rank_model(SafetensorsWeights(path), cfg, 2, coll))
        batched, alone = _batched_and_alone(model)
        torch.save({"batched": batched, "alone": alone, "stats": coll.stats.as_dict()}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_over_gloo_give_the_threads_bits(tmp_path):
    """Real torch.distributed (gloo over TCP between two processes, as Ray's rank actors use it
    on CPUs): the same logits as the two ranks on threads, batched and alone."""
    import socket

    import torch.multiprocessing as mp

    full = _llama()
    full.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(port, str(tmp_path / "ckpt"), str(tmp_path)), nprocs=2, join=True)
    group = ThreadGroup(2)

    def rank(r):
        return _batched_and_alone(make_invariant(rank_model(ModelWeights(full), full.config, 2, group.member(r))))

    threads = group.run(rank)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for b, a, t in zip(got["batched"], got["alone"], threads[r][0]):
            assert torch.equal(b, a) and torch.equal(b, t)
        # 2 row-parallel layers per decoder layer, and the LM head, per forward
        assert got["stats"]["gathers"] > 0 and got["stats"]["bytes_received"] > 0
