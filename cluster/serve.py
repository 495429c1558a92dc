"""``ralmspec serve``: run the Serve application of ``serve_config.yaml`` from the CLI.

Equivalent to ``serve run serve_config.yaml`` with the common settings as flags, with one
difference: without ``--model`` (and ``--config``) it serves :data:`DEFAULT_MODEL`, the
pretrained SmolLM2-135M-Instruct, where the file names the 4.5M-parameter demo model::

    ralmspec serve                                  # SmolLM2-135M-Instruct on 127.0.0.1:8000
    ralmspec serve --model demo                     # the demo model (what serve_config.yaml names)
    ralmspec serve --port 8080 --retrievers edr,sr --n-shards 4
    ralmspec serve --address auto                   # on a running Ray cluster
    ralmspec serve --preset llama2-70b-4gpu --model /models/Llama-2-70b-hf

The file is validated as a Serve deploy config (``ServeDeploySchema``) and its ralmspec
application's ``args`` as :class:`deployments.app.AppConfig` before anything starts.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import signal
import sys
import time
from pathlib import Path

import yaml

from actors.signals import preserve_fatal_signal_handlers
from ralm import constants as C
from ralm.config import RalmConfig

log = logging.getLogger(__name__)

DEFAULT_SERVE_CONFIG = C.PACKAGE_ROOT / "serve_config.yaml"
APP_NAME = "ralmspec"

#: The generator of ``ralmspec serve`` and ``ralmspec generate`` when neither ``--model`` nor
#: ``--config`` is given: SmolLM2-135M-Instruct (the preset of ralm/models.py, installed offline
#: by ``make setup``), so that the first thing a user tries answers in sentences. The library
#: default (``GeneratorConfig.model``) and ``serve_config.yaml`` keep the demo model: the tests,
#: benchmarks, ``ralmspec soak`` and the KubeRay manifests build on it.
DEFAULT_MODEL = "smollm2-135m"
#: ``--model`` names besides paths, hub names and the presets of ralm/models.py
MODEL_ALIASES = {"demo": str(C.DEMO_MODEL_DIR)}
#: Generator settings the command line gives a model when the configuration leaves them at
#: their defaults. SmolLM2 on a CPU: the whole-model invariance proof that every engine runs
#: before it batches (docs/batching.md) packs up to these many tokens and sequences; on one
#: quiet core it took 21.5 s at 256 tokens and 16 sequences, 36 s at 256 and 64, and 63 s at the
#: library's 512 and 64. More requests in flight than 16 share the following forwards (exact
#: either way); a GPU preset keeps the library's shapes.
MODEL_GENERATOR_SETTINGS: dict[str, dict[str, int]] = {
    DEFAULT_MODEL: {"batch_token_budget": 256, "batch_max_sequences": 16},
}


def cli_model(args: argparse.Namespace, default: str | None = DEFAULT_MODEL) -> str | None:
    """The generator the command line asks for: ``--model`` (``demo`` names the demo model),
    else ``default``, unless ``--config`` gives a whole configuration or ``--serve-config`` a
    file of the user's own (then None: the configuration's own model)."""
    model = getattr(args, "model", None)
    if model:
        return MODEL_ALIASES.get(model, model)
    if getattr(args, "config", None):
        return None
    serve_config = getattr(args, "serve_config", None)
    if serve_config is not None and Path(serve_config).resolve() != DEFAULT_SERVE_CONFIG.resolve():
        return None
    return default


def model_settings(model: str | None) -> dict[str, int]:
    """The generator settings of :data:`MODEL_GENERATOR_SETTINGS` for ``model`` (else none)."""
    return dict(MODEL_GENERATOR_SETTINGS.get(model or "", {}))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``ralmspec serve`` (besides the common --config/--corpus/--work-dir/--model/--encoder/--pad-to)."""
    p.add_argument(
        "--serve-config",
        type=Path,
        default=DEFAULT_SERVE_CONFIG,
        help="Serve config YAML (default: the repository's serve_config.yaml)",
    )
    p.add_argument("--host", help="HTTP host (default from the file: 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default from the file: 8000)")
    p.add_argument("--address", help="Ray cluster address (e.g. auto); default: start a local Ray")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: all)")
    p.add_argument("--retrievers", help="comma-separated kinds to serve, the first is the default (edr,adr,sr)")
    p.add_argument("--n-shards", type=int, help="shards per retriever")
    p.add_argument("--pool-size", type=int, help="coordinators started with the server")
    p.add_argument("--max-pool-size", type=int, help="most coordinators (requests in flight)")
    p.add_argument("--window-ms", type=float, help="verification batching window")
    p.add_argument("--no-batching", action="store_true", help="turn cross-request verification batching off")
    p.add_argument("--preset", choices=["cpu", "gpu", "llama2-70b-4gpu"], help="generator preset")
    p.add_argument("--admin", action="store_true", help="enable the admin API (run-time batching changes)")
    p.add_argument("--check", action="store_true", help="validate the configuration, print it and exit")


def load_serve_config(path: str | Path) -> dict:
    """Read and validate a Serve deploy config; returns it as a dict."""
    from ray.serve.schema import ServeDeploySchema

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"serve config not found: {path}")
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    try:
        ServeDeploySchema.model_validate(data)
    except Exception as e:
        raise ValueError(f"{path} is not a valid Serve config: {e}") from None
    return data


def app_entry(data: dict, name: str = APP_NAME) -> dict:
    for app in data.get("applications", []):
        if app.get("name") == name or app.get("import_path") == "deployments.app:build_app":
            return app
    raise ValueError(f"the serve config has no application {name!r} (import_path deployments.app:build_app)")


def apply_overrides(data: dict, args: argparse.Namespace) -> dict:
    """The serve config with the CLI flags applied (validated as AppConfig)."""
    from deployments.app import AppConfig  # lazy: the app config pulls in the generator (torch)

    data = copy.deepcopy(data)
    http = data.setdefault("http_options", {})
    if getattr(args, "host", None):
        http["host"] = args.host
    if getattr(args, "port", None):
        http["port"] = args.port
    app = app_entry(data)
    a = app.setdefault("args", {}) or {}
    app["args"] = a
    ralm = a.setdefault("ralm", {})
    if getattr(args, "config", None):
        ralm = RalmConfig.from_yaml(args.config).model_dump(mode="json")
        a["ralm"] = ralm
    if getattr(args, "corpus", None):
        ralm["corpus"] = str(args.corpus)
    if getattr(args, "work_dir", None):
        ralm["work_dir"] = str(args.work_dir)
    # `ralmspec serve` defaults to DEFAULT_MODEL; a caller's own Namespace (ralmspec soak) keeps the file's
    model = cli_model(args, DEFAULT_MODEL if hasattr(args, "serve_config") else None)
    if model is not None:
        ralm.setdefault("generator", {})["model"] = model
    if getattr(args, "encoder", None):
        ralm.setdefault("retriever", {})["encoder"] = args.encoder
    if getattr(args, "pad_to", None) is not None:
        ralm.setdefault("retriever", {})["pad_to"] = args.pad_to
    if getattr(args, "retrievers", None):
        a["retrievers"] = [k.strip() for k in args.retrievers.split(",") if k.strip()]
    if getattr(args, "n_shards", None):
        a.setdefault("sharding", {})["n_shards"] = args.n_shards
    if getattr(args, "pool_size", None):
        a.setdefault("pool", {})["size"] = args.pool_size
        a["pool"].setdefault("max_size", max(args.pool_size, a["pool"].get("max_size", 16)))
    if getattr(args, "max_pool_size", None):
        a.setdefault("pool", {})["max_size"] = args.max_pool_size
    if getattr(args, "window_ms", None) is not None:
        a.setdefault("verifier", {})["window_ms"] = args.window_ms
    if getattr(args, "no_batching", False):
        a.setdefault("verifier", {})["batching"] = False
    if getattr(args, "preset", None):
        a["generator_preset"] = args.preset
        if args.preset != "cpu":
            a.pop("generator_deployment", None)  # let the preset place the generator
            ralm.get("generator", {}).pop("device", None)
            ralm.get("generator", {}).pop("dtype", None)
            if not getattr(args, "model", None) and args.preset == "llama2-70b-4gpu":
                ralm.get("generator", {}).pop("model", None)
    if model is not None and getattr(args, "preset", None) in (None, "cpu"):
        for key, value in model_settings(model).items():  # where the file leaves them to the library
            ralm["generator"].setdefault(key, value)
    if getattr(args, "admin", False):
        a.setdefault("ingress", {})["admin"] = True
    AppConfig.model_validate(a)  # fail early, with pydantic's message
    return data


def start_local_app(data: dict, address: str | None = None, num_cpus: int | None = None, blocking: bool = False) -> str:
    """Start Ray (or connect), Serve and the ralmspec app of ``data``; returns the base URL."""
    import ray
    from ray import serve

    from deployments.app import build_app  # lazy: torch and Ray, only once a server starts

    app = app_entry(data)
    env = (app.get("runtime_env") or {}).get("env_vars") or {}
    for k, v in env.items():
        os.environ.setdefault(k, str(v))
    paths = [str(C.PACKAGE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            with preserve_fatal_signal_handlers():  # keep the JVM's handlers (actors/signals.py)
                ray.init(address=address)
        else:
            # "local": a Ray of its own, as documented, even where another one was started on this
            # machine (without an address ray.init joins the last cluster `ray start` began there)
            with preserve_fatal_signal_handlers():  # keep the JVM's handlers (actors/signals.py)
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    http = dict(data.get("http_options") or {})
    serve.start(
        http_options={
            k: v
            for k, v in http.items()
            if k in ("host", "port", "request_timeout_s", "keep_alive_timeout_s", "root_path")
        },
        proxy_location=data.get("proxy_location", "HeadOnly"),
    )
    serve.run(
        build_app(app.get("args") or {}),
        name=app.get("name", APP_NAME),
        route_prefix=app.get("route_prefix", "/"),
        blocking=blocking,
    )
    return f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"


def serve_main(args: argparse.Namespace) -> int:
    """Entry point of ``ralmspec serve``: validate, start, and serve until interrupted."""
    data = apply_overrides(load_serve_config(args.serve_config), args)
    if getattr(args, "check", False):
        print(yaml.safe_dump(data, sort_keys=False))
        return 0
    t0 = time.time()
    print("starting ralmspec (missing indexes are built on first start; this can take minutes)...", file=sys.stderr)
    url = start_local_app(data, getattr(args, "address", None), getattr(args, "num_cpus", None))
    print(
        f"ralmspec is serving on {url} (ready in {time.time() - t0:.0f} s)\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"messages": [{{"role": "user", "content": "What does json.dumps do?"}}], "max_tokens": 64}}\'\n'
        f"  OpenAI client: base_url={url}/v1   (Ctrl-C stops the server)",
        file=sys.stderr,
    )

    def _stop(signum, _frame):
        raise KeyboardInterrupt  # SIGTERM (systemd, docker stop, kill) shuts down like Ctrl-C

    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping ralmspec...", file=sys.stderr)
    finally:
        from ray import serve

        serve.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone: ``python -m cluster.serve [flags]``."""
    p = argparse.ArgumentParser(
        prog="ralmspec serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", type=Path, help="YAML RalmConfig replacing args.ralm of the serve config")
    p.add_argument("--corpus", type=Path)
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--model", help=f"generator (default {DEFAULT_MODEL}; demo: the demo model)")
    p.add_argument("--encoder")
    p.add_argument("--pad-to", type=int)
    add_serve_args(p)
    return serve_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
