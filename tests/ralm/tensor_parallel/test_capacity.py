"""The tensor-parallel capacity plan (ralm/tensor_parallel/capacity.py, ``gpu-check --plan``)
counted against the real thing: the parameters of the ranks ``rank_model`` builds, their KV
pools' bytes per position, and the bytes their collectives receive in a decode step."""

from __future__ import annotations

import json

import pytest

from ralm.batching.invariant import make_invariant
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV
from ralm.tensor_parallel.capacity import ModelShape, rank_capacity
from ralm.tensor_parallel.collective import ThreadGroup
from ralm.tensor_parallel.plan import TensorParallelUnavailable
from ralm.tensor_parallel.shard import ModelWeights, rank_model
from tests.ralm.tensor_parallel.test_shard import _llama

pytestmark = pytest.mark.unit


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_plan_counts_what_the_ranks_hold_and_gather(ranks):
    full = _llama(heads=4, kv=2)  # width 64, MLP 128, 2 layers, a vocabulary of 301
    shape = ModelShape.of_config(full.config)
    S = 4  # sequences of a decode step (a whole row tile: no padding rows gathered)
    cap = rank_capacity(shape, ranks, "float32", sequences=S, context=100)
    group = ThreadGroup(ranks)

    def rank(r):
        c = group.member(r)
        m = make_invariant(rank_model(ModelWeights(full), full.config, ranks, c))
        pool = KVPool.for_model(m)
        kvs = [PagedKV(pool) for _ in range(S)]
        for i, kv in enumerate(kvs):
            packed_forward(m, [(kv, list(range(3 + i, 20 + i)))])
        before = c.stats.bytes_received
        packed_forward(m, [(kv, [5 + i]) for i, kv in enumerate(kvs)])  # one decode step
        return _bytes(m), pool.block_bytes // pool.block_size, c.stats.bytes_received - before

    got = group.run(rank)
    assert cap.weights_bytes == max(w for w, _, _ in got)  # rank 0's LM-head slice is the longest
    assert {kv for _, kv, _ in got} == {cap.kv_bytes_per_position}
    assert {g for _, _, g in got} == {cap.gather_bytes_per_decode_step}
    assert cap.kv_bytes == S * 128 * cap.kv_bytes_per_position  # 100 positions: two blocks of 64 each
    if ranks == 1:
        assert cap.weights_bytes == _bytes(full) and cap.gather_bytes_per_decode_step == 0


def test_llama2_70b_fits_an_a100_80gb_at_four_ranks_and_not_at_two():
    four = rank_capacity("llama2-70b-4gpu", 4, "float16", 64, 4096, device_gib=80)
    two = rank_capacity("llama2-70b", 2, "float16", 64, 4096, device_gib=80)
    assert four.fits is True and two.fits is False
    # the whole model's parameters (about 69 billion) over the ranks, the embedding on every one
    whole = rank_capacity("llama2-70b", 1, "float16", 64, 4096)
    assert 68.5e9 < whole.weights_bytes / 2 < 69.5e9
    assert four.weights_bytes < whole.weights_bytes / 4 + 32000 * 8192 * 2
    assert four.kv_bytes * 4 == whole.kv_bytes == 64 * 4096 * 80 * 2 * 8 * 128 * 2
    assert "fits in 90% of a 80 GiB device" in four.summary()


def test_bad_plans_get_clear_errors():
    with pytest.raises(TensorParallelUnavailable, match="3 ranks do not divide the model's 64 attention heads"):
        rank_capacity("llama2-70b", 3)
    with pytest.raises(ValueError, match="no shape is known for 'gpt-5'"):
        rank_capacity("gpt-5", 2)
    with pytest.raises(ValueError, match="dtype 'int3'"):
        rank_capacity("llama2-7b", 2, "int3")
    with pytest.raises(ValueError, match="must be at least 1"):
        rank_capacity("llama2-7b", 2, sequences=0)


def test_gpu_check_plan_prints_writes_and_exits_on_the_verdict(tmp_path, capsys):
    from cluster.bench.gpu_check import main

    assert main(["--plan", "llama2-70b-4gpu", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu-plan.json").read_text())
    assert data["ranks"] == 4 and data["fits"] is True
    assert "KV pool" in capsys.readouterr().out
    assert main(["--plan", "llama2-70b", "--tp", "2", "--out", str(tmp_path)]) == 1  # does not fit
    # a local model folder: its config.json
    full = _llama()
    full.config.save_pretrained(tmp_path / "m")
    assert main(["--plan", str(tmp_path / "m"), "--tp", "2", "--plan-device-gib", "0", "--out", str(tmp_path)]) == 0
    assert (
        json.loads((tmp_path / "gpu-plan.json").read_text())["weights_bytes"]
        == rank_capacity(ModelShape.of_config(full.config), 2, "float16").weights_bytes
    )
