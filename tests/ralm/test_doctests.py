"""The worked examples in the docstrings of the pure core (``ralm``, ``cache``) run as tests.

Every module whose source holds a ``>>>`` example is collected; each must run at least one
example and fail none, so an example that drifts from the code fails the suite.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def modules_with_examples() -> list[str]:
    names = []
    for pkg in ("ralm", "cache"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if ">>> " in path.read_text(encoding="utf-8"):
                rel = path.relative_to(ROOT).with_suffix("")
                names.append(".".join(p for p in rel.parts if p != "__init__"))
    return names


def test_the_core_has_worked_examples():
    assert len(modules_with_examples()) >= 5


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.attempted > 0 and res.failed == 0, f"{name}: {res.failed} of {res.attempted} examples failed"
