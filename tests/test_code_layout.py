"""Rules of the code's shape that a reader relies on, checked on the whole repository:
modules import one another without cycles (so each can be read, and imported, before the
ones that use it), a module's project dependencies are at its top (a lazy import says why),
each module opens by saying what it is, no module is named for no concept (``utils``,
``helpers``), and no private name is imported from another module. A long module that is
one concept is fine: there is no line cap. The layers between packages are `lint-imports`'
contract (pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("ralm", "cache", "actors", "deployments", "cluster")
ROOT = Path(__file__).resolve().parents[1]
MAX_LAZY_IMPORTS = 40
GRAB_BAG_NAMES = frozenset({"utils", "util", "helpers", "helper", "misc", "common", "stuff", "tools"})


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def _is_project(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in PACKAGES for a in node.names)
    return False


def function_level_imports(path: Path, text: str) -> dict[int, bool]:
    """{line: has a ``# lazy:`` comment on it or the line above} of the project imports inside
    functions of one module."""
    lines = text.splitlines()
    out: dict[int, bool] = {}
    for fn in ast.walk(ast.parse(text, str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _is_project(node):
                    n = node.lineno
                    out[n] = "# lazy:" in lines[n - 1] or (n > 1 and "# lazy:" in lines[n - 2])
    return out


def test_function_level_imports_are_few_and_say_why():
    found = {
        (p.relative_to(ROOT), n): ok for p, text in _sources() for n, ok in function_level_imports(p, text).items()
    }
    unexplained = sorted(f"{p}:{n}" for (p, n), ok in found.items() if not ok)
    assert not unexplained, f"project imports inside functions without a '# lazy:' reason: {unexplained}"
    assert len(found) <= MAX_LAZY_IMPORTS, f"{len(found)} function-level project imports (at most {MAX_LAZY_IMPORTS})"


def test_the_checker_sees_a_function_level_import():
    text = "def f():\n    from ralm import constants\n\n\ndef g():\n    # lazy: torch\n    from ralm.engine import LMEngine\n"
    assert function_level_imports(Path("x.py"), text) == {2: False, 7: True}


def _module_name(path: Path) -> tuple[str, bool]:
    """(dotted name, is a package's ``__init__``) of a file below ROOT."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _runtime_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: its top level, inside ``if``/``try``/
    ``with`` blocks, not under ``if TYPE_CHECKING`` and not inside functions or classes."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name != "TYPE_CHECKING":
                out += _runtime_imports(node.body)
            out += _runtime_imports(node.orelse)
        elif isinstance(node, ast.Try):
            out += _runtime_imports(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                out += _runtime_imports(handler.body)
        elif isinstance(node, ast.With):
            out += _runtime_imports(node.body)
    return out


def import_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the project modules it imports when imported} of ``{dotted name: (source,
    is a package)}``. ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
    else to ``a.b``."""
    graph: dict[str, set[str]] = {}
    for name, (text, is_pkg) in modules.items():
        package = name if is_pkg else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _runtime_imports(ast.parse(text).body):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    edges.add(f"{target}.{a.name}")
                elif target in modules:
                    edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_level_import_cycle():
    modules = {}
    for path, text in _sources():
        name, is_pkg = _module_name(path)
        modules[name] = (text, is_pkg)
    cycles = import_cycles(import_graph(modules))
    assert not cycles, f"modules that import one another when imported: {cycles}"


def test_the_cycle_finder_sees_a_cycle_through_a_package_face():
    modules = {
        "p": ("from p.a import A\n", True),
        "p.a": ("from p.b import B\nA = 1\n", False),
        "p.b": ("from typing import TYPE_CHECKING\nfrom p import A\nB = 2\n", False),
        "p.c": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.d import D\n", False),
        "p.d": ("from . import c\n\n\ndef f():\n    from p import a\n", False),
    }
    graph = import_graph(modules)
    assert graph["p.d"] == {"p.c"} and graph["p.c"] == set()  # typing-only and function-level imports are no edges
    assert import_cycles(graph) == [["p", "p.a", "p.b"]]


def test_every_module_says_what_it_is():
    missing = [str(p.relative_to(ROOT)) for p, text in _sources() if ast.get_docstring(ast.parse(text)) is None]
    assert not missing, f"modules without a docstring saying what they are: {missing}"


def test_no_module_is_named_for_no_concept():
    bad = [str(p.relative_to(ROOT)) for p, _ in _sources() if p.stem in GRAB_BAG_NAMES]
    assert not bad, f"modules named for no concept (name them for what they hold): {bad}"


def test_no_private_name_is_imported_from_another_module():
    bad = []
    for p, text in _sources():
        for node in ast.walk(ast.parse(text, str(p))):
            if isinstance(node, ast.ImportFrom) and _is_project(node):
                bad += [f"{p.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, f"private names imported across modules: {bad}"
