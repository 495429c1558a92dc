"""Fixtures for the loop tests: the project's own small generator over the fixture corpus."""

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
