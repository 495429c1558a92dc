"""``docs/config.md``: the configuration reference, generated from the pydantic models.

    python -m cluster.config_reference            # rewrite docs/config.md
    python -m cluster.config_reference --check    # exit 1 if docs/config.md is out of date
    make config-docs                              # the same as the first

Every model reachable from :class:`deployments.config.AppConfig` (the ``args:`` block of
``serve_config.yaml``, which holds :class:`ralm.config.RalmConfig`, the file that ``--config``
reads) gets one table: each field with its type and bounds, its default and its description,
all read from the models themselves, so the page cannot say something the code does not.
``tests/test_config_reference.py`` fails when the page and the models differ.
"""

from __future__ import annotations

import argparse
import enum
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from cluster.flags import Default, HelpFormatter, add_shared
from deployments.config import AppConfig
from ralm import constants as C, retrievers

OUT = C.PACKAGE_ROOT / "docs" / "config.md"

HEADER = """# Configuration reference

Generated from the pydantic models by `python -m cluster.config_reference` (or `make config-docs`);
`tests/test_config_reference.py` fails when this page and the models differ, so edit the models'
`Field(..., description=...)`, not this page.

Two files use these models:

- the Serve config (`serve_config.yaml`, `ralmspec serve --serve-config FILE`): its ralmspec
  application's `args:` block is an [AppConfig](#appconfig);
- `--config FILE.yaml` of every `ralmspec` command: a [RalmConfig](#ralmconfig) (the same model as
  `args.ralm` of the Serve config).

Every model rejects unknown keys (a misspelt option fails validation). Every field has a default,
so `{}` is a valid configuration: the demo. Paths: `<repo>` is the repository (or installed package)
root, `~` the user's home directory; relative paths in a Serve config are taken relative to the
current directory if they exist there, else to `<repo>`.
"""


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation refers to (through unions, lists, dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _type(annotation: Any) -> str:
    """A field's type as a reader writes it: ``int``, ``"a" | "b"``, ``list[str]``, a link."""
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{_anchor(annotation)})"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f'"{m.value}"' for m in annotation)
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in get_args(annotation))
    if origin is typing.Annotated:
        return _type(get_args(annotation)[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in get_args(annotation))}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _bounds(field: FieldInfo) -> str:
    """The field's numeric and length bounds (``ge=1``, ``le=256``, ...)."""
    out = []
    unit = "character" if field.annotation is str else "item"
    for m in field.metadata:
        for cls, attr, op in ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<")):
            if isinstance(m, cls):
                out.append(f"{op} {getattr(m, attr)}")
        if isinstance(m, at.MinLen):
            out.append(f"at least {m.min_length} {unit}" + "s" * (m.min_length != 1))
        if isinstance(m, at.MaxLen):
            out.append(f"at most {m.max_length} {unit}" + "s" * (m.max_length != 1))
    return ", ".join(out)


def _shown(value: Any) -> str:
    """A default value as it would be written in YAML, with machine-specific paths made portable."""
    if isinstance(value, BaseModel):
        return f"see [{type(value).__name__}](#{_anchor(type(value))})"
    if isinstance(value, Path) or (isinstance(value, str) and value.startswith(("/", "~"))):
        text = str(value)
        root, home = str(C.PACKAGE_ROOT), str(Path.home())
        if text.startswith(root):
            text = "<repo>" + text[len(root) :]
        elif text.startswith(home):
            text = "~" + text[len(home) :]
        return f"`{text}`"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        with retrievers.builtin_only():  # the package's defaults, whatever plugins are loaded here
            return _shown(field.default_factory())  # type: ignore[call-arg]
    if field.default is PydanticUndefined:
        return "required"
    return _shown(field.default)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _walk(root: type[BaseModel]) -> list[tuple[type[BaseModel], list[str]]]:
    """Every model reachable from ``root``, depth first (a model's sections follow it), with
    the YAML paths it appears at."""
    order: list[type[BaseModel]] = []
    paths: dict[type[BaseModel], list[str]] = {}

    def visit(model: type[BaseModel], path: str) -> None:
        first = model not in paths
        paths.setdefault(model, []).append(path)
        if not first:
            return
        order.append(model)
        for name, field in model.model_fields.items():
            for sub in _models_in(field.annotation):
                visit(sub, f"{path}.{name}")

    visit(root, "args")
    return [(m, paths[m]) for m in order]


def render() -> str:
    """The whole page."""
    models = _walk(AppConfig)
    parts = [HEADER, "Models: " + ", ".join(f"[{m.__name__}](#{_anchor(m)})" for m, _ in models) + ".\n"]
    for model, where in models:
        parts.append(f"## {model.__name__}\n")
        doc = (model.__doc__ or "").strip().split("\n\n")[0]
        if doc and not doc.startswith(("Usage docs", "A base class")):
            parts.append(" ".join(doc.split()) + "\n")
        parts.append(f"`{model.__module__}.{model.__name__}`, at " + ", ".join(f"`{w}`" for w in where) + ".\n")
        parts.append("| field | type | default | description |")
        parts.append("|---|---|---|---|")
        for name, field in model.model_fields.items():
            kind = _type(field.annotation)
            bounds = _bounds(field)
            if bounds:
                kind += f" ({bounds})"
            parts.append(f"| `{name}` | {kind} | {_cell(_default(field))} | {_cell(field.description or '')} |")
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cluster.config_reference", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_shared(
        p,
        out=Default(OUT, help="where to write the page", unset="docs/config.md"),
        check=Default(help="check only: write nothing; exit 1 if the page is out of date"),
    )
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date: run `make config-docs`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
