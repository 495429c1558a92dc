"""Stacked projections (ralm.batching.fused_projection): q/k/v and gate/up are one product each,
transformers' forwards read their slices, and the model still batches exactly."""

from __future__ import annotations

import pytest
import torch

from ralm.batching.fused_projection import FusedProjection, ProjectionSlice, fuse
from ralm.batching.invariant import InvariantLinear
from tests.ralm.batching.test_rotary_attention import _model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_q_k_v_and_gate_up_are_one_product_each_whose_slices_transformers_reads(family):
    """Biases stacked too (Qwen2's q, k, v); every stacked layer is found once (fast drafts and
    the kernel choice walk the InvariantLinear modules)."""
    model = _model(family)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(attn.qkv_proj, FusedProjection) and attn.qkv_proj.widths == (64, 32, 32)
    assert isinstance(mlp.gate_up_proj, FusedProjection) and mlp.gate_up_proj.widths == (128, 128)
    assert all(isinstance(p, ProjectionSlice) for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj))
    assert (attn.qkv_proj.proj.bias is not None) == (family == "qwen2") and mlp.gate_up_proj.proj.bias is None
    linears = [m for m in model.modules() if isinstance(m, InvariantLinear)]
    assert len(linears) == len({id(m) for m in linears}) == 2 * 4 + 1  # qkv, o, gate_up, down; the head


def test_one_product_per_input_and_nothing_held_after_every_part_was_taken():
    model = _model("llama")
    attn = model.model.layers[0].self_attn
    fused = attn.qkv_proj
    calls = []
    real = fused.proj.forward
    fused.proj.forward = lambda x: (calls.append(1), real(x))[1]
    x = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        assert len(calls) == 1 and fused._memo is None
        assert torch.equal(torch.cat([q, k, v], dim=-1), real(x))
        attn.q_proj(x)
        attn.q_proj(x)  # the same part twice: a new product (another forward of the same tensor)
        attn.k_proj(x.clone())  # another input: its own product
        assert len(calls) == 4


def test_layers_that_cannot_be_stacked_are_left_alone():
    a = InvariantLinear(torch.randn(8, 16), None, 4)
    b = InvariantLinear(torch.randn(8, 12), None, 4)  # another input width
    holder = torch.nn.Module()
    holder.a, holder.b = a, b
    assert fuse(holder, ("a", "b"), "ab") is None and holder.a is a and not hasattr(holder, "ab")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_the_stacked_model_is_the_plain_models_function(family):
    """To float32 rounding: stacking changes which kernel computes a column, not the function."""
    model, plain = _model(family), _model(family, invariant=False)  # the same seed: the same weights
    ids = torch.randint(1, 300, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = model(input_ids=ids).logits
        want = plain(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_unstacked_state_dict_is_the_plain_models(family):
    """Split back under transformers' names, the stacked model's weights are the plain model's,
    key for key and bit for bit (Qwen2's q/k/v biases too)."""
    from ralm.batching.fused_projection import unstacked_state_dict

    model, plain = _model(family), _model(family, invariant=False)
    got, want = unstacked_state_dict(model), plain.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
