"""IGPG n-gram drafting (IDR2): copy what follows the current suffix in the documents or
the question.

The last ``n`` tokens of ``context + generated`` are looked up in the retrieved
document(s) (first occurrence, documents in prompt order) and then earlier in the
context itself (question and generated text, latest occurrence); with no match the
suffix is shortened down to ``min_n`` tokens. The ``m`` tokens that follow the match
are the draft. Verification is in :mod:`ralm.drafting.decode`.
"""

from __future__ import annotations

from collections.abc import Sequence


class NGramDrafter:
    needs_hidden = False

    def __init__(self, sources: Sequence[Sequence[int]], n: int = 5, m: int = 7, min_n: int = 2):
        self.n, self.m, self.min_n = int(n), int(m), max(1, min(int(min_n), int(n)))
        self.sources = [list(s) for s in sources if len(s)]
        self.index: dict[tuple, tuple[int, int]] = {}
        for si, src in enumerate(self.sources):
            for L in range(self.min_n, self.n + 1):
                for i in range(len(src) - L):  # a match needs a following token
                    self.index.setdefault(tuple(src[i : i + L]), (si, i + L))

    def propose(self, seq: Sequence[int], hidden=None, nxt: int | None = None, m: int | None = None) -> list[list[int]]:
        m = self.m if m is None else min(m, self.m)
        if m <= 0:
            return []
        seq = list(seq)
        for L in range(min(self.n, len(seq)), self.min_n - 1, -1):
            key = tuple(seq[-L:])
            hit = self.index.get(key)
            if hit is not None:
                si, end = hit
                return [self.sources[si][end : end + m]]
            for i in range(len(seq) - L - 1, -1, -1):  # earlier in the context itself
                if tuple(seq[i : i + L]) == key:
                    return [seq[i + L : i + L + m]]
        return []
