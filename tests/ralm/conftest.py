"""Fixtures for the loop tests: the project's own small generator over the fixture corpus, and
a tinier one for the tests where the model does not matter."""

from __future__ import annotations

import pytest

from ralm import constants as C
from ralm.config import GeneratorConfig
from ralm.engine import LMEngine
from ralm.generator import LocalGenerator


@pytest.fixture(scope="session")
def project_engine() -> LMEngine:
    assert (C.DEMO_MODEL_DIR / "config.json").is_file(), (
        f"the project's generator is missing at {C.DEMO_MODEL_DIR}; rebuild it with `ralmspec assets train`"
    )
    return LMEngine.from_config(GeneratorConfig(model=str(C.DEMO_MODEL_DIR)))


@pytest.fixture(scope="session")
def fixture_generator(project_engine, fixture_corpus) -> LocalGenerator:
    return LocalGenerator(project_engine, fixture_corpus)


@pytest.fixture(scope="session")
def tiny_generator(tmp_path_factory, fixture_corpus) -> LocalGenerator:
    """A GPT-2 of 2 layers and width 64 with random weights (seed 0) and the project
    generator's tokenizer, over the fixture corpus, on the default engine (invariant forward,
    continuous batching, KV sessions): about 4x cheaper a step than the project's generator.
    For tests of the loops' contract, which holds for any generator: its text means nothing,
    so queries drift and the retrieved documents change often."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(str(C.DEMO_MODEL_DIR))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            n_positions=1024,
            vocab_size=len(tok),
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    path = tmp_path_factory.mktemp("tiny-gpt2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return LocalGenerator(LMEngine.from_config(GeneratorConfig(model=str(path))), fixture_corpus)
