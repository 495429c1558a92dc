"""IDGR instruction block (IDR2): tell the model which documents are related.

OPT-IN and OUTPUT-CHANGING: the block is extra prompt text, so generations differ from
the plain prompt. It is placed after the documents and before the context (so the
documents' KV prefix is still reused). Relevance is given as the retrieval *rank*, never
as a score, so the block is a function of the ranked doc ids only -- which RaLMSpec
verifies -- and speculation stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence


def idgr_block(related: Sequence[int], unrelated: Sequence[int]) -> str:
    lines = ["Instruction: answer using the related documents; ignore the unrelated ones."]
    if related:
        lines.append(
            "Related documents: " + ", ".join(f"[{d}] (relevance rank {i + 1})" for i, d in enumerate(related))
        )
    if unrelated:
        lines.append("Unrelated documents: " + ", ".join(f"[{d}]" for d in unrelated))
    return "\n".join(lines) + "\n"
