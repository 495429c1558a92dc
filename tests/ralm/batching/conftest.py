"""Tiny models of every supported family, made invariant once per module."""

from __future__ import annotations

import pytest
import torch

from ralm.batching.invariant import make_invariant
from tests.factories import tiny_causal_lm

FAMILIES = ["gpt2", "opt", "llama", "project"]


def invariant_model(family: str):
    if family == "project":
        from transformers import AutoModelForCausalLM

        from ralm import constants as C

        model = AutoModelForCausalLM.from_pretrained(str(C.DEMO_MODEL_DIR), dtype=torch.float32).eval()
    else:
        model = tiny_causal_lm(family, vocab_size=300, eos_token_id=0, seed=3)
    return make_invariant(model)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, invariant_model(request.param)
