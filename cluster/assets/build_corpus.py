"""Build the demo corpus: docstrings of the Python standard library, as ~100-word passages.

The text is real documentation that ships with every Python install, so the corpus can
be rebuilt offline, byte for byte, on the same Python version (and package versions,
when ``--packages`` adds installed third-party packages).

Extraction
    Every public module in ``sys.stdlib_module_names`` and its public submodules is
    imported (modules with side effects on import, GUI toolkits and the test suite are
    skipped; modules that fail to import are skipped). For each module we take the
    module docstring, and the docstrings of the classes and functions it defines (or
    re-exports from a private C accelerator such as ``_heapq``), and of their methods
    and properties. Inherited docstrings are not used.

Passages
    Whitespace is collapsed. A docstring of at least ``MIN_WORDS`` words is cut into
    ~100-word passages on paragraph, then sentence, boundaries, titled with the object's
    qualified name. Shorter member docstrings of one class or module are gathered, as
    ``name: text`` entries, into passages titled with the class or module name. Exact
    duplicate texts are dropped (the copy with the shortest qualified name is kept).
    Passages are sorted by (title, part index) and numbered ``pydoc-000000``... in file
    order, so string order equals row order.

Output: pyserini JsonCollection records ``{"id", "title", "contents"}`` in a gzip file
written with ``mtime=0``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import inspect
import io
import json
import pkgutil
import platform
import sys
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.assets.passage_text import MAX_WORDS, MIN_DOC_WORDS, MIN_WORDS, TARGET_WORDS, chunk, clean, paragraphs
from cluster.flags import Default, HelpFormatter, add_shared

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "assets" / "corpus" / "pydocs.jsonl.gz"


# Modules (and packages, with all their submodules) never imported: side effects on
# import (browser, printing, files written), GUI toolkits, the test suite, deprecated
# duplicates, and platform-specific modules.
SKIP_MODULES = frozenset(
    {
        "antigravity",
        "this",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "test",
        "lib2to3",
        "distutils",
        "readline",
        "ensurepip",
        "venv",
        "pydoc_data",
        "sre_compile",
        "sre_constants",
        "sre_parse",
        "xxlimited",
        "xxlimited_35",
        "xxsubtype",
        "msilib",
        "msvcrt",
        "winreg",
        "winsound",
        "nt",
        "_winapi",
        "idle",
        "__main__",
        "sitecustomize",
        "usercustomize",
        "site",
        "encodings",
    }
)
# Submodule name components that are never imported.
SKIP_COMPONENTS = frozenset(
    {"__main__", "test", "tests", "testing", "_test", "conftest", "distutils", "setup", "idle_test"}
)

# Display names for implementation modules that users know under another name.
MODULE_ALIASES = {"posixpath": "os.path"}


@dataclass(frozen=True)
class Doc:
    """One docstring: ``qualname`` of the object, ``parent`` (its class or module)."""

    qualname: str
    parent: str
    name: str
    text: str
    kind: str  # module | class | function | method | property


# --------------------------------------------------------------------------- text


def _skipped(modname: str) -> bool:
    parts = modname.split(".")
    if parts[0] in SKIP_MODULES or modname in SKIP_MODULES:
        return True
    return any(p.startswith("_") or p in SKIP_COMPONENTS for p in parts)


def _quiet_import(modname: str) -> types.ModuleType | None:
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return importlib.import_module(modname)
    except (Exception, SystemExit):  # noqa: BLE001 - any failure means "skip it"
        return None


def iter_modules(roots: list[str]) -> list[tuple[str, types.ModuleType]]:
    """Import ``roots`` and their public submodules; sorted by module name."""
    found: dict[str, types.ModuleType] = {}
    todo = sorted({r for r in roots if not _skipped(r)})
    while todo:
        name = todo.pop()
        if name in found:
            continue
        mod = _quiet_import(name)
        if mod is None or getattr(mod, "__name__", None) != name:
            continue
        found[name] = mod
        path = getattr(mod, "__path__", None)
        if path:
            try:
                subs = [name + "." + info.name for info in pkgutil.iter_modules(list(path))]
            except Exception:  # noqa: BLE001
                subs = []
            todo.extend(sorted(s for s in subs if not _skipped(s) and s not in found))
    return sorted(found.items())


def _own_doc(obj) -> str | None:
    try:
        doc = obj.__doc__
    except Exception:  # noqa: BLE001
        return None
    return doc if isinstance(doc, str) and doc.strip() else None


def _belongs(obj, modname: str, name: str, public: set[str] | None) -> bool:
    """Is ``obj`` (found as ``modname.name``) defined by that module?"""
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str):
        return False
    if owner == modname:
        return True
    # Re-exported from a private accelerator (heapq.heappush lives in _heapq).
    if any(p.startswith("_") for p in owner.split(".")):
        return public is None or name in public
    return False


_GENERIC = {  # docstrings every class gets from ``object``/``type``
    clean(d) for d in (object.__doc__, object.__init__.__doc__, type.__doc__, dict.__doc__, Exception.__doc__) if d
}


def _member_doc(name: str, value) -> tuple[str, str] | None:
    """(kind, docstring) of a class attribute, or None."""
    if name.startswith("_") and name not in ("__init__", "__call__"):
        return None
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        doc = _own_doc(value) or (_own_doc(value.fget) if value.fget else None)
        return ("property", doc) if doc else None
    if isinstance(value, (types.GetSetDescriptorType, types.MemberDescriptorType)):
        doc = _own_doc(value)
        return ("property", doc) if doc else None
    if isinstance(
        value,
        (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType, types.ClassMethodDescriptorType),
    ):
        if name.startswith("__") and not isinstance(value, types.FunctionType):
            return None  # slot wrappers of C types: generic text
        doc = _own_doc(value)
        return ("method", doc) if doc else None
    return None


def _doc_instance(obj) -> bool:
    """A callable instance with a docstring of its own (numpy ufuncs, typing forms)."""
    if inspect.isclass(obj) or inspect.ismodule(obj) or not callable(obj):
        return False
    d = _own_doc(obj)
    return bool(d) and d != _own_doc(type(obj))


def topic_docs() -> list[Doc]:
    """The help topics of the Python language reference (``help("assignment")``)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [Doc(f"reference.{key}", "", key, topics[key], "topic") for key in sorted(topics)]


def module_docs(modname: str, mod: types.ModuleType) -> list[Doc]:
    """Docstrings of a module, its classes and functions, and their members."""
    shown = MODULE_ALIASES.get(modname, modname)
    docs: list[Doc] = []
    top = shown.rsplit(".", 1)[0] if "." in shown else ""
    mdoc = _own_doc(mod)
    if mdoc:
        docs.append(Doc(shown, top, shown.rsplit(".", 1)[-1], mdoc, "module"))
    public = getattr(mod, "__all__", None)
    public = {str(x) for x in public} if isinstance(public, (list, tuple)) else None
    try:
        items = sorted(vars(mod).items())
    except Exception:  # noqa: BLE001
        return docs
    seen: set[int] = set()
    for name, obj in items:
        if name.startswith("_") or not isinstance(name, str):
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj) or _doc_instance(obj)):
            continue
        if not _belongs(obj, modname, name, public) or id(obj) in seen:
            continue
        seen.add(id(obj))
        qual = f"{shown}.{name}"
        if inspect.isclass(obj):
            docs.extend(_class_docs(qual, shown, name, obj, depth=0))
        else:
            d = _own_doc(obj)
            if d:
                docs.append(Doc(qual, shown, name, d, "function"))
    return docs


def _class_docs(qual: str, parent: str, name: str, cls: type, depth: int) -> list[Doc]:
    out: list[Doc] = []
    d = _own_doc(cls)
    if d and clean(d) not in _GENERIC:
        out.append(Doc(qual, parent, name, d, "class"))
    try:
        members = sorted(vars(cls).items())
    except Exception:  # noqa: BLE001
        return out
    for mname, value in members:
        if not isinstance(mname, str):
            continue
        if (
            inspect.isclass(value)
            and depth < 1
            and not mname.startswith("_")
            and getattr(value, "__qualname__", "").endswith(f"{cls.__name__}.{mname}")
        ):
            out.extend(_class_docs(f"{qual}.{mname}", qual, mname, value, depth + 1))
            continue
        md = _member_doc(mname, value)
        if md and clean(md[1]) not in _GENERIC:
            out.append(Doc(f"{qual}.{mname}", qual, mname, md[1], md[0]))
    return out


# ----------------------------------------------------------------------- passages


def passages_from_docs(docs: list[Doc]) -> list[tuple[str, int, str]]:
    """Docs -> sorted, deduplicated ``(title, part, contents)``."""
    rows: list[tuple[str, int, str]] = []
    short: dict[str, list[str]] = {}
    long_titles: set[str] = set()
    for d in sorted(docs, key=lambda d: (d.qualname, d.kind)):
        paras = paragraphs(d.text)
        words = sum(len(p.split()) for p in paras)
        if words >= MIN_WORDS or (d.kind == "topic" and words >= MIN_DOC_WORDS):
            for i, text in enumerate(chunk(paras)):
                rows.append((d.qualname, i, text))
            long_titles.add(d.qualname)
        elif words >= MIN_DOC_WORDS and d.kind != "module" and d.parent:
            short.setdefault(d.parent, []).append(f"{d.name}: {' '.join(paras)}")
    # Short member docs of one parent -> passages titled with the parent.
    for parent, entries in short.items():
        groups: list[list[str]] = []
        cur: list[str] = []
        n = 0
        for e in entries:
            w = len(e.split())
            if cur and n + w > MAX_WORDS:
                groups.append(cur)
                cur, n = [], 0
            cur.append(e)
            n += w
            if n >= TARGET_WORDS:
                groups.append(cur)
                cur, n = [], 0
        if cur:
            if groups and n < MIN_WORDS:
                groups[-1].extend(cur)
            else:
                groups.append(cur)
        base = 1000 if parent in long_titles else 0  # after the parent's own passages
        for j, g in enumerate(groups):
            text = " ".join(g)
            if len(text.split()) >= MIN_WORDS:
                rows.append((parent, base + j, text))
    # Exact duplicates: keep the copy with the shortest qualified name.
    best: dict[str, tuple[int, str, int]] = {}
    for title, part, text in rows:
        key = (title.count("."), title, part)
        if text not in best or key < best[text]:
            best[text] = key
    kept = sorted((title, part, text) for text, (_, title, part) in best.items())
    # Renumber parts 0..n-1 per title.
    out: list[tuple[str, int, str]] = []
    last, k = None, 0
    for title, _, text in kept:
        k = k + 1 if title == last else 0
        last = title
        out.append((title, k, text))
    return out


def stdlib_roots() -> list[str]:
    return sorted(n for n in sys.stdlib_module_names if not _skipped(n))


def extract(modules: list[str] | None = None, packages: Sequence[str] = ()) -> list[tuple[str, int, str]]:
    """(title, part, contents) rows for ``modules`` (default: the whole stdlib and the
    language reference's help topics) plus the installed ``packages``. A module name
    includes its submodules."""
    roots = list(modules) if modules else stdlib_roots()
    roots += list(packages)
    docs: list[Doc] = [] if modules else topic_docs()
    for modname, mod in iter_modules(roots):
        docs.extend(module_docs(modname, mod))
    return passages_from_docs(docs)


def to_records(rows: list[tuple[str, int, str]], prefix: str = "pydoc-", width: int = 6) -> list[dict]:
    return [{"id": f"{prefix}{i:0{width}d}", "title": t, "contents": c} for i, (t, _, c) in enumerate(rows)]


def write_jsonl_gz(records: list[dict], out: Path) -> bytes:
    """Write records as gzip'd JSONL with mtime=0 (reproducible bytes)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(raw)
    data = buf.getvalue()
    out.write_bytes(data)
    return data


def _versions(packages: list[str]) -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version(), "implementation": platform.python_implementation()}
    for p in packages:
        try:
            out[p] = metadata.version(p)
        except Exception:  # noqa: BLE001
            out[p] = "unknown"
    return out


def write_readme(out: Path, records: list[dict], packages: list[str], shown: list[str]) -> None:
    """README.md next to ``out``: source, versions, count, and the rebuild command."""
    import hashlib

    vers = _versions(packages)
    words = sorted(len(r["contents"].split()) for r in records)
    median = words[len(words) // 2] if words else 0
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    by_src: dict[str, int] = {}
    for r in records:
        top = r["title"].split(".")[0]
        key = top if top in packages or top == "reference" else "stdlib"
        by_src[key] = by_src.get(key, 0) + 1
    pkg_line = ", ".join(f"{p} {vers[p]}" for p in packages) if packages else "none"
    src_lines = "\n".join(f"| {k} | {v:,} |" for k, v in sorted(by_src.items()))
    cmd = " ".join(["python -m cluster.assets.build_corpus", *shown])
    out_rel = out.name
    text = f"""# pydocs demo corpus

`{out_rel}` is the knowledge base of ralmspec's demo: **{len(records):,} passages** cut
from real documentation that nobody on the ralmspec team wrote and that is available
offline: the docstrings of the Python standard library (modules, classes, functions,
methods, properties), the help topics of the Python language reference
(`pydoc_data.topics`, titled `reference.<topic>`), and the docstrings of the installed
packages {pkg_line}.

| source | passages |
| --- | --- |
{src_lines}

- Built with CPython {vers["python"]}; packages: {pkg_line}. Other versions give a
  slightly different corpus; the same versions give the same bytes.
- Format: pyserini JsonCollection, one JSON object per line:
  `{{"id": "pydoc-000000", "title": "<qualified name>", "contents": "<text>"}}`.
  Ids are zero-padded and assigned in file order (string order == row order).
- Passages: whitespace collapsed, doctest code and numpydoc `Examples` sections dropped,
  ~{TARGET_WORDS} words (median {median}, min {words[0] if words else 0}, max {words[-1] if words else 0}),
  cut on paragraph, then sentence, boundaries. Short member docstrings of one class or
  module are gathered as `name: text` entries under the parent's title. Exact
  duplicates are dropped. Sorted by (title, part).
- gzip written with mtime=0. sha256 of `{out_rel}`: `{digest}`.

Rebuild (a few seconds):

```
{cmd}
```

Licenses: the CPython docstrings are under the PSF License; numpy and scipy are under
the BSD 3-Clause License.
"""
    (out.parent / "README.md").write_text(text, encoding="utf-8")


DEFAULT_PACKAGES = ("numpy", "scipy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ralmspec assets corpus", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_shared(ap, out=Default(DEFAULT_OUT, help="the corpus: a .jsonl.gz file"))
    ap.add_argument(
        "--min-passages", type=int, default=10_000, help="fail if the corpus has fewer passages (default 10000)"
    )
    ap.add_argument(
        "--modules",
        default="",
        help="comma-separated modules to extract, with their submodules "
        "(default: the whole stdlib and the language reference topics)",
    )
    ap.add_argument(
        "--packages",
        default=None,
        help="comma-separated installed packages to add "
        f"(default: {','.join(DEFAULT_PACKAGES)} for the full build, "
        "none with --modules)",
    )
    ap.add_argument(
        "--readme",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write README.md next to the output (default: for the full build)",
    )
    args = ap.parse_args(argv)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    if args.packages is None:
        packages = [] if modules else list(DEFAULT_PACKAGES)
    else:
        packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    rows = extract(modules or None, packages)
    records = to_records(rows)
    if len(records) < args.min_passages:
        print(f"error: only {len(records)} passages (< --min-passages {args.min_passages})", file=sys.stderr)
        return 1
    write_jsonl_gz(records, args.out)
    if args.readme if args.readme is not None else not modules:
        shown = (
            []
            if (not modules and list(packages) == list(DEFAULT_PACKAGES))
            else ([f"--modules {','.join(modules)}"] if modules else []) + [f"--packages '{','.join(packages)}'"]
        )
        write_readme(args.out, records, packages, shown)
    words = sorted(len(r["contents"].split()) for r in records)
    print(f"wrote {len(records)} passages to {args.out} (median {words[len(words) // 2]} words)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
