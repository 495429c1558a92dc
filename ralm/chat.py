"""Chat messages to the generator's prompt: the model's own chat template, applied once.

A chat request is a RaLM request like any other: its *question* is the conversation
rendered by the tokenizer's chat template, ending with the assistant's turn opener, and
the RaLM loop retrieves, generates and stops at the model's end-of-turn token exactly as
it does for a completion. So ``/v1/chat/completions`` is exact by construction: its tokens
are RaLMSeq's tokens for the rendered prompt.

Worked example (SmolLM2-Instruct's template)::

    chat_prompt(tok, [{"role": "user", "content": "What is json.dumps?"}])
    -> '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\\n'
       '<|im_start|>user\\nWhat is json.dumps?<|im_end|>\\n<|im_start|>assistant\\n'

The template's special tokens stay special when the prompt is tokenized (the engine's
tokenizer parses them), and the retrieval query (the last ``query_window`` tokens,
decoded without special tokens) sees the words, not the markers.

A model without a chat template (the project's demo model) gets the messages' contents
joined by blank lines: one user message is then exactly the completion prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ralm.errors import RalmInputError

ROLES = ("system", "developer", "user", "assistant")
NO_TEMPLATE_SEPARATOR = "\n\n"


def message_text(content: Any, where: str) -> str:
    """The text of one message's ``content``: a string, or a list of ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RalmInputError(
                    f"{where}.content[{j}]: only text parts are supported (got {kind!r}); this is a text-only model"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RalmInputError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def normalise_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` with text content; clear errors for anything else."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RalmInputError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RalmInputError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise RalmInputError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
        out.append(
            {"role": "system" if role == "developer" else str(role), "content": message_text(m.get("content"), where)}
        )
    return out


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(tokenizer: Any, messages: Sequence[Any]) -> str:
    """The prompt text of a conversation for ``tokenizer``'s model (see the module docstring).

    A conversation that ends with an assistant message is continued (that message is the
    start of the answer); otherwise the template opens the assistant's turn.
    """
    msgs = normalise_messages(messages)
    if not has_chat_template(tokenizer):
        return NO_TEMPLATE_SEPARATOR.join(m["content"] for m in msgs)
    cont = msgs[-1]["role"] == "assistant"
    try:
        text = tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=not cont, continue_final_message=cont
        )
    except Exception as e:  # a template that rejects this conversation (e.g. roles out of order)
        raise RalmInputError(f"the model's chat template rejected the messages: {e}") from None
    if not isinstance(text, str):
        raise RalmInputError("the model's chat template did not produce text")
    return text


__all__ = ["ROLES", "chat_prompt", "has_chat_template", "message_text", "normalise_messages"]
