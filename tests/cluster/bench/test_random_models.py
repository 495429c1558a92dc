"""The benchmarks' random models: each named shape is what its table says, and a name gives
the same weights every time."""

from __future__ import annotations

import pytest
import torch

from cluster.bench.random_models import SHAPES, random_model
from tests.factories import tiny_tokenizer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_a_named_shape_is_built_as_its_table_says_and_deterministically(name):
    tok = tiny_tokenizer()
    s = SHAPES[name]
    a, b = random_model(name, tok, torch.bfloat16), random_model(name, tok, torch.bfloat16)
    assert a.config.model_type == s.family and a.config.num_hidden_layers == s.layers
    assert a.config.hidden_size == s.width and a.config.num_attention_heads == s.heads
    assert a.config.vocab_size == len(tok) and a.config.eos_token_id == tok.eos_token_id
    assert next(a.parameters()).dtype == torch.bfloat16 and not a.training
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
