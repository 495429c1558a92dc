"""Batch-invariant Triton kernels: the invariant forward on NVIDIA GPUs.

On a GPU the plain forward is not batch-invariant: cuBLAS picks another GEMM kernel (other
tiles, split-K) when the row count M changes, so a row's bits depend on how many rows share
the product; torch's batched matmuls in attention and the norms' reductions change their
reduction order with the shape as well. The kernels here fix every reduction order by
construction, so a row's (a query's) result is a function of that row alone:

``matmul`` (linear layers)
    One program per ``[BLOCK_M, BLOCK_N]`` output tile loops over K in fixed ``BLOCK_K``
    steps, in increasing order, accumulating with ``tl.dot`` in float32 (IEEE float32
    products for float32 inputs: no TF32). No split-K, and the tile configuration depends
    on (dtype, N, K) only, never on M. An output element ``y[m, n]`` is therefore always
    the same sequence of ``tl.dot`` steps over row ``m`` of ``x`` and row ``n`` of the
    weight; the other rows of its tile (other requests, or zero padding past M) enter other
    output elements only. Masked K columns load zeros and add exact zeros.

``rms_norm`` / ``layer_norm``
    One program per row; the whole row is one ``BLOCK = next_pow2(d)`` vector reduced by
    ``tl.sum`` (a fixed tree for a fixed BLOCK). Nothing about the other rows or M enters.

``attention``
    One program per (sequence, head, tile of ``BLOCK_Q`` queries): an online softmax
    (float32 running max ``m``, sum ``l`` and accumulator ``acc``) over key blocks of a
    fixed ``BLOCK_N`` keys, in increasing order, blocks ``0 .. max_pos // BLOCK_N`` (the
    largest position in the tile). For one query, a block it cannot see wholly is masked:
    its probabilities are set to exact zeros (``tl.where``), its block max is ``-inf``, so
    ``m`` stays the same, ``alpha`` is set to exactly 1 and ``l * 1 + 0`` and
    ``acc * 1 + 0 @ v`` (finite values) leave ``l`` and ``acc`` bit for bit unchanged.
    Hence a query's result depends on its position, its own keys and values only, never on
    nq, L, S, its neighbours in the tile or how the context was chunked: alone
    (``nq = 1``), inside a whole prefill, in a chunk, or next to a longer sequence it runs
    the same steps over blocks ``0 .. pos // BLOCK_N`` and then only exact no-ops. Inside
    its last (partly visible) block the hidden keys get ``-inf`` scores and zero weights.

Example: with ``BLOCK_N = 64`` a query at position 70 folds in block 0 (keys 0-63) and
block 1 (keys 64-70, keys 71-127 hidden), whether it is a decode token, row 70 of a
100-token prefill (whose tile may run to block 1 anyway) or next to a 900-token sequence
(blocks 2-14 are no-ops for it).

``attention`` and :func:`ralm.batching.triton_paged.paged_attention` launch ONE kernel,
:data:`attention_kernel`: its ``PAGED`` flag picks where query rows and key blocks are read
(the program grid and one tensor per sequence, or tile arrays and a block table); the online
softmax is one piece of code for both layouts, so the paged result equals the contiguous
one bit for bit by construction, not by keeping two copies in step.

Addresses are computed in 64 bits in every kernel (program ids and index vectors are int64
before they meet a stride). :mod:`ralm.batching.triton_compile` compiles (and launches once)
every kernel a model needs before its proof runs.

The module imports without triton (``triton_available()`` says whether it is there). The
kernels are jitted at import: triton reads ``TRITON_INTERPRET`` then (and for its own
library functions at its first import), so the tests set it before anything imports triton
to run the kernels on CPU tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

try:  # an optional dependency: CUDA builds of torch ship it; CPU serving never needs it
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]

    _TRITON_ERROR: Exception | None = None
except ImportError as e:  # pragma: no cover - depends on the installation
    triton = None
    tl = None
    _TRITON_ERROR = e

#: attention tiles: queries per program and keys per block (the block size fixes the reduction order)
ATTN_BLOCK_Q = 16
ATTN_BLOCK_N = 64
#: the kernels' name as the model reports it (``invariant_kernels``)
DESCRIPTION = f"triton (fixed tiles, no split-K; row-wise norms; fixed {ATTN_BLOCK_N}-key blocks)"


def triton_available() -> bool:
    """Whether triton can be imported here."""
    return triton is not None


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _jit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``triton.jit(**options)``, or the function unchanged where triton is missing (the
    module still imports; :func:`kernels` raises)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        return triton.jit(**options)(fn) if triton is not None else fn

    return wrap


# Address arithmetic is 64-bit in every kernel: program ids, loaded block and row indices
# and the index vectors are cast to int64 before they meet a stride, so an offset past 2^31
# elements (a pool of 32 layers x 4,096 blocks of 64 positions x 8 heads x 128 columns, or a
# 2^31-element weight) never wraps.


# the row count is never specialised on (triton would compile another kernel for M == 1 or
# M % 16 == 0): one compiled kernel per (dtype, shape) serves every batch
@_jit(do_not_specialize=["M"])
def matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (unused without HAS_BIAS)
    y_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    sxm,
    sxk,
    swn,
    swk,
    sym,
    syn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the whole K range, in order, by this program: no split-K
        kk = k0 + rk
        a = tl.load(
            x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            w_ptr + kk[:, None] * swk + rn[None, :] * swn, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0
        )  # [BLOCK_K, BLOCK_N] = W^T tile
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * sym + rn[None, :] * syn,
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@_jit()
def rms_norm_kernel(
    x_ptr,  # [M, d]
    w_ptr,  # [d]
    y_ptr,  # [M, d], promote(weight, x) dtype
    d,
    sxm,
    sym,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * sxm + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / d
    h = h * (1.0 / tl.sqrt(var + eps))
    h = h.to(x.dtype).to(tl.float32)  # LlamaRMSNorm: weight * h.to(input_dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sym + cols, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


@_jit()
def layer_norm_kernel(
    x_ptr,  # [M, d]
    w_ptr,  # [d] (unused without HAS_W)
    b_ptr,  # [d] (unused without HAS_B)
    y_ptr,  # [M, d], x's dtype
    d,
    sxm,
    sym,
    eps,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    h = tl.load(x_ptr + row * sxm + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(h, axis=0) / d
    c = tl.where(mask, h - mean, 0.0)
    var = tl.sum(c * c, axis=0) / d  # biased, like torch
    y = c * (1.0 / tl.sqrt(var + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@_jit(do_not_specialize=["nq", "L"])
def attention_kernel(
    q_ptr,  # contiguous: [S, H, nq, D]; paged: [N, H, D] packed rows
    k_ptr,  # contiguous: [S, Hkv, L, D]; paged: one layer of the pool (block, offset, head, column)
    v_ptr,  # the same for the values (>= D columns, the first D are read)
    pos_ptr,  # contiguous: [S, nq] int64; paged: [N] int64, each packed row's position
    o_ptr,  # contiguous: [S, nq, H, D]; paged: [N, H, D]; q's dtype
    tab_ptr,  # paged: [S, max_blocks] int32 block tables (contiguous: unused)
    tile_seq_ptr,  # paged: [T] int32, each tile's sequence (contiguous: unused)
    tile_row_ptr,  # paged: [T] int32, its first packed row
    tile_n_ptr,  # paged: [T] int32, its rows (1 .. BLOCK_Q)
    nq,  # contiguous: query rows per sequence (paged: unused)
    L,  # keys at positions >= L are never read (contiguous: the padded length; paged: table width x BLOCK_N)
    D,
    GROUP,  # H // Hkv
    scaling,
    sqs,  # query row r of sequence s at s*sqs + r*sqn (paged: sqs = 0, rows are global)
    sqn,
    sqh,
    sqd,
    skb,  # contiguous: the sequence stride; paged: the pool's block stride
    skn,
    skh,
    skd,
    svb,
    svn,
    svh,
    svd,
    sps,
    spn,
    sts,
    stb,
    sos,
    son,
    soh,
    sod,
    PAGED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # The one attention kernel. PAGED chooses only where a tile's rows and a key block's
    # rows live (a tile array and a block table, or the program grid and one contiguous
    # tensor per sequence); the online softmax below is the same code for both, so the
    # paged result is the contiguous one bit for bit by construction.
    h = tl.program_id(1).to(tl.int64)
    kvh = h // GROUP
    if PAGED:
        t = tl.program_id(0)
        s = tl.load(tile_seq_ptr + t).to(tl.int64)
        r0 = tl.load(tile_row_ptr + t).to(tl.int64)
        nr = tl.load(tile_n_ptr + t).to(tl.int64)
    else:
        s = tl.program_id(2).to(tl.int64)
        r0 = tl.program_id(0).to(tl.int64) * BLOCK_Q
        nr = nq - r0
    rq = tl.arange(0, BLOCK_Q).to(tl.int64)
    rows = r0 + rq  # [BLOCK_Q] query rows (of the sequence; paged: packed rows)
    rd = tl.arange(0, BLOCK_D).to(tl.int64)
    rb = tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N] rows of a key block
    qmask = rq < nr
    dmask = rd < D
    q = tl.load(
        q_ptr + s * sqs + rows[:, None] * sqn + h * sqh + rd[None, :] * sqd,
        mask=qmask[:, None] & dmask[None, :],
        other=0.0,
    )  # [BLOCK_Q, BLOCK_D]
    pos = tl.load(pos_ptr + s * sps + rows * spn, mask=qmask, other=0)  # padded rows: position 0
    m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    lsum = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    max_pos = tl.max(pos, axis=0)
    n_blocks = max_pos // BLOCK_N + 1
    for j in range(0, n_blocks):  # fixed blocks, in order: block 0 holds key 0, seen by every query
        if PAGED:
            blk = tl.load(tab_ptr + s * sts + j * stb).to(tl.int64)
            k_off = blk * skb + rb * skn
            v_off = blk * svb + rb * svn
        else:
            k_off = s * skb + (j * BLOCK_N + rb) * skn
            v_off = s * svb + (j * BLOCK_N + rb) * svn
        rk = j * BLOCK_N + rb  # [BLOCK_N] key positions
        # keys past the tile's last position are never loaded (stale or padding content)
        kvmask = (rk[:, None] < L) & (rk[:, None] <= max_pos) & dmask[None, :]
        k = tl.load(k_ptr + k_off[:, None] + kvh * skh + rd[None, :] * skd, mask=kvmask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + kvh * svh + rd[None, :] * svd, mask=kvmask, other=0.0)
        # the online-softmax step over this block ([BLOCK_N, BLOCK_D] keys and values)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling  # [BLOCK_Q, BLOCK_N] float32
        seen = rk[None, :] <= pos[:, None]
        sc = tl.where(seen, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.where(m_new == m, 1.0, tl.exp(m - m_new))  # exactly 1 for a wholly hidden block
        p = tl.where(seen, tl.exp(sc - m_new[:, None]), 0.0)  # exact zeros for hidden keys
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    out = acc / lsum[:, None]
    tl.store(
        o_ptr + s * sos + rows[:, None] * son + h * soh + rd[None, :] * sod,
        out.to(o_ptr.dtype.element_ty),
        mask=qmask[:, None] & dmask[None, :],
    )


@_jit()
def silu_mul_kernel(
    x_ptr,  # [M, 2I]: gate columns 0..I-1, up columns I..2I-1
    y_ptr,  # [M, I], x's dtype
    I,
    sxm,
    sym,
    BLOCK: tl.constexpr,
):
    # InvariantSiLU's formula, x / (1 + exp(-x)), in float32 and rounded to the dtype as the
    # module's output is; then the product with the up projection, rounded once. Element-wise:
    # a row's bits are its own, whatever M is.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * sxm + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * sxm + I + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(y_ptr + row * sym + cols, (act * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


@_jit()
def rotary_kv_write_kernel(
    qkv_ptr,  # [N, (H + 2 Hkv) D]: a row's q heads, k heads, v heads (the stacked projection)
    cos_ptr,  # [N, D], the dtype of qkv
    sin_ptr,  # [N, D]
    k_ptr,  # one layer of the pool's keys (block, offset, head, column strides below)
    v_ptr,  # the values (>= D columns; the first D are written)
    blk_ptr,  # [N] int64: the pool block of row n's position
    off_ptr,  # [N] int64: its offset in the block
    sqn,
    scn,
    ssn,
    skb,
    skn,
    skh,
    skd,
    svb,
    svn,
    svh,
    svd,
    H,
    HKV,
    D,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (row, head). Query and key heads are rotated, transformers'
    # ``x * cos + rotate_half(x) * sin`` element for element with the same roundings (each
    # product rounded to the dtype, then the sum; launched without fused multiply-adds):
    # ``rotate_half(x)[d]`` is ``-x[d + D/2]`` below the half and ``x[d - D/2]`` above it,
    # and ``(-a) * s`` is ``a * (-s)`` exactly. Query heads are written back in place (the
    # attention reads them there); key heads and value heads go to the row's pool slot.
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dm = d < D
    src = qkv_ptr + r * sqn + h * D
    x = tl.load(src + d, mask=dm, other=0.0)
    blk = tl.load(blk_ptr + r)
    off = tl.load(off_ptr + r)
    if h < H + HKV:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        xr = tl.load(src + partner, mask=dm, other=0.0)
        c = tl.load(cos_ptr + r * scn + d, mask=dm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + r * ssn + d, mask=dm, other=0.0).to(tl.float32)
        s = tl.where(d < HALF, -s, s)  # (negated in float32: exact, and the interpreter's 16-bit floats are raw bits)
        p1 = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        p2 = (xr.to(tl.float32) * s).to(x.dtype).to(tl.float32)
        y = (p1 + p2).to(x.dtype)
        if h < H:
            tl.store(src + d, y, mask=dm)
        else:
            tl.store(k_ptr + blk * skb + off * skn + (h - H) * skh + d * skd, y, mask=dm)
    else:
        tl.store(v_ptr + blk * svb + off * svn + (h - H - HKV) * svh + d * svd, x, mask=dm)


def kernels() -> dict[str, Any]:
    """The jitted kernels by name (interpreted where ``TRITON_INTERPRET=1`` was set before
    triton's first import: see the module docstring)."""
    if triton is None:
        raise RuntimeError(f"triton is not available: {_TRITON_ERROR}")
    return {
        "matmul": matmul_kernel,
        "rms_norm": rms_norm_kernel,
        "layer_norm": layer_norm_kernel,
        "attention": attention_kernel,
        "silu_mul": silu_mul_kernel,
        "rotary_kv_write": rotary_kv_write_kernel,
    }


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # the latter is ignored for 16-bit inputs


def matmul_config(dtype: torch.dtype, n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` for a ``[*, k] @ [k, n]`` product: a function
    of the dtype and the layer's shape, never of the row count."""
    block_n = 64 if n <= 64 else 128
    block_k = 32 if dtype == torch.float32 else 64
    return 64, block_n, min(block_k, max(16, next_pow2(k))), 4


def flat_rows(x: torch.Tensor) -> tuple[int, int] | None:
    """``(M, row stride)`` of ``x [..., d]`` read as ``M`` rows of ``d`` without a copy (its
    leading dimensions merge into one strided dimension), or None. Example: ``[1, N, d]``
    contiguous is ``(N, d)``; a ``[2, 3, d]`` slice of a ``[2, 5, d]`` tensor is None."""
    lead = x.shape[:-1]
    if not lead:
        return None
    m, stride = lead[-1], x.stride(-2)
    for size, st in zip(reversed(lead[:-1]), reversed(x.stride()[:-2])):
        if size != 1 and st != stride * m:
            return None
        m *= size
    return m, stride


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T + bias[N]`` -> ``[..., N]`` in ``x.dtype`` (like ``F.linear``),
    accumulated in float32 with M-independent tiles (``M``: the rows of ``x``; any strides;
    leading dimensions that merge into rows cost no reshape, :func:`flat_rows`)."""
    if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"matmul takes x [..., K] and weight [N, K], not {tuple(x.shape)} and {tuple(weight.shape)}")
    K = x.shape[-1]
    N = weight.shape[0]
    y = x.new_empty(*x.shape[:-1], N)
    rows = flat_rows(x)
    if rows is None:
        x = x.reshape(-1, K)
        rows = (x.shape[0], x.stride(0))
    M, sxm = rows
    if M == 0:
        return y
    bm, bn, bk, warps = matmul_config(x.dtype, N, K)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    with on_device(x):
        kernels()["matmul"][grid](
            x,
            weight,
            bias if bias is not None else weight,
            y,
            M,
            N,
            K,
            sxm,
            x.stride(-1),
            weight.stride(0),
            weight.stride(1),
            N,  # y is contiguous: rows at stride N
            1,
            HAS_BIAS=bias is not None,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            PRECISION=dot_precision(x.dtype),
            num_warps=warps,
        )
    return y


def on_device(x: torch.Tensor):
    """The device context of ``x`` for a launch (a model spread over several GPUs launches on
    each layer's own GPU); nothing on a CPU tensor (the interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _row_major(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(x, M, row stride)``: ``x [..., d]`` as ``M`` rows with a unit stride along ``d`` (the
    norm kernels index rows by one stride): a copy only when it has no such view."""
    rows = flat_rows(x) if x.dim() >= 2 and x.stride(-1) == 1 else None
    if rows is None:
        x = x.contiguous()
        rows = (x.numel() // max(x.shape[-1], 1), x.shape[-1])
    return x, rows[0], rows[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``LlamaRMSNorm`` of each row of ``x [..., d]``: float32 inside,
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``; -> ``[..., d]``."""
    x, M, sxm = _row_major(x)
    d = x.shape[-1]
    dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(weight.dtype, x.dtype)
    y = x.new_empty(x.shape, dtype=dtype)
    if M:
        block = next_pow2(d)
        with on_device(x):
            kernels()["rms_norm"][(M,)](x, weight, y, d, sxm, d, float(eps), BLOCK=block, num_warps=norm_warps(block))
    return y


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` over the last dimension of ``x [..., d]`` (float32
    statistics); -> ``[..., d]`` in ``x.dtype``."""
    x, M, sxm = _row_major(x)
    d = x.shape[-1]
    y = x.new_empty(x.shape)
    if M:
        block = next_pow2(d)
        with on_device(x):
            kernels()["layer_norm"][(M,)](
                x,
                weight if weight is not None else x,
                bias if bias is not None else x,
                y,
                d,
                sxm,
                d,
                float(eps),
                HAS_W=weight is not None,
                HAS_B=bias is not None,
                BLOCK=block,
                num_warps=norm_warps(block),
            )
    return y


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's activation on its stacked ``[gate | up]`` product ``x [..., 2I]``:
    ``silu(gate) * up`` -> ``[..., I]`` in ``x.dtype``, one launch (``silu`` is
    :class:`~ralm.batching.invariant.InvariantSiLU`'s formula, rounded to the dtype)."""
    x, M, sxm = _row_major(x)
    I = x.shape[-1] // 2
    y = x.new_empty(*x.shape[:-1], I)
    if M:
        block = min(1024, next_pow2(I))
        with on_device(x):
            kernels()["silu_mul"][(M, triton.cdiv(I, block))](x, y, I, sxm, I, BLOCK=block, num_warps=4)
    return y


def norm_warps(block: int) -> int:
    return 4 if block <= 2048 else 8  # a function of d only


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of ``S`` sequences with a fixed reduction order.

    ``q [S, H, nq, D]``; ``k, v [S, Hkv, L, D]``: keys and values at positions ``0..L-1``
    (positions past a query's own are never read into its result; L may be padded);
    ``q_pos [S, nq]`` (int64): query ``i`` sees keys ``j <= q_pos[s, i]`` (every position
    ``< L``). ``H`` is a multiple of ``Hkv``: query head ``h`` reads kv head
    ``h // (H // Hkv)``. Returns ``[S, nq, H, D]`` in ``q.dtype``. Any strides.
    """
    S, H, nq, D = q.shape
    hkv, L = k.shape[1], k.shape[2]
    if k.shape != (S, hkv, L, D) or v.shape != k.shape or H % hkv or q_pos.shape != (S, nq):
        raise ValueError(
            f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, q_pos {tuple(q_pos.shape)}"
        )
    if D > 256:
        raise ValueError(f"head dimension {D} > 256")
    out = q.new_empty(S, nq, H, D)
    if S == 0 or nq == 0:
        return out
    q_pos = q_pos.to(device=q.device, dtype=torch.int64)
    sqs, sqh, sqn, sqd = q.stride()
    sks, skh, skn, skd = k.stride()
    svs, svh, svn, svd = v.stride()
    launch_attention(
        (triton.cdiv(nq, ATTN_BLOCK_Q), H, S),
        q,
        k,
        v,
        q_pos,
        out,
        None,
        nq=nq,
        L=L,
        group=H // hkv,
        scaling=scaling,
        q_strides=(sqs, sqn, sqh, sqd),
        k_strides=(sks, skn, skh, skd),
        v_strides=(svs, svn, svh, svd),
        pos_strides=q_pos.stride(),
        table_strides=(0, 0),
        out_strides=out.stride(),
    )
    return out


def attention_config(head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_D, num_warps, num_stages)`` of the attention kernel: a function of the head
    dimension only, the same for the contiguous and the paged launch. Two stages of
    prefetched key and value blocks: with triton's default three, the contiguous kernel at
    float32 and head dimension 256 needs 282,688 bytes of shared memory on sm_90, over the
    H100's 232,448; with two it needs 151,616 (compiled for sm_90 with triton 3.9)."""
    block_d = max(16, next_pow2(head_dim))
    return block_d, 4 if block_d <= 64 else 8, 2


def launch_attention(
    grid: tuple[int, int, int],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    out: torch.Tensor,
    paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    *,
    nq: int,
    L: int,
    group: int,
    scaling: float,
    q_strides: tuple[int, ...],
    k_strides: tuple[int, ...],
    v_strides: tuple[int, ...],
    pos_strides: tuple[int, ...],
    table_strides: tuple[int, ...],
    out_strides: tuple[int, ...],
) -> None:
    """Launch :data:`attention_kernel` (the one attention kernel; the strides in its order:
    sequence or block, row, head, column). ``paged``: ``(tables, tile_seq, tile_row, tile_n)``
    for the paged layout, None for the contiguous one."""
    D = k.shape[-1]  # the head dimension (q may be a wider tensor: the stacked projection)
    block_d, warps, stages = attention_config(D)
    tab, tseq, trow, tn = paged if paged is not None else (q_pos, q_pos, q_pos, q_pos)
    with on_device(q):
        kernels()["attention"][grid](
            q,
            k,
            v,
            q_pos,
            out,
            tab,
            tseq,
            trow,
            tn,
            nq,
            L,
            D,
            group,
            float(scaling),
            *q_strides,
            *k_strides,
            *v_strides,
            *pos_strides,
            *table_strides,
            *out_strides,
            PAGED=paged is not None,
            BLOCK_Q=ATTN_BLOCK_Q,
            BLOCK_N=ATTN_BLOCK_N,
            BLOCK_D=block_d,
            PRECISION=dot_precision(q.dtype),
            num_warps=warps,
            num_stages=stages,
        )
