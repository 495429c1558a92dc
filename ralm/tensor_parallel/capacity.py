"""What one rank of a tensor-parallel replica needs, worked out before renting GPUs.

``ralmspec gpu-check --plan MODEL --tp R`` prints it; no GPU is needed. For a Llama-family
shape split over ``R`` ranks the way :class:`~ralm.tensor_parallel.plan.ShardPlan` splits it:

- **weights per rank**: each layer's column-parallel q, k, v, gate and up rows and
  row-parallel o and down columns (a ``1/R`` share each), its two norms whole; the embedding
  and the final norm whole; the LM head's ``ceil(V/R)`` vocabulary rows;
- **KV pool per rank**: the rank's ``Hkv/R`` key/value heads, for ``sequences`` sequences of
  ``context`` positions, each rounded up to whole blocks of the pool;
- **collective bytes per decode step** (received by each rank): every layer gathers the other
  ranks' partial products of ``o_proj`` and ``down_proj`` (``S x hidden`` each, in the model's
  dtype), and the LM head gathers their vocabulary slices' logits (``S x ceil(V/R)``). A
  ring all-reduce would move ``2 (R-1)/R`` of a partial instead of ``R-1`` of them, but sums
  in the transport, in an order that is not fixed: the gather is what keeps the bits
  (``docs/tensor-parallel.md``).

Worked example, LLaMA-2-70B in fp16 at ``R = 4``, 64 sequences of 4,096 positions: about
32.5 GiB of weights and 20 GiB of KV per rank, 52.5 GiB in all, so an A100-80GB holds it at
the default 90% utilisation (72 GiB); at ``R = 2``, 64.5 + 40 GiB does not fit.

The counts are checked against the real thing in the tests: the parameters of the ranks
:func:`~ralm.tensor_parallel.shard.rank_model` builds, the bytes per position of their KV
pools, and the bytes their collectives receive in a decode step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ralm import constants as C
from ralm.tensor_parallel.plan import ModelShape, ShardPlan

GIB = 1 << 30


#: shapes by name, from their published configs (no download): ``--plan NAME``
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama2-70b": ModelShape(80, 8192, 28672, 64, 8, 128, 32000),
    "llama2-13b": ModelShape(40, 5120, 13824, 40, 40, 128, 32000),
    "llama2-7b": ModelShape(32, 4096, 11008, 32, 32, 128, 32000),
    "llama3.2-1b": ModelShape(16, 2048, 8192, 32, 8, 64, 128256),
    "smollm2-135m": ModelShape(30, 576, 1536, 9, 3, 64, 49152),
}
#: the generator preset that names each shape (``deployments.config``)
PRESET_SHAPES = {"llama2-70b-4gpu": "llama2-70b"}

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class RankCapacity:
    """One rank's bytes (every rank's are the same but the last's LM-head slice, which may
    be shorter; this is the largest)."""

    model: str
    ranks: int
    dtype: str
    sequences: int
    context: int
    weights_bytes: int
    kv_bytes: int
    kv_bytes_per_position: int
    gather_bytes_per_decode_step: int
    allreduce_bytes_per_decode_step: int  # what a ring all-reduce of the same partials would move
    device_bytes: int | None
    utilization: float

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def fits(self) -> bool | None:
        """Whether weights and KV fit in ``utilization`` of the device (None: no device given)."""
        return None if self.device_bytes is None else self.total_bytes <= self.utilization * self.device_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "fits": self.fits}

    def summary(self) -> str:
        """The plan in a few lines, in GiB and MB."""
        lines = [
            f"{self.model} in {self.dtype} over {self.ranks} rank(s), {self.sequences} sequences x "
            f"{self.context} positions, per rank:",
            f"  weights   {self.weights_bytes / GIB:8.2f} GiB",
            f"  KV pool   {self.kv_bytes / GIB:8.2f} GiB  ({self.kv_bytes_per_position:,} bytes per position)",
            f"  total     {self.total_bytes / GIB:8.2f} GiB",
            f"  gathered per decode step {self.gather_bytes_per_decode_step / 1e6:,.1f} MB "
            f"(a ring all-reduce would move {self.allreduce_bytes_per_decode_step / 1e6:,.1f} MB, "
            "not in a fixed order)",
        ]
        if self.device_bytes is not None:
            room = self.utilization * self.device_bytes / GIB
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(
                f"  {verdict} in {self.utilization:.0%} of a {self.device_bytes / GIB:.0f} GiB device ({room:.1f} GiB); "
                "the rest is for activations, the CUDA context and graphs"
            )
        return "\n".join(lines)


def rank_capacity(
    model: str | ModelShape,
    ranks: int,
    dtype: str = "float16",
    sequences: int = C.BATCH_MAX_SEQUENCES,
    context: int = 4096,
    device_gib: float | None = None,
    utilization: float = 0.9,
    block_size: int = C.INVARIANT_KEY_BLOCK,
) -> RankCapacity:
    """One rank's weights, KV pool and decode-step traffic (see the module docstring).
    ``model``: a name of :data:`KNOWN_SHAPES` or :data:`PRESET_SHAPES`, or a shape."""
    name = model if isinstance(model, str) else "model"
    if isinstance(model, str):
        key = PRESET_SHAPES.get(model, model)
        if key not in KNOWN_SHAPES:
            known = ", ".join([*KNOWN_SHAPES, *PRESET_SHAPES])
            raise ValueError(f"no shape is known for {model!r}: choose one of {known}, or give a model's config")
        model = KNOWN_SHAPES[key]
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    if sequences < 1 or context < 1:
        raise ValueError(f"sequences ({sequences}) and context ({context}) must be at least 1")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization {utilization} must be in (0, 1]")
    s, b = model, DTYPE_BYTES[dtype]
    plan = ShardPlan.for_shape(s, ranks)
    q, kv, inter = s.heads * s.head_dim // ranks, s.kv_heads * s.head_dim // ranks, s.intermediate // ranks
    per_layer = s.hidden * (q + 2 * kv) + q * s.hidden + 2 * s.hidden * inter + inter * s.hidden + 2 * s.hidden
    params = s.layers * per_layer + s.vocab * s.hidden + s.hidden + plan.vocab_per_rank * s.hidden
    kv_per_position = s.layers * 2 * kv * b
    positions = sequences * -(-context // block_size) * block_size
    S = sequences
    gather = (ranks - 1) * S * b * (2 * s.layers * s.hidden + plan.vocab_per_rank)
    allreduce = 2 * (ranks - 1) * S * b * (2 * s.layers * s.hidden + plan.vocab_per_rank) // ranks
    return RankCapacity(
        name,
        ranks,
        dtype,
        sequences,
        context,
        params * b,
        positions * kv_per_position,
        kv_per_position,
        gather,
        allreduce,
        int(device_gib * GIB) if device_gib is not None else None,
        utilization,
    )
