"""The served backend: the Ray topology behind the HTTP ingress (:class:`RayBackend`).

Started once per ingress replica (:func:`start_ray_backend`, called by
:class:`deployments.serve_ingress.Ingress`), it builds, per served retriever, the index and
shard slices (a one-off Ray task; missing indexes are built into ``ralm.work_dir``), the
shard actors and the verifier; then the pool of coordinator actors (:mod:`actors.pool`),
each holding handles to the generator deployment and every verifier, and the state-store
settings (request checkpoints, the verified-KB cache). Every request leases a coordinator,
which runs the core loop; this class only routes jobs to the pool and collects statistics.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import ray

from actors.coordinator import coordinator_host_class
from actors.pool import CoordinatorPool, SlotFactory
from actors.remote_proxies import RemoteGenerator
from actors.shard import prepare_shards, start_shards
from actors.verifier import verifier_actor_class
from cache.state import STATE_URL_ENV, StateStoreConfig, redact_url
from deployments.backend import BackendUnavailable
from deployments.config import AppConfig
from ralm.chat import chat_prompt
from ralm.config import GeneratorConfig, RetrieverConfig
from ralm.corpus import Corpus
from ralm.errors import RalmInputError
from ralm.job import RalmJob
from ralm.results import RalmResult
from ralm.retrieval.errors import IndexNotFoundError
from ralm.retrieval.index_build import MANIFEST
from ralm.retrievers import entry

log = logging.getLogger(__name__)


def _prepare_shards_task(rcfg: dict, corpus_path: str, index_dir: str, n_shards: int, build: bool):
    """One-off task: build missing indexes and shard slices; returns the shard specs and the
    index version (the hash of its manifest)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the encoder libraries are imported
    cfg = RetrieverConfig.model_validate(rcfg)
    missing = not os.path.isfile(os.path.join(index_dir, MANIFEST))
    if missing and not build:
        raise IndexNotFoundError(
            f"no {cfg.kind} index at {index_dir} and build_indexes is off; build it with "
            f"`ralmspec index --retriever {cfg.kind}`"
        )
    if missing:
        print(f"ralmspec: no {cfg.kind} index at {index_dir}: building it (first start; progress below)", flush=True)
    specs = prepare_shards(cfg, Corpus.load(corpus_path), index_dir, n_shards, progress=missing)
    with open(os.path.join(index_dir, MANIFEST), "rb") as fh:  # identifies the index build
        version = hashlib.sha256(fh.read()).hexdigest()
    return specs, version


class RayBackend:
    """:class:`~deployments.backend.RalmBackend` over Ray actors and the generator deployment.

    Build it with ``await RayBackend(cfg, generator).start()`` inside a Ray worker (the
    ingress replica); ``generator`` is the generator deployment's handle.
    """

    def __init__(self, cfg: AppConfig, generator: Any):
        self.cfg = cfg
        self.generator = generator
        self.kinds = list(cfg.retrievers)
        self.features: dict[str, bool] = {}
        self.codec: RemoteGenerator | None = None
        self.shards: dict[str, list] = {}
        self.shard_names: dict[str, list[str]] = {}
        self.verifiers: dict[str, Any] = {}
        self.index_versions: dict[str, str] = {}
        self.state_info: dict = {}
        self.pool: CoordinatorPool | None = None
        self.slots: SlotFactory | None = None

    # ---------------------------------------------------------------- start-up
    async def start(self) -> RayBackend:
        """Start the topology: shards and a verifier per retriever, then the coordinator pool.

        The retrievers start while the generator replica loads its model (and proves its
        batching exact), not after it: one chain per retriever family, in its kinds' build
        order (EDR's build caches the passage vectors ADR's then reuses), the families beside
        each other."""
        cfg = self.cfg
        chains: dict[str, list[str]] = {}
        for kind in sorted(self.kinds, key=lambda k: entry(k).build_order):
            chains.setdefault(entry(kind).family.name, []).append(kind)

        async def start_chain(kinds: list[str]) -> None:
            for kind in kinds:
                await self._start_retriever(kind)

        retrievers = asyncio.gather(*(start_chain(c) for c in chains.values()))
        try:
            info = await self.generator.info.remote()
            tok = await self.generator.tokenizer.remote()
        except BaseException:
            retrievers.cancel()
            raise
        self.features = dict(info.get("features") or {})  # optional modes: dense drafting, KNN-LM
        self.codec = RemoteGenerator(
            None,
            tok,
            GeneratorConfig(max_prompt_tokens=info["max_prompt_tokens"], max_new_tokens_limit=info["max_new_tokens"]),
            info["eos_token_id"],
        )
        await retrievers
        await asyncio.gather(*(v.ping.remote() for v in self.verifiers.values()))
        await self._start_pool(self._state())
        log.info(
            "ralmspec backend ready: retrievers %s, %d shards each, pool %d",
            self.kinds,
            cfg.sharding.n_shards,
            cfg.pool.size,
        )
        return self

    async def _start_retriever(self, kind: str) -> None:
        """Index and shard slices (a one-off task), the shard actors and the verifier of ``kind``."""
        cfg, sh, v = self.cfg, self.cfg.sharding, self.cfg.verifier
        e = entry(kind)
        prep = ray.remote(num_cpus=sh.build_num_cpus, max_calls=1)(_prepare_shards_task)
        rcfg = cfg.ralm.retriever.model_copy(update={"kind": kind})
        if not e.scan:  # padding emulates a larger flat index: scanned kinds only
            rcfg = rcfg.model_copy(update={"pad_to": 0})
        specs, self.index_versions[kind] = await prep.remote(
            rcfg.model_dump(mode="json"),
            str(cfg.ralm.corpus),
            str(cfg.ralm.index_dir(kind)),
            sh.n_shards,
            cfg.build_indexes,
        )
        prefix = f"shard-{kind}-{uuid.uuid4().hex[:8]}"
        actors = await asyncio.to_thread(
            start_shards,
            specs,
            sh.num_cpus,
            sh.max_restarts,
            sh.max_task_retries,
            True,
            prefix,
            sh.resources,
            sh.spread,
            sh.num_gpus if e.gpu else 0,
        )
        self.shards[kind] = actors
        self.shard_names[kind] = [f"{prefix}-{s.index}" for s in specs]
        vopts: dict[str, Any] = {"name": f"verifier-{kind}-{uuid.uuid4().hex[:8]}", "namespace": "ralmspec"}
        if v.resources:
            vopts["resources"] = dict(v.resources)
        self.verifiers[kind] = (
            verifier_actor_class(v.num_cpus)
            .options(**vopts)
            .remote(
                kind,
                actors,
                [(s.lo, s.hi) for s in specs],
                rcfg.model_dump(mode="json"),
                v.window_ms,
                v.max_batch,
                v.batching,
                v.max_inflight,
                v.flush_when_all_waiting,
                v.wait_for_speculating,
            )
        )

    def _state(self) -> dict:
        """The coordinators' state-store settings (and the redacted summary for ``stats``)."""
        cfg = self.cfg
        store_cfg = cfg.state.store
        if store_cfg is None and os.environ.get(STATE_URL_ENV):
            store_cfg = StateStoreConfig.from_env()
        state: dict[str, Any] = {
            "store": store_cfg.model_dump(mode="json") if store_cfg is not None else None,
            "checkpoints": cfg.state.checkpoints,
            "kb_cache": {k: self.index_versions[k] for k in cfg.state.kb_cache} if store_cfg else {},
        }
        self.state_info = {
            "store": redact_url(store_cfg.url) if store_cfg else None,
            "checkpoints": bool(store_cfg and cfg.state.checkpoints and store_cfg.scheme != "memory"),
            "kb_cache": sorted(state["kb_cache"]),
        }
        return state

    async def _start_pool(self, state: dict) -> None:
        cfg = self.cfg
        host_cls = coordinator_host_class(cfg.pool.num_cpus, cfg.pool.slots_per_host)
        generator, verifiers = self.generator, self.verifiers
        extra = {"resources": dict(cfg.pool.resources)} if cfg.pool.resources else {}

        def make_host(name: str):
            return host_cls.options(name=name, namespace="ralmspec", **extra).remote(
                generator, verifiers, cfg.pool.slots_per_host, state=state
            )

        self.slots = SlotFactory(make_host, cfg.pool.slots_per_host)
        self.pool = CoordinatorPool(
            self.slots.new_slot,
            self.slots.ready,
            cfg.pool.size,
            cfg.pool.max_size,
            cfg.pool.max_waiting,
            probe=self.slots.ping,
            on_discard=self.slots.discard,
            headroom=cfg.pool.headroom,
        )
        await self.pool.start()

    def _started_codec(self) -> RemoteGenerator:
        """The tokenizer-side generator stand-in, which :meth:`start` makes."""
        if self.codec is None:
            raise RuntimeError("RayBackend is not started: await RayBackend(...).start() first")
        return self.codec

    def _started_pool(self) -> CoordinatorPool:
        """The coordinator pool, which :meth:`start` makes."""
        if self.pool is None:
            raise RuntimeError("RayBackend is not started: await RayBackend(...).start() first")
        return self.pool

    # ---------------------------------------------------------------- RalmBackend
    @property
    def max_prompt_tokens(self) -> int:
        return self._started_codec().cfg.max_prompt_tokens

    @property
    def max_new_tokens(self) -> int:
        return self._started_codec().cfg.max_new_tokens_limit

    def encode_question(self, question: str) -> list[int]:
        return self._started_codec().encode_question(question)

    def chat_prompt(self, messages: list) -> str:
        return chat_prompt(self._started_codec().tokenizer, messages)

    async def embed(self, texts: list[str]) -> tuple[Any, list[int]]:
        """On the first served dense retriever's verifier (it holds the encoder)."""
        kind = next((k for k in self.kinds if entry(k).family.encodes and k in self.verifiers), None)
        if kind is None:
            raise RalmInputError(f"embeddings need a dense retriever; this server serves only {', '.join(self.kinds)}")
        return await self.verifiers[kind].embed.remote(texts)

    async def run(self, job: RalmJob) -> RalmResult:
        """On a leased coordinator; retried on a fresh one if the coordinator died. The result
        carries ``queue_s``: how long the request waited for a coordinator."""
        t0 = time.perf_counter()
        started: list[float] = []

        def call(c):
            started.append(time.perf_counter())
            return c.run(job)

        res: RalmResult = await self._started_pool().run(call, cancel=lambda c: c.cancel())
        return res.queued(started[0] - t0)

    async def stream(self, job: RalmJob) -> AsyncGenerator[dict, None]:
        """On a coordinator leased for the whole stream (:meth:`CoordinatorPool.stream`); the
        last chunk's result carries ``queue_s``."""
        t0 = time.perf_counter()
        queue_s = 0.0
        chunks = self._started_pool().stream(lambda c: c.run_stream(job), cancel=lambda c: c.cancel())
        try:
            async for piece in chunks:
                if piece is None:  # leased: the ingress may send its headers now
                    queue_s = time.perf_counter() - t0
                    yield {"delta": "", "tokens": []}
                elif piece.get("done"):
                    yield {**piece, "result": piece["result"].queued(queue_s)}
                else:
                    yield piece
        finally:  # the ingress closed the stream early: the pool stops the request
            await chunks.aclose()

    async def health(self) -> dict:
        try:
            await asyncio.wait_for(asyncio.gather(*(v.ping.remote() for v in self.verifiers.values())), 10)
        except Exception as e:
            raise BackendUnavailable(f"verifier: {type(e).__name__}") from None
        return {"pool": self._started_pool().stats.as_dict()}

    async def stats(self) -> dict:
        vstats = await asyncio.gather(*(v.stats.remote() for v in self.verifiers.values()))
        ginfo = await self.generator.info.remote()
        return {
            "pool": self._started_pool().stats.as_dict(),
            "coordinators": await self._host_stats(),
            "verifiers": dict(zip(self.verifiers, vstats)),
            "generator": ginfo,
            "shards": {k: {"namespace": "ralmspec", "names": v} for k, v in self.shard_names.items()},
            "state": self.state_info,
        }

    async def _host_stats(self) -> dict:
        """The coordinator hosts: how many, and each one's requests, slots and peak RSS."""
        if self.slots is None:
            return {}
        hosts = list(self.slots.hosts)

        async def one(h):
            try:
                return {"name": h.name, **await asyncio.wait_for(h.handle.info.remote(), 5)}
            except Exception as e:  # a host that does not answer is reported, not fatal
                return {"name": h.name, "error": type(e).__name__}

        infos = await asyncio.gather(*(one(h) for h in hosts))
        return {**self.slots.stats(), "per_host": infos, "rss_mib": sum(i.get("rss_mib", 0) for i in infos)}

    async def configure_verifiers(self, policy: dict, reset_stats: bool = False) -> dict:
        out = {}
        for kind, v in self.verifiers.items():
            out[kind] = await v.configure.remote(**policy)
            if reset_stats:
                await v.stats.remote(True)
        return out


async def start_ray_backend(cfg: AppConfig, generator: Any) -> RayBackend:
    """The ingress replica's backend factory (see :data:`deployments.backend.BackendFactory`)."""
    return await RayBackend(cfg, generator).start()


__all__ = ["RayBackend", "start_ray_backend"]
