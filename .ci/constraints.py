"""Write ``constraints.txt``: the exact versions of everything ``make setup`` installs, read
from a venv where the test suite passed.

    make constraints            # = .venv/bin/python .ci/constraints.py > constraints.txt

The set is the dependency closure of this project's ``[project] dependencies`` and its
``dev`` extra (pyproject.toml), plus the packages the Makefile installs with ``--no-deps``
(the SmolLM2 and mpnet wheels), each at the version installed in the running interpreter's
environment. Local version labels are dropped (``torch==2.13.0+cpu`` -> ``torch==2.13.0``),
so the same file serves the CPU wheel here and a CUDA wheel of the same release elsewhere.
Packages installed but not needed (a tool added by hand) are left out.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("dev",)


def makefile_no_deps() -> list[str]:
    """Names of the packages the Makefile installs with --no-deps (SMOLLM2_SPEC, MPNET_SPECS)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    names = re.findall(r"^SMOLLM2_SPEC \?= ([A-Za-z0-9_.-]+)==", text, flags=re.M)
    for prefix in re.findall(r"\$\(foreach i,[0-9 ]+,([A-Za-z0-9_.-]+?)\$\(i\)==", text):
        names += [d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].startswith(prefix)]
    return names


def closure(roots: list[Requirement]) -> dict[str, metadata.Distribution]:
    """Installed distributions reachable from ``roots`` (markers evaluated here, extras followed)."""
    found: dict[str, metadata.Distribution] = {}
    todo = [(r, set(r.extras)) for r in roots]
    seen_extras: dict[str, set[str]] = {}
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in found and extras <= seen_extras.get(name, set()):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{req.name} is required but not installed in {sys.prefix}: run `make setup` first")
        found[name] = dist
        seen_extras[name] = seen_extras.get(name, set()) | extras
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((sub, set(sub.extras)))
    return found


def main() -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    roots = [Requirement(r) for r in project["dependencies"]]
    for extra in EXTRAS:
        roots += [Requirement(r) for r in project["optional-dependencies"][extra]]
    dists = list(closure(roots).values()) + [metadata.distribution(n) for n in makefile_no_deps()]
    pins = sorted({(canonicalize_name(d.metadata["Name"]), d.version.split("+")[0]) for d in dists})
    print("# The versions `make setup` installs (pip install -c constraints.txt): the environment the")
    print("# test suite passed in. Regenerate with `make constraints` after changing a dependency.")
    print(f"# Python {sys.version_info.major}.{sys.version_info.minor}; torch's local label (+cpu) dropped.")
    for name, version in pins:
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
