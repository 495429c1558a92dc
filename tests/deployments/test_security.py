"""Security basics over real HTTP: the optional API key (bearer token from RALMSPEC_API_KEY or
RALMSPEC_API_KEY_FILE, never from the config), the body size limit, the local bind address."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import yaml

from ralm.config import RequestConfig
from tests.deployments.serving import app_args, serve_app

REQ = RequestConfig(max_new_tokens=8, generation_stride=4)
KEY = "test-key-4f1c9a7e"
LIMIT = 4096
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory, index_dirs, fixture_corpus, gen_model_dir):
    from tests.actors.support import stop_ray

    d = tmp_path_factory.mktemp("secret")
    key_file = d / "api-key"
    key_file.write_text(KEY + "\n")
    saved = {k: os.environ.pop(k, None) for k in ("RALMSPEC_API_KEY", "RALMSPEC_API_KEY_FILE")}
    os.environ["RALMSPEC_API_KEY_FILE"] = str(key_file)  # Ray's workers inherit it (a mounted Secret)
    try:
        args = app_args(
            tmp_path_factory.mktemp("sec-work"),
            index_dirs,
            fixture_corpus,
            gen_model_dir,
            ("edr",),
            REQ,
            ingress={"max_body_bytes": LIMIT},
        )
        url = serve_app(args)
        with httpx.Client(base_url=url, timeout=300) as client:
            yield {"url": url, "client": client}
    finally:
        stop_ray()
        os.environ.pop("RALMSPEC_API_KEY_FILE", None)
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v


def _auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


BODY = {"question": "What does json.dumps do?", "max_new_tokens": 8}


def test_missing_key_is_401(server):
    r = server["client"].post("/v1/ralm/generate", json=BODY)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "missing_api_key" and "Authorization: Bearer" in err["message"]
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert server["client"].get("/v1/models").status_code == 401


@pytest.mark.parametrize("header", [f"Bearer {KEY}x", "Bearer", f"Basic {KEY}", KEY, f"Bearer {KEY[:-1]}"])
def test_wrong_key_is_401(server, header):
    r = server["client"].post("/v1/ralm/generate", json=BODY, headers={"Authorization": header})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert KEY not in r.text


def test_right_key_is_200(server):
    r = server["client"].post("/v1/ralm/generate", json=BODY, headers=_auth())
    assert r.status_code == 200, r.text
    assert len(r.json()["tokens"]) >= 1
    assert server["client"].get("/v1/models", headers=_auth()).status_code == 200


def test_health_stays_open(server):
    r = server["client"].get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_openai_client_with_api_key(server):
    import openai

    good = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    out = good.completions.create(
        model=good.models.list().data[0].id, prompt="What does json.dumps do?", max_tokens=8, temperature=0
    )
    assert out.choices[0].text and out.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="x", prompt="hi", max_tokens=4)


def test_oversized_body_is_413_before_parsing(server):
    c = server["client"]
    big = {"question": "x" * (LIMIT + 10)}
    r = c.post("/v1/ralm/generate", json=big, headers=_auth())
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and str(LIMIT) in r.json()["error"]["message"]
    # not even JSON: rejected on its size, before any parsing
    r = c.post("/v1/completions", content=b"{" * (LIMIT + 1), headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 413

    # chunked upload without Content-Length: counted while reading
    def chunks():
        for _ in range(LIMIT // 512 + 2):
            yield b" " * 512

    r = c.post("/v1/completions", content=chunks(), headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 413
    # a body under the limit still goes through to validation (400 for bad JSON, not 413)
    r = c.post("/v1/completions", content=b"{not json", headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 400


def test_prompt_token_limit_is_4xx(server):
    r = server["client"].post("/v1/ralm/generate", json={"question": "word " * 800}, headers=_auth())
    assert 400 <= r.status_code < 500, r.text


def test_server_keeps_serving(server):
    c = server["client"]
    for _ in range(3):
        assert c.post("/v1/ralm/generate", json=BODY).status_code == 401
        assert c.post("/v1/ralm/generate", json={"question": "y" * (LIMIT * 2)}, headers=_auth()).status_code == 413
    r = c.post("/v1/ralm/generate", json=BODY, headers=_auth())
    assert r.status_code == 200, r.text


def test_read_api_key_sources(tmp_path):
    from deployments.ingress import read_api_key

    assert read_api_key({}) is None
    assert read_api_key({"RALMSPEC_API_KEY": "abc"}) == "abc"
    f = tmp_path / "k"
    f.write_text("from-file\n")
    assert read_api_key({"RALMSPEC_API_KEY_FILE": str(f)}) == "from-file"
    with pytest.raises(ValueError, match="set only one"):
        read_api_key({"RALMSPEC_API_KEY": "a", "RALMSPEC_API_KEY_FILE": str(f)})
    with pytest.raises(ValueError, match="cannot read"):
        read_api_key({"RALMSPEC_API_KEY_FILE": str(tmp_path / "missing")})


def test_api_key_is_not_a_config_field():
    from pydantic import ValidationError

    from deployments.app import AppConfig

    for bad in ({"ingress": {"api_key": "x"}}, {"api_key": "x"}):
        with pytest.raises(ValidationError):
            AppConfig.model_validate(bad)


def test_bind_address_local_by_default_cluster_overrides_all_interfaces():
    local = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    assert local["http_options"]["host"] == "127.0.0.1"
    over = yaml.safe_load((REPO / "k8s" / "src" / "serve-overrides.yaml").read_text())
    assert over["http_options"]["host"] == "0.0.0.0"


def test_redis_password_never_from_config():
    from cache.state import StateStoreConfigError
    from deployments.app import AppConfig

    for bad in (
        {"state": {"store": {"url": "redis://u:s3cret@redis:6379/0"}}},
        {"state": {"store": {"url": "redis://redis:6379/0", "password": "s3cret"}}},
    ):
        with pytest.raises(Exception) as e:
            AppConfig.model_validate(bad)
        assert "s3cret" not in str(e.value)
        assert "RALMSPEC_REDIS_PASSWORD" in str(e.value) or isinstance(e.value, StateStoreConfigError)
