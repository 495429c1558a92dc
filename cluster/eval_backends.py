"""The backends of ``ralmspec eval`` (:mod:`cluster.eval_job`): what answers its items.

* ``local`` - :class:`cluster.eval_local.LocalBackend`, an in-process pipeline;
* ``ray`` - :class:`RayEvalBackend`, a pool of Ray actors each holding a pipeline; chosen
  by ``auto`` when the command runs as a Ray job;
* :class:`RequestFnBackend` - any ``fn(job: RalmJob) -> RalmResult.as_dict()`` (the
  signature of ``actors.coordinator.Coordinator.run``), several at once in threads;
* anything registered with :func:`register_backend`.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from actors.signals import preserve_fatal_signal_handlers
from cluster.eval_items import EvalItem
from cluster.eval_local import LocalBackend, answer_item, warm_pipeline
from ralm.config import RalmConfig, RequestConfig
from ralm.errors import ConfigError
from ralm.job import RalmJob

RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray for a job's entrypoint process


class EvalBackend(Protocol):
    """Answers items. ``run`` yields ``(item, RalmResult.as_dict())`` as items finish, in
    any order; an item whose input is invalid yields ``{"error": message}`` instead."""

    name: str

    def describe(self) -> str: ...

    def run(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, dict]]: ...

    def close(self) -> None: ...


class _RayEvalWorker:
    """Body of a Ray actor holding one pipeline."""

    def __init__(self, cfg_json: str, kinds: list[str], warmup: list[str]):
        from ralm.pipeline import Pipeline  # lazy: torch and the model load in the worker, never in the driver

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.pipe = Pipeline.from_config(RalmConfig.model_validate_json(cfg_json), kinds=tuple(kinds), progress=False)
        warm_pipeline(self.pipe, warmup, kinds)
        self.where = f"{socket.gethostname()}:{os.getpid()}"

    def ready(self) -> str:
        return self.where

    def answer(self, item: EvalItem) -> dict:
        out = answer_item(self.pipe, item)
        out["worker"] = self.where
        return out


class RayEvalBackend:
    """A pool of Ray actors, each with its own pipeline; items go to whichever is free.

    Inside a Ray job (``ray job submit``) it connects to the job's cluster; elsewhere it
    connects to ``$RAY_ADDRESS`` or starts a local Ray instance.
    """

    name = "ray"

    def __init__(
        self,
        cfg,
        kinds: Sequence[str],
        workers: int = 1,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        warmup: Sequence[str] = (),
    ):
        import ray

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            if address:  # a Ray job's driver, or an explicit cluster
                with preserve_fatal_signal_handlers():  # keep the JVM's handlers (actors/signals.py)
                    ray.init(address=address)
            else:  # no cluster: start a local Ray instance
                with preserve_fatal_signal_handlers():  # keep the JVM's handlers (actors/signals.py)
                    ray.init(include_dashboard=False)
        # a worker that dies is restarted once and its item retried there
        opts: dict[str, Any] = {"num_cpus": num_cpus, "max_restarts": 1, "max_task_retries": 1}
        if num_gpus:
            opts["num_gpus"] = num_gpus
        actor_cls = ray.remote(**opts)(_RayEvalWorker)
        cfg_json = cfg.model_dump_json()
        # actor handles: Ray types their methods dynamically
        self.actors: list[Any] = [actor_cls.remote(cfg_json, list(kinds), list(warmup)) for _ in range(max(1, workers))]
        self.where = ray.get([a.ready.remote() for a in self.actors])
        self._ray = ray

    def describe(self) -> str:
        return f"ray ({len(self.actors)} actors: {', '.join(self.where)})"

    def run(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, dict]]:
        ray = self._ray
        todo = list(items)[::-1]
        free = list(self.actors)
        pending: dict[Any, tuple[EvalItem, Any]] = {}
        while todo or pending:
            while todo and free:
                item, actor = todo.pop(), free.pop()
                pending[actor.answer.remote(item)] = (item, actor)
            done, _ = ray.wait(list(pending), num_returns=1)
            item, actor = pending.pop(done[0])
            free.append(actor)
            yield item, ray.get(done[0])

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)


class RequestFnBackend:
    """Adapter for any ``fn(job: RalmJob) -> RalmResult.as_dict()`` callable, e.g. the
    serving layer's ``Coordinator.run`` through its pool. Each item becomes a
    :class:`~ralm.job.RalmJob` under ``request`` (the job's generation options). Runs up to
    ``concurrency`` requests at once in threads."""

    def __init__(
        self,
        fn: Callable[[RalmJob], dict],
        request: RequestConfig | None = None,
        name: str = "request-fn",
        concurrency: int = 1,
        describe: str = "",
    ):
        self.fn, self.name, self.concurrency = fn, name, max(1, concurrency)
        self.request = request or RequestConfig()
        self._describe = describe or name

    def describe(self) -> str:
        return self._describe

    def run(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, dict]]:
        todo = list(items)[::-1]
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="eval-req") as ex:
            pending: dict[Future[dict], EvalItem] = {}
            while todo or pending:
                while todo and len(pending) < self.concurrency:
                    item = todo.pop()
                    pending[ex.submit(self.fn, item.job(self.request))] = item
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in done:
                    yield pending.pop(fut), fut.result()

    def close(self) -> None:
        pass


BackendFactory = Callable[[Any, Sequence[str], argparse.Namespace, Sequence[str]], EvalBackend]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``--backend NAME`` available: ``factory(cfg, kinds, args, warmup_questions)``."""
    _BACKENDS[name] = factory


def _ray_backend(cfg, kinds: Sequence[str], args: argparse.Namespace, warm: Sequence[str]) -> RayEvalBackend:
    if getattr(args, "concurrency", 1) > 1:
        raise ConfigError("--concurrency applies to the local backend; the ray backend scales with --workers")
    return RayEvalBackend(
        cfg, kinds, workers=args.workers, num_cpus=args.worker_cpus, num_gpus=args.worker_gpus, warmup=warm
    )


register_backend(
    "local",
    lambda cfg, kinds, args, warm: LocalBackend(cfg, kinds, warm, concurrency=getattr(args, "concurrency", 1)),
)
register_backend("ray", _ray_backend)


def in_ray_job() -> bool:
    return RAY_JOB_ENV in os.environ


def choose_backend(name: str) -> str:
    if name == "auto":
        return "ray" if in_ray_job() else "local"
    if name not in _BACKENDS:
        raise ConfigError(f"unknown eval backend {name!r}: choose auto or one of {', '.join(sorted(_BACKENDS))}")
    return name


def make_backend(
    name: str, cfg: Any, kinds: Sequence[str], args: argparse.Namespace, warm: Sequence[str]
) -> EvalBackend:
    """The backend ``--backend name`` names (``auto``: :func:`choose_backend`)."""
    return _BACKENDS[choose_backend(name)](cfg, kinds, args, warm)
