"""A tensor-parallel rank's model: its slice of every weight, and the layers that gather.

:func:`rank_model` builds rank ``r``'s model from a :class:`WeightSource` (a whole model in
memory, or a checkpoint whose safetensors slices are read without loading the rest), with
the rank's head counts and MLP width (:meth:`ShardPlan.local_config`). Its column-parallel
layers are plain linear layers on their slices; two kinds of layer talk to the other ranks:

- :class:`RowParallelLinear` (``o_proj``, ``down_proj``): the rank's partial product over its
  input slice, the partials of every rank gathered (a copy) and added in rank order in
  float32, ``((p_0 + p_1) + p_2) + ...``, then the bias. Every rank computes the same sum from
  the same parts in the same order: the same bits on every rank, whatever the batch, the
  message size or the transport.
- :class:`VocabParallelHead` (``lm_head``): the logits of the rank's vocabulary slice, the
  slices gathered and laid end to end: the whole vocabulary's logits on every rank, so the
  greedy token is the lowest index among equal maxima, as on one device.

Embeddings and norms are held whole by every rank (computed redundantly, identically).
Apply :func:`ralm.batching.invariant.make_invariant` to the result: the linear layers inside
these two become invariant ones like the rest.

Example (R = 2, hidden 64, 4 heads of 16): rank 0 holds ``q_proj [32, 64]`` (heads 0-1),
``o_proj`` as ``RowParallelLinear`` over ``[64, 32]``; its attention output ``[N, 32]`` gives
the partial ``p_0 [N, 64]``, rank 1's gives ``p_1``, and both ranks continue with ``p_0 + p_1``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ralm.tensor_parallel.collective import Collective
from ralm.tensor_parallel.plan import ShardPlan, TensorParallelUnavailable


def fixed_order_sum(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``((p_0 + p_1) + p_2) + ...`` in float32, then cast to ``dtype``: the same bits for the
    same parts on every rank (an element's sum never depends on the other elements)."""
    acc = parts[0] if parts[0].dtype == torch.float32 else parts[0].float()
    for p in parts[1:]:
        acc = acc + (p if p.dtype == torch.float32 else p.float())
    return acc if dtype == torch.float32 else acc.to(dtype)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r W_r^T + b``: this rank's ``x [..., in/R]`` times its weight columns
    ``[out, in/R]`` (``linear``), the partials of all ranks gathered and added in rank order,
    then ``b`` (``bias``, held whole by every rank)."""

    def __init__(self, in_local: int, out: int, bias: bool, dtype: torch.dtype, collective: Collective):
        super().__init__()
        self.linear = nn.Linear(in_local, out, bias=False, dtype=dtype)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self.collective = collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.linear(x)
        y = fixed_order_sum(self.collective.all_gather(part), part.dtype)
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows (``linear``: ``[V_r, d]``); returns the
    whole vocabulary's logits ``[..., V]`` (each rank's slice padded to ``ceil(V/R)`` for the
    gather, the padding cut after)."""

    def __init__(self, d: int, rows: int, vocab: int, per_rank: int, dtype: torch.dtype, collective: Collective):
        super().__init__()
        self.linear = nn.Linear(d, rows, bias=False, dtype=dtype)
        self.vocab, self.per_rank, self.collective = vocab, per_rank, collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x)
        short = self.per_rank - local.shape[-1]
        if short:
            local = torch.nn.functional.pad(local, (0, short))
        full = torch.cat(self.collective.all_gather(local), dim=-1)
        return full if full.shape[-1] == self.vocab else full[..., : self.vocab]


# --------------------------------------------------------------------------- weight sources
class WeightSource(Protocol):
    """Named weights, read a slice at a time: :meth:`get` returns rows or columns
    ``[start, stop)`` of a weight, or the whole of it, without reading the rest where the
    source allows (safetensors)."""

    def names(self) -> list[str]: ...

    def get(self, name: str, axis: str | None = None, span: tuple[int, int] | None = None) -> torch.Tensor: ...


class ModelWeights:
    """A whole model's state dict (already in memory: tests, small models)."""

    def __init__(self, model: nn.Module):
        self.sd = model.state_dict()

    def names(self) -> list[str]:
        return list(self.sd)

    def get(self, name, axis=None, span=None):
        t = self.sd[name]
        if axis == "rows":
            t = t[span[0] : span[1]]
        elif axis == "cols":
            t = t[:, span[0] : span[1]]
        return t.detach().clone()


class SafetensorsWeights:
    """A checkpoint folder's ``*.safetensors`` files (one, or several with their index):
    each :meth:`get` reads only the requested slice from disk."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise TensorParallelUnavailable(
                f"{folder} has no .safetensors files: a tensor-parallel rank reads its slices from "
                "safetensors (convert the checkpoint with save_pretrained(safe_serialization=True))"
            )
        self._open = {f: safe_open(str(f), framework="pt") for f in files}
        self._where: dict[str, Path] = {}
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self._where = {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            for f, h in self._open.items():
                self._where.update(dict.fromkeys(h.keys(), f))

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name, axis=None, span=None):
        sl = self._open[self._where[name]].get_slice(name)
        if axis == "rows":
            return sl[span[0] : span[1]]
        if axis == "cols":
            return sl[:, span[0] : span[1]]
        return sl[:]


def _no_init() -> contextlib.AbstractContextManager:
    """transformers' context that skips random initialisation (the weights are loaded next)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        try:
            from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def rank_model(
    source: WeightSource,
    config,
    ranks: int,
    collective: Collective,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Rank ``collective.rank``'s model of a ``ranks``-way split: a causal LM of ``config``'s
    class with the rank's head counts and MLP width, its weight slices read from ``source``,
    ``o_proj``/``down_proj`` as :class:`RowParallelLinear` and ``lm_head`` as
    :class:`VocabParallelHead`. Raises :class:`TensorParallelUnavailable` for a split the plan
    refuses."""
    from transformers import AutoModelForCausalLM

    plan = ShardPlan.for_config(config, ranks)
    if collective.ranks != ranks:
        raise ValueError(f"a {ranks}-way split needs a group of {ranks} ranks, not {collective.ranks}")
    rank = collective.rank
    cfg = plan.local_config(config)
    cfg.tie_word_embeddings = False  # the LM head is this rank's vocabulary slice, not the embedding
    with _no_init():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    for layer in model.model.layers:
        for parent, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            lin = getattr(parent, attr)
            rp = RowParallelLinear(lin.in_features, lin.out_features, lin.bias is not None, dtype, collective)
            setattr(parent, attr, rp)
    lo, hi = plan.span("vocab", rank)
    model.lm_head = VocabParallelHead(
        int(config.hidden_size), hi - lo, plan.vocab, plan.vocab_per_rank, dtype, collective
    )
    names = set(source.names())
    state: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        own = name.replace(".linear.", ".")  # the wrappers hold the layer's own weight as .linear
        src = own
        if src == "lm_head.weight" and src not in names:  # a tied checkpoint: the embedding's rows
            src = "model.embed_tokens.weight"
        if src not in names:
            raise TensorParallelUnavailable(f"the checkpoint has no {src!r} for the rank's {name!r}")
        split = plan.split_of(own)
        if split is None:
            state[name] = source.get(src)
        else:
            axis, kind = split
            state[name] = source.get(src, axis, plan.span(kind, rank))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    model._ralm_tensor_parallel = {"rank": rank, "ranks": ranks}
    return model.eval()
