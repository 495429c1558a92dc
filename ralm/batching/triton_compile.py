"""Compile every batch-invariant Triton kernel a model needs, on its device, before its proof.

:func:`compile_kernels` launches each kernel once on small tensors of the model's dtype:
each linear layer's matmul configuration (its tiles depend on the layer's shape), its
norms, and attention, contiguous and paged, at its head dimension and GQA group. A launch
compiles the kernel and loads it, and loading is where a kernel that needs more shared
memory or registers than the device has fails; the error then names the kernel and its
configuration (``attention/float32/d256/group4``) and turns batching off with that reason
(:class:`~ralm.errors.InvariantUnavailable`). :func:`model_kernel_shapes` reads those
arguments off a model made invariant on the Triton kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ralm.batching import triton_kernels as T, triton_paged as TP
from ralm.errors import InvariantUnavailable


def compile_kernels(
    device: torch.device | str,
    dtype: torch.dtype,
    head_dims: Sequence[int] = (),
    *,
    groups: Sequence[int] = (1,),
    linear_shapes: Sequence[tuple[int, int, bool]] = (),
    norms: Sequence[tuple[str, int, bool, bool]] = (),
    gated_widths: Sequence[int] = (),
) -> list[str]:
    """Compile every kernel a model needs on ``device`` in ``dtype``, each by one launch on
    small tensors (a launch loads the compiled kernel, which is where a kernel that needs
    more shared memory or registers than the device has fails), before any proof runs.

    ``head_dims`` and ``groups`` (query heads per KV head): the attention kernel, contiguous
    and paged, over three key blocks; ``linear_shapes``: ``(out_features, in_features,
    bias)`` of each linear layer (the matmul kernel's tiles depend on them); ``norms``:
    ``("rms" | "layer", d, has_weight, has_bias)``; ``gated_widths``: the intermediate width
    of each SiLU-gated MLP (its one-launch activation). The attention kernels compile with
    the fused rotation and pool write of Llama-family layers. Returns the labels compiled, in order;
    raises :class:`~ralm.errors.InvariantUnavailable` naming the kernel and its
    configuration at the first that fails."""
    dev = torch.device(device)
    done: list[str] = []

    def run(label: str, launch: Callable[..., object], *args: Any) -> None:
        try:
            launch(*args)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:  # a compilation error, out of resources, no driver
            raise InvariantUnavailable(
                f"the Triton kernel {label} does not compile or run on {dev} ({type(e).__name__}: {str(e)[:300]})"
            ) from e
        done.append(label)

    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dtype)

    name = str(dtype).removeprefix("torch.")
    for n, k, bias in dict.fromkeys(linear_shapes):
        run(
            f"matmul/{name}/{n}x{k}{'+bias' if bias else ''}",
            T.matmul,
            rand(1, k),
            rand(n, k),
            rand(n) if bias else None,
        )
    for kind, d, has_w, has_b in dict.fromkeys(norms):
        x, w, b = rand(2, d), rand(d) if has_w else None, rand(d) if has_b else None
        if kind == "rms":
            run(f"rms_norm/{name}/d{d}", T.rms_norm, x, w if w is not None else x[0], 1e-6)
        else:
            run(f"layer_norm/{name}/d{d}", T.layer_norm, x, w, b, 1e-5)
    for width in dict.fromkeys(gated_widths):
        run(f"silu_mul/{name}/i{width}", T.silu_mul, rand(2, 2 * width))
    L = 2 * T.ATTN_BLOCK_N + 5  # three key blocks, the last partly visible
    pos = torch.arange(L, device=dev)
    tables = torch.tensor([[3, 0, 2]], dtype=torch.int32, device=dev)
    tiles = TP.query_tiles([0], [L], dev)
    for D in dict.fromkeys(head_dims):
        for G in dict.fromkeys(groups):
            q, keys, values = rand(1, G, L, D), rand(1, 1, L, D), rand(1, 1, L, D)
            run(f"attention/{name}/d{D}/group{G}", T.attention, q, keys, values, pos[None], D**-0.5)
            pool_k, pool_v, qp = rand(1, 4, T.ATTN_BLOCK_N, D), rand(1, 4, T.ATTN_BLOCK_N, D + 1), rand(L, G, D)
            run(
                f"paged_attention/{name}/d{D}/group{G}",
                TP.paged_attention,
                *(qp, pool_k, pool_v, tables, tiles, pos, D**-0.5),
            )
            qkv, cos, sin = rand(1, L, (G + 2) * D), rand(1, L, D), rand(1, L, D)
            slots = (tables[0].long().repeat_interleave(T.ATTN_BLOCK_N)[:L], pos % T.ATTN_BLOCK_N)
            run(
                f"rotary_paged_attention/{name}/d{D}/group{G}",
                TP.rotary_paged_attention,
                *(qkv, cos, sin, G, 1, pool_k, pool_v, slots, tables, tiles, pos, D**-0.5),
            )
    return done


def model_kernel_shapes(model, head_dim: int) -> dict[str, Any]:
    """The keyword arguments of :func:`compile_kernels` for a model made invariant on the
    Triton kernels: its head dimension and GQA group, its linear layers' shapes and its norms."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    linear, norms, gated = [], [], []
    for m in model.modules():
        if getattr(m, "forward", None) is not None and getattr(m.forward, "__name__", "") == "_triton_gated_forward":
            gated.append(int(m.gate_up_proj.widths[0]))
        w = getattr(m, "weight", None)
        if getattr(m, "kernel", None) == "triton" and isinstance(w, torch.Tensor) and w.dim() == 2:
            linear.append((int(w.shape[0]), int(w.shape[1]), getattr(m, "bias", None) is not None))
        elif type(m).__name__ == "TritonRMSNorm":
            norms.append(("rms", int(m.weight.shape[0]), True, False))
        elif type(m).__name__ == "TritonLayerNorm":
            d = int(m.weight.shape[0]) if m.weight is not None else int(cfg.hidden_size)
            norms.append(("layer", d, m.weight is not None, m.bias is not None))
    return {
        "head_dims": [int(head_dim)],
        "groups": [heads // kv_heads],
        "linear_shapes": list(dict.fromkeys(linear)),
        "norms": list(dict.fromkeys(norms)),
        "gated_widths": list(dict.fromkeys(gated)),
    }
