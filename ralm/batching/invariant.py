"""A batch- and chunk-invariant forward pass for Hugging Face causal LMs.

The exactness contract asks that a request's tokens equal what RaLMSeq returns for it
alone. Batching requests together and keeping their KV between steps only keeps that
promise if a sequence's logits and KV do not depend on

* which other sequences share its forward pass, or where it sits in the batch, and
* whether its context was processed in one prefill, in chunks, or one token at a time.

A plain CPU forward has neither property. ``make_invariant(model)`` rewrites a model in
place so that it has both, without forking its code:

Linear layers (``nn.Linear`` and GPT-2's ``Conv1D``)
    A float32 GEMM gives a row different last bits when the row count changes (a 1-row
    product is a GEMV with another summation order; 2 rows take another path again). Two
    kernels avoid that. *BLAS tiles*: run on a row count padded to a multiple of
    ``tile_rows``, every row takes the same kernel and the same reduction order over the
    input features whatever the other rows hold. *oneDNN* (torch's ``mkldnn`` linear): every
    row count from 2 up gives a row the same bits, and 2 rows cost little more than the GEMV
    of one, where a 4-row BLAS tile costs 2-4× a GEMV (measured, one thread, width 768).
    Layers with at least ``INVARIANT_ONEDNN_MIN_WEIGHTS`` weights use oneDNN, smaller ones
    (where its per-call overhead dominates) BLAS tiles: the choice depends on the shape
    only, never on a timing, so every replica computes the same bits.
    :func:`check_row_invariance` verifies each layer shape on the running machine at
    start-up and falls back to BLAS tiles.

Attention (registered through transformers' ``AttentionInterface``)
    Per sequence, queries in tiles of ``query_tile`` rows against keys in blocks of
    ``key_block`` positions: every matrix product has one fixed shape. Softmax uses the
    exact row max, ``exp`` (position-independent, see below) and a *deferred* sum: values
    carry an extra column of ones, so ``p @ [V | 1]`` yields the numerator and the
    denominator in one product, and block partials are added in block order (a float64 running sum). A key a query
    may not see gets ``exp(-inf) = 0`` and adds an exact zero, so a longer padded key range
    (the same row inside a bigger prefill) changes no bit.

Element-wise functions
    torch evaluates an element-wise op with SIMD code on full vectors and with scalar code
    on the tail, and for ``sigmoid``, ``silu`` and ``gelu`` the two give different bits
    (measured: 4% of inputs). ``exp``, ``tanh``, ``erf``, ``rsqrt``, ``cos``, ``sin`` and
    the IEEE operations (``+ - * /``, ``pow(x, 2|3)``) agree bit for bit, so SiLU and the
    GELUs are rewritten from those. Norms (LayerNorm, RMSNorm) reduce each row on its own
    and are row-invariant as they are.

On NVIDIA GPUs none of this holds (cuBLAS changes a row's reduction with the row count,
and torch's batched matmuls and norm reductions with the shape): ``kernels="triton"`` (the
default for a model on CUDA) runs the linear layers, the norms and attention on the
batch-invariant Triton kernels of :mod:`ralm.batching.triton_kernels` instead, whose
reduction orders are fixed by construction (see there).

Only architectures made of these parts are accepted (GPT-2, OPT, Llama, Mistral without
a sliding window, Qwen2, and the project's model); anything else raises a clear error.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ralm import constants as C
from ralm.batching.attention import attend, pad_kv
from ralm.batching.attention_backend import invariant_attention
from ralm.batching.fused_projection import ProjectionSlice, fuse_gated_mlps
from ralm.batching.gpt2_attention import use_packed_gpt2_attention
from ralm.batching.rotary_attention import use_packed_rotary_attention
from ralm.errors import InvariantUnavailable

log = logging.getLogger(__name__)

ATTENTION_NAME = "ralm_invariant"
SUPPORTED_MODEL_TYPES = ("gpt2", "opt", "llama", "mistral", "qwen2")


# --------------------------------------------------------------------------- linear
def _pad_rows(x2: torch.Tensor, rows: int) -> torch.Tensor:
    """``x2 [n, in]`` with zero rows appended up to ``rows`` (``rows >= n``)."""
    pad = rows - x2.shape[0]
    return torch.cat([x2, x2.new_zeros(pad, x2.shape[1])]) if pad else x2


def onednn_available(device: torch.device | str = "cpu") -> bool:
    """Whether torch's oneDNN linear kernel can run here (a CPU build with mkldnn)."""
    return (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [n, in] @ weight[out, in]^T + bias`` on torch's oneDNN kernel (plain weight layout:
    oneDNN reorders it itself, so no second copy of the weights is kept)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class InvariantLinear(nn.Module):
    """``y = x W^T + b`` on a fixed kernel path whatever the row count.

    ``x [..., in]`` -> ``[..., out]``. ``kernel`` is ``"blas"`` (rows padded to a multiple of
    ``tile_rows``), ``"onednn"`` (rows padded to at least ``INVARIANT_ONEDNN_MIN_ROWS``) or
    ``"triton"`` (:func:`ralm.batching.triton_kernels.matmul`: M-independent tiles, no padding).
    Worked example with BLAS and ``tile_rows=16``: a decode step of 3 sequences is a
    ``[3, in]`` input; it runs as ``[16, in]`` (13 zero rows) and the 3 real rows come back;
    the same row inside a 40-row prefill runs as part of ``[48, in]`` and gets the same bits.
    With oneDNN the 3 rows run as they are and a single decode row runs as ``[2, in]``.

    The weight is stored the way its kernel reads it fastest (:meth:`use_kernel`):
    ``weight`` always has the shape ``[out, in]``, but on BLAS tiles it is the transposed
    view of an ``[in, out]`` contiguous tensor, so the GEMM reads ``B = W^T`` without a
    transposition.
    """

    def __init__(
        self,
        weight: torch.Tensor | nn.Parameter,
        bias: torch.Tensor | None,
        tile_rows: int,
        kernel: str = "blas",
        shared: bool = False,
    ):
        super().__init__()
        self.shared = shared  # the weight is also another module's (a tied LM head): never re-laid out
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else (bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias))
        self.tile_rows = int(tile_rows)
        self.in_features = int(self.weight.shape[1])
        self.out_features = int(self.weight.shape[0])
        self.kernel = kernel
        #: run on torch's own kernel (``F.linear``: fast, not batch-invariant) while True; set
        #: only around the draft forwards of :mod:`ralm.batching.fast_draft`, whose tokens are
        #: verified by an invariant forward
        self.plain = False
        self.use_kernel(kernel)

    def use_kernel(self, kernel: str) -> None:
        """Run on ``kernel`` ("blas", "onednn" or "triton") and lay the weight out for it: oneDNN
        and Triton take ``[out, in]`` contiguous; BLAS tiles an ``[in, out]`` contiguous buffer
        (``weight`` is its transposed view). Measured, one thread, 4-row tiles: ``[1024 -> 256]`` 45 us
        against 75 us with the ``[out, in]`` layout, ``[256 -> 768]`` 35 against 42 us; the
        demo model's batch-1 invariant forward 1.44x the plain one against 1.55x. A weight
        shared with another module (a tied LM head, ``shared``) keeps its layout, and stays
        shared."""
        w = self.weight.detach()
        if self.shared:
            pass
        elif kernel == "blas" and not w.t().is_contiguous():
            w = w.t().contiguous().t()
        elif kernel != "blas" and not w.is_contiguous():  # onednn, triton
            w = w.contiguous()
        if w.data_ptr() != self.weight.data_ptr() or w.stride() != self.weight.stride():
            self.weight = nn.Parameter(w, requires_grad=False)
        self.kernel = kernel

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, tile_rows={self.tile_rows}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return F.linear(x, self.weight, self.bias)
        if self.kernel == "triton":  # any leading dimensions, no padding (M-independent tiles)
            # lazy: keeps triton (optional, only the CUDA path uses it) out of CPU processes
            from ralm.batching import triton_kernels

            return triton_kernels.matmul(x, self.weight, self.bias)
        shape = x.shape
        n = math.prod(shape[:-1])
        # rows already a whole number of tiles (a packed forward pads them so): one call on x as
        # it is, whatever its leading dimensions (the same GEMM on the same rows, no reshapes)
        if self.kernel == "blas" and n % self.tile_rows == 0:
            return F.linear(x, self.weight, self.bias)
        if self.kernel == "onednn" and n >= C.INVARIANT_ONEDNN_MIN_ROWS and x.is_contiguous():
            return onednn_linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, shape[-1])
        if self.kernel == "onednn":
            rows = max(n, C.INVARIANT_ONEDNN_MIN_ROWS)
            y = onednn_linear(_pad_rows(x2, rows).contiguous(), self.weight, self.bias)
        else:
            rows = -(-n // self.tile_rows) * self.tile_rows
            y = F.linear(_pad_rows(x2, rows), self.weight, self.bias)
        if rows != n:  # padded: the real rows (no op when there was nothing to pad)
            y = y[:n]
        return y.reshape(*shape[:-1], self.out_features)


class NoDropout(nn.Identity):
    """An eval-mode ``nn.Dropout``: the identity, without the dispatched ``dropout`` op a
    dropout module makes even when it drops nothing (``p`` kept for code that reads it)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p


# --------------------------------------------------------------------------- activations
class InvariantSiLU(nn.Module):
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))``: built only from position-invariant ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (1.0 + torch.exp(-x))


class InvariantGELU(nn.Module):
    """Exact (erf) GELU from ``erf`` and IEEE arithmetic."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class InvariantGELUTanh(nn.Module):
    """The tanh approximation of GELU from ``tanh`` and IEEE arithmetic (``x**3`` as ``x*x*x``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))


# --------------------------------------------------------------------------- norms
class CastFreeRMSNorm(nn.Module):
    """Llama's RMSNorm (``w * x / sqrt(mean(x^2) + eps)``, reduced in float32) in fewer host ops.

    - float32 on a CPU: ``torch.rms_norm``, one fused op for the 6 of the formula. Each row is
      reduced alone over its own width, the same way at any row count, so a row's bits do not
      depend on its batch (the load-time proof checks it on the machine); on torch 2.13's CPU
      kernel they are also the formula's, bit for bit (checked on widths 64 to 4,096).
    - otherwise the formula without its two casts when there is nothing to cast: the same
      operations in the same order as transformers', so the same bits, in 6 ops instead of 8
      (a ``to`` to the same dtype is still dispatched).
    """

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and x.device.type == "cpu" and self.weight.dtype == torch.float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        h = x if dtype == torch.float32 else x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * (h if dtype == torch.float32 else h.to(dtype))


#: the RMSNorm classes whose forward is exactly :class:`CastFreeRMSNorm`'s (Gemma's ``1 + w`` is not)
_LLAMA_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


#: activation class name -> invariant replacement (None: already invariant, kept)
_ACTIVATIONS: dict[str, type[nn.Module] | None] = {
    "SiLU": InvariantSiLU,
    "SiLUActivation": InvariantSiLU,
    "GELUActivation": InvariantGELU,
    "GELU": InvariantGELU,
    "GELUTanh": InvariantGELUTanh,
    "PytorchGELUTanh": InvariantGELUTanh,
    "FastGELUActivation": InvariantGELUTanh,
    "NewGELUActivation": None,
    "ReLU": None,
    "InvariantSiLU": None,
    "InvariantGELU": None,
    "InvariantGELUTanh": None,
}
#: leaf modules that are row-wise (or position-wise) by construction
_ROWWISE_SUFFIXES = ("LayerNorm", "RMSNorm", "Embedding", "Dropout", "RotaryEmbedding", "Identity")


def _is_rowwise(mod: nn.Module) -> bool:
    name = type(mod).__name__
    return isinstance(mod, (nn.Embedding, nn.LayerNorm, nn.Dropout, nn.Identity)) or name.endswith(_ROWWISE_SUFFIXES)


_REGISTERED = False


def _register_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, invariant_attention)
    _REGISTERED = True


# --------------------------------------------------------------------------- the switch
def check_row_invariance(layer: InvariantLinear, rows: int = 5) -> None:
    """Raise :class:`InvariantUnavailable` unless ``layer`` gives each row the same bits alone
    and at every position of bigger batches (the BLAS property the design rests on)."""
    g = torch.Generator().manual_seed(0)
    w = layer.weight
    x = torch.randn(rows * layer.tile_rows + 3, layer.in_features, generator=g).to(w.dtype).to(w.device)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
        for n in (2, layer.tile_rows + 1, x.shape[0]):
            for s in (0, 1):
                if not torch.equal(layer(x[s : s + n]), alone[s : s + n]):
                    raise InvariantUnavailable(
                        f"this machine's matrix multiply is not row-invariant at {layer.tile_rows}-row tiles "
                        f"({w.dtype}, {w.device}); set generator.invariant=false (no batching, no KV sessions) "
                        "or try another invariant_tile_rows"
                    )


def _check_architecture(model) -> None:
    cfg = model.config
    mt = getattr(cfg, "model_type", "")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise InvariantUnavailable(
            f"the invariant forward supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not {mt!r}; "
            "set generator.invariant=false to serve it without batching and KV sessions"
        )
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", mt == "mistral")
    if window and uses_window and window < getattr(cfg, "max_position_embeddings", 0):
        raise InvariantUnavailable(
            f"{mt} with a {window}-token sliding window is not supported by the invariant forward"
        )


#: ``make_invariant``'s kernel choices (``GeneratorConfig.invariant_kernels``)
KERNELS = ("auto", "torch", "triton")


def make_invariant(model, tile_rows: int = C.INVARIANT_TILE_ROWS, kernels: str = "auto") -> Any:
    """Rewrite ``model`` in place for the invariant forward and return it (idempotent).

    Linear layers become :class:`InvariantLinear` (sharing the weights of ``nn.Linear``,
    e.g. a tied LM head; ``Conv1D`` weights are transposed once), activations become their
    invariant forms, and attention runs :func:`invariant_attention`. ``kernels``: ``"torch"``
    (BLAS tiles / oneDNN and :func:`attend`: torch's own kernels), ``"triton"`` (the Triton kernels for linear
    layers, norms and attention: what a GPU needs; also runs in triton's interpreter on CPU
    tensors), ``"auto"``: ``"triton"`` for a model on CUDA, else ``"torch"``. Raises
    :class:`InvariantUnavailable` for an unsupported architecture or machine.
    """
    if getattr(model, "_ralm_invariant", None):
        return model
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, not {kernels!r}")
    if kernels == "auto":
        param = next(model.parameters(), None)
        kernels = "triton" if param is not None and param.device.type == "cuda" else "torch"
    _check_architecture(model)
    if kernels == "triton":
        # lazy: keeps triton (optional, only the CUDA path uses it) out of CPU processes
        from ralm.batching import triton_kernels
        from ralm.batching.triton_forward import triton_norm, use_triton  # lazy: triton, as above

        if not triton_kernels.triton_available():
            raise InvariantUnavailable(
                "the invariant forward on this device needs triton (pip install triton); "
                "set generator.invariant=false to serve without batching and KV sessions"
            )
    from transformers.pytorch_utils import Conv1D

    unknown = {
        type(m).__name__
        for m in model.modules()
        if not list(m.children())
        and not isinstance(m, (nn.Linear, Conv1D, InvariantLinear, ProjectionSlice))
        and type(m).__name__ not in _ACTIVATIONS
        and not _is_rowwise(m)
    }
    if unknown:  # checked before anything is rewritten: the model stays usable as it was
        raise InvariantUnavailable(
            f"no invariant form for module types {sorted(unknown)}; set generator.invariant=false to serve this model"
        )
    # weights that modules other than linear layers hold too (tied input embeddings)
    held_elsewhere = {
        id(p) for m in model.modules() if not isinstance(m, (nn.Linear, Conv1D)) for p in m.parameters(recurse=False)
    }
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if isinstance(child, nn.Linear):
                shared = id(child.weight) in held_elsewhere
                setattr(parent, name, InvariantLinear(child.weight, child.bias, tile_rows, shared=shared))
            elif isinstance(child, Conv1D):  # weight [in, out]: y = x W + b; its transposed view
                setattr(parent, name, InvariantLinear(child.weight.detach().t(), child.bias, tile_rows))
            elif isinstance(child, nn.Dropout):  # an inference engine: dropout is the identity
                setattr(parent, name, NoDropout(child.p))
            elif kind in _ACTIVATIONS:
                repl = _ACTIVATIONS[kind]
                if repl is not None:
                    setattr(parent, name, repl())
            elif kernels == "triton" and (norm := triton_norm(child)) is not None:
                setattr(parent, name, norm)
            elif kernels == "torch" and kind in _LLAMA_RMS_NORMS:
                setattr(parent, name, CastFreeRMSNorm(child.weight, child.variance_epsilon))
    _register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    use_packed_rotary_attention(model)  # Llama-family layers: the packed batch's forward in fewer ops
    use_packed_gpt2_attention(model)  # GPT-2's layers: the same
    fuse_gated_mlps(model)  # gate and up projections: one product
    layers = [m for m in model.modules() if isinstance(m, InvariantLinear)]
    if kernels == "triton":
        return use_triton(model, layers, head_dim(model))
    _choose_kernels(layers)  # probes the oneDNN shapes; the tile loop probes the BLAS ones
    blas = {(m.in_features, m.out_features): m for m in layers if m.kernel == "blas"}
    for tile in dict.fromkeys((tile_rows, 16, 64)):  # the configured tile, then safer ones
        for layer in layers:
            layer.tile_rows = tile
        try:
            for layer in blas.values():
                check_row_invariance(layer)
        except InvariantUnavailable:
            log.warning("matrix multiply not row-invariant at %d-row tiles here; trying larger tiles", tile)
            continue
        check_attention_invariance(head_dim(model), layers[0].weight.device, layers[0].weight.dtype)
        kinds = sorted({m.kernel for m in layers})
        model._ralm_invariant = f"{'+'.join(kinds)}, {tile}-row BLAS tiles"
        # a packed forward of a multiple of this many rows needs no padding in any linear layer
        model._ralm_row_multiple = tile if "blas" in kinds else C.INVARIANT_ONEDNN_MIN_ROWS
        return model
    check_row_invariance(layers[0])  # raises with the reason
    return model


def _choose_kernels(layers: list[InvariantLinear]) -> None:
    """oneDNN for layers of at least ``INVARIANT_ONEDNN_MIN_WEIGHTS`` weights (by shape, so every
    replica chooses alike), where the machine's oneDNN passes the row-invariance check for that
    shape; BLAS tiles for the rest."""
    verdict: dict[tuple[int, int, torch.dtype], str] = {}
    for layer in layers:
        big = layer.in_features * layer.out_features >= C.INVARIANT_ONEDNN_MIN_WEIGHTS
        if not big or not onednn_available(layer.weight.device):
            layer.use_kernel("blas")
            continue
        key = (layer.in_features, layer.out_features, layer.weight.dtype)
        if key not in verdict:
            layer.use_kernel("onednn")
            try:
                check_row_invariance(layer)
                verdict[key] = "onednn"
            except (InvariantUnavailable, RuntimeError) as e:  # RuntimeError: oneDNN refused the dtype
                log.warning("oneDNN linear %s not usable for the invariant forward (%s); BLAS tiles", key, e)
                verdict[key] = "blas"
        layer.use_kernel(verdict[key])


def row_multiple(model) -> int:
    """The packed forward's row count is padded to a multiple of this (at least this many rows):
    then no linear layer pads its input (its kernel's tile, or oneDNN's smallest row count), and
    each layer is one op on the rows as they are. 1: no padding (the Triton kernels, or a model
    not made invariant)."""
    return int(getattr(model, "_ralm_row_multiple", 1))


def invariant_kernels(model) -> str | None:
    """The kernels the invariant forward of ``model`` runs on (None: not invariant)."""
    return getattr(model, "_ralm_invariant", None)


def check_attention_invariance(head_dim: int, device="cpu", dtype=torch.float32) -> None:
    """Raise :class:`InvariantUnavailable` unless :func:`attend` gives a query the same bits
    alone (one key block), inside a prefill over four blocks, and next to another sequence
    (checked at engine load: it rests on the BLAS giving a score the same bits whatever the
    row count and the key range)."""
    g = torch.Generator().manual_seed(1)
    KB = C.INVARIANT_KEY_BLOCK
    L = 3 * KB + 9
    q, k, v = (torch.randn(1, 2, L, head_dim, generator=g).to(device, dtype) for _ in range(3))
    pos = torch.arange(L, device=device)[None]
    k_pad, v_aug = pad_kv(k, v)
    full = attend(q, k_pad, v_aug, pos, 0.125)
    p = KB - 5
    kp1, va1 = pad_kv(k[:, :, : p + 1], v[:, :, : p + 1])
    one = attend(q[:, :, p : p + 1], kp1, va1, pos[:, p : p + 1], 0.125)
    two = attend(
        torch.cat([q[:, :, p : p + 1], q[:, :, L - 1 :]]),
        torch.cat([k_pad, k_pad]),
        torch.cat([v_aug, v_aug]),
        torch.tensor([[p], [L - 1]], device=device),
        0.125,
    )
    if not (torch.equal(one[0, 0], full[0, p]) and torch.equal(two[0, 0], full[0, p])):
        raise InvariantUnavailable(
            f"this machine's batched matrix multiply is not shape-invariant for attention ({dtype}, {device}); "
            "set generator.invariant=false"
        )


def head_dim(model) -> int:
    """The attention heads' dimension of ``model``'s config."""
    cfg = model.config
    hd = getattr(cfg, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    return int(hidden) // int(heads)
