"""Starting the ralmspec Serve app for a test module (shared by the metrics, security and state tests)."""

from __future__ import annotations

import socket

from ralm.config import RequestConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(work, index_dirs, fixture_corpus, gen_model_dir, kinds, req: RequestConfig, **extra) -> dict:
    (work / "indexes").mkdir(exist_ok=True)
    for kind in kinds:
        link = work / "indexes" / kind
        if not link.exists():
            link.symlink_to(index_dirs[kind], target_is_directory=True)
    args = {
        "ralm": {
            "corpus": fixture_corpus.path,
            "work_dir": str(work),
            "generator": {"model": gen_model_dir},
            "request": req.model_dump(),
        },
        "retrievers": list(kinds),
        "generator_deployment": {"num_cpus": 0.2},
        "sharding": {"n_shards": 2, "num_cpus": 0.05},
        "verifier": {"window_ms": 10.0},
        "pool": {"size": 2, "max_size": 4},
        "build_indexes": True,
    }
    args.update(extra)
    return args


def serve_app(args: dict, metrics_export_port: int | None = None) -> str:
    """Start Ray (if needed), Serve on a free 127.0.0.1 port and the app; returns the base URL."""
    from ray import serve

    from deployments.app import build_app
    from tests.actors.support import start_ray

    start_ray(metrics_export_port=metrics_export_port)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="ralmspec", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def run_schemathesis(url: str, tmp_path, max_examples: int, phases: str = "coverage,fuzzing", extra=()) -> int:
    """Run the schemathesis CLI against ``url``'s OpenAPI schema with the no-5xx check; fail the
    test with its output on any failure; return the number of test cases it generated."""
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.fail("schemathesis is a test dependency (pyproject [dev]); `make setup` installs it")
    cmd = [
        st,
        "run",
        url + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(max_examples),
        "--phases",
        phases,
        "--seed",
        "7",
        "--workers",
        "1",
        "--request-timeout",
        "60",
        "--max-response-time",
        "60",
        "--report",
        "junit",
        "--report-junit-path",
        str(tmp_path / "junit.xml"),
        "--no-color",
        *extra,
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1200, cwd=tmp_path
    )  # its cache stays out of the repo
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    m = re.search(r"(\d+) generated, (\d+) passed", text)
    assert m, text[-3000:]
    print(f"schemathesis against {url}: {m.group(0)}")
    return int(m.group(1))
