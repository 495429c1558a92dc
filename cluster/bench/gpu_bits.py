"""``ralmspec gpu-check``'s ``bits`` section: the Triton kernels' batch-invariance, bit for bit,
on the device, one kernel at a time (before any model runs on them).

Per dtype:

- ``matmul``: rows 0, 1 and the last of a 512-row input, alone, against the same rows inside
  products of every row count from 1 to 80, and of 200 and 512 rows (a GEMM whose tiles or
  split-K change with the row count fails here first);
- ``attention``: the query at position 70 alone (its own 71 keys), inside a 100-token
  prefill, inside a prefill run in chunks of 37, and in one launch next to a 900-token
  sequence; grouped-query heads (4 query heads per KV head);
- ``paged``: the paged launch over random block tables (a shuffled pool, sequences reaching
  position 2,200) against the contiguous launch of the same keys;
- ``rotary``: the same sequences through the fused rotation, KV write and paged attention of a
  Llama-family layer, against transformers' rotation in torch, an index write and the paged
  launch (queries, pool and outputs).

Each check counts the rows or queries whose bits differ (0 passes). On a CPU the kernels run
in triton's interpreter (``TRITON_INTERPRET=1`` set before triton's first import), whose
``tl.dot`` is numpy's matmul: :func:`mma_model` replaces it with a fixed-order float32 sum
per output element, the property of a GPU's MMA the kernels rely on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ralm.batching import triton_kernels as T, triton_paged as TP


def fixed_order_dot(a, b, d, input_precision=None, max_num_imprecise_acc=None):
    """``d + a @ b`` on triton interpreter handles with every element summed over k in one
    fixed order, whatever its row or column (operands widened exactly to float32)."""
    import triton.language as tl  # type: ignore[import-untyped]
    from triton.runtime.interpreter import TensorHandle  # type: ignore[import-untyped]

    def f32(h):
        if h.dtype == tl.bfloat16:  # stored as raw uint16 bit patterns: exact widening
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        return h.data.astype(np.float32)

    x, y = f32(a), f32(b)
    acc = d.data.astype(np.float32, copy=True)
    for k in range(x.shape[1]):
        acc += x[:, k : k + 1] * y[k : k + 1, :]
    return TensorHandle(acc, d.dtype.scalar)


def rne_cast(saved_cast):
    """The interpreter's ``cast_impl`` with a GPU's float32 -> bfloat16 conversion: rounded to
    nearest, ties to even (``cvt.rn.bf16.f32``), where the interpreter truncates; every
    other cast is ``saved_cast``'s."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def cast(src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return TensorHandle(bits.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return saved_cast(src, dst_type)

    return cast


@contextlib.contextmanager
def mma_model() -> Iterator[None]:
    """Within: the interpreter's ``tl.dot`` is :func:`fixed_order_dot` and its float32 ->
    bfloat16 cast rounds as a GPU's does (:func:`rne_cast`); nothing else changes."""
    from triton.runtime.interpreter import interpreter_builder

    saved = interpreter_builder.create_dot, interpreter_builder.cast_impl
    interpreter_builder.create_dot = fixed_order_dot
    interpreter_builder.cast_impl = rne_cast(saved[1])
    try:
        yield
    finally:
        interpreter_builder.create_dot, interpreter_builder.cast_impl = saved


def _randn(shape: tuple[int, ...], seed: int, dtype, device):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def matmul_rows(device: str, dtype, k: int, n: int, counts: list[int]) -> dict:
    """Rows 0, 1 and the last of each product against the same rows alone: the counts of
    products and of rows that differ."""
    x, w = _randn((max(counts), k), 1, dtype, device), _randn((n, k), 2, dtype, device)
    rows = sorted({0, 1, max(counts) - 1})
    alone = {i: T.matmul(x[i : i + 1], w)[0] for i in rows}
    bad_products, bad_rows = [], 0
    for m in counts:
        y = T.matmul(x[:m], w)
        diff = sum(not torch.equal(y[i], alone[i]) for i in rows if i < m)
        if diff:
            bad_products.append(m)
            bad_rows += diff
    return {"products": len(counts), "shape": f"{k}->{n}", "differing_rows": bad_rows, "differing_m": bad_products}


def attention_query(device: str, dtype, head_dim: int, group: int) -> dict:
    """The query at position 70 alone, in a 100-token prefill, in chunks of 37, and next to
    a 900-token sequence: how many of those runs differ from it alone (per head, all bits)."""
    L, p, hkv = 100, 70, 2
    H, sc = hkv * group, head_dim**-0.5
    q = _randn((1, H, L, head_dim), 3, dtype, device)
    k, v = _randn((1, hkv, L, head_dim), 4, dtype, device), _randn((1, hkv, L, head_dim), 5, dtype, device)
    pos = torch.arange(L, device=device)[None]
    alone = T.attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], pos[:, p : p + 1], sc)[0, 0]
    runs = {"prefill": T.attention(q, k, v, pos, sc)[0, p]}
    chunk = [
        T.attention(q[:, :, a : a + 37], k[:, :, : a + 37], v[:, :, : a + 37], pos[:, a : a + 37], sc)
        for a in range(0, L, 37)
    ]
    runs["chunks_of_37"] = torch.cat(chunk, dim=1)[0, p]
    long = 900
    k2 = torch.cat([torch.cat([k, torch.zeros_like(k[:, :, :1]).expand(1, hkv, long - L, head_dim)], 2)])
    k2 = torch.cat([k2, _randn((1, hkv, long, head_dim), 6, dtype, device)])
    v2 = torch.cat([v, torch.zeros_like(v[:, :, :1]).expand(1, hkv, long - L, head_dim)], 2)
    v2 = torch.cat([v2, _randn((1, hkv, long, head_dim), 7, dtype, device)])
    q2 = torch.cat([q[:, :, p : p + 1], _randn((1, H, 1, head_dim), 8, dtype, device)])
    pos2 = torch.tensor([[p], [long - 1]], device=device)
    runs["beside_900"] = T.attention(q2, k2, v2, pos2, sc)[0, 0]
    return {
        "head_dim": head_dim,
        "group": group,
        "differing": [name for name, r in runs.items() if not torch.equal(r, alone)],
    }


def paged_tables(device: str, dtype, head_dim: int, group: int, lens: list[int], new: list[int]) -> dict:
    """Sequences of ``lens`` positions (``new`` rows each) over random block tables of a
    shuffled pool, in one paged launch, against the contiguous launch per sequence: the
    count of rows whose bits differ."""
    g = torch.Generator().manual_seed(9)
    B, hkv = T.ATTN_BLOCK_N, 2
    H, sc = hkv * group, head_dim**-0.5
    need = [-(-n // B) for n in lens]
    nblk = sum(need) + 3
    perm = torch.randperm(nblk, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    k_pool = _randn((hkv, nblk, B, head_dim), 10, dtype, device)
    v_pool = _randn((hkv, nblk, B, head_dim + 1), 11, dtype, device)
    qs = [_randn((m, H, head_dim), 12 + i, dtype, device) for i, m in enumerate(new)]
    pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)]).to(device)
    starts = [sum(new[:i]) for i in range(len(new))]
    tab = torch.tensor([t + [0] * (max(need) - len(t)) for t in tables], dtype=torch.int32, device=device)
    out = TP.paged_attention(torch.cat(qs), k_pool, v_pool, tab, TP.query_tiles(starts, new, device), pos, sc)
    bad = 0
    for s, (n, m) in enumerate(zip(lens, new)):
        k = torch.cat([k_pool[:, b] for b in tables[s]], dim=1)[:, :n][None]
        v = torch.cat([v_pool[:, b] for b in tables[s]], dim=1)[:, :n, :head_dim][None]
        pos_s = torch.arange(n - m, n, device=device)[None]
        want = T.attention(qs[s].permute(1, 0, 2)[None], k, v, pos_s, sc)[0]
        bad += int((out[starts[s] : starts[s] + m] != want).flatten(1).any(1).sum())
    return {"rows": sum(new), "max_position": max(lens) - 1, "differing_rows": bad}


def fused_rotation(device: str, dtype, head_dim: int, group: int, lens: list[int], new: list[int]) -> dict:
    """The paged attention with the rotation and KV write fused (:func:`TP.rotary_paged_attention`,
    what a Llama-family layer runs on the pool) against transformers' rotation in torch
    (``x * cos + rotate_half(x) * sin``), an index write into the pool and :func:`TP.paged_attention`:
    rows whose rotated queries, pooled keys and values, or outputs differ in any bit. A
    difference means the kernel's roundings are not torch's on this device (a fused
    multiply-add, another bfloat16 rounding), and the lone and the pooled paths would part."""
    B, hkv = T.ATTN_BLOCK_N, 2
    H, D, sc = hkv * group, head_dim, head_dim**-0.5
    need = [-(-n // B) for n in lens]
    tables, at = [], 1  # block 0 stays unused
    for n in need:
        tables.append(list(range(at, at + n))[::-1])  # blocks in reverse order
        at += n
    N, W = sum(new), (H + 2 * hkv) * D
    k_pool = _randn((hkv, at, B, D), 20, dtype, device)
    v_pool = torch.cat(
        [_randn((hkv, at, B, D), 21, dtype, device), torch.ones(hkv, at, B, 1, dtype=dtype, device=device)], -1
    )
    qkv = _randn((1, N, W), 22, dtype, device)
    pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new)])
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos[:, None].float() * inv[None]
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(device, dtype)[None] for f in (torch.cos, torch.sin))
    blocks = torch.tensor([tables[s][p // B] for s, (n, m) in enumerate(zip(lens, new)) for p in range(n - m, n)])
    blocks, offsets, pos = blocks.to(device), (pos % B).to(device), pos.to(device)
    tab = torch.tensor([t + [0] * (max(need) - len(t)) for t in tables], dtype=torch.int32, device=device)
    starts = [sum(new[:i]) for i in range(len(new))]
    tiles = TP.query_tiles(starts, new, device)
    x = qkv[0].view(N, H + 2 * hkv, D)
    half = x[:, : H + hkv]
    rot = half * cos[0][:, None] + torch.cat((-half[..., D // 2 :], half[..., : D // 2]), -1) * sin[0][:, None]
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref[:, blocks, offsets] = rot[:, H:].transpose(0, 1)
    v_ref[:, blocks, offsets, :D] = x[:, H + hkv :].transpose(0, 1)
    want = TP.paged_attention(rot[:, :H].contiguous(), k_ref, v_ref, tab, tiles, pos, sc)
    got = qkv.clone()
    out = TP.rotary_paged_attention(got, cos, sin, H, hkv, k_pool, v_pool, (blocks, offsets), tab, tiles, pos, sc)
    q_bad = (got[0].view(N, -1, D)[:, :H] != rot[:, :H]).flatten(1).any(1)
    k_bad = (k_pool[:, blocks, offsets] != k_ref[:, blocks, offsets]).any(0).any(-1)
    v_bad = (v_pool[:, blocks, offsets] != v_ref[:, blocks, offsets]).any(0).any(-1)
    o_bad = (out[0].view(N, H, D) != want).flatten(1).any(1)
    return {"rows": N, "differing_rows": int((q_bad | k_bad | v_bad | o_bad).sum())}


def bit_checks(
    device: str, dtypes: list[str], head_dim: int, group: int, small: bool, deadline: float | None = None
) -> dict:
    """The section: per dtype, the four checks (``small``: CPU sizes, the interpreter);
    dtypes not started by ``deadline`` (``time.perf_counter()``) are ``skipped``."""
    out: dict[str, Any] = {}
    counts = list(range(1, 81)) + [200, 512]
    shape = (48, 40) if small else (2048, 2048)
    lens, new = ([1100, 130], [1, 19]) if small else ([2200, 900, 130, 2049, 4100], [1, 37, 3, 1, 16])
    ctx = mma_model() if device == "cpu" else contextlib.nullcontext()
    with ctx, torch.inference_mode():
        for name in dtypes:
            if deadline is not None and time.perf_counter() > deadline:
                out[name] = {"skipped": "time budget"}
                continue
            dt = getattr(torch, name)
            r: dict[str, Any] = {
                "matmul": matmul_rows(device, dt, shape[0], shape[1], counts),
                "attention": attention_query(device, dt, head_dim, group),
                "paged": paged_tables(device, dt, head_dim, group, lens, new),
                "rotary": fused_rotation(device, dt, head_dim, group, lens, new),
            }
            r["ok"] = not (
                r["matmul"]["differing_rows"]
                or r["attention"]["differing"]
                or r["paged"]["differing_rows"]
                or r["rotary"]["differing_rows"]
            )
            out[name] = r
    return out
