"""A real pretrained chat model served over Ray Serve and called with the official ``openai``
client: SmolLM2-135M-Instruct (the preset, from its pip wheel; no hub download), its own chat
template, streaming, and exactness against in-process RaLMSeq on the rendered prompt."""

from __future__ import annotations

import pytest

from ralm.chat import chat_prompt
from ralm.config import GeneratorConfig, RequestConfig
from ralm.seq import run_seq

PRESET = "smollm2-135m"
REQ = RequestConfig(max_new_tokens=12, generation_stride=4)
KINDS = ("edr",)
#: what `ralmspec serve` gives this model on a CPU (cluster.serve.MODEL_GENERATOR_SETTINGS): a
#: third of the default proof's forwards; the tokens are the same at any batch settings
SETTINGS = {"batch_token_budget": 256, "batch_max_sequences": 16}
MESSAGES = [
    [{"role": "user", "content": "What does json.dumps return?"}],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "How do I join two paths in Python?"},
    ],
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, index_dirs, fixture_corpus):
    from ray import serve

    from tests.actors.support import stop_ray
    from tests.deployments.serving import app_args, serve_app

    args = app_args(
        tmp_path_factory.mktemp("serve-smollm2"),
        index_dirs,
        fixture_corpus,
        PRESET,
        KINDS,
        REQ,
        generator_deployment={"num_cpus": 0.2},
        pool={"size": 2, "max_size": 2},
    )
    args["ralm"]["generator"].update(SETTINGS)
    url = serve_app(args)
    yield url
    serve.delete("ralmspec")
    stop_ray()


@pytest.fixture(scope="module")
def smollm2_local(fixture_corpus, server):
    """The in-process reference. Its proof is the served replica's, taken from the run's proof
    cache: the same weights, shapes, kernels and machine, so the same key."""
    import os

    from ralm.engine import LMEngine
    from ralm.generator import LocalGenerator

    mp = pytest.MonkeyPatch()
    mp.setenv("RALMSPEC_PROOF_CACHE", os.environ["RALMSPEC_TEST_PROOF_CACHE"])
    try:
        engine = LMEngine.from_config(GeneratorConfig(model=PRESET, **SETTINGS))
    finally:
        mp.undo()
    assert engine.invariance_proof is not None and engine.invariance_proof.ok
    assert engine.invariance_proof.cached, "the served replica's proof was not taken from the cache"
    return LocalGenerator(engine, fixture_corpus)


def test_chat_with_the_official_client_is_exact(server, smollm2_local, retrievers):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="dummy", max_retries=0, timeout=600)
    assert "smollm2-135m" in [m.id for m in client.models.list().data]
    tok = smollm2_local.engine.tokenizer
    for msgs in MESSAGES:
        prompt = chat_prompt(tok, msgs)
        assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
        base = run_seq(prompt, smollm2_local, retrievers["edr"], REQ)
        out = client.chat.completions.create(
            model="smollm2-135m", messages=msgs, extra_body={"retriever": "edr", "spec": "PSA"}
        )
        assert out.choices[0].message.content == base.text, msgs
        assert out.model_extra["ralm"]["tokens"] == base.tokens
        assert out.usage.completion_tokens == len(base.tokens) and out.usage.prompt_tokens == len(
            tok(prompt, add_special_tokens=False)["input_ids"]
        )
        assert out.choices[0].finish_reason == base.finish_reason
    # streamed: the deltas are the same answer
    msgs = MESSAGES[0]
    base = run_seq(chat_prompt(tok, msgs), smollm2_local, retrievers["edr"], REQ)
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m", messages=msgs, stream=True, extra_body={"retriever": "edr", "method": "seq"}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == base.text
    # a conversation the template cannot render, or an image, is a clear 400
    with pytest.raises(openai.BadRequestError, match="text parts"):
        client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        )
