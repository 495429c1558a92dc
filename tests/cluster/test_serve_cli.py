"""Which generator ``ralmspec serve``, ``ralmspec generate`` and the Makefile's serve targets
run: SmolLM2-135M-Instruct by default, the demo model with ``--model demo`` (``make
serve-demo``), the configuration's own model with ``--config`` / ``--serve-config``. Checked
through ``ralmspec serve --check`` (the resolved, validated Serve config; nothing starts) and a
``generate`` stopped before it loads anything."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess

import pytest
import yaml

from cluster.cli import main
from cluster.serve import DEFAULT_SERVE_CONFIG, apply_overrides, load_serve_config, start_local_app
from ralm import constants as C
from ralm.config import GeneratorConfig
from ralm.errors import ConfigError

DEMO = str(C.DEMO_MODEL_DIR)
LIBRARY = GeneratorConfig()


def served_generator(argv: list[str], capsys) -> dict:
    """The ``args.ralm.generator`` block that ``ralmspec serve <argv>`` would serve."""
    assert main(["serve", "--check", *argv]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    (app,) = data["applications"]
    return app["args"]["ralm"]["generator"]


def test_serve_defaults_to_smollm2_with_its_cpu_settings(capsys):
    gen = served_generator([], capsys)
    assert gen["model"] == "smollm2-135m"
    # the shapes of the invariance proof and of batching, smaller than the library's
    assert gen["batch_token_budget"] == 256 < LIBRARY.batch_token_budget
    assert gen["batch_max_sequences"] == 16 < LIBRARY.batch_max_sequences
    assert gen["device"] == "cpu" and gen["dtype"] == "float32"  # the file's own settings stay
    assert served_generator(["--model", "smollm2-135m"], capsys) == gen


def test_serve_model_demo_is_the_demo_model_with_library_settings(capsys):
    gen = served_generator(["--model", "demo"], capsys)
    assert gen["model"] == DEMO and (C.DEMO_MODEL_DIR / "config.json").is_file()
    assert "batch_token_budget" not in gen and "batch_max_sequences" not in gen
    # the file itself names the demo model: `serve run serve_config.yaml` serves it
    file_gen = load_serve_config(DEFAULT_SERVE_CONFIG)["applications"][0]["args"]["ralm"]["generator"]
    assert file_gen["model"] == "assets/model/pydocs-gpt"


def test_serve_other_models_and_configs_keep_their_own(tmp_path, capsys):
    assert served_generator(["--model", "/models/x"], capsys)["model"] == "/models/x"
    # --config replaces args.ralm: its model (here the library default), no SmolLM2 settings
    cfg = tmp_path / "ralm.yaml"
    cfg.write_text(yaml.safe_dump({"request": {"max_new_tokens": 16}}))
    gen = served_generator(["--config", str(cfg)], capsys)
    assert gen["model"] == LIBRARY.model and gen["batch_token_budget"] == LIBRARY.batch_token_budget
    # a serve config of the user's own serves the model it names
    own = load_serve_config(DEFAULT_SERVE_CONFIG)
    own["applications"][0]["args"]["ralm"]["generator"]["model"] = "/models/mine"
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(own))
    assert served_generator(["--serve-config", str(path)], capsys)["model"] == "/models/mine"
    # a GPU preset serves SmolLM2 too, without the CPU batching settings
    gen = served_generator(["--preset", "gpu"], capsys)
    assert gen["model"] == "smollm2-135m" and "batch_token_budget" not in gen


def test_a_namespace_without_serve_flags_keeps_the_files_model():
    """``ralmspec bench soak`` starts the server from its own Namespace: the demo model, as before."""
    data = apply_overrides(load_serve_config(DEFAULT_SERVE_CONFIG), argparse.Namespace(port=8123, retrievers="edr"))
    gen = data["applications"][0]["args"]["ralm"]["generator"]
    assert gen["model"] == "assets/model/pydocs-gpt" and "batch_token_budget" not in gen


@pytest.mark.parametrize(
    "argv,model,budget",
    [
        ([], "smollm2-135m", 256),
        (["--model", "demo"], DEMO, LIBRARY.batch_token_budget),
        (["--model", "smollm2-135m"], "smollm2-135m", 256),
    ],
)
def test_generate_resolves_the_same_default(argv, model, budget, monkeypatch, capsys):
    from ralm.pipeline import Pipeline

    seen = {}

    def stop(cfg, **kwargs):
        seen["generator"] = cfg.generator
        raise ConfigError("stopped before loading")

    monkeypatch.setattr(Pipeline, "from_config", stop)
    assert main(["generate", *argv, "What does json.dumps do?"]) == 2
    assert "stopped before loading" in capsys.readouterr().err
    assert seen["generator"].model == model and seen["generator"].batch_token_budget == budget


@pytest.mark.parametrize(
    "target,model", [("serve", "smollm2-135m"), ("serve-demo", DEMO), ("serve-smollm2", "smollm2-135m")]
)
def test_makefile_serve_targets(target, model, capsys):
    """The command each Makefile target runs (``make -n``: printed, not run) serves that model."""
    out = subprocess.run(
        ["make", "-n", "-s", "-C", str(C.PACKAGE_ROOT), target], capture_output=True, text=True, check=True
    ).stdout
    (line,) = [ln for ln in out.splitlines() if "bin/ralmspec serve" in ln]
    argv = shlex.split(line)
    assert argv[1] == "serve"
    gen = served_generator(argv[2:], capsys)
    assert gen["model"] == model


@pytest.mark.parametrize(
    "address,env,want",
    [(None, None, "local"), ("auto", None, "auto"), (None, "10.0.0.5:6379", "10.0.0.5:6379")],
)
def test_the_server_starts_a_ray_of_its_own_unless_given_an_address(address, env, want, monkeypatch):
    """Without --address (or RAY_ADDRESS) ``ralmspec serve`` starts its own Ray, even where a
    cluster was started on this machine with ``ray start`` (which a bare ray.init() would join)."""
    import ray

    class Started(Exception):
        pass

    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        raise Started

    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored afterwards
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Started):
        start_local_app(load_serve_config(DEFAULT_SERVE_CONFIG), address=address)
    assert seen["address"] == want
