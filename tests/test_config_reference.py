"""The configuration models: a leaf of the import graph, one strict base, a description on
every field, and ``docs/config.md`` generated from them and current."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import BaseModel, ValidationError

from cluster import config_reference
from deployments.config import AppConfig
from ralm.config import StrictModel

MODELS = [m for m, _ in config_reference._walk(AppConfig)]


def test_docs_config_md_is_current():
    assert config_reference.OUT.read_text(encoding="utf-8") == config_reference.render(), (
        "docs/config.md is out of date: run `make config-docs` (python -m cluster.config_reference)"
    )
    assert config_reference.main(["--check"]) == 0


def test_the_check_fails_on_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(config_reference.render().replace("| `stride` |", "| `strides` |"), encoding="utf-8")
    assert config_reference.main(["--check", "--out", str(stale)]) == 1
    assert "make config-docs" in capsys.readouterr().err
    assert config_reference.main(["--out", str(stale)]) == 0
    assert config_reference.main(["--check", "--out", str(stale)]) == 0


def test_every_field_of_every_model_is_in_the_page_with_a_description():
    page = config_reference.render()
    assert len(MODELS) >= 17
    for model in MODELS:
        assert f"## {model.__name__}\n" in page
        for name, field in model.model_fields.items():
            assert field.description and field.description.strip(), f"{model.__name__}.{name} has no description"
            assert f"| `{name}` |" in page


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_model_rejects_unknown_keys(model: type[BaseModel]):
    assert model.model_config.get("extra") == "forbid"
    if model.__module__.startswith(("ralm.", "deployments.")):  # cache/ is below ralm: its one model keeps its own
        assert issubclass(model, StrictModel)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        model.model_validate({"no_such_option": 1})


def test_config_modules_import_no_torch_ray_engine_or_actor():
    """Validating a configuration (``ralmspec serve --check``, docs/config.md) loads none of the
    heavy parts; the lint-imports contract "Configs are a leaf" checks the same statically."""
    code = (
        "import sys, ralm.config, deployments.config, cache.state.config, cluster.config_reference\n"
        "heavy = ('torch', 'transformers', 'ray', 'faiss', 'pyserini', 'jnius', 'fastapi', 'actors',"
        " 'ralm.engine', 'deployments.generator', 'deployments.modes')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
