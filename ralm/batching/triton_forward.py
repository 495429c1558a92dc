"""The invariant forward on Triton kernels: what :func:`~ralm.batching.invariant.make_invariant`
does with ``kernels="triton"`` (the default for a model on CUDA).

Linear layers run :func:`ralm.batching.triton_kernels.matmul`, the norms (Hugging Face's
``*RMSNorm``, ``nn.LayerNorm``) are replaced by modules calling the row-wise Triton norms,
and attention modules are flagged so that they run the ``triton`` attention backend
(:func:`ralm.batching.attention_backend.attention_backend`).
A cheap probe then runs the kernels on the model's device and dtype; the whole-model proof
(:mod:`ralm.batching.proof`) follows in the engine.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ralm.batching import triton_compile, triton_kernels
from ralm.batching.fused_projection import FusedProjection
from ralm.errors import InvariantUnavailable


class LinearLayer(Protocol):
    """What this module needs of :class:`~ralm.batching.invariant.InvariantLinear`."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...

    @property
    def in_features(self) -> int: ...

    def use_kernel(self, kernel: str) -> None: ...


class TritonRMSNorm(nn.Module):
    """Hugging Face's ``*RMSNorm`` (Llama, Mistral, Qwen2) on :func:`triton_kernels.rms_norm`
    (one program per row); ``weight`` is the replaced module's parameter (shared)."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_kernels.rms_norm(x, self.weight, self.variance_epsilon)


class TritonLayerNorm(nn.Module):
    """``nn.LayerNorm`` over the last dimension on :func:`triton_kernels.layer_norm` (one
    program per row); ``weight`` and ``bias`` are the replaced module's parameters (shared)."""

    def __init__(self, weight: nn.Parameter | None, bias: nn.Parameter | None, eps: float):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_kernels.layer_norm(x, self.weight, self.bias, self.eps)


def triton_norm(mod: nn.Module) -> nn.Module | None:
    """The Triton replacement of a norm module (None: not a norm, or already replaced)."""
    if isinstance(mod, (TritonRMSNorm, TritonLayerNorm)):
        return None
    if isinstance(mod, nn.LayerNorm):
        if len(mod.normalized_shape) != 1:
            raise InvariantUnavailable(
                f"LayerNorm over {tuple(mod.normalized_shape)}: only the last dimension is supported"
            )
        return TritonLayerNorm(mod.weight, mod.bias, mod.eps)
    if type(mod).__name__.endswith("RMSNorm"):
        weight, eps = getattr(mod, "weight", None), getattr(mod, "variance_epsilon", None)
        if not isinstance(weight, nn.Parameter) or eps is None:
            raise InvariantUnavailable(
                f"no Triton form for {type(mod).__name__} (expected .weight and .variance_epsilon)"
            )
        return TritonRMSNorm(weight, eps)
    return None


def use_triton(model, layers: Sequence[LinearLayer], head_dim: int) -> Any:
    """Finish :func:`make_invariant` on the Triton kernels: linear layers on
    :func:`triton_kernels.matmul`, attention modules flagged for :func:`triton_kernels.attention`,
    then a cheap probe of both on the model's device and dtype."""
    for layer in layers:
        layer.use_kernel("triton")
    model._ralm_triton = True  # read by ralm.batching.attention_backend.attention_backend, and nowhere else
    for m in model.modules():
        if hasattr(m, "layer_idx"):  # the attention modules (the decoder layers too: harmless)
            m._ralm_triton = True
    use_triton_gated_mlps(model)
    try:
        # every kernel the model runs, compiled and loaded on its device before any check
        # (a kernel out of shared memory fails here, with its configuration in the reason)
        triton_compile.compile_kernels(
            layers[0].weight.device, layers[0].weight.dtype, **triton_compile.model_kernel_shapes(model, head_dim)
        )
        check_triton_invariance(layers[0], head_dim)
    except InvariantUnavailable:
        raise
    except Exception as e:  # no driver, a compilation failure, ...
        raise InvariantUnavailable(
            f"the Triton invariant kernels cannot run here ({type(e).__name__}: {e}); set generator.invariant=false"
        ) from e
    model._ralm_invariant = triton_kernels.DESCRIPTION
    return model


def _triton_gated_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A SiLU-gated MLP on the stacked ``[gate | up]`` product: the activation and the product
    in one launch (:func:`triton_kernels.silu_mul`)."""
    return self.down_proj(triton_kernels.silu_mul(self.gate_up_proj(x)))


def use_triton_gated_mlps(model) -> int:
    """Give every gated MLP whose gate and up projections are stacked
    (:func:`~ralm.batching.fused_projection.fuse_gated_mlps`) and whose activation is SiLU the
    one-launch activation; returns how many. Lone and batched steps run the same forward, so
    both take their bits from the same kernel."""
    n = 0
    for m in model.modules():
        # InvariantSiLU by name: ralm.batching.invariant imports this module
        if isinstance(getattr(m, "gate_up_proj", None), FusedProjection) and (
            type(getattr(m, "act_fn", None)).__name__ == "InvariantSiLU"
        ):
            object.__setattr__(m, "forward", types.MethodType(_triton_gated_forward, m))
            n += 1
    return n


def check_triton_invariance(layer: LinearLayer, head_dim: int) -> None:
    """Raise :class:`InvariantUnavailable` unless the Triton kernels give a row of ``layer``
    the same bits alone and inside 64- and 200-row batches, and a query the same bits alone
    and inside a prefill over three key blocks (on ``layer``'s device and dtype)."""
    w = layer.weight
    dev, dt = w.device, w.dtype
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, layer.in_features, generator=g).to(dev, dt)
    rows = (0, 37, 63)
    with torch.inference_mode():
        alone = torch.cat([triton_kernels.matmul(x[i : i + 1], w, layer.bias) for i in rows])
        ok = all(torch.equal(triton_kernels.matmul(x[:n], w, layer.bias)[list(rows)], alone) for n in (64, 200))
        L = 2 * triton_kernels.ATTN_BLOCK_N + 9
        q, k, v = (torch.randn(1, 2, L, head_dim, generator=g).to(dev, dt) for _ in range(3))
        pos = torch.arange(L, device=dev)[None]
        full = triton_kernels.attention(q, k, v, pos, 0.125)
        for p in (triton_kernels.ATTN_BLOCK_N - 5, L - 1):
            one = triton_kernels.attention(
                q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], pos[:, p : p + 1], 0.125
            )
            ok = ok and torch.equal(one[0, 0], full[0, p])
    if not ok:
        raise InvariantUnavailable(
            f"the Triton kernels are not batch-invariant on this device ({dt}, {dev}); set generator.invariant=false"
        )
