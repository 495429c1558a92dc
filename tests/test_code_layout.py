"""Rules of the code's shape that a reader relies on, checked on the whole repository:
a module's project dependencies are at its top (a lazy import says why), no package file
grows past 500 lines, and no private name is imported from another module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("ralm", "cache", "actors", "deployments", "cluster")
ROOT = Path(__file__).resolve().parents[1]
MAX_LAZY_IMPORTS = 40
MAX_LINES = 500


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
                if _is_project(node):
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


def test_no_package_file_is_over_500_lines():
    long = sorted(
        f"{p.relative_to(ROOT)} ({text.count(chr(10))})" for p, text in _sources() if text.count("\n") > MAX_LINES
    )
    assert not long, f"package files over {MAX_LINES} lines: {long}"


def test_no_private_name_is_imported_from_another_module():
    bad = []
    for p, text in _sources():
        for node in ast.walk(ast.parse(text, str(p))):
            if isinstance(node, ast.ImportFrom) and _is_project(node):
                bad += [f"{p.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, f"private names imported across modules: {bad}"
