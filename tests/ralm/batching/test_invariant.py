"""The invariant forward, piece by piece and whole: each piece's invariance is checked
before the model-level properties that rest on it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ralm.batching.invariant import (
    CastFreeRMSNorm,
    InvariantGELU,
    InvariantGELUTanh,
    InvariantLinear,
    InvariantSiLU,
    InvariantUnavailable,
    attend,
    check_row_invariance,
    make_invariant,
    onednn_available,
    pad_kv,
)
from ralm.hf_cache import cache_kwargs, cache_of
from tests.ralm.batching.conftest import invariant_model

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------------------- pieces
@pytest.mark.parametrize("kernel", ["blas", "onednn"])
@pytest.mark.parametrize("d_in,d_out", [(64, 64), (256, 1024), (576, 1536)])
def test_linear_rows_are_the_same_alone_and_at_any_batch_position(d_in, d_out, kernel):
    g = torch.Generator().manual_seed(d_in)
    layer = InvariantLinear(torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g), 16, kernel)
    x = torch.randn(70, d_in, generator=g)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
    for start, n in [(0, 2), (3, 3), (5, 16), (1, 17), (0, 70), (30, 40)]:
        assert torch.equal(layer(x[start : start + n]), alone[start : start + n]), (start, n)
    # a 3-D input is rows too, and the layer is still the linear map
    assert torch.equal(layer(x[:12].view(3, 4, d_in)).view(12, d_out), alone[:12])
    assert torch.allclose(alone, F.linear(x, layer.weight, layer.bias), atol=1e-4)
    # the weight is laid out for its kernel: [in, out] contiguous for BLAS tiles, [out, in] for oneDNN
    assert layer.weight.shape == (d_out, d_in)
    assert (layer.weight.t() if kernel == "blas" else layer.weight).is_contiguous()


def test_kernels_are_chosen_by_layer_shape_and_a_failing_onednn_falls_back(monkeypatch):
    """Big layers run on oneDNN, small ones on BLAS tiles (a shape rule: every replica picks
    alike); where oneDNN fails the row-invariance probe, the layer runs on BLAS tiles."""
    import ralm.batching.invariant as inv
    from ralm import constants as C
    from tests.factories import tiny_causal_lm

    model = make_invariant(tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3))
    assert {m.kernel for m in model.modules() if isinstance(m, InvariantLinear)} == {"blas"}

    monkeypatch.setattr(C, "INVARIANT_ONEDNN_MIN_WEIGHTS", 64 * 128)
    model = make_invariant(tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3))
    by_size = {
        (m.in_features * m.out_features >= 64 * 128, m.kernel)
        for m in model.modules()
        if isinstance(m, InvariantLinear)
    }
    want = "onednn" if onednn_available() else "blas"
    assert by_size == {(False, "blas"), (True, want)}
    assert "onednn" not in inv.invariant_kernels(model) or want == "onednn"

    real = inv.onednn_linear
    monkeypatch.setattr(inv, "onednn_linear", lambda x, w, b: real(x, w, b) + x.shape[0] * 1e-3)  # row count leaks in
    model = make_invariant(tiny_causal_lm("llama", vocab_size=300, eos_token_id=0, seed=3))
    assert {m.kernel for m in model.modules() if isinstance(m, InvariantLinear)} == {"blas"}


def test_row_invariance_check_raises_when_rows_differ():
    class Noisy(InvariantLinear):
        def forward(self, x):  # a row's value depends on the batch size: not invariant
            return super().forward(x) + x.shape[0] * 1e-3

    check_row_invariance(InvariantLinear(torch.randn(8, 8), None, 16))
    with pytest.raises(InvariantUnavailable, match="not row-invariant"):
        check_row_invariance(Noisy(torch.randn(8, 8), None, 16))


@pytest.mark.parametrize(
    "mod,ref",
    [
        (InvariantSiLU(), F.silu),
        (InvariantGELU(), F.gelu),
        (InvariantGELUTanh(), lambda x: F.gelu(x, approximate="tanh")),
    ],
)
def test_activations_are_position_independent_and_the_right_function(mod, ref):
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)) * 8
    vec = mod(x)  # contiguous: SIMD body
    strided = mod(torch.stack([x, x], 1)[:, 0])  # strided: the scalar loop
    tails = torch.cat([mod(x[i : i + 7].clone()) for i in range(0, 700, 7)])  # short tensors: tails
    assert torch.equal(vec, strided)
    assert torch.equal(tails, vec[:700])
    assert torch.allclose(vec, ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_are_the_same_at_any_row_count_and_the_right_function(dtype):
    """float32 on a CPU takes torch's fused rms_norm (one op); every dtype: a row's bits at any
    row count and position equal its bits alone, and the function is Llama's RMSNorm."""
    g = torch.Generator().manual_seed(4)
    d = 576
    norm = CastFreeRMSNorm(torch.nn.Parameter((torch.randn(d, generator=g) + 1).to(dtype)), 1e-5)
    x = (torch.randn(203, d, generator=g) * torch.rand(203, 1, generator=g) * 10).to(dtype)
    with torch.inference_mode():
        full = norm(x)
        assert all(torch.equal(norm(x[i : i + 1])[0], full[i]) for i in range(0, 203, 7))
        assert all(torch.equal(norm(x[:n]), full[:n]) for n in (1, 2, 3, 5, 17, 64, 100))
        assert torch.equal(norm(x.view(1, 203, d))[0], full)  # packed [1, N, d] as the model feeds it
        h = x.float()
        want = norm.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        assert torch.allclose(full.float(), want, atol=tol, rtol=tol)


def _reference_attention(q, k, v, pos, scaling):
    """Plain softmax attention in float64: q [H, nq, D], k/v [Hkv, L, D] -> [nq, H, D]."""
    H, hkv = q.shape[0], k.shape[0]
    k = k.double().repeat_interleave(H // hkv, 0)
    v = v.double().repeat_interleave(H // hkv, 0)
    s = q.double() @ k.transpose(1, 2) * scaling
    mask = torch.arange(k.shape[1])[None, :] > pos[:, None]
    s = s.masked_fill(mask, -math.inf)
    return (s.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("hkv", [4, 2])
def test_attend_is_attention_and_chunk_invariant(hkv):
    g = torch.Generator().manual_seed(hkv)
    H, D, L = 4, 16, 150
    q = torch.randn(H, L, D, generator=g)
    k = torch.randn(hkv, L, D, generator=g)
    v = torch.randn(hkv, L, D, generator=g)
    pos = torch.arange(L)

    def att(qq, kk, vv, pp):  # one sequence (S = 1)
        kp, va = pad_kv(kk, vv)
        return attend(qq[None], kp[None], va[None], pp[None], 0.25)[0]

    full = att(q, k, v, pos)
    assert torch.allclose(full.double(), _reference_attention(q, k, v, pos, 0.25), atol=1e-5)
    # query i alone, seeing only keys 0..i (a decode step), and chunks of 37: same bits
    for i in [0, 1, 63, 64, 65, 149]:
        assert torch.equal(att(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], pos[i : i + 1]), full[i : i + 1])
    for a in range(0, L, 37):
        b = min(L, a + 37)
        assert torch.equal(att(q[:, a:b], k[:, :b], v[:, :b], pos[a:b]), full[a:b])
    # next to other sequences: a stacked call over longer key ranges changes no bit
    kp, va = pad_kv(k, v)
    other = torch.randn(3, H, 1, D, generator=g)
    qs = torch.cat([q[None, :, 70:71], other])
    ps = torch.tensor([[70], [149], [3], [100]])
    many = attend(qs, kp.expand(4, -1, -1, -1), va.expand(4, -1, -1, -1), ps, 0.25)
    assert torch.equal(many[0], full[70:71])


# ----------------------------------------------------------------------------- whole model
def _chunked_logits(model, ids: list[int], sizes: list[int]) -> torch.Tensor:
    from transformers import DynamicCache

    cache, out, i, j = DynamicCache(), [], 0, 0
    while i < len(ids):
        n = sizes[j % len(sizes)]
        o = model(input_ids=torch.tensor([ids[i : i + n]]), use_cache=True, **cache_kwargs(model, cache))
        cache = cache_of(o)
        out.append(o.logits[0])
        i, j = i + n, j + 1
    return torch.cat(out)


@torch.inference_mode()
def test_one_pass_chunks_and_token_by_token_give_the_same_logits(family_model):
    family, model = family_model
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 290, (133,), generator=g).tolist()
    one = model(input_ids=torch.tensor([ids])).logits[0]
    assert torch.equal(_chunked_logits(model, ids, [1]), one), family
    assert torch.equal(_chunked_logits(model, ids, [37]), one), family
    assert torch.equal(_chunked_logits(model, ids, [5, 64, 1, 16]), one), family


@torch.inference_mode()
@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_invariant_model_computes_the_same_function_as_the_plain_one(family):
    from tests.factories import tiny_causal_lm

    plain = tiny_causal_lm(family, vocab_size=300, eos_token_id=0, seed=3)
    ids = torch.randint(1, 290, (1, 90), generator=torch.Generator().manual_seed(2))
    want = plain(input_ids=ids).logits
    got = make_invariant(tiny_causal_lm(family, vocab_size=300, eos_token_id=0, seed=3))(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_make_invariant_is_idempotent_and_shares_tied_weights():
    model = invariant_model("gpt2")
    before = [id(p) for p in model.parameters()]
    assert make_invariant(model) is model
    assert [id(p) for p in model.parameters()] == before
    assert model.lm_head.weight is model.transformer.wte.weight


def test_unsupported_architecture_is_a_clear_error():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=50)
    with pytest.raises(InvariantUnavailable, match="gpt_neox.*invariant=false"):
        make_invariant(GPTNeoXForCausalLM(cfg))


def test_an_engine_on_an_unsupported_model_keeps_serving_without_batching():
    """The default (invariant on) does not refuse a model it cannot make invariant: the engine
    says why, and steps run one at a time on the untouched model."""
    from transformers import OPTConfig, OPTForCausalLM

    from ralm.config import GeneratorConfig
    from ralm.engine import LMEngine
    from tests.factories import tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = OPTConfig(
        num_hidden_layers=1,
        hidden_size=32,
        ffn_dim=64,
        num_attention_heads=2,
        vocab_size=len(tok),
        word_embed_proj_dim=32,
        activation_function="quick_gelu",
    )  # no invariant form
    model = OPTForCausalLM(cfg).eval()
    engine = LMEngine(model, tok, GeneratorConfig(model="tiny-opt-quick-gelu"))
    assert engine.batcher is None and "QuickGELU" in (engine.invariant_error or "")
    assert not any(isinstance(m, InvariantLinear) for m in model.modules())  # nothing rewritten
    out = engine.step(None, engine.encode_question("still serving"), 3)
    assert out.forward_passes >= 1


def test_padding_mask_is_refused_not_ignored():
    model = invariant_model("gpt2")
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    with pytest.raises(InvariantUnavailable, match="padding"), torch.inference_mode():
        model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]).view(2, 1, 1, 3).bool())
