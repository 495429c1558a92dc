"""Corpus of passages in pyserini JsonCollection format (``id``, ``title``, ``contents``).

Accepts ``.jsonl`` or ``.jsonl.gz``. A passage's *doc id* everywhere in ralmspec is
its row number in the file; its string id is kept for display and for Lucene.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path


class CorpusError(ValueError):
    """The corpus file is missing or malformed."""


@dataclass
class Corpus:
    ids: list[str]
    titles: list[str]
    contents: list[str]
    sha256: str = ""
    path: str = ""
    _row_of: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.ids) == len(self.titles) == len(self.contents)):
            raise CorpusError("ids, titles and contents must have the same length")
        self._row_of = {s: i for i, s in enumerate(self.ids)}
        if len(self._row_of) != len(self.ids):
            raise CorpusError("corpus has duplicate passage ids")

    def __len__(self) -> int:
        return len(self.ids)

    def text(self, doc_id: int) -> str:
        """Title and contents of passage ``doc_id``, as the generator sees it."""
        t, c = self.titles[doc_id], self.contents[doc_id]
        return f"{t}\n{c}" if t else c

    def row_of(self, string_id: str) -> int:
        return self._row_of[string_id]

    @classmethod
    def from_records(cls, records: list[dict]) -> Corpus:
        # sha256 of the records' sorted-key JSON lines joined by "\n", hashed line by line
        # (the same digest as hashing the joined text, without a second copy of the corpus)
        digest = hashlib.sha256()
        for i, r in enumerate(records):
            digest.update((b"\n" if i else b"") + json.dumps(r, sort_keys=True).encode())
        return cls(
            ids=[str(r["id"]) for r in records],
            titles=[str(r.get("title", "")) for r in records],
            contents=[str(r["contents"]) for r in records],
            sha256=digest.hexdigest(),
        )

    @classmethod
    def load(cls, path: str | Path, limit: int | None = None) -> Corpus:
        """Load a JsonCollection file; ``limit`` keeps the first rows only."""
        path = Path(path)
        if not path.is_file():
            raise CorpusError(f"corpus file not found: {path}")
        opener = gzip.open if path.suffix == ".gz" else open
        records = []
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CorpusError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(rec, dict) or "id" not in rec or "contents" not in rec:
                    raise CorpusError(f"{path}:{lineno}: a passage needs 'id' and 'contents' fields")
                records.append(rec)
                if limit is not None and len(records) >= limit:
                    break
        if not records:
            raise CorpusError(f"corpus file is empty: {path}")
        corpus = cls.from_records(records)
        corpus.path = str(path)
        return corpus


def load_questions(path: str | Path, limit: int | None = None) -> list[str]:
    """Questions from JSONL with a ``question`` field (one object per line)."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"questions file not found: {path}")
    out: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            q = rec.get("question") if isinstance(rec, dict) else None
            if not isinstance(q, str) or not q.strip():
                raise CorpusError(f"{path}:{lineno}: needs a non-empty string 'question' field")
            out.append(q)
            if limit is not None and len(out) >= limit:
                break
    return out
