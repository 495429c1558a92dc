"""The attention seam (ralm.batching.attention_backend): a model's backend is read in one place,
and every attention the invariant forward runs (a lone step, packed sequences in pools of their own,
the pool) goes through it, so a new kernel family is one new backend."""

from __future__ import annotations

import pytest
import torch

import ralm.batching.attention_backend as AB
from ralm.batching.invariant import make_invariant
from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV
from tests.factories import tiny_causal_lm

pytestmark = pytest.mark.unit


class Recording(AB.TorchAttention):
    """The torch backend, counting the calls that reach it."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _hit(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def attend_alone(self, *a):
        self._hit("alone")
        return super().attend_alone(*a)

    def attend_contiguous(self, *a):
        self._hit("contiguous")
        return super().attend_contiguous(*a)

    def pool_sections(self, *a):
        self._hit("pool_sections")
        return super().pool_sections(*a)

    def attend_pool(self, *a):
        self._hit("pool")
        return super().attend_pool(*a)


def test_the_backend_is_read_from_the_models_flag_in_one_place():
    model = make_invariant(tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3))
    assert AB.attention_backend(model) is AB.BACKENDS["torch"]
    assert sorted(AB.BACKENDS) == ["torch", "triton"]
    assert not AB.BACKENDS["torch"].fuses_rotary and AB.BACKENDS["triton"].fuses_rotary
    attn = next(m for m in model.modules() if type(m).__name__ == "LlamaAttention")
    object.__setattr__(attn, "_ralm_triton", True)  # what use_triton sets
    assert AB.attention_backend(attn) is AB.BACKENDS["triton"]


@torch.inference_mode()
def test_every_attention_of_the_invariant_forward_goes_through_the_backend(monkeypatch):
    model = make_invariant(tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3))
    L = model.config.num_hidden_layers
    seq = [(37 * i + 5) % 290 + 1 for i in range(70)]
    want_lone = model(input_ids=torch.tensor([seq])).logits[0, -1]
    want_packed = packed_forward(model, [(PagedKV.standalone(L), seq)])[0]

    rec = Recording()
    monkeypatch.setitem(AB.BACKENDS, "torch", rec)
    # a lone step: transformers' forward, the attention interface
    assert torch.equal(model(input_ids=torch.tensor([seq])).logits[0, -1], want_lone)
    assert rec.calls == {"alone": L}
    # packed, a lone sequence in a pool of its own: the pooled path (planned at its first layer)
    rec.calls.clear()
    assert torch.equal(packed_forward(model, [(PagedKV.standalone(L), seq)])[0], want_packed)
    assert rec.calls == {"pool_sections": 1, "pool": L, "contiguous": L}
    # packed, two sequences in pools of their own: each appended alone, attended together
    rec.calls.clear()
    both = packed_forward(model, [(PagedKV.standalone(L), seq), (PagedKV.standalone(L), seq)])
    assert torch.equal(both[0], want_packed) and torch.equal(both[1], want_packed)
    assert rec.calls == {"contiguous": L}
    # packed, in the pool (allocated by a first forward, then planned before the second)
    pool = KVPool(L)
    kv = PagedKV(pool)
    packed_forward(model, [(kv, seq[:-1])])
    rec.calls.clear()
    assert torch.equal(packed_forward(model, [(kv, seq[-1:])])[0], want_packed)
    assert rec.calls == {"pool_sections": 1, "pool": L, "contiguous": L}
