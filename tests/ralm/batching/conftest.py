"""Tiny models of every supported family, made invariant once per module."""

from __future__ import annotations

import pytest
import torch

from ralm.batching.invariant import InvariantLinear, make_invariant
from tests.factories import tiny_causal_lm

#: "llama-onednn": a tiny Llama with every linear layer on the oneDNN kernel (real models'
#: layers are big enough for it; tiny ones would run on BLAS tiles)
FAMILIES = ["gpt2", "opt", "llama", "llama-onednn", "project"]


def invariant_model(family: str):
    if family == "project":
        from transformers import AutoModelForCausalLM

        from ralm import constants as C

        model = AutoModelForCausalLM.from_pretrained(str(C.DEMO_MODEL_DIR), dtype=torch.float32).eval()
    elif family == "llama-onednn":
        from ralm import constants as C

        model = tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3)
        saved, C.INVARIANT_ONEDNN_MIN_WEIGHTS = C.INVARIANT_ONEDNN_MIN_WEIGHTS, 0
        try:
            model = make_invariant(model)
        finally:
            C.INVARIANT_ONEDNN_MIN_WEIGHTS = saved
        assert {m.kernel for m in model.modules() if isinstance(m, InvariantLinear)} == {"onednn"}
        return model
    else:
        model = tiny_causal_lm(family, vocab_size=300, eos_token_id=0, seed=3)
    return make_invariant(model)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, invariant_model(request.param)
