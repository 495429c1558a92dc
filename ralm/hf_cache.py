"""Hugging Face's KV-cache argument, by the name the installed transformers gives it.

transformers 5.x renamed a model's ``past_key_values`` argument and output field to
``cache`` (the old name still works, with a deprecation warning); 4.x knows only the old
name. :func:`cache_kwargs` gives the keyword a model's ``forward`` takes, and
:func:`cache_of` reads the cache back from its output, without touching the deprecated name.

Example: ``out = model(input_ids=ids, use_cache=True, **cache_kwargs(model, past))`` and
``past = cache_of(out)``.
"""

from __future__ import annotations

import inspect
from typing import Any

_NAMES: dict[type, str] = {}


def cache_name(model) -> str:
    """``"cache"`` when ``model.forward`` takes it, else ``"past_key_values"``."""
    t = type(model)
    name = _NAMES.get(t)
    if name is None:
        params = inspect.signature(t.forward).parameters
        name = _NAMES[t] = "cache" if "cache" in params else "past_key_values"
    return name


def cache_kwargs(model, past: Any) -> dict[str, Any]:
    """``{name: past}`` for ``model``'s forward (nothing when ``past`` is None)."""
    return {} if past is None else {cache_name(model): past}


def cache_of(out: Any) -> Any:
    """The cache a forward returned (``use_cache=True``), under either name."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.get("past_key_values")
