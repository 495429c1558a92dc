"""Passage text of the demo corpus (:mod:`cluster.assets.build_corpus`): docstring markup
stripped, whitespace collapsed, and paragraphs cut into ~100-word passages on paragraph,
then sentence, boundaries."""

from __future__ import annotations

import inspect
import re

TARGET_WORDS = 100  # aim of a passage
MAX_WORDS = 130  # a passage grows past this only to absorb a short tail
MIN_WORDS = 40  # passages shorter than this are merged or dropped
MIN_DOC_WORDS = 4  # member docstrings shorter than this carry no information


_WS = re.compile(r"\s+")
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`])")


def clean(text: str) -> str:
    return _WS.sub(" ", text).strip()


_RULE = re.compile(r"^\s*[-=~^*#+`]{3,}\s*$")
_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_DIRECTIVE = re.compile(r"^\s*\.\.\s+[a-z-]+::.*$")
_SECTION_END = {"Examples", "Example", "Examples:", "Example:"}


def strip_markup(doc: str) -> str:
    """Drop doctest code, rule lines, an Examples section, and Sphinx roles."""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    in_code = False
    for i, line in enumerate(lines):
        s = line.strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if s in _SECTION_END and _RULE.match(nxt or ""):
            break  # numpydoc Examples section: code, to the end
        if s.startswith(">>>"):
            in_code = True
        if in_code:
            if not s:
                in_code = False
                out.append("")
            continue
        if _RULE.match(line) or _DIRECTIVE.match(line) or "::=" in line:
            continue
        out.append(_ROLE.sub(r"\1", line))
    return "\n".join(out)


def paragraphs(doc: str) -> list[str]:
    """Docstring -> cleaned paragraphs (split on blank lines)."""
    out = [clean(p) for p in re.split(r"\n\s*\n", strip_markup(doc))]
    return [p for p in out if p and p not in _SECTION_END and not (p.endswith("::") and len(p.split()) <= 12)]


def _units(paras: list[str]) -> list[tuple[str, bool]]:
    """Pieces of at most MAX_WORDS words; the flag marks the end of a paragraph."""
    units: list[tuple[str, bool]] = []
    for p in paras:
        pieces: list[str] = []
        if len(p.split()) <= MAX_WORDS:
            pieces = [p]
        else:
            for s in _SENT.split(p):
                words = s.split()
                for i in range(0, len(words), TARGET_WORDS):
                    pieces.append(" ".join(words[i : i + TARGET_WORDS]))
        for j, piece in enumerate(pieces):
            units.append((piece, j == len(pieces) - 1))
    return units


def chunk(paras: list[str]) -> list[str]:
    """Cut paragraphs into ~TARGET_WORDS-word passages, preferring paragraph ends."""
    chunks: list[list[str]] = []
    cur: list[str] = []
    n = 0
    for piece, para_end in _units(paras):
        w = len(piece.split())
        if cur and n + w > MAX_WORDS and n >= MIN_WORDS:
            chunks.append(cur)
            cur, n = [], 0
        cur.append(piece)
        n += w
        if n >= TARGET_WORDS or (para_end and n >= 0.8 * TARGET_WORDS):
            chunks.append(cur)
            cur, n = [], 0
    if cur:
        if chunks and n < MIN_WORDS:
            chunks[-1].extend(cur)  # a short tail joins the previous passage
        else:
            chunks.append(cur)
    return [" ".join(c) for c in chunks]


# --------------------------------------------------------------------- extraction
