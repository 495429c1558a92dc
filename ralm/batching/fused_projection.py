"""Linear layers that read the same input, run as one product over their stacked weights.

A Llama-family layer has two such groups: the attention's ``q_proj``, ``k_proj``, ``v_proj``
and the MLP's ``gate_proj``, ``up_proj``. Stacked (``[Wq; Wk; Wv]``, ``[Wg; Wu]``, biases
too), each group is one linear layer: one kernel launch on a GPU instead of three or two,
and one dispatched op on the host.

transformers' attention forward keeps calling the projections by name: after :func:`fuse`, each name
is a :class:`ProjectionSlice`, a column slice of the group's :class:`FusedProjection`. The
first call of a group makes the product; the others reuse it for the same input tensor (a
one-entry memo, emptied once every part was taken). So a path that runs transformers'
forward and one that reads the stacked product directly (the packed attention,
:mod:`ralm.batching.rotary_attention`) take their bits from the same kernel. A gated MLP's
forward is replaced outright (:func:`fuse_gated_mlps`: transformers' arithmetic, one split).

Worked example, Llama-3.2-1B (d = 2048, H = 32, Hkv = 8, D = 64, intermediate 8192):
``qkv_proj`` is ``[3072, 2048]`` (2048 + 512 + 512 rows), ``gate_up_proj`` ``[16384, 2048]``;
a layer runs 4 matrix products (qkv, o, gate_up, down) instead of 7.

The stacked layer's rows are invariant like any other linear layer's: the same load-time
probe and whole-model proof check it. Its bits differ from the separate layers' where a
kernel's blocking depends on the output width; nothing compares them with those.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class FusedProjection(nn.Module):
    """``x [..., d] -> [..., sum(widths)]``: ``proj`` (an
    :class:`~ralm.batching.invariant.InvariantLinear` over the stacked weight), with the memo
    that lets :class:`ProjectionSlice` calls on one input share one product."""

    def __init__(
        self,
        proj: nn.Module,
        widths: Sequence[int],
        names: Sequence[str] = (),
        biased: Sequence[bool] = (),
    ):
        super().__init__()
        self.proj = proj
        self.widths = tuple(int(w) for w in widths)
        self.names = tuple(names)  # the parts' names on the parent (q_proj, k_proj, v_proj)
        self.biased = tuple(biased)  # which parts had a bias of their own (the others' are zeros)
        self._memo: tuple[torch.Tensor, torch.Tensor, set[int]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def part(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """Columns of part ``which`` of ``forward(x)``, a view. The product is made once for an
        input (the same tensor object: transformers passes one hidden state to every projection
        of a group) whose parts are all asked for. The memo holds ``x`` itself, so an identity
        can never be a recycled one; inference tensors keep no version counter, so an in-place
        change of ``x`` between the calls would not be seen (no caller makes one)."""
        memo = self._memo
        if memo is None or memo[0] is not x or which in memo[2]:
            memo = self._memo = (x, self.proj(x), set())
        memo[2].add(which)
        out = memo[1]
        if len(memo[2]) == len(self.widths):
            self._memo = None  # every part taken: hold nothing between forwards
        return out.narrow(-1, sum(self.widths[:which]), self.widths[which])


class ProjectionSlice(nn.Module):
    """A fused projection's part ``which``, under the name transformers calls (the fused module
    is registered once, on the parent, not here)."""

    fused: FusedProjection

    def __init__(self, fused: FusedProjection, which: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)
        self.which = which
        self.out_features = fused.widths[which]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.which)


def fuse(module: Any, names: Sequence[str], fused_name: str) -> FusedProjection | None:
    """Stack ``module``'s linear layers ``names`` (already
    :class:`~ralm.batching.invariant.InvariantLinear`, same input width, tiles and kernel) into
    ``module.<fused_name>`` and make each name its slice. Idempotent; ``None`` (nothing
    changed) where the layers cannot be stacked."""
    have = getattr(module, fused_name, None)
    if isinstance(have, FusedProjection):
        return have
    parts: list[Any] = [getattr(module, n, None) for n in names]
    first = parts[0]
    same = all(
        p is not None
        and type(p) is type(first)
        and hasattr(p, "tile_rows")
        and not getattr(p, "shared", False)
        and p.weight.shape[1] == first.weight.shape[1]
        and (p.tile_rows, p.kernel, p.weight.dtype, p.weight.device)
        == (first.tile_rows, first.kernel, first.weight.dtype, first.weight.device)
        for p in parts
    )
    if not same:
        return None
    weight = torch.cat([p.weight.detach() for p in parts], dim=0)
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat(
            [p.bias.detach() if p.bias is not None else weight.new_zeros(p.weight.shape[0]) for p in parts]
        )
    # the parts' own class (InvariantLinear: this module sits below invariant.py), same tiles and kernel
    fused = FusedProjection(
        type(first)(weight, bias, first.tile_rows, kernel=first.kernel),
        [p.weight.shape[0] for p in parts],
        names,
        [p.bias is not None for p in parts],
    )
    setattr(module, fused_name, fused)
    for i, n in enumerate(names):
        setattr(module, n, ProjectionSlice(fused, i))
    return fused


def unstacked_state_dict(model) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under transformers' names: each stacked projection's weight and
    bias split back into its parts (views), so a stacked model compares with, or saves as, the
    model it was made from."""
    stacked = {name: m for name, m in model.named_modules() if isinstance(m, FusedProjection)}
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")  # e.g. 'model.layers.0.self_attn.qkv_proj.proj', 'weight'
        fused_name = owner.removesuffix(".proj")
        fused = stacked.get(fused_name) if fused_name != owner else None
        if fused is None:
            out[key] = t
            continue
        parent = fused_name.rpartition(".")[0]
        for name, has_bias, piece in zip(fused.names, fused.biased, t.split(list(fused.widths), dim=0)):
            if leaf == "weight" or has_bias:
                out[f"{parent}.{name}.{leaf}" if parent else f"{name}.{leaf}"] = piece
    return out


#: MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")


def _gated_forward(self, x: torch.Tensor) -> torch.Tensor:
    """transformers' gated MLP on the stacked product: the same arithmetic, with the two
    halves taken by one ``split`` instead of two slice calls."""
    gate, up = self.gate_up_proj(x).split(self.gate_up_proj.widths, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def fuse_gated_mlps(model) -> int:
    """Stack ``gate_proj`` and ``up_proj`` of every gated MLP of ``model`` into ``gate_up_proj``
    and run its forward on the stacked product (``gate_proj``, ``up_proj`` stay callable, as
    slices); returns how many were fused."""
    n = 0
    for m in model.modules():
        if type(m).__name__ not in GATED_MLPS or not hasattr(m, "act_fn"):
            continue
        if fuse(m, ("gate_proj", "up_proj"), "gate_up_proj") is not None:
            object.__setattr__(m, "forward", types.MethodType(_gated_forward, m))
            n += 1
    return n
