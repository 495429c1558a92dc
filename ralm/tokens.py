"""The tokenizer's side of the LM engine: a question's token ids and the text of tokens.

Plain functions over a Hugging Face tokenizer, so that processes which only tokenize - the
coordinator hosts, the ingress - use the very code the engine uses without importing the
model stack (torch): :class:`~ralm.engine.LMEngine` and
:class:`~actors.remote_proxies.RemoteGenerator` both call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ralm.errors import RalmInputError


def encode_question(tokenizer: Any, question: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of a question (no special tokens); rejects empty, non-string and over-long input."""
    if not isinstance(question, str):
        raise RalmInputError(f"question must be a string, got {type(question).__name__}")
    if not question.strip():
        raise RalmInputError("question is empty")
    ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens:
        raise RalmInputError(f"question is {len(ids)} tokens long; the limit is {max_prompt_tokens} tokens")
    if not ids:
        raise RalmInputError("question has no tokens")
    return list(ids)


def decode(tokenizer: Any, tokens: Sequence[int]) -> str:
    """The text of ``tokens``, special tokens left out."""
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


__all__ = ["decode", "encode_question"]
