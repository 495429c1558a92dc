"""The batch-invariant Triton kernels (ralm.batching.triton_kernels), run in triton's
interpreter on CPU tensors: each computes its plain op, and a row's (a query's) bits do
not depend on the batch, its neighbours, the chunking or the padding; then whole tiny
models on them (``make_invariant(kernels="triton")``).

triton reads ``TRITON_INTERPRET`` when a function is decorated, its own library helpers
(``tl.zeros``, ``tl.sum``, ...) included: the variable must be set before triton is first
imported in the process. This module sets it before it imports anything that imports
triton (nothing collected before it does; the ``interpreter`` fixture fails loudly
otherwise), and :mod:`ralm.batching.triton_kernels` builds its kernels on first use, per
value of the variable. triton is a dev dependency: without it these tests fail, they do
not skip.

What the interpreter cannot show as it is: its ``tl.dot`` is numpy's matmul, i.e. OpenBLAS
sgemm for float32, which gives a row other bits at another position in the tile (measured:
rows 6-11 of every 12), and garbage for bfloat16 (raw 16-bit patterns multiplied). A GPU's
MMA computes every output element the same way wherever it sits in the tile, which is what
the kernels rely on; the ``interpreter`` fixture models that: ``tl.dot`` becomes
:func:`cluster.bench.gpu_bits.fixed_order_dot`, a fixed-order float32 sum over k for every
element (``acc + a[:, 0] b[0] + a[:, 1] b[1] + ...``, operands converted exactly to float32). The
interpreter also truncates float32 to bfloat16 where a GPU rounds to nearest even; the fixture
rounds (:func:`cluster.bench.gpu_bits.rne_cast`), so a kernel's roundings can be compared with
torch's bit for bit. Everything else (tiling, masks, the K loop,
the online softmax, the casts) runs as the interpreter runs it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (see above)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cluster.bench.gpu_bits import fixed_order_dot, rne_cast  # noqa: E402
from ralm import constants as C  # noqa: E402
from ralm.batching import (
    triton_compile as TC,  # noqa: E402
    triton_kernels as T,  # noqa: E402
    triton_paged as TP,  # noqa: E402
)
from ralm.batching.invariant import (  # noqa: E402
    InvariantLinear,
    head_dim,
    invariant_kernels,
    make_invariant,
)
from ralm.batching.kv_pool import KVPool  # noqa: E402
from ralm.batching.packed import packed_forward  # noqa: E402
from ralm.batching.paged_kv import PagedKV  # noqa: E402
from ralm.batching.triton_forward import TritonLayerNorm, TritonRMSNorm  # noqa: E402
from ralm.errors import InvariantUnavailable  # noqa: E402
from tests.factories import tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.unit

#: dtype -> (matmul/attention tolerance against float64, norm tolerance)
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 4e-3), torch.bfloat16: (2e-2, 4e-2)}


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    assert T.triton_available(), "triton is a dev dependency (pip install -e '.[dev]')"
    from triton.runtime.interpreter import InterpretedFunction, interpreter_builder

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(T.tl.zeros, InterpretedFunction), "triton was imported before TRITON_INTERPRET=1 was set"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter_builder, "create_dot", fixed_order_dot)
        mp.setattr(interpreter_builder, "cast_impl", rne_cast(interpreter_builder.cast_impl))
        yield


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_the_kernels_run_in_the_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    assert all(isinstance(k, InterpretedFunction) for k in T.kernels().values())


# ----------------------------------------------------------------------------- matmul
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matmul_is_the_linear_map_and_rows_are_batch_invariant(dtype):
    K, N = 48, 56  # neither a multiple of the tiles: masked tails
    x = _randn(40, K, seed=1, dtype=dtype)
    w, b = _randn(N, K, seed=2, dtype=dtype), _randn(N, seed=3, dtype=dtype)
    y = T.matmul(x, w, b)
    assert y.dtype == dtype and y.shape == (40, N)
    ref = F.linear(x.double(), w.double(), b.double())
    assert torch.allclose(y.double(), ref, atol=TOL[dtype][0] * 20, rtol=TOL[dtype][0])
    alone = torch.cat([T.matmul(x[i : i + 1], w, b) for i in range(40)])
    assert torch.equal(alone, y)
    for start, n in [(0, 2), (5, 3), (1, 17), (23, 17)]:
        assert torch.equal(T.matmul(x[start : start + n], w, b), alone[start : start + n]), (start, n)
    # other neighbours, a strided x and a transposed (non-contiguous) weight: the same bits
    other = _randn(40, K, seed=4, dtype=dtype)
    other[7] = x[7]
    assert torch.equal(T.matmul(other, w, b)[7], alone[7])
    wide = torch.cat([x, x], dim=1)[:, :K]
    assert torch.equal(T.matmul(wide, w.t().contiguous().t(), b), alone)
    assert torch.allclose(T.matmul(x, w).double(), ref - b.double(), atol=TOL[dtype][0] * 20, rtol=TOL[dtype][0])
    # leading dimensions: merged into rows in place ([1, 40, K], [5, 8, K]) or, where they do
    # not merge (every other row of a [10, 8, K] tensor), copied first: the same bits either way
    assert torch.equal(T.matmul(x.view(1, 40, K), w, b), y.view(1, 40, N))
    assert torch.equal(T.matmul(x.view(5, 8, K), w, b), y.view(5, 8, N))
    assert T.flat_rows(x.view(5, 8, K)) == (40, K)
    gappy = torch.stack([x.view(5, 8, K), other.view(5, 8, K)], dim=1).view(10, 8, K)[::2]
    assert T.flat_rows(gappy) is None
    assert torch.equal(T.matmul(gappy, w, b), y.view(5, 8, N))


# ----------------------------------------------------------------------------- norms
def _hf_rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_norms_compute_their_formula_row_by_row(dtype):
    d = 48
    x = (_randn(24, d, seed=5) * 3 + 1).to(dtype)
    w, b = (1 + _randn(d, seed=6)).to(dtype), _randn(d, seed=7).to(dtype)
    tol = TOL[dtype][1]
    rms = T.rms_norm(x, w, 1e-6)
    assert rms.dtype == dtype
    assert torch.allclose(rms.double(), _hf_rms_norm(x, w, 1e-6).double(), atol=tol, rtol=tol)
    ln = T.layer_norm(x, w, b, 1e-5)
    assert ln.dtype == dtype
    ref = F.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-5)
    assert torch.allclose(ln.double(), ref, atol=tol, rtol=tol)
    assert torch.allclose(
        T.layer_norm(x, None, None, 1e-5).double(), F.layer_norm(x.double(), (d,)), atol=tol, rtol=tol
    )
    for norm in (lambda r: T.rms_norm(r, w, 1e-6), lambda r: T.layer_norm(r, w, b, 1e-5)):
        whole = norm(x)
        assert torch.equal(torch.cat([norm(x[i : i + 1]) for i in range(24)]), whole)
        assert torch.equal(norm(torch.cat([x[:3], x[10:]])[2:4]), whole[2:11:8])
        # leading dimensions merged into rows in place (also rows of a wider tensor: a row stride of 2d)
        assert torch.equal(norm(x.view(2, 12, d)), whole.view(2, 12, d))
        assert torch.equal(norm(torch.cat([x, x], dim=1)[:, :d].view(4, 6, d)), whole.view(4, 6, d))


# ----------------------------------------------------------------------------- attention
def _ref_attention(q, k, v, pos, scaling):
    """Plain causal softmax attention in float64: ``[S, nq, H, D]``."""
    S, H, nq, D = q.shape
    G = H // k.shape[1]
    out = torch.empty(S, nq, H, D, dtype=torch.float64)
    for s in range(S):
        for h in range(H):
            for i in range(nq):
                p = int(pos[s, i])
                sc = (k[s, h // G, : p + 1].double() @ q[s, h, i].double()) * scaling
                out[s, i, h] = torch.softmax(sc, 0) @ v[s, h // G, : p + 1].double()
    return out


@pytest.mark.parametrize(
    "dtype,D", [(torch.float32, 16), (torch.float32, 24), (torch.float16, 32), (torch.bfloat16, 16)]
)
def test_attention_is_causal_softmax_and_a_query_is_the_same_wherever_it_runs(dtype, D):
    L, H, Hkv, sc = 80, 4, 2, D**-0.5  # two key blocks; grouped-query heads
    q, k, v = (_randn(1, n, L, D, seed=10 + i, dtype=dtype) for i, n in enumerate((H, Hkv, Hkv)))
    pos = torch.arange(L)[None]
    full = T.attention(q, k, v, pos, sc)  # the whole prefill in one pass
    assert full.dtype == dtype and full.shape == (1, L, H, D)
    tol = TOL[dtype][0] * 10
    assert torch.allclose(full.double(), _ref_attention(q, k, v, pos, sc), atol=tol, rtol=tol)
    # alone (nq = 1, only its own keys), at block edges and inside blocks
    for p in (0, 9, 63, 64, 79):
        one = T.attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], pos[:, p : p + 1], sc)
        assert torch.equal(one[0, 0], full[0, p]), p
    # chunked prefill (chunks of 5, keys up to the chunk's end) and a padded key range
    chunks = [
        T.attention(q[:, :, a : a + 5], k[:, :, : a + 5], v[:, :, : a + 5], pos[:, a : a + 5], sc)
        for a in range(0, L, 5)
    ]
    assert torch.equal(torch.cat(chunks, dim=1), full)
    kp, vp = (torch.cat([t, _randn(1, Hkv, 50, D, seed=20, dtype=dtype) * 1e3], dim=2) for t in (k, v))
    # (queries 50-63 share a tile with 64-65: block 1 is wholly hidden from them, a no-op)
    assert torch.equal(T.attention(q[:, :, 50:71], kp, vp, pos[:, 50:71], sc), full[:, 50:71])
    # next to other sequences of other lengths (S = 3, keys padded to the longest; padded
    # query rows repeat the last position, as PackedBatch lays them out)
    n = 6  # new tokens of each sequence; the sequences are 80, 33 and 7 long
    ks, vs = (torch.cat([t, _randn(2, Hkv, L, D, seed=30 + i, dtype=dtype)]) for i, t in enumerate((k, v)))
    qs = torch.cat([q[:, :, 74:80], _randn(2, H, n, D, seed=32, dtype=dtype)])
    ps = torch.tensor([[74 + t for t in range(n)], [27 + t for t in range(n)], [6, 6, 6, 6, 6, 6]])
    ps[2, 0] = 5  # the 7-token sequence: 2 new tokens (positions 5, 6), then padded rows
    many = T.attention(qs, ks, vs, ps, sc)
    assert torch.equal(many[0], full[0, 74:80])
    assert torch.allclose(many.double(), _ref_attention(qs, ks, vs, ps, sc), atol=tol, rtol=tol)
    assert torch.equal(many[2, 1], T.attention(qs[2:, :, 1:2], ks[2:, :, :7], vs[2:, :, :7], ps[2:, 1:2], sc)[0, 0])
    # grouped-query heads read their kv head: the same bits as the kv heads repeated
    rep = T.attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), pos, sc)
    assert torch.equal(rep, full)


# ----------------------------------------------------------------------------- paged attention
@pytest.mark.parametrize("dtype,D", [(torch.float32, 16), (torch.float16, 32), (torch.bfloat16, 24)])
def test_paged_attention_is_the_contiguous_kernel_in_one_launch(dtype, D):
    """Three sequences (80, 33 and 7 positions; 20, 1 and 7 new rows: a prefill chunk that
    straddles a block edge, a decode token, a whole short prefill) in one launch, their
    blocks scattered through the pool: every row is the contiguous kernel's, bit for bit."""
    B, H, Hkv, sc = T.ATTN_BLOCK_N, 4, 2, D**-0.5
    lens, new = [80, 33, 7], [20, 1, 7]
    tables = [[5, 2], [7], [1]]  # pool blocks of each sequence, out of order
    k_pool = _randn(Hkv, 9, B, D, seed=40, dtype=dtype) * 3
    v_pool = torch.cat([_randn(Hkv, 9, B, D, seed=41, dtype=dtype), torch.ones(Hkv, 9, B, 1, dtype=dtype)], -1)
    qs = [_randn(n, H, D, seed=42 + i, dtype=dtype) for i, n in enumerate(new)]
    pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    starts = [0, 20, 21]
    tab = torch.tensor([t + [0] * (2 - len(t)) for t in tables], dtype=torch.int32)
    out = TP.paged_attention(torch.cat(qs), k_pool, v_pool, tab, TP.query_tiles(starts, new, "cpu"), pos, sc)
    assert out.shape == (28, H, D) and out.dtype == dtype
    for s, (n, m) in enumerate(zip(lens, new)):
        k = torch.cat([k_pool[:, b] for b in tables[s]], dim=1)[:, :n][None]  # [1, Hkv, n, D]
        v = torch.cat([v_pool[:, b] for b in tables[s]], dim=1)[:, :n, :D][None]
        q = qs[s].permute(1, 0, 2)[None]  # [1, H, m, D]
        want = T.attention(q, k, v, torch.arange(n - m, n)[None], sc)[0]
        assert torch.equal(out[starts[s] : starts[s] + m], want), s
    # a row alone in its launch: the same bits
    one = TP.paged_attention(qs[0][5:6], k_pool, v_pool, tab[:1], TP.query_tiles([0], [1], "cpu"), pos[5:6], sc)
    assert torch.equal(one[0], out[5])


@pytest.mark.parametrize("dtype,D", [(torch.float32, 16), (torch.float16, 32), (torch.bfloat16, 64)])
def test_rotary_paged_attention_is_the_torch_rotation_a_pool_write_and_the_paged_kernel(dtype, D):
    """The fused launch of a Llama layer's attention (rotary_kv_write, then the paged kernel
    reading the queries in place) against transformers' rotation in torch, a pool write and
    :func:`paged_attention`: the same queries, keys, values and outputs, bit for bit; the
    pool's other slots untouched."""
    from transformers.models.llama.modeling_llama import rotate_half

    B, H, Hkv, sc = T.ATTN_BLOCK_N, 4, 2, D**-0.5
    lens, new = [80, 33], [20, 1]  # a prefill chunk over a block edge, a decode token
    tables = [[5, 2], [7]]
    N, W = sum(new), (H + 2 * Hkv) * D
    k_pool = _randn(Hkv, 9, B, D, seed=50, dtype=dtype)
    v_pool = torch.cat([_randn(Hkv, 9, B, D, seed=51, dtype=dtype), torch.ones(Hkv, 9, B, 1, dtype=dtype)], -1)
    qkv = _randn(1, N, W, seed=52, dtype=dtype) * 2
    pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    ang = pos[:, None].double() * (1e-2 ** (torch.arange(D // 2).double() / (D // 2)))[None]
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(dtype)[None] for f in (torch.cos, torch.sin))
    blocks = torch.tensor([tables[s][p // B] for s, (n, m) in enumerate(zip(lens, new)) for p in range(n - m, n)])
    offsets = pos % B
    tab = torch.tensor([t + [0] * (2 - len(t)) for t in tables], dtype=torch.int32)
    tiles = TP.query_tiles([0, new[0]], new, "cpu")

    # the reference: torch's rotation (transformers' formula), a pool write, the paged kernel
    x = qkv[0].view(N, H + 2 * Hkv, D)
    rot = x[:, : H + Hkv] * cos[0][:, None] + rotate_half(x[:, : H + Hkv]) * sin[0][:, None]
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref[:, blocks, offsets] = rot[:, H:].transpose(0, 1)
    v_ref[:, blocks, offsets, :D] = x[:, H + Hkv :].transpose(0, 1)
    want = TP.paged_attention(rot[:, :H].contiguous(), k_ref, v_ref, tab, tiles, pos, sc)

    got_qkv = qkv.clone()
    out = TP.rotary_paged_attention(got_qkv, cos, sin, H, Hkv, k_pool, v_pool, (blocks, offsets), tab, tiles, pos, sc)
    assert out.shape == (1, N, H * D) and out.dtype == dtype
    assert torch.equal(got_qkv[0].view(N, -1, D)[:, :H], rot[:, :H])  # queries rotated in place
    assert torch.equal(got_qkv[0].view(N, -1, D)[:, H:], x[:, H:])  # keys and values left as they were
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)  # written where they belong, nowhere else
    assert torch.equal(out[0].view(N, H, D), want)


def test_gpu_checks_fused_rotation_count_sees_a_rounding_that_is_not_torchs(monkeypatch):
    """``gpu-check``'s bits line for the fused rotation: 0 differing rows where the kernel rounds
    as torch does (the GPU's round-to-nearest-even bfloat16 cast, modelled here), and rows
    that differ under the interpreter's own truncating cast: the check can fail."""
    import types

    from triton.runtime.interpreter import InterpreterBuilder, interpreter_builder

    from cluster.bench.gpu_bits import fused_rotation

    args = ("cpu", torch.bfloat16, 16, 2, [1100, 130], [1, 19])
    assert fused_rotation(*args) == {"rows": 20, "differing_rows": 0}
    monkeypatch.setattr(
        interpreter_builder, "cast_impl", types.MethodType(InterpreterBuilder.cast_impl, interpreter_builder)
    )
    assert fused_rotation(*args)["differing_rows"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_mul_is_the_gated_activation_row_by_row(dtype):
    from ralm.batching.invariant import InvariantSiLU

    I = 40  # noqa: E741
    x = _randn(1, 7, 2 * I, seed=60, dtype=dtype) * 3
    y = T.silu_mul(x)
    assert y.shape == (1, 7, I) and y.dtype == dtype
    g, u = x.double().split(I, dim=-1)
    want = InvariantSiLU()(g) * u
    tol = TOL[dtype][1]
    assert torch.allclose(y.double(), want, atol=tol, rtol=tol), (y.double() - want).abs().max()
    for r in (0, 3, 6):  # a row alone: the same bits
        assert torch.equal(T.silu_mul(x[:, r : r + 1])[0, 0], y[0, r])


def test_paged_attention_refuses_a_pool_of_other_blocks():
    q = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="blocks of 64"):
        TP.paged_attention(
            q,
            torch.zeros(2, 2, 32, 16),
            torch.zeros(2, 2, 32, 17),
            torch.zeros(1, 1, dtype=torch.int32),
            TP.query_tiles([0], [1], "cpu"),
            torch.zeros(1, dtype=torch.long),
            0.25,
        )


# ----------------------------------------------------------------------------- models
@pytest.fixture(scope="module", params=["llama", "gpt2"])
def triton_model(request, interpreter):
    plain = tiny_causal_lm(request.param, vocab_size=300, eos_token_id=0, seed=3)
    model = make_invariant(tiny_causal_lm(request.param, vocab_size=300, eos_token_id=0, seed=3), kernels="triton")
    return request.param, plain, model


def test_make_invariant_puts_every_part_on_the_triton_kernels(triton_model):
    family, plain, model = triton_model
    assert invariant_kernels(model) == T.DESCRIPTION
    mods = list(model.modules())
    assert {m.kernel for m in mods if isinstance(m, InvariantLinear)} == {"triton"}
    norm = TritonRMSNorm if family == "llama" else TritonLayerNorm
    assert sum(isinstance(m, norm) for m in mods) == 2 * 2 + 1
    assert not any(type(m).__name__ in ("LlamaRMSNorm", "LayerNorm") for m in mods)
    final = model.model.norm if family == "llama" else model.transformer.ln_f
    assert (
        final.weight
        is dict(model.named_parameters())["model.norm.weight" if family == "llama" else "transformer.ln_f.weight"]
    )


@torch.inference_mode()
def test_packed_and_chunked_forwards_equal_the_sequence_alone(triton_model):
    family, plain, model = triton_model
    L = model.config.num_hidden_layers
    # 70 tokens: two key blocks, and prefill chunks whose query tile straddles them
    seq = [(37 * i + 5) % 290 + 1 for i in range(70)]
    others = [[11, 12, 13], [200, 201, 202, 203, 204, 205, 206]]
    kv = PagedKV.standalone(L)
    alone = packed_forward(model, [(kv, seq)], range(len(seq)))
    ref = plain(input_ids=torch.tensor([seq])).logits[0]
    assert torch.allclose(alone, ref, atol=1e-4, rtol=1e-4), (alone - ref).abs().max()
    # packed with two sequences of other lengths, in the middle of the batch
    kvs = [PagedKV.standalone(L) for _ in range(3)]
    rows = range(len(others[0]), len(others[0]) + len(seq))
    packed = packed_forward(model, [(kvs[0], others[0]), (kvs[1], seq), (kvs[2], others[1])], rows)
    assert torch.equal(packed, alone)
    # chunked prefill (chunks of 5), then a decode step next to the others' decode steps
    kc = PagedKV.standalone(L)
    chunked = torch.cat(
        [packed_forward(model, [(kc, seq[a : a + 5])], range(len(seq[a : a + 5]))) for a in range(0, len(seq), 5)]
    )
    assert torch.equal(chunked, alone)
    n, span = len(seq), 2 * C.INVARIANT_KEY_BLOCK
    for i in range(L):
        want_k, want_v = (t[:, :n] for t in kv.span(i, span))
        assert torch.equal(kc.span(i, span)[0][:, :n], want_k)
        assert torch.equal(kvs[1].span(i, span)[0][:, :n], want_k)
        assert torch.equal(kvs[1].span(i, span)[1][:, :n], want_v)
    step = packed_forward(model, [(kvs[0], [4]), (kvs[1], [9]), (kvs[2], [4])])[1]
    assert torch.equal(step, packed_forward(model, [(kv, [9])])[0])


@torch.inference_mode()
def test_paged_sequences_in_one_launch_equal_the_sequence_alone(triton_model):
    """The pool path on the Triton kernels (one write and one attention launch per layer):
    a prefill next to others, a fork sharing its blocks, and decode steps equal the sequence
    alone in its own buffers."""
    family, plain, model = triton_model
    L = model.config.num_hidden_layers
    seq = [(37 * i + 5) % 290 + 1 for i in range(70)]
    kv = PagedKV.standalone(L)
    alone = packed_forward(model, [(kv, seq)], range(len(seq)))
    pool = KVPool(L, initial_blocks=2)  # it grows during the first forward
    kvs = [PagedKV(pool) for _ in range(3)]
    rows = range(3, 3 + len(seq))
    packed = packed_forward(model, [(kvs[0], [11, 12, 13]), (kvs[1], seq), (kvs[2], [200, 201])], rows)
    assert torch.equal(packed, alone)
    twin = kvs[1].fork()  # shares both blocks; the decode step below copies the partial one
    steps = packed_forward(model, [(kvs[0], [4]), (kvs[1], [9]), (twin, [9]), (kvs[2], [4])])
    want = packed_forward(model, [(kv, [9])])[0]
    assert torch.equal(steps[1], want) and torch.equal(steps[2], want)
    assert pool.copies == 1 and pool.grows >= 1


@torch.inference_mode()
def test_the_triton_backends_pool_has_no_ones_column_and_the_same_bits(triton_model):
    """The Triton kernels keep the softmax sum in registers: a pool laid out for them stores
    ``D``-wide values (no column of ones), and its sequences get the bits of the default layout."""
    from ralm.batching.attention_backend import attention_backend

    family, plain, model = triton_model
    L = model.config.num_hidden_layers
    assert attention_backend(model).value_ones is False
    seq = [(37 * i + 5) % 290 + 1 for i in range(70)]
    kv = PagedKV.standalone(L)  # the default layout, with the ones column
    want = packed_forward(model, [(kv, seq)], range(len(seq)))
    pool = KVPool(L, initial_blocks=2, value_ones=False)
    kvs = [PagedKV(pool) for _ in range(2)]
    got = packed_forward(model, [(kvs[0], [11, 12, 13]), (kvs[1], seq)], range(3, 3 + len(seq)))
    assert torch.equal(got, want)
    assert pool.v[0].shape[-1] == pool.k[0].shape[-1] == kv.pool.v[0].shape[-1] - 1
    steps = packed_forward(model, [(kvs[0], [4]), (kvs[1], [9])])
    assert torch.equal(steps[1], packed_forward(model, [(kv, [9])])[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_equals_contiguous_with_random_block_tables_past_position_2048(dtype):
    """Random block tables over a shuffled pool, sequences reaching positions 2,100-2,200 (34
    key blocks), decode rows, a prefill chunk crossing a block edge, grouped heads: every
    row of the one paged launch is the contiguous launch's, bit for bit."""
    g = torch.Generator().manual_seed(7)
    B, H, Hkv, D = T.ATTN_BLOCK_N, 2, 1, 16
    lens, new = [2171, 2100, 130], [1, 19, 3]  # the second: rows 2081-2099, a block edge at 2048
    need = [-(-n // B) for n in lens]
    perm = torch.randperm(sum(need) + 5, generator=g)  # spare blocks: not every pool block is used
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n].tolist())
        at += n
    nblk = sum(need) + 5
    k_pool = _randn(Hkv, nblk, B, D, seed=50, dtype=dtype)
    v_pool = _randn(Hkv, nblk, B, D + 1, seed=51, dtype=dtype)
    qs = [_randn(m, H, D, seed=52 + i, dtype=dtype) for i, m in enumerate(new)]
    pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    starts = [sum(new[:i]) for i in range(len(new))]
    width = max(need)
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = TP.paged_attention(torch.cat(qs), k_pool, v_pool, tab, TP.query_tiles(starts, new, "cpu"), pos, D**-0.5)
    assert out.isfinite().all()
    for s, (n, m) in enumerate(zip(lens, new)):
        k = torch.cat([k_pool[:, b] for b in tables[s]], dim=1)[:, :n][None]
        v = torch.cat([v_pool[:, b] for b in tables[s]], dim=1)[:, :n, :D][None]
        want = T.attention(qs[s].permute(1, 0, 2)[None], k, v, torch.arange(n - m, n)[None], D**-0.5)[0]
        assert torch.equal(out[starts[s] : starts[s] + m], want), s
    ref = _ref_attention(
        qs[0].permute(1, 0, 2)[None],
        k_pool[:, tables[0]].flatten(1, 2)[None, :, : lens[0]],
        v_pool[:, tables[0]].flatten(1, 2)[None, :, : lens[0], :D],
        pos[:1][None],
        D**-0.5,
    )
    tol = TOL[dtype][0] * 10
    assert torch.allclose(out[:1].double(), ref[0], atol=tol, rtol=tol)


def test_compile_kernels_launches_every_configuration_and_names_the_one_that_fails():
    labels = TC.compile_kernels(
        "cpu",
        torch.float16,
        [16, 24],
        groups=[1, 2],
        linear_shapes=[(40, 24, True), (8, 16, False)],
        norms=[("rms", 24, True, False), ("layer", 24, True, True)],
        gated_widths=[40],
    )
    assert labels == [
        "matmul/float16/40x24+bias",
        "matmul/float16/8x16",
        "rms_norm/float16/d24",
        "layer_norm/float16/d24",
        "silu_mul/float16/i40",
        *[
            f"{k}attention/float16/d{d}/group{g}"
            for d in (16, 24)
            for g in (1, 2)
            for k in ("", "paged_", "rotary_paged_")
        ],
    ]
    with pytest.raises(InvariantUnavailable, match=r"attention/float32/d320/group1 does not compile or run on cpu"):
        TC.compile_kernels("cpu", torch.float32, [320])


def test_model_kernel_shapes_lists_what_a_model_on_the_kernels_launches(triton_model):
    family, plain, model = triton_model
    shapes = TC.model_kernel_shapes(model, head_dim(model))
    cfg = model.config
    assert shapes["head_dims"] == [cfg.hidden_size // cfg.num_attention_heads]
    assert shapes["groups"] == [cfg.num_attention_heads // getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)]
    assert (cfg.vocab_size, cfg.hidden_size, False) in shapes["linear_shapes"]
    kind = "rms" if family == "llama" else "layer"
    assert [n[0] for n in shapes["norms"]] == [kind]
    # the SiLU-gated MLP's one-launch activation: Llama's; GPT-2's MLP is not gated
    assert shapes["gated_widths"] == ([cfg.intermediate_size] if family == "llama" else [])
    assert TC.compile_kernels("cpu", torch.float32, **shapes)
