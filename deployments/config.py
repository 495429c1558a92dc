"""The served application's configuration: :class:`AppConfig`, the ``args:`` block of the
Serve config (``serve_config.yaml``), with every option of the deployments it starts.

Pure pydantic (no Ray): :mod:`cluster.serve` validates a config with it before anything
starts, and :func:`deployments.app.build_app` builds the application from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.verifier import DEFAULT_MAX_INFLIGHT, DEFAULT_WINDOW_MS
from cache.state.config import StateStoreConfig
from deployments.generator import GeneratorDeploymentOptions, preset, resources_field
from deployments.modes import DenseDraftingOptions, KnnServeOptions
from ralm import constants as C
from ralm.config import GeneratorConfig, RalmConfig, RetrieverKind
from ralm.methods import MethodName, is_knn


class _Opts(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ShardingOptions(_Opts):
    n_shards: int = Field(2, ge=1, le=256, description="Contiguous corpus slices per retriever, one shard actor each.")
    num_cpus: float = Field(0.1, ge=0, description="CPUs reserved per shard actor (a scheduling reservation).")
    num_gpus: float = Field(
        0,
        ge=0,
        description="GPUs reserved per exact-dense (edr) shard actor; with retriever.dense_scan 'gpu' its scan runs on that GPU (a fraction lets several shards share one). 0: none.",
    )
    max_restarts: int = Field(
        5, ge=-1, description="Restarts of a shard actor that died (-1: unlimited); it reloads its slice."
    )
    max_task_retries: int = Field(3, ge=-1, description="Ray retries of a shard call interrupted by the shard's death.")
    build_num_cpus: float = Field(
        0.1, ge=0, description="CPUs reserved by the one-off task that builds missing indexes and shards."
    )
    resources: dict[str, float] = resources_field("shard actor", "ralmspec_shard")
    spread: bool = Field(
        False,
        description="Spread the shard actors over the nodes (Ray's SPREAD strategy), so losing one node loses as few shards as possible.",
    )


class VerifierOptions(_Opts):
    batching: bool = Field(
        True, description="Batch KB calls across in-flight requests (off: each call is searched on its own)."
    )
    window_ms: float = Field(
        DEFAULT_WINDOW_MS,
        ge=0,
        le=5000,
        description="Longest wait to fill a batch after its first query (a batch leaves earlier when every request in flight is waiting, see flush_when_all_waiting).",
    )
    max_batch: int = Field(64, ge=1, description="A batch is sent as soon as this many queries wait.")
    max_inflight: int = Field(DEFAULT_MAX_INFLIGHT, ge=1, description="Batches in flight at once per retriever.")
    flush_when_all_waiting: bool = Field(
        True,
        description="Send a batch before the window ends as soon as every request in flight is waiting on the verifier (one request alone never waits for the window).",
    )
    wait_for_speculating: bool = Field(
        False,
        description="Hold a batch for requests that are speculating (generating a window on cached documents, so no KB call until its verification). Off: a batch leaves once every request that is not speculating waits, and a window's verification joins whichever batch forms when it arrives.",
    )
    num_cpus: float = Field(0.1, ge=0, description="CPUs reserved per verifier actor (it encodes queries).")
    resources: dict[str, float] = resources_field("verifier actor", "ralmspec_head")


class PoolOptions(_Opts):
    size: int = Field(
        C.POOL_SIZE,
        ge=1,
        description="Coordinators (request slots) ready when the server starts: a burst of this many runs at once without starting anything.",
    )
    max_size: int = Field(
        C.POOL_MAX_SIZE, ge=1, description="Most coordinators (= most requests in flight); further requests queue."
    )
    slots_per_host: int = Field(
        C.POOL_SLOTS_PER_HOST,
        ge=1,
        description="Coordinators per coordinator host actor (one process; each request still has its own coordinator, cache and checkpoints). A new host starts only when every host is full.",
    )
    headroom: int = Field(
        C.POOL_HEADROOM,
        ge=0,
        description="Coordinators kept idle or starting ahead of demand: when a request leaves fewer free, more are started in the background (up to max_size).",
    )
    num_cpus: float = Field(0.02, ge=0, description="CPUs reserved per coordinator host actor.")
    resources: dict[str, float] = resources_field("coordinator host actor", "ralmspec_head")
    max_waiting: int = Field(
        64,
        ge=0,
        description="Requests that may wait for a coordinator when all max_size are busy; beyond that a request is refused at once with 503 and Retry-After (a bounded queue).",
    )

    @model_validator(mode="after")
    def _check(self) -> PoolOptions:
        if self.max_size < self.size:
            raise ValueError("pool.max_size must be >= pool.size")
        return self


class IngressOptions(_Opts):
    served_model_name: str | None = Field(
        None, description="Model id in the OpenAI API (default: the generator's directory or hub name)."
    )
    num_cpus: float = Field(0.1, ge=0, description="CPUs reserved by the ingress replica.")
    resources: dict[str, float] = resources_field("ingress replica", "ralmspec_head")
    max_ongoing_requests: int = Field(
        256, ge=1, description="Concurrent HTTP requests the ingress accepts (beyond the pool they wait)."
    )
    max_queued_requests: int = Field(
        256,
        ge=1,
        description="HTTP requests that may wait for the ingress beyond max_ongoing_requests; Serve's proxy answers any further one 503 with Retry-After.",
    )
    retry_after_s: float = Field(
        C.SHED_RETRY_AFTER_S,
        ge=0,
        description="Retry-After of the proxy's 503 when the ingress queue is full (seconds).",
    )
    max_prompt_chars: int = Field(
        20_000, ge=1, description="Prompts longer than this are rejected before tokenisation."
    )
    admin: bool = Field(
        False, description="Enable POST /v1/ralm/admin/verifier (change batching at run time; for benchmarks)."
    )
    max_body_bytes: int = Field(
        1_048_576, ge=1, description="Request bodies larger than this are rejected with 413 before they are parsed."
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="The whole request body must arrive within this many seconds of the first byte; a body trickled slower gets 408 and the connection's request is dropped (slow-client protection).",
    )
    request_timeout_s: float = Field(
        600.0,
        ge=0,
        description="Deadline of a request, queueing included: past it the request is cancelled (its coordinator stops at the next step) and the client gets 504 with code 'timeout'. 0: no deadline.",
    )


class StateOptions(_Opts):
    # a rejected store config may hold a password: never echo it in errors
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), hide_input_in_errors=True)

    store: StateStoreConfig | None = Field(
        None,
        description="State store for request checkpoints and the verified-KB cache (cache.state.StateStoreConfig; "
        "no secrets: the Redis password comes from RALMSPEC_REDIS_PASSWORD or RALMSPEC_REDIS_PASSWORD_FILE). "
        "None: the URL in RALMSPEC_STATE_URL if set, else no store (checkpoints and the KB cache are off).",
    )
    checkpoints: bool = Field(
        True,
        description="With a durable store (Redis, SQLite): save each request's verified prefix as "
        "it commits, so a request whose coordinator died resumes from it on a replacement.",
    )
    kb_cache: list[RetrieverKind] = Field(
        default_factory=list,
        description="Retrievers whose verified KB results are "
        "cached across requests in the store (exact; keyed by index version).",
    )


def _all_retrievers() -> list[RetrieverKind]:
    return ["edr", "adr", "sr"]


class AppConfig(_Opts):
    """Everything the served application needs. Every field has a default: ``{}`` is the demo."""

    # state.store may hold a (rejected) password: errors name fields, never echo input values
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), hide_input_in_errors=True)

    ralm: RalmConfig = Field(
        default_factory=RalmConfig,
        description="Corpus, work dir, retriever, generator, speculation and request defaults (ralm.config.RalmConfig).",
    )
    retrievers: list[RetrieverKind] = Field(
        default_factory=_all_retrievers,
        min_length=1,
        description="Retriever kinds served; the first is the default of a request.",
    )
    default_method: MethodName = Field(
        "spec", description="Method of a request that names none (knnlm-*: needs knnlm.enabled)."
    )
    generator_preset: Literal["cpu", "gpu", "llama2-70b-4gpu"] | None = Field(
        None,
        description="Generator preset; fills generator settings not given explicitly (see deployments.generator.preset).",
    )
    generator_deployment: GeneratorDeploymentOptions = Field(
        default_factory=GeneratorDeploymentOptions,
        description="Replicas, CPUs/GPUs, autoscaling and placement group of the generator.",
    )
    sharding: ShardingOptions = Field(default_factory=ShardingOptions, description="Retrieval shards.")
    verifier: VerifierOptions = Field(
        default_factory=VerifierOptions, description="Cross-request verification batching."
    )
    pool: PoolOptions = Field(default_factory=PoolOptions, description="Pre-started coordinator actors.")
    ingress: IngressOptions = Field(default_factory=IngressOptions, description="HTTP front end.")
    state: StateOptions = Field(
        default_factory=StateOptions,
        description="Request checkpoints and the cross-request verified-KB cache (off unless a store is configured).",
    )
    build_indexes: bool = Field(
        True, description="Build missing indexes and shards on start (else a missing index is an error)."
    )
    dense_drafting: DenseDraftingOptions = Field(
        default_factory=DenseDraftingOptions,
        description="DReSD datastore for requests with drafting='dense' (off unless a datastore is given).",
    )
    knnlm: KnnServeOptions = Field(
        default_factory=KnnServeOptions,
        description="KNN-LM requests (method knnlm-seq / "
        "knnlm-spec), run in the generator replicas over a token datastore (off by default).",
    )

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if len(set(self.retrievers)) != len(self.retrievers):
            raise ValueError("retrievers lists a kind twice")
        if set(self.state.kb_cache) - set(self.retrievers):
            raise ValueError("state.kb_cache names a retriever that is not served")
        if self.ralm.request.drafting == "dense" and not self.dense_drafting.enabled:
            raise ValueError("ralm.request.drafting is 'dense' but no dense_drafting.datastore is configured")
        if is_knn(self.default_method) and not self.knnlm.enabled:
            raise ValueError(f"default_method is {self.default_method!r} but knnlm.enabled is false")
        return self

    def resolved(self) -> AppConfig:
        """The config with paths made absolute and the generator preset applied (explicit settings win).

        Relative paths (corpus, work dir, a local model directory) are taken relative to the
        current directory if they exist there, else to the repository root, so
        ``serve_config.yaml`` works from any directory; ``~`` is expanded.
        """
        ralm = self.ralm
        gen = ralm.generator
        upd: dict = {}
        if self.generator_preset:
            gen_over, dep = preset(self.generator_preset)
            explicit = gen.model_fields_set
            data = gen.model_dump()
            data.update({k: v for k, v in gen_over.items() if k not in explicit})
            gen = GeneratorConfig.model_validate(data)
            if "generator_deployment" not in self.model_fields_set:
                upd["generator_deployment"] = dep
        model = gen.model
        if _looks_local(model):
            model = str(_abs(model))
        ralm = ralm.model_copy(
            update={
                "corpus": _abs(ralm.corpus),
                "work_dir": _abs(ralm.work_dir),
                "generator": gen.model_copy(update={"model": model}),
                "retriever": ralm.retriever.model_copy(
                    update={"index_dir": _abs(ralm.retriever.index_dir) if ralm.retriever.index_dir else None}
                ),
            }
        )
        upd["ralm"] = ralm
        if self.dense_drafting.datastore is not None:
            upd["dense_drafting"] = self.dense_drafting.model_copy(
                update={"datastore": _abs(self.dense_drafting.datastore)}
            )
        knn = self.knnlm.config
        upd["knnlm"] = self.knnlm.model_copy(
            update={
                "config": knn.model_copy(
                    update={
                        "datastore_dir": _abs(knn.datastore_dir)
                        if knn.datastore_dir
                        else Path(ralm.work_dir) / "knn-datastore"
                    }
                )
            }
        )
        return self.model_copy(update=upd)

    @property
    def model_name(self) -> str:
        if self.ingress.served_model_name:
            return self.ingress.served_model_name
        m = str(self.ralm.generator.model)
        p = Path(m)
        return p.name if p.is_dir() or m.startswith("/") else m


def _abs(p) -> Path:
    p = Path(str(p)).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve()
    return (C.PACKAGE_ROOT / p).resolve()


def _looks_local(model: str) -> bool:
    m = str(model)
    return m.startswith((".", "/", "~")) or Path(m).expanduser().exists() or (C.PACKAGE_ROOT / m).exists()


__all__ = ["AppConfig", "IngressOptions", "PoolOptions", "ShardingOptions", "StateOptions", "VerifierOptions"]
