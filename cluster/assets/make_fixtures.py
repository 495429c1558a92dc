"""Make the tiny test fixtures in ``tests/data/`` from the pydocs extraction code.

``fixture_corpus.jsonl`` holds every passage of a few related standard-library modules
(so that those modules are covered in depth, and retrieval has real near-misses), in
the demo corpus's format with ids re-assigned ``fx-0000``... in file order.
``fixture_questions.jsonl`` holds questions about those passages, made by
``build_questions.make_questions``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.assets.build_corpus import MODULE_ALIASES, extract, to_records
from cluster.assets.build_questions import make_questions, write_jsonl
from cluster.flags import Default, HelpFormatter, add_shared

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO_ROOT / "tests" / "data"

# About 300 passages in all (with CPython 3.11).
FIXTURE_MODULES = (
    "json",
    "posixpath",
    "shutil",
    "re",
    "collections",
    "itertools",
    "functools",
    "pathlib",
    "datetime",
    "random",
    "math",
    "statistics",
    "string",
    "textwrap",
    "heapq",
    "bisect",
    "copy",
    "operator",
    "fnmatch",
    "glob",
    "tempfile",
    "csv",
    "subprocess",
    "argparse",
    "contextlib",
    "dataclasses",
    "enum",
    "queue",
    "time",
    "base64",
)


# Extracted along with the fixture modules only so that duplicates are resolved as in the
# full corpus (e.g. collections.UserString.maketrans repeats builtins.str.maketrans).
DEDUP_WITH = ("builtins",)


def fixture_records(modules: tuple[str, ...] = FIXTURE_MODULES) -> list[dict]:
    shown = {MODULE_ALIASES.get(m, m) for m in modules}
    rows = [
        row
        for row in extract(list(modules) + list(DEDUP_WITH))
        if any(row[0] == m or row[0].startswith(m + ".") for m in shown)
    ]
    return to_records(rows, prefix="fx-", width=4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ralmspec assets fixtures", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_DIR, help="where the fixture files go")
    add_shared(ap, num_questions=Default(40, help="questions to write"), seed=0)
    args = ap.parse_args(argv)
    records = fixture_records()
    questions = make_questions(records, args.num_questions, args.seed)
    write_jsonl(records, args.out_dir / "fixture_corpus.jsonl")
    write_jsonl(questions, args.out_dir / "fixture_questions.jsonl")
    print(f"wrote {len(records)} passages and {len(questions)} questions to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
