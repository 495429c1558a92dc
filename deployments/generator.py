"""The LM engine as a Ray Serve deployment.

A replica owns one :class:`~ralm.engine.LMEngine` (model, tokenizer, doc-KV cache) and
the corpus text, and serves the deterministic step ``f(doc, context, k)`` to the
coordinators: a step is one :class:`~ralm.step_request.StepRequest`, built by the
coordinator and handed to the engine's one entry (:meth:`ralm.engine.LMEngine.submit`)
unchanged; this class only loads the engine and takes calls. A request carries the step's
generation options (:class:`ralm.drafting.StepOptions`: drafting, FLARE, several documents, IDGR). When the app
config enables them, a replica also holds a DReSD datastore for dense drafting and a KNN-LM
token datastore, and runs KNN-LM requests (:mod:`deployments.modes`).

Batching. ``step`` is asynchronous, and the engine decides how a step runs: a plain step joins its continuous
batcher (:mod:`ralm.batching.continuous_batcher`), so the steps of all requests in flight on a
replica share one packed forward per iteration (n-gram drafted and FLARE steps too), and
each still gets the tokens it gets alone. Dense-drafted steps and KNN-LM forward passes
run one at a time on the batcher's thread between two iterations. ``info()['batching']`` reports the batcher's
metrics and the KV session store's statistics. With ``generator.invariant=false`` there
is no batcher: steps run in a worker thread, one at a time under ``serialize_steps``.

Session affinity. A coordinator sends every step of a request with the request's session
key as Serve's multiplexed model id (``handle.options(multiplexed_model_id=key)``). The
replica "loads" the key through a ``serve.multiplexed`` loader that only records it, so
Serve routes the request's next steps to the replica that holds its KV sessions; the key
is the step's session ``owner``. When the request ends the coordinator calls
:meth:`GeneratorServer.release` with the same id, which frees the key's sessions; a key
evicted from the multiplexed LRU (``session_keys_per_replica``) is released too (Serve
calls the loaded object's ``__del__``). A request whose replica is gone, or whose steps
land elsewhere, recomputes its session there: the same tokens, only slower.

Placement. :class:`GeneratorDeploymentOptions` turns the config into Serve deployment
options: replicas or autoscaling, ``num_cpus``/``num_gpus`` per replica and, for models
that need several GPUs in one replica, a placement group. The ``llama2-70b-4gpu``
preset reserves 4 one-GPU bundles with ``STRICT_PACK`` (all on one node), loads the
model in fp16 and lets ``device_map="auto"`` spread its layers over the 4 GPUs. The
replica runs in bundle 0 and sees only its own GPU at first; :func:`claim_placement_group_gpus`
parks a probe actor in every other bundle, learns their GPU ids and makes all of them
visible to the replica before CUDA starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, cast

from actors.metrics import record_generator_host, record_generator_iteration
from deployments.config import GeneratorDeploymentOptions
from deployments.modes import knn_server, load_dense_datastore
from ralm.batching.invariant import invariant_kernels
from ralm.config import GeneratorConfig
from ralm.corpus import Corpus
from ralm.engine import LMEngine, StepOutput
from ralm.errors import RalmInputError
from ralm.job import RalmJob
from ralm.step_request import StepRequest

if TYPE_CHECKING:
    from ray.serve import Deployment

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ multi-GPU replicas
class _BundleProbe:
    """Parked in one bundle of the replica's placement group; reports the GPUs Ray gave it."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]


def claim_placement_group_gpus(timeout_s: float = 120.0) -> tuple[list, list[str]]:
    """Make every GPU of the current placement group visible to this process.

    Returns ``(probes, gpu_ids)``; keep ``probes`` alive as long as the GPUs are used.
    Outside a placement group (or outside Ray) it does nothing. Must run before CUDA is
    initialised in this process.
    """
    try:
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:  # pragma: no cover
        return [], []
    if not ray.is_initialized():
        return [], []
    pg = get_current_placement_group()
    if pg is None:
        return [], []
    probe_cls = ray.remote(_BundleProbe)
    probes: list[Any] = []  # actor handles (Ray types their methods dynamically)
    for i, bundle in enumerate(pg.bundle_specs[1:], start=1):
        probes.append(
            probe_cls.options(
                num_cpus=0,
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote()
        )
    ids = [str(g) for g in ray.get_gpu_ids()]
    for p in probes:
        ids += ray.get(p.gpu_ids.remote(), timeout=timeout_s)
    if ids:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(ids))
    log.info("placement group with %d bundles; visible GPUs: %s", len(pg.bundle_specs), ids or "none")
    return probes, ids


def load_engine(cfg: GeneratorConfig) -> LMEngine:
    """The one way every process loads its engine (fp16/``device_map="auto"`` included)."""
    return LMEngine.from_config(cfg)


# ------------------------------------------------------------------ the deployment
class GeneratorServer:
    """Body of the generator deployment (also usable in-process, e.g. in tests)."""

    def __init__(
        self,
        generator: dict,
        corpus: str,
        serialize_steps: bool = True,
        dense_drafting: dict | None = None,
        knnlm: dict | None = None,
        session_keys: int = 4096,
    ):
        """``dense_drafting`` / ``knnlm``: :class:`deployments.modes.DenseDraftingOptions` /
        :class:`~deployments.modes.KnnServeOptions` as dicts (None: the mode is off);
        ``session_keys``: the bound of Serve's multiplexed LRU of request session keys."""
        from deployments.affinity import SessionKeys  # lazy: Ray; a config is validated without it

        self._probes, self.gpu_ids = claim_placement_group_gpus()
        self.cfg = GeneratorConfig.model_validate(generator)
        self.engine = load_engine(self.cfg)
        if self.engine.batch is not None:  # batch-size histogram, tokens/s and host time, exported by Ray
            self.engine.batch.on_iteration = record_generator_iteration
        if self.engine.batcher is not None:
            self.engine.batcher.on_host_time = record_generator_host
        self.corpus = Corpus.load(corpus)
        self.engine.attach_corpus(self.corpus)
        # without the batcher: steps (and KNN-LM forwards) one at a time, or overlapping
        self._lock: Any = threading.Lock() if serialize_steps else contextlib.nullcontext()
        self.engine.step_lock = self._lock
        self.steps = 0
        self.dense = load_dense_datastore(dense_drafting, self.engine, self.corpus)
        self.knn = knn_server(knnlm, self.engine, self.corpus, self._lock)
        self.session_keys = SessionKeys(self.engine.release, self.engine.sessions.held, session_keys)

    async def step(self, request: StepRequest) -> StepOutput:
        """``f`` of ``request`` (a :class:`~ralm.step_request.StepRequest`, as the coordinator's
        :class:`~actors.remote_proxies.RemoteGenerator` built it) on this replica's engine:
        :meth:`ralm.engine.LMEngine.submit` decides how it runs (batched, or alone on the
        model's thread) and this awaits its future.

        A step sent with a multiplexed model id (the request's session key) has that key
        recorded in Serve's LRU and is its KV session's owner, so :meth:`release` frees it
        when the request ends.
        """
        self.steps += 1
        key = await self.session_keys.step_owner()  # affinity bookkeeping, not a step decision
        if key is not None and request.owner != key:
            request = dataclasses.replace(request, owner=key)
        return await asyncio.wrap_future(self.engine.submit(request))

    def release(self, key: str | None = None) -> int:
        """Free the KV sessions of a request that ended (its session key: ``key``, or the
        call's multiplexed model id); returns how many this replica freed (0 when it holds
        none, e.g. the request's steps ran elsewhere)."""
        key = key or self.session_keys.current()
        return self.session_keys.release(key) if key else 0

    def knn_generate(self, job: RalmJob):
        """One KNN-LM job (method knnlm-seq or knnlm-spec) on this replica; a
        :class:`~ralm.results.RalmResult`. Each forward pass runs between the batcher's
        iterations (under the step lock with ``invariant=false``)."""
        if self.knn is None:
            raise RalmInputError("knnlm is not enabled on this server (app config: knnlm.enabled)")
        return self.knn.run(job)

    def features(self) -> dict:
        """The optional modes this replica serves."""
        return {"dense_drafting": self.dense is not None, "knnlm": self.knn is not None}

    def tokenizer(self):
        """The engine's tokenizer (coordinators tokenise and decode locally with it)."""
        return self.engine.tokenizer

    def info(self) -> dict:
        model = self.engine.model
        return {
            "model": self.cfg.model,
            "dtype": self.cfg.dtype,
            "device": str(self.engine.device),
            "hf_device_map": {k: str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()},
            "gpu_ids": self.gpu_ids,
            "eos_token_id": self.engine.eos_token_id,
            "max_prompt_tokens": self.cfg.max_prompt_tokens,
            "max_new_tokens": self.cfg.max_new_tokens_limit,
            "corpus_size": len(self.corpus),
            "corpus_sha256": self.corpus.sha256,
            "steps": self.steps,
            "doc_kv": self.engine.doc_kv.stats.as_dict() if hasattr(self.engine.doc_kv, "stats") else None,
            "batching": self.batching(),
            "invariant_forward": self.engine.batcher is not None,
            "invariant_kernels": invariant_kernels(self.engine.model),
            "invariant_error": self.engine.invariant_error,
            "kv_pool_error": self.engine.kv_pool_error,
            "batching_off_reason": self.engine.batching_off_reason,
            "invariance_proof": proof.as_dict() if (proof := self.engine.invariance_proof) is not None else None,
            "session_keys": self.session_keys.info(),
            "features": self.features(),
            "dense_drafting": self.dense,
            "knnlm": self.knn.info() if self.knn is not None else None,
            "pid": os.getpid(),
        }

    def batching(self) -> dict | None:
        """The continuous batcher's metrics (sequences-per-iteration histogram, iterations,
        tokens/s, ...) and the KV session store's statistics, the KV pool's blocks (None with ``generator.kv_pool=false``),
        the pooled documents' KV and the decode iterations' CUDA graphs (None where they are
        off); None without the batcher."""
        if self.engine.batcher is None:
            return None
        pool, docs = self.engine.kv_pool, self.engine.doc_blocks
        return {
            **self.engine.batcher.metrics(),
            "sessions": self.engine.sessions.stats.as_dict(),
            "kv_pool": pool.stats() if pool is not None else None,
            "doc_blocks": docs.stats.as_dict() if docs is not None else None,
            "cuda_graphs": graphs.stats() if (graphs := self.engine.batcher.engine.graphs) is not None else None,
        }

    def check_health(self) -> None:
        return None


def generator_deployment(options: GeneratorDeploymentOptions | None = None, name: str = "Generator"):
    """The Serve deployment of :class:`GeneratorServer` with ``options`` applied."""
    from ray import serve

    options = options or GeneratorDeploymentOptions()
    # called on a class, serve.deployment returns the Deployment itself (Ray annotates only
    # its decorator-factory form)
    deployment = cast("Deployment", serve.deployment(GeneratorServer))
    return deployment.options(**options.deployment_options(name))
