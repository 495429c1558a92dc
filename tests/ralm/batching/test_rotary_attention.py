"""Llama-family attention on a packed batch (ralm/batching/rotary_attention.py): the same bits
as transformers' attention forward, in fewer host ops."""

from __future__ import annotations

import pytest
import torch

from ralm.batching.invariant import make_invariant
from ralm.batching.rotary_attention import RotaryTables
from tests.factories import restore_hf_attention, two_sequence_forwards

pytestmark = pytest.mark.unit


def _model(family: str, kernels: str = "torch", invariant: bool = True):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(7)
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    else:  # qwen2: biases on q, k, v
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **common))
    return make_invariant(model.eval(), kernels=kernels) if invariant else model.eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("paged", [True, False], ids=["pool", "standalone"])
def test_the_packed_forward_gives_transformers_attention_bits(family, paged):
    model = _model(family)
    assert sum(hasattr(m, "_ralm_hf_forward") for m in model.modules()) == 2  # every layer's attention
    fast = two_sequence_forwards(model, paged)
    restore_hf_attention(model)
    slow = two_sequence_forwards(model, paged)
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_is_transformers_rotary_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    N, H, D = 11, 4, 16
    x = torch.randn(N, H, D, generator=g).to(dtype)
    ang = torch.randn(1, N, D, generator=g)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1).unsqueeze(0), x.transpose(0, 1).unsqueeze(0), cos, sin)
    got = RotaryTables(cos, sin).rotate(x)
    assert torch.equal(got, want[0].transpose(0, 1))


def test_calls_without_a_packed_batch_run_transformers_forward():
    """A plain forward (generation with transformers' cache) is untouched: the same logits with
    and without the packed forward installed."""
    model = _model("llama")
    ids = torch.randint(1, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        with_packed = model(input_ids=ids).logits
        restore_hf_attention(model)
        plain = model(input_ids=ids).logits
    assert torch.equal(with_packed, plain)
