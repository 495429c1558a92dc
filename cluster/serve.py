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
application's ``args`` as :class:`deployments.config.AppConfig` before anything starts, and
what would otherwise fail deep inside Ray is checked first, each with one line that says what
to run (exit code 2, no traceback): the HTTP port already in use, a generator preset whose
pip package is missing, a missing local model or corpus, a missing index with
``build_indexes: false``.

Stopping. Ctrl-C or SIGTERM stops the server within :data:`STOP_BUDGET_S` seconds, whatever
the model, with exit code 0: Serve is shut down (requests in flight are answered by the
ingress's drain, :func:`stop_server`) and the process leaves with ``os._exit(0)`` once
Ray is down or the budget is spent, skipping an interpreter teardown that Ray's threads
abort (SIGABRT, exit 134). A local Ray's processes run in a process group of their own, so
a signal to the terminal's group (``make serve``, Ctrl-C) reaches this process, which stops
them in order, instead of killing them under the controller (which then waited 30 s).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from actors.signals import c_handler, keep_driver_signal_handlers, preserve_fatal_signal_handlers
from cluster.flags import Default, add_shared
from deployments.config import AppConfig
from ralm import constants as C
from ralm.config import RalmConfig
from ralm.errors import ConfigError
from ralm.models import PRESETS as MODEL_PRESETS, resolve

log = logging.getLogger(__name__)

DEFAULT_SERVE_CONFIG = C.PACKAGE_ROOT / "serve_config.yaml"
APP_NAME = "ralmspec"

#: The generator of ``ralmspec serve`` and ``ralmspec generate`` when neither ``--model`` nor
#: ``--config`` is given: SmolLM2-135M-Instruct (the preset of ralm/models.py, installed offline
#: by ``make setup``), so that the first thing a user tries answers in sentences. The library
#: default (``GeneratorConfig.model``) and ``serve_config.yaml`` keep the demo model: the tests,
#: benchmarks, ``ralmspec bench soak`` and the KubeRay manifests build on it.
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
    """Flags of ``ralmspec serve`` (besides the RalmConfig ones of :func:`cluster.flags.config_parent`)."""
    add_shared(p, serve_config=Default(DEFAULT_SERVE_CONFIG, unset="the repository's serve_config.yaml"))
    p.add_argument("--host", help="HTTP host (default from the file: 127.0.0.1)")
    add_shared(p, port=Default(unset="the file's, 8000"))
    p.add_argument("--address", help="Ray cluster address (e.g. auto); default: start a local Ray")
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: all)")
    add_shared(
        p,
        retrievers=Default(
            help="retriever kinds to serve, comma-separated, of edr,adr,sr; the first is the default",
            unset="the file's",
        ),
    )
    p.add_argument("--n-shards", type=int, help="shards per retriever")
    p.add_argument("--pool-size", type=int, help="coordinators started with the server")
    p.add_argument("--max-pool-size", type=int, help="most coordinators (requests in flight)")
    add_shared(p, window_ms=Default(unset="the file's"))
    p.add_argument("--no-batching", action="store_true", help="turn cross-request verification batching off")
    p.add_argument("--preset", choices=["cpu", "gpu", "llama2-70b-4gpu"], help="generator preset")
    p.add_argument("--admin", action="store_true", help="enable the admin API (run-time batching changes)")
    add_shared(p, check=Default(help="check only: validate the configuration, print it and exit"))


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
    # `ralmspec serve` defaults to DEFAULT_MODEL; a caller's own Namespace (ralmspec bench soak) keeps the file's
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
        keep_driver_signal_handlers()  # a SIGTERM during start-up stops the server, never aborts it
        if address:
            with preserve_fatal_signal_handlers():  # keep the JVM's handlers (actors/signals.py)
                ray.init(address=address)
        else:
            # "local": a Ray of its own, as documented, even where another one was started on this
            # machine (without an address ray.init joins the last cluster `ray start` began there)
            for k, v in C.LOCAL_RAY_ENV.items():
                os.environ.setdefault(k, v)
            with preserve_fatal_signal_handlers(), ray_processes_in_own_group():
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


#: Seconds from Ctrl-C or SIGTERM to the process's exit, whatever the model and the load.
STOP_BUDGET_S = 4.5
#: Of which requests in flight get this many to finish before the ingress answers them 503.
DRAIN_GRACE_S = 1.5


@contextlib.contextmanager
def ray_processes_in_own_group() -> Iterator[None]:
    """Start the processes of a local Ray (GCS, raylet, and through the raylet every worker)
    in a session of their own.

    A terminal's Ctrl-C and ``kill -- -PGID`` signal the whole foreground process group:
    ``make``, this driver and, without this, every Ray process, whose workers exit on SIGTERM
    at once, so the driver's Serve shutdown waits on a controller that is gone. In their own
    session only the driver gets the signal and stops them in order; they still die with it
    (Ray's kernel fate sharing, PR_SET_PDEATHSIG). Only ``ray.init`` runs under this.
    """
    from ray._private import services

    popen = services.ConsolePopen

    class _OwnSession(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    setattr(services, "ConsolePopen", _OwnSession)  # noqa: B010 (mypy: a class attribute of Ray's)
    try:
        yield
    finally:
        setattr(services, "ConsolePopen", popen)  # noqa: B010


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _bounded(fn, timeout_s: float) -> bool:
    """Run ``fn`` in a daemon thread for at most ``timeout_s``; True if it returned."""
    done = threading.Event()

    def run():
        with contextlib.suppress(BaseException):
            fn()
        done.set()

    threading.Thread(target=run, name=f"stop-{fn.__name__}", daemon=True).start()
    return done.wait(max(0.0, timeout_s))


def _drain_ingress(grace_s: float) -> None:
    from ray import serve

    counts = serve.get_app_handle(APP_NAME).drain.remote(grace_s).result(timeout_s=grace_s + 2.0)
    log.info("ingress drained: %s", counts)


def stop_server(deadline: float, local_ray: bool) -> None:
    """Stop the server by ``deadline`` (``time.monotonic()``), then leave with exit code 0.

    First the ingress drains (:mod:`deployments.drain`): new requests get 503, requests in
    flight :data:`DRAIN_GRACE_S` seconds to finish, then 503. Then a local Ray is shut down
    (its processes, replicas and actors with it); on a cluster given by ``--address`` Serve's
    applications are deleted and the cluster keeps running. Whatever has not stopped by the
    deadline dies with this process (a local Ray's processes share its fate)."""
    import ray
    from ray import serve

    _bounded(lambda: _drain_ingress(DRAIN_GRACE_S), min(DRAIN_GRACE_S + 1.5, deadline - time.monotonic()))
    _bounded(ray.shutdown if local_ray else serve.shutdown, deadline - time.monotonic())
    _flush_and_exit(0)


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the proxy binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def preflight(data: dict) -> None:
    """What would fail deep inside Ray, checked before anything starts: raises ConfigError
    with one line that says what to run."""

    http = data.get("http_options") or {}
    host, port = str(http.get("host", "127.0.0.1")), int(http.get("port", 8000))
    if _port_in_use(host, port):
        raise ConfigError(
            f"port {port} on {host} is in use (another ralmspec serve?): stop it, or serve on another port with --port"
        )
    cfg = AppConfig.model_validate(app_entry(data).get("args") or {}).resolved()
    gen = cfg.ralm.generator
    if gen.model in MODEL_PRESETS or gen.model.endswith(".gguf"):
        resolve(gen.model, gen.gguf_file, gen.model_sha256)  # RalmInputError: the package to install
    elif Path(gen.model).is_absolute() and not Path(gen.model).exists():
        raise ConfigError(
            f"generator model {gen.model} does not exist: give --model a model directory, or --model demo"
        )
    if not Path(cfg.ralm.corpus).is_file():
        raise ConfigError(f"corpus {cfg.ralm.corpus} does not exist: give --corpus a JSONL corpus")
    if not cfg.build_indexes:
        for kind in cfg.retrievers:
            index = cfg.ralm.index_dir(kind)
            if not (index / "manifest.json").is_file():
                raise ConfigError(
                    f"no {kind} index at {index} (build_indexes is false): run `ralmspec index --retriever {kind}`"
                )


def serve_main(args: argparse.Namespace) -> int:
    """Entry point of ``ralmspec serve``: validate, check, start, and serve until Ctrl-C or
    SIGTERM, which stop the server within :data:`STOP_BUDGET_S` seconds with exit code 0."""
    data = apply_overrides(load_serve_config(args.serve_config), args)
    if getattr(args, "check", False):
        print(yaml.safe_dump(data, sort_keys=False))
        return 0
    preflight(data)
    local_ray = not (getattr(args, "address", None) or os.environ.get("RAY_ADDRESS"))
    stopping = threading.Event()

    def _begin_stop() -> None:
        if not stopping.is_set():
            stopping.set()
            # the watchdog: whatever hangs, the process is gone within the budget
            watchdog = threading.Timer(STOP_BUDGET_S, _flush_and_exit, args=(0,))
            watchdog.daemon = True
            watchdog.start()

    def _stop(signum, _frame):
        if stopping.is_set():  # a second Ctrl-C: leave now
            _flush_and_exit(0)
        _begin_stop()
        raise KeyboardInterrupt

    def _install() -> None:
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)  # systemd, docker stop, kill: as Ctrl-C

    t0 = time.time()
    _install()
    try:
        print("starting ralmspec (missing indexes are built on first start; this can take minutes)...", file=sys.stderr)
        url = start_local_app(data, getattr(args, "address", None), getattr(args, "num_cpus", None))
        _install()  # ray.init installs a SIGTERM handler of its own
        print(
            f"ralmspec is serving on {url} (ready in {time.time() - t0:.0f} s)\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"messages": [{{"role": "user", "content": "What does json.dumps do?"}}], "max_tokens": 64}}\'\n'
            f"  OpenAI client: base_url={url}/v1   (Ctrl-C stops the server)",
            file=sys.stderr,
        )
        # Ray's native code can put its own SIGTERM handler back after start (seen: a stop
        # logged "*** SIGTERM received ***" by Ray's handler, ran ours, then aborted with exit
        # -6); ours is put back whenever the process's C-level handler is no longer it
        ours = {sig: c_handler(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        while True:
            time.sleep(0.2)
            if any(c_handler(sig) != h for sig, h in ours.items()):
                _install()
    except (KeyboardInterrupt, SystemExit):  # SystemExit: Ray's own SIGTERM handler, before ours is back
        _begin_stop()
    except Exception as e:
        if not stopping.is_set():  # Ray's "Deploying application failed": its last line is the cause
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            print(f"error: the server did not start: {lines[-1] if lines else type(e).__name__}", file=sys.stderr)
            print("  (the whole error and the replicas' logs: /tmp/ray/session_latest/logs)", file=sys.stderr)
            _bounded(_shutdown_quietly, 3.0)
            _flush_and_exit(1)
    print("stopping ralmspec...", file=sys.stderr)
    deadline = time.monotonic() + STOP_BUDGET_S - 0.5
    stop_server(deadline, local_ray)
    return 0  # not reached: stop_server leaves the process


def _shutdown_quietly() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
