"""``ralmspec gpu-check``'s ``compile`` section: every invariant Triton kernel, compiled for
every dtype, head dimension and GQA group a served model may use.

On a device (``device_sweep``) each configuration is compiled by launching it once on small
tensors (:func:`ralm.batching.triton_kernels.compile_kernels`): a launch loads the kernel,
which is where one that needs more shared memory or registers than the device has fails. A
configuration that fails is reported with its reason; the others still run.

Without a GPU (``offline_sweep``) triton compiles the same kernels for a named NVIDIA
architecture (``sm_90``, the H100's) down to a cubin with the ``ptxas`` triton ships, and
each kernel's static shared memory is compared with that architecture's per-block limit.
That shows on a CPU whether a configuration would run out of shared memory on the GPU
(register spills and the driver's own checks are seen only on the device).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cluster.flags import add_shared
from ralm.batching import triton_kernels as T
from ralm.batching.triton_compile import compile_kernels
from ralm.errors import InvariantUnavailable

DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4)
#: linear layer shapes ``(out, in, bias)`` of the Llama-3.2-1B shape, and a small biased one
LINEAR_SHAPES = ((2048, 2048, False), (512, 2048, False), (8192, 2048, False), (2048, 8192, False), (64, 48, True))
NORM_DIMS = (2048,)
#: the SiLU-gated MLPs' intermediate widths (the one-launch activation): the Llama-3.2-1B shape's
GATED_WIDTHS = (8192,)
#: the largest shared memory one block may use, in bytes, per architecture (opt-in maximum)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def device_sweep(
    device: str,
    dtypes=DTYPES,
    head_dims=HEAD_DIMS,
    groups=GROUPS,
    linear_shapes=LINEAR_SHAPES,
    norm_dims=NORM_DIMS,
    deadline: float | None = None,
    gated_widths=GATED_WIDTHS,
) -> dict:
    """Per dtype: the configurations compiled and launched on ``device``, the seconds it
    took, and the first failure's reason (``ok`` false) if one failed; dtypes not started
    by ``deadline`` (``time.perf_counter()``) are ``skipped``."""
    out: dict[str, Any] = {}
    for name in dtypes:
        if deadline is not None and time.perf_counter() > deadline:
            out[name] = {"skipped": "time budget"}
            continue
        dt = getattr(torch, name)
        t = time.perf_counter()
        norms = [("rms", d, True, False) for d in norm_dims] + [("layer", d, True, True) for d in norm_dims]
        row: dict[str, Any] = {"ok": True, "compiled": 0}
        try:
            labels = compile_kernels(
                device,
                dt,
                head_dims,
                groups=groups,
                linear_shapes=linear_shapes,
                norms=norms,
                gated_widths=gated_widths,
            )
            row["compiled"] = len(labels)
        except InvariantUnavailable as e:
            row.update(ok=False, error=str(e))
        row["seconds"] = round(time.perf_counter() - t, 1)
        out[name] = row
    return out


def _signature(fn, dtype: str) -> dict[str, str]:
    """The triton signature of a jitted kernel for ``dtype`` data, in argument order: data
    pointers of ``dtype``, positions ``*i64``, tables and tiles ``*i32``, ``eps`` and
    ``scaling`` ``fp32``, other integers ``i32``, constexprs ``constexpr``."""
    data = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            sig[name] = "constexpr"
        elif name in ("pos_ptr", "blk_ptr", "off_ptr"):
            sig[name] = "*i64"
        elif name.startswith(("tab_", "tile_")):
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = data
        elif name in ("eps", "scaling"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _configs(
    dtype: str, head_dims, linear_shapes, norm_dims, gated_widths=GATED_WIDTHS
) -> list[tuple[str, str, dict[str, Any], dict]]:
    """``(label, kernel, constexprs, launch options)`` of every configuration the wrappers launch."""
    dt = getattr(torch, dtype)
    prec = T.dot_precision(dt)
    out = []
    for n, k, bias in linear_shapes:
        bm, bn, bk, warps = T.matmul_config(dt, n, k)
        c = {"HAS_BIAS": bias, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PRECISION": prec}
        out.append((f"matmul/{dtype}/{n}x{k}{'+bias' if bias else ''}", "matmul", c, {"num_warps": warps}))
    for d in norm_dims:
        block = T.next_pow2(d)
        opts = {"num_warps": T.norm_warps(block)}
        out.append((f"rms_norm/{dtype}/d{d}", "rms_norm", {"BLOCK": block}, opts))
        out.append((f"layer_norm/{dtype}/d{d}", "layer_norm", {"HAS_W": True, "HAS_B": True, "BLOCK": block}, opts))
    for D in head_dims:
        block_d, warps, stages = T.attention_config(D)
        for paged in (False, True):
            c = {"PAGED": paged, "BLOCK_Q": T.ATTN_BLOCK_Q, "BLOCK_N": T.ATTN_BLOCK_N, "BLOCK_D": block_d}
            c["PRECISION"] = prec
            label = f"{'paged_' if paged else ''}attention/{dtype}/d{D}"
            out.append((label, "attention", c, {"num_warps": warps, "num_stages": stages}))
        rotary = {"HALF": D // 2, "BLOCK_D": T.next_pow2(D)}
        rotary_opts = {"num_warps": 1 if D <= 64 else 2, "enable_fp_fusion": False}
        out.append((f"rotary_kv_write/{dtype}/d{D}", "rotary_kv_write", rotary, rotary_opts))
    for width in gated_widths:
        block = min(1024, T.next_pow2(width))
        out.append((f"silu_mul/{dtype}/i{width}", "silu_mul", {"BLOCK": block}, {"num_warps": 4}))
    return out


def offline_sweep(
    arch: int = 90,
    dtypes=DTYPES,
    head_dims=HEAD_DIMS,
    linear_shapes=LINEAR_SHAPES,
    norm_dims=NORM_DIMS,
    deadline: float | None = None,
    gated_widths=GATED_WIDTHS,
) -> dict:
    """Compile every configuration for ``sm_{arch}`` on this machine (no GPU needed): per
    label, the static shared memory in bytes, whether it fits the architecture's limit, and
    the error where triton or ptxas refused it. (GQA groups are a runtime argument: one
    compiled kernel serves every group.)"""
    import triton  # type: ignore[import-untyped]
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource  # type: ignore[import-untyped]

    fns = T.kernels()
    limit = SHARED_LIMIT.get(arch, 99 * 1024)
    target = GPUTarget("cuda", arch, 32)
    rows: dict[str, Any] = {}
    for dtype in dtypes:
        for label, kernel, consts, opts in _configs(dtype, head_dims, linear_shapes, norm_dims, gated_widths):
            if deadline is not None and time.perf_counter() > deadline:
                rows[label] = {"fits": None, "skipped": "time budget"}
                continue
            sig = _signature(fns[kernel], dtype)
            t = time.perf_counter()
            try:
                src = ASTSource(fn=fns[kernel], signature=sig, constexprs=consts)
                c = triton.compile(src, target=target, options=opts)
                shared = int(c.metadata.shared)
                rows[label] = {"shared_bytes": shared, "fits": shared <= limit, **opts}
            except Exception as e:  # triton or ptxas refused it
                rows[label] = {"fits": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows[label]["seconds"] = round(time.perf_counter() - t, 1)
    return {"arch": f"sm_{arch}", "shared_limit_bytes": limit, "kernels": rows}


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.bench.gpu_compile [--arch 90]``: the offline sweep's JSON and table
    (run without ``TRITON_INTERPRET``); exit status 1 when a configuration does not fit."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m cluster.bench.gpu_compile", description=__doc__)
    p.add_argument("--arch", type=int, default=90, help="the NVIDIA architecture, e.g. 90 (H100), 80 (A100)")
    add_shared(p, dtypes=",".join(DTYPES))
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    a = p.parse_args(argv)
    res = offline_sweep(a.arch, a.dtypes.split(","), [int(d) for d in a.head_dims.split(",")])
    print(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res["kernels"].items() if not v.get("fits")}, indent=1))
    return 0 if all(r.get("fits") for r in res["kernels"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
