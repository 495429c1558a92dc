"""Which slice of each weight a tensor-parallel rank holds.

Megatron's split of a Llama-family decoder layer over ``R`` ranks, rank ``r`` holding:

- **column-parallel** (output features split, no cross-rank sum): ``q_proj`` rows of query
  heads ``r*H/R .. (r+1)*H/R - 1`` (``D`` rows each), ``k_proj`` and ``v_proj`` rows of kv
  heads ``r*Hkv/R ..`` (so every query head finds its kv head on the same rank: grouped-query
  attention keeps its groups), ``gate_proj`` and ``up_proj`` rows ``r*I/R .. (r+1)*I/R - 1``;
- **row-parallel** (input features split, partial sums gathered and added in rank order):
  ``o_proj`` columns of its query heads, ``down_proj`` columns ``r*I/R ..``; a bias is added
  once, after the sum;
- the **LM head**'s vocabulary rows ``r*ceil(V/R) ..`` (the last rank's slice may be short);
- everything else whole (embeddings, norms).

Worked example, SmolLM2-135M (``H = 9`` heads of ``D = 64``, ``Hkv = 3``, ``I = 1536``,
``V = 49152``) at ``R = 3``: rank 1 holds ``q_proj`` rows 192-383 (heads 3-5), ``k_proj``/``v_proj``
rows 64-127 (kv head 1), ``gate``/``up`` rows 512-1023, ``o_proj`` columns 192-383, ``down``
columns 512-1023 and LM-head rows 16384-32767.
"""

from __future__ import annotations

from dataclasses import dataclass

from ralm.errors import InvariantUnavailable

#: model types whose layers the plan knows (their weights are named like Llama's)
TP_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: weight-name suffix -> how it is split: "rows" of the output features, "cols" of the input
#: features (the row-parallel layers), by "q" heads, "kv" heads, "mlp" columns or "vocab"
_SPLITS: dict[str, tuple[str, str]] = {
    "q_proj.weight": ("rows", "q"),
    "q_proj.bias": ("rows", "q"),
    "k_proj.weight": ("rows", "kv"),
    "k_proj.bias": ("rows", "kv"),
    "v_proj.weight": ("rows", "kv"),
    "v_proj.bias": ("rows", "kv"),
    "o_proj.weight": ("cols", "q"),
    "gate_proj.weight": ("rows", "mlp"),
    "up_proj.weight": ("rows", "mlp"),
    "down_proj.weight": ("cols", "mlp"),
    "lm_head.weight": ("rows", "vocab"),
}


class TensorParallelUnavailable(InvariantUnavailable):
    """This model cannot be split over R ranks (the reason says why)."""


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-family model that its split, memory and traffic depend on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_type: str = "llama"

    @classmethod
    def of_config(cls, config) -> ModelShape:
        """From a transformers config."""
        heads = int(config.num_attention_heads)
        return cls(
            int(config.num_hidden_layers),
            int(config.hidden_size),
            int(config.intermediate_size),
            heads,
            int(getattr(config, "num_key_value_heads", None) or heads),
            int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            int(config.vocab_size),
            str(getattr(config, "model_type", "llama")),
        )


def _check_ranks(ranks: int) -> None:
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"tensor_parallel must be a whole number of ranks >= 1, not {ranks!r}")


@dataclass(frozen=True)
class ShardPlan:
    """The split of one model over ``ranks`` ranks (see the module docstring)."""

    ranks: int
    heads: int  # query heads, H
    kv_heads: int  # Hkv
    head_dim: int  # D
    intermediate: int  # I
    vocab: int  # V

    @classmethod
    def for_config(cls, config, ranks: int) -> ShardPlan:
        """The plan for a transformers config, or :class:`TensorParallelUnavailable` with the
        reason (an unknown architecture, or a head count, kv-head count or MLP width that
        ``ranks`` does not divide)."""
        _check_ranks(ranks)
        mt = getattr(config, "model_type", "")
        if mt not in TP_MODEL_TYPES:
            raise TensorParallelUnavailable(
                f"tensor parallelism supports {', '.join(TP_MODEL_TYPES)} models, not {mt!r}"
            )
        return cls.for_shape(ModelShape.of_config(config), ranks)

    @classmethod
    def for_shape(cls, shape: ModelShape, ranks: int) -> ShardPlan:
        """The plan for a model's numbers (see :meth:`for_config`)."""
        _check_ranks(ranks)
        if shape.model_type not in TP_MODEL_TYPES:
            raise TensorParallelUnavailable(
                f"tensor parallelism supports {', '.join(TP_MODEL_TYPES)} models, not {shape.model_type!r}"
            )
        heads, kv, inter = shape.heads, shape.kv_heads, shape.intermediate
        for what, n in (("attention heads", heads), ("key/value heads", kv), ("MLP columns", inter)):
            if n % ranks:
                raise TensorParallelUnavailable(
                    f"{ranks} ranks do not divide the model's {n} {what}: choose a tensor_parallel that divides "
                    f"{heads} heads, {kv} key/value heads and {inter} MLP columns"
                )
        return cls(ranks, heads, kv, shape.head_dim, inter, shape.vocab)

    @property
    def vocab_per_rank(self) -> int:
        """``ceil(V / R)``: every rank's slice but the last is this long."""
        return -(-self.vocab // self.ranks)

    def span(self, kind: str, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of rank ``rank``'s slice of a ``kind`` dimension ("q", "kv", "mlp", "vocab")."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not one of 0..{self.ranks - 1}")
        if kind == "vocab":
            n = self.vocab_per_rank
            return min(rank * n, self.vocab), min((rank + 1) * n, self.vocab)
        width = {"q": self.heads * self.head_dim, "kv": self.kv_heads * self.head_dim, "mlp": self.intermediate}[kind]
        n = width // self.ranks
        return rank * n, (rank + 1) * n

    def split_of(self, name: str) -> tuple[str, str] | None:
        """``(axis, kind)`` for a weight name (``"rows"``/``"cols"``, ``"q"``/``"kv"``/``"mlp"``/
        ``"vocab"``), or None: held whole."""
        for suffix, split in _SPLITS.items():
            if name.endswith(suffix):
                return split
        return None

    def local_config(self, config):
        """A copy of ``config`` with a rank's head counts and MLP width (the hidden size, head
        dimension and vocabulary kept: the LM head's slice is the shard's own business)."""
        import copy

        cfg = copy.deepcopy(config)
        cfg.num_attention_heads = self.heads // self.ranks
        cfg.num_key_value_heads = self.kv_heads // self.ranks
        cfg.intermediate_size = self.intermediate // self.ranks
        cfg.head_dim = self.head_dim
        return cfg
