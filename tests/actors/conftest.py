"""Fixtures of the Ray actor tests: one local Ray per module, the generator model."""
from __future__ import annotations

import pytest

from tests.actors.support import model_dir, start_ray, stop_ray


@pytest.fixture(scope="module")
def ray_local():
    start_ray()
    yield
    stop_ray()


@pytest.fixture(scope="session")
def gen_model_dir(tmp_path_factory) -> str:
    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def local_generator(gen_model_dir, fixture_corpus):
    """In-process generator over the fixture corpus: the reference the Ray paths must match."""
    from ralm.config import GeneratorConfig
    from ralm.engine import LMEngine
    from ralm.generator import LocalGenerator

    return LocalGenerator(LMEngine.from_config(GeneratorConfig(model=gen_model_dir)), fixture_corpus)
