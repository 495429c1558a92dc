"""Chat messages to a prompt: the tokenizer's template, the no-template fallback, and the clear
errors for what a text model cannot take. (SmolLM2-Instruct's own template, end to end over
HTTP, is tested in tests/deployments/test_http_smollm2.py.)"""

from __future__ import annotations

import pytest

from ralm import constants as C
from ralm.chat import chat_prompt, normalise_messages
from ralm.errors import RalmInputError

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(C.DEMO_MODEL_DIR))
    t.chat_template = TEMPLATE
    return t


def test_the_template_renders_the_conversation_and_opens_the_answer(tok):
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "what is json?"}]
    assert chat_prompt(tok, msgs) == "<system>be brief</system><user>what is json?</user><assistant>"


def test_a_final_assistant_message_is_continued_not_closed(tok):
    msgs = [{"role": "user", "content": "name a module"}, {"role": "assistant", "content": "The json"}]
    assert chat_prompt(tok, msgs) == "<user>name a module</user><assistant>The json"


def test_without_a_template_the_contents_are_joined(tok):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(C.DEMO_MODEL_DIR))
    assert not plain.chat_template
    assert chat_prompt(plain, [{"role": "user", "content": "what is json?"}]) == "what is json?"
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]}]
    assert chat_prompt(plain, msgs) == "a\n\nb"


def test_a_template_error_is_a_clear_input_error(tok):
    from transformers import AutoTokenizer

    strict = AutoTokenizer.from_pretrained(str(C.DEMO_MODEL_DIR))
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RalmInputError, match="chat template rejected the messages: .*roles must alternate"):
        chat_prompt(strict, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "tool", "content": "x"}], r"messages\[0\].role must be one of"),
        ([{"role": "user"}], r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], r"messages\[0\].content\[0\]: only text"),
        ([{"role": "user", "content": "ok"}, 7], r"messages\[1\] must be an object"),
    ],
)
def test_malformed_messages(messages, needle):
    with pytest.raises(RalmInputError, match=needle):
        normalise_messages(messages)
