"""Build the demo question set from the pydocs corpus, deterministically.

Each question names the API (or language-reference topic) of one passage, in the way a
user would ask about it: "What does json.dumps do?", "How do I create a
collections.OrderedDict object?", "What is the difference between shutil.copy and
shutil.copy2?". The passage it was made from is recorded as ``doc_id`` (its string id)
with its ``title``; it is the natural source for an answer, not a relevance label that
retrieval is scored against.

The sample is spread over modules: passages are grouped by module (the top-level name,
or the first two components for packages such as ``scipy.stats``), the groups and the
passages inside them are ordered by a seeded hash, and questions are drawn round-robin.
The kind of object (module, class, function, method, ...) is looked up by importing the
title with ``pydoc.locate``; titles that do not resolve fall back to name heuristics.

Output: JSONL, one ``{"question", "doc_id", "title"}`` object per line.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import inspect
import io
import json
import pydoc
import re
import sys
import warnings
from pathlib import Path

from cluster.flags import Default, HelpFormatter, add_shared

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO_ROOT / "assets" / "corpus" / "pydocs.jsonl.gz"
DEFAULT_OUT = REPO_ROOT / "assets" / "questions" / "pydocs-questions.jsonl"

TEMPLATES = {
    "module": ["What is the {t} module for?", "What does the {t} module provide?", "When should I use the {t} module?"],
    "class": [
        "What is {t} used for?",
        "How do I create a {t} object?",
        "What is the {t} class?",
        "What does {t} represent?",
    ],
    "function": [
        "What does {t} do?",
        "How do I use the {t} function?",
        "What does {t} return?",
        "What arguments does {t} accept?",
        "When should I call {t}?",
    ],
    "method": ["What does the {t} method do?", "How do I call {t}?", "What does {t} return?"],
    "property": ["What is {t}?", "What does the {t} attribute hold?"],
    "member": ["What does {t} do?", "How do I use {t}?"],
    "topic": [
        "What does the Python language reference say about {t}?",
        "How does {t} work in Python?",
        "Explain {t} in Python.",
    ],
    "more": ["What else should I know about {t}?", "Explain the details of {t}.", "What are the caveats of {t}?"],
    "params": ["What are the parameters of {t}?", "Which options does {t} take?"],
    "diff": ["What is the difference between {t} and {u}?", "Should I use {t} or {u}?"],
}


def _h(*parts: object) -> int:
    return int(hashlib.sha1("\x1f".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def load_records(path: str | Path) -> list[dict]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _locate(title: str):
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return pydoc.locate(title)
    except Exception:  # noqa: BLE001
        return None


def kind_of(title: str) -> str:
    """module | class | function | method | property | topic."""
    if title.startswith("reference."):
        return "topic"
    obj = _locate(title)
    last = title.rsplit(".", 1)[-1]
    if obj is None:
        parent = _locate(title.rsplit(".", 1)[0]) if "." in title else None
        if inspect.isclass(parent):
            return "property"
        return "class" if last[:1].isupper() else "function"
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        parent = _locate(title.rsplit(".", 1)[0])
        return "method" if inspect.isclass(parent) else "function"
    return "property"


_MEMBER = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*): ")


def _group(title: str) -> str:
    parts = title.split(".")
    if (
        parts[0]
        in (
            "numpy",
            "scipy",
            "reference",
            "os",
            "email",
            "xml",
            "http",
            "urllib",
            "importlib",
            "concurrent",
            "multiprocessing",
        )
        and len(parts) > 2
    ):
        return ".".join(parts[:2])
    return parts[0]


def question_for(rec: dict, part: int, kind: str, sibling: str | None, salt: str) -> str:
    """One question about passage ``rec`` (``part`` is its index among its title's passages)."""
    title = rec["title"]
    text = rec["contents"]
    pick = _h(salt, rec["id"])
    if kind == "topic":
        t = title.split(".", 1)[1].replace("-", " ")
        opts = TEMPLATES["topic"] if part == 0 else TEMPLATES["more"]
        return opts[pick % len(opts)].format(t=t if part == 0 else f"{t} in Python")
    m = _MEMBER.match(text)
    if m and kind in ("module", "class") and hasattr(_locate(title), m.group(1)):
        # A passage of gathered short member docstrings: ask about its first member.
        name = m.group(1)
        if name == "__init__":
            return f"How do I create a {title} object?"
        opts = TEMPLATES["member"]
        return opts[pick % len(opts)].format(t=f"{title}.{name}")
    if sibling and pick % 5 == 0 and kind in ("function", "method", "class"):
        opts = TEMPLATES["diff"]
        return opts[(pick // 5) % len(opts)].format(t=title, u=sibling)
    if part > 0:
        opts = TEMPLATES["params"] if "Parameters" in text.split()[:3] or " : " in text[:60] else TEMPLATES["more"]
        return opts[pick % len(opts)].format(t=title)
    opts = TEMPLATES[kind]
    return opts[pick % len(opts)].format(t=title)


def make_questions(records: list[dict], n: int, seed: int = 0) -> list[dict]:
    """``n`` questions about ``records``, spread over modules, deterministic in ``seed``."""
    salt = f"pydocs-questions-{seed}"
    part: dict[str, int] = {}
    parts_of: list[int] = []
    for r in records:
        parts_of.append(part.get(r["title"], 0))
        part[r["title"]] = parts_of[-1] + 1
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        # Prefer the first passage of an object: later parts get a lower priority.
        groups.setdefault(_group(r["title"]), []).append(i)
    order = sorted(groups, key=lambda g: (_h(salt, g), g))
    for g in order:
        groups[g].sort(key=lambda i: (parts_of[i] > 0, _h(salt, records[i]["id"]), i))
    titles = sorted(set(part))
    siblings: dict[str, list[str]] = {}
    for t in titles:
        if "." in t and not t.startswith("reference."):
            siblings.setdefault(t.rsplit(".", 1)[0], []).append(t)
    out: list[dict] = []
    used_q: set[str] = set()
    cursor = {g: 0 for g in order}
    while len(out) < n and any(cursor[g] < len(groups[g]) for g in order):
        for g in order:
            if len(out) >= n:
                break
            while cursor[g] < len(groups[g]):
                i = groups[g][cursor[g]]
                cursor[g] += 1
                r = records[i]
                kind = kind_of(r["title"])
                sib = None
                if "." in r["title"]:
                    sibs = [s for s in siblings.get(r["title"].rsplit(".", 1)[0], []) if s != r["title"]]
                    if sibs:
                        sib = sibs[_h(salt, "sib", r["id"]) % len(sibs)]
                q = question_for(r, parts_of[i], kind, sib, salt)
                if q in used_q:
                    continue
                used_q.add(q)
                out.append({"question": q, "doc_id": r["id"], "title": r["title"]})
                break
    return out


def write_jsonl(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="\n") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ralmspec assets questions", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_shared(
        ap,
        corpus=DEFAULT_CORPUS,
        out=Default(DEFAULT_OUT, help="the questions: a JSONL file"),
        num_questions=Default(300, help="questions to write"),
        seed=0,
    )
    args = ap.parse_args(argv)
    records = load_records(args.corpus)
    qs = make_questions(records, args.num_questions, args.seed)
    if len(qs) < args.num_questions:
        print(f"error: only {len(qs)} questions", file=sys.stderr)
        return 1
    write_jsonl(qs, args.out)
    print(f"wrote {len(qs)} questions about {len({q['doc_id'] for q in qs})} passages to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
