"""serve_config.yaml and the app builder's configuration (no Ray needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from deployments.app import AppConfig, build_app
from ralm import constants as C

SERVE_CONFIG = C.PACKAGE_ROOT / "serve_config.yaml"


def test_serve_config_is_a_valid_serve_deploy_config():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load(SERVE_CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(data)
    app = schema.applications[0]
    assert app.import_path == "deployments.app:build_app"
    assert schema.http_options.host == "127.0.0.1" and schema.http_options.port == 8000
    cfg = AppConfig.model_validate(app.args).resolved()
    assert cfg.ralm.corpus == C.DEMO_CORPUS.resolve()
    assert Path(cfg.ralm.generator.model) == C.DEMO_MODEL_DIR.resolve()
    assert cfg.ralm.work_dir == (Path.home() / ".cache" / "ralmspec").resolve()
    assert cfg.retrievers == ["edr", "adr", "sr"] and cfg.verifier.batching


def test_every_config_field_has_a_description():
    def walk(model, seen=()):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
            ann = f.annotation
            for sub in getattr(ann, "__args__", ()) + (ann,):
                if isinstance(sub, type) and hasattr(sub, "model_fields") and sub not in seen:
                    walk(sub, seen + (sub,))

    walk(AppConfig)


def test_empty_args_are_the_demo_and_bad_args_fail_clearly():
    cfg = AppConfig.model_validate({}).resolved()
    assert cfg.default_method == "spec" and cfg.pool.size >= 1
    with pytest.raises(ValueError, match="retriever"):
        AppConfig.model_validate({"retrievers": ["edr", "faiss"]})
    with pytest.raises(ValueError, match="max_size"):
        AppConfig.model_validate({"pool": {"size": 8, "max_size": 2}})
    with pytest.raises(ValueError, match="extra|not permitted"):
        AppConfig.model_validate({"shards": 3})


def test_build_app_returns_an_application():
    from ray.serve import Application

    app = build_app({"retrievers": ["edr"], "generator_preset": "llama2-70b-4gpu"})
    assert isinstance(app, Application)
    # Serve's proxy sheds requests beyond the ingress queue with 503 and Retry-After
    bp = app._bound_deployment.backpressure_config
    assert (bp.status_code, bp.retry_after_s) == (503, C.SHED_RETRY_AFTER_S)
    app = build_app({"retrievers": ["edr"], "generator_preset": "llama2-70b-4gpu", "ingress": {"retry_after_s": 2}})
    assert app._bound_deployment.backpressure_config.retry_after_s == 2


def test_cli_overrides_and_check(capsys):
    from cluster.serve import add_serve_args, apply_overrides, load_serve_config, serve_main

    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--model")
    add_serve_args(p)
    args = p.parse_args(
        [
            "--port",
            "8011",
            "--retrievers",
            "sr,edr",
            "--n-shards",
            "3",
            "--no-batching",
            "--pool-size",
            "2",
            "--model",
            "/m/x",
            "--check",
        ]
    )
    data = apply_overrides(load_serve_config(SERVE_CONFIG), args)
    a = data["applications"][0]["args"]
    assert data["http_options"]["port"] == 8011
    assert a["retrievers"] == ["sr", "edr"] and a["sharding"]["n_shards"] == 3
    assert a["verifier"]["batching"] is False and a["pool"]["size"] == 2
    assert a["ralm"]["generator"]["model"] == "/m/x"
    assert serve_main(args) == 0
    assert "deployments.app:build_app" in capsys.readouterr().out
    bad = p.parse_args(["--retrievers", "bm42"])
    with pytest.raises(ValueError):
        apply_overrides(load_serve_config(SERVE_CONFIG), bad)


def test_the_docs_name_the_model_the_default_server_serves():
    """Every ``"model": ...`` in the README's and the deploying guide's requests is the id the
    default serve_config.yaml serves (an unknown model id gets a 404, so a stale name in a
    copy-pasted quick-start command fails)."""
    import re

    from deployments.ingress import IngressSettings

    data = yaml.safe_load(SERVE_CONFIG.read_text())
    cfg = AppConfig.model_validate(data["applications"][0]["args"]).resolved()
    served = cfg.model_name
    embedding_ids = IngressSettings.from_config(cfg).embedding_ids  # /v1/embeddings' model
    assert embedding_ids, "the default server serves no embedding model"
    docs = [C.PACKAGE_ROOT / "README.md", C.PACKAGE_ROOT / "docs" / "deploying.md", C.PACKAGE_ROOT / "docs" / "api.md"]
    named = [
        (d.name, m) for d in docs for m in re.findall(r"""["']?model["']?\s*[:=]\s*["']([^"']+)["']""", d.read_text())
    ]
    assert any(d == "README.md" for d, _ in named), "the README's quick start names no model"
    wrong = [(d, m) for d, m in named if m != served and m not in embedding_ids]
    assert not wrong, f"documented model ids that the default server ({served!r}) rejects: {wrong}"
