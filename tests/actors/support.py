"""Helpers for the Ray tests (tests/actors, tests/deployments): a small local Ray, the model."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_ray(num_cpus: int = 2, metrics_export_port: int | None = None) -> None:
    """One local Ray for a test module: 2 CPUs, no dashboard; workers import from the repo.
    Always a new Ray of this process's own (``address="local"``), never one found on the
    machine: under pytest-xdist each worker process starts its own.
    ``metrics_export_port``: where Ray serves its Prometheus metrics (default: Ray picks)."""
    import ray

    if ray.is_initialized():
        return
    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from ralm import constants as C

    for k, v in C.LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    extra = {"_metrics_export_port": metrics_export_port} if metrics_export_port else {}
    from actors.signals import preserve_fatal_signal_handlers

    # Ray's processes (a generator replica's proof) share one proof cache per test run; this
    # process keeps proving (tests/conftest.py)
    driver_proof_cache = os.environ.get("RALMSPEC_PROOF_CACHE")
    os.environ["RALMSPEC_PROOF_CACHE"] = os.environ["RALMSPEC_TEST_PROOF_CACHE"]
    try:
        with preserve_fatal_signal_handlers():
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                **extra,
            )
    finally:
        if driver_proof_cache is None:
            os.environ.pop("RALMSPEC_PROOF_CACHE", None)
        else:
            os.environ["RALMSPEC_PROOF_CACHE"] = driver_proof_cache


def stop_ray() -> None:
    """Serve and Ray down. Garbage first: an ObjectRef left in a reference cycle and freed by
    the collector after ``ray.shutdown()`` calls into a core worker that is gone."""
    import gc

    import ray

    from actors.signals import preserve_fatal_signal_handlers

    gc.collect()

    with preserve_fatal_signal_handlers():
        try:
            from ray import serve

            serve.shutdown()
        except Exception:
            pass
        ray.shutdown()


def model_dir(tmp_root: Path) -> str:
    """The project's generator if it is present, else a tiny random GPT-2 saved under ``tmp_root``."""
    from ralm import constants as C

    if (C.DEMO_MODEL_DIR / "config.json").is_file():
        return str(C.DEMO_MODEL_DIR)
    from tests.factories import tiny_causal_lm, tiny_tokenizer

    d = tmp_root / "tiny-gpt2"
    if not (d / "config.json").is_file():
        tok = tiny_tokenizer()
        tiny_causal_lm("gpt2", len(tok), tok.eos_token_id).save_pretrained(d)
        tok.save_pretrained(d)
    return str(d)


def kill_later(actor, after: float):
    """Kill ``actor`` (letting Ray restart it) from a timer thread after ``after`` seconds."""
    import threading

    import ray

    t = threading.Timer(after, lambda: ray.kill(actor, no_restart=False))
    t.start()
    return t
