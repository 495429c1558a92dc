"""The served application's configuration: :class:`AppConfig`, the ``args:`` block of the
Serve config (``serve_config.yaml``), with every option of the deployments it starts.

Pure pydantic, a leaf of the import graph: no Ray, torch, engine or actor is imported here
(a lint-imports contract in pyproject.toml keeps it so). :mod:`cluster.serve` validates a
config with it before anything starts, and :func:`deployments.app.build_app` builds the
application from it. The generator deployment's placement (:class:`GeneratorDeploymentOptions`,
the presets) and the two generator-side modes' options (:class:`DenseDraftingOptions`,
:class:`KnnServeOptions`) live here too; :mod:`deployments.generator` and
:mod:`deployments.modes` run them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from cache.state.config import StateStoreConfig
from ralm import constants as C
from ralm.config import GeneratorConfig, KnnLMConfig, RalmConfig, StrictModel
from ralm.methods import MethodName, is_knn
from ralm.retrievers import RetrieverKind, kinds

NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
LLAMA2_70B = "meta-llama/Llama-2-70b-hf"


class AutoscalingOptions(StrictModel):
    """Serve autoscaling of the generator deployment."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running.")
    max_replicas: int = Field(2, ge=1, description="Most replicas started under load.")
    target_ongoing_requests: float = Field(4.0, gt=0, description="Ongoing step calls per replica that Serve aims for.")
    upscale_delay_s: float = Field(5.0, ge=0, description="Load must stay high this long before a replica is added.")
    downscale_delay_s: float = Field(
        60.0, ge=0, description="Load must stay low this long before a replica is removed."
    )


def resources_field(what: str, example: str) -> Any:
    """The ``resources`` option of one Ray part of the app (shards, verifiers, coordinators,
    ingress, generator replicas): custom Ray resources that pin it to chosen nodes."""
    return Field(
        default_factory=dict,
        description=f"Custom Ray resources each {what} reserves, e.g. {{'{example}': 1}}: it then runs only on "
        "nodes started with that resource (ray start --resources), which pins it to chosen nodes.",
    )


class GeneratorDeploymentOptions(StrictModel):
    """How the generator deployment is placed and scaled (Serve deployment options)."""

    preset: str | None = Field(None, description="Name of the preset these options came from (informational).")
    num_replicas: int = Field(1, ge=1, description="Replicas when autoscaling is off.")
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per replica (a scheduling reservation).")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs reserved per replica actor (with a placement group: in bundle 0)."
    )
    resources: dict[str, float] = resources_field("replica", "ralmspec_generator")
    max_ongoing_requests: int = Field(
        64,
        ge=1,
        description="Concurrent step calls a replica accepts. With the continuous batcher (generator.invariant, "
        "the default) the steps in flight share forward passes, so this bounds the batch: keep it at least "
        "the number of requests in flight (pool.max_size).",
    )
    autoscaling: AutoscalingOptions | None = Field(None, description="Autoscaling instead of a fixed replica count.")
    placement_group_bundles: list[dict[str, float]] | None = Field(
        None, description="Per-replica placement group; the replica actor runs in the first bundle."
    )
    placement_group_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None, description="Placement group strategy (STRICT_PACK: every bundle on one node)."
    )
    serialize_steps: bool = Field(
        True,
        description="Only with generator.invariant=false (no continuous batcher): run one step at a time per "
        "replica. With the batcher (the default) steps of concurrent requests always share forward passes "
        "and this setting is ignored.",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of the replica processes."
    )
    session_keys_per_replica: int = Field(
        4096,
        ge=1,
        description="Session keys (one per request a coordinator runs) a replica keeps in Serve's multiplexed "
        "LRU, which routes every step of a request to the replica holding its KV sessions. A key is a few "
        "bytes (the sessions themselves are bounded by generator.kv_session_bytes); an evicted key's sessions "
        "are released. Keep it well above the requests in flight per replica.",
    )

    def deployment_options(self, name: str = "Generator") -> dict:
        """Keyword arguments for ``Deployment.options``."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            actor["num_gpus"] = self.num_gpus
        if self.resources:
            actor["resources"] = dict(self.resources)
        if self.env_vars:
            actor["runtime_env"] = {"env_vars": dict(self.env_vars)}
        opts: dict[str, Any] = {
            "name": name,
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests,
        }
        if self.autoscaling is not None:
            a = self.autoscaling
            opts["autoscaling_config"] = {
                "min_replicas": a.min_replicas,
                "max_replicas": a.max_replicas,
                "target_ongoing_requests": a.target_ongoing_requests,
                "upscale_delay_s": a.upscale_delay_s,
                "downscale_delay_s": a.downscale_delay_s,
            }
        else:
            opts["num_replicas"] = self.num_replicas
        opts["request_router_config"] = {
            "request_router_class": "deployments.affinity.SessionAffinityRouter",
            "request_router_kwargs": {"max_keys": max(65536, 16 * self.session_keys_per_replica)},
        }
        if self.placement_group_bundles:
            opts["placement_group_bundles"] = [dict(b) for b in self.placement_group_bundles]
            opts["placement_group_strategy"] = self.placement_group_strategy or "PACK"
        return opts

    @property
    def gpus_per_replica(self) -> float:
        if self.placement_group_bundles:
            return sum(b.get("GPU", 0.0) for b in self.placement_group_bundles)
        return self.num_gpus


def preset(name: str, model: str | None = None) -> tuple[dict, GeneratorDeploymentOptions]:
    """(GeneratorConfig overrides, deployment options) of a named preset.

    - ``cpu``: one CPU replica (the embedded default).
    - ``gpu``: one replica per GPU, fp16.
    - ``llama2-70b-4gpu``: LLaMA-2-70B in fp16, one replica spanning 4 GPUs of one node
      (placement group of 4 one-GPU bundles, ``STRICT_PACK``, ``device_map="auto"``).
    """
    if name == "cpu":
        gen, opts = {}, GeneratorDeploymentOptions(preset=name)
    elif name == "gpu":
        gen = {"device": "cuda", "dtype": "float16"}
        opts = GeneratorDeploymentOptions(preset=name, num_cpus=1, num_gpus=1)
    elif name == "llama2-70b-4gpu":
        gen = {"model": LLAMA2_70B, "device": "auto", "dtype": "float16"}
        opts = GeneratorDeploymentOptions(
            preset=name,
            num_replicas=1,
            num_cpus=1,
            num_gpus=1,
            placement_group_bundles=[{"CPU": 1, "GPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}],
            placement_group_strategy="STRICT_PACK",
            env_vars={NOSET_CUDA_ENV: "1"},
        )
    else:
        raise ValueError(f"unknown generator preset {name!r}: choose one of {', '.join(PRESETS)}")
    if model:
        gen = {**gen, "model": model}
    return gen, opts


PRESETS = ("cpu", "gpu", "llama2-70b-4gpu")


class DenseDraftingOptions(StrictModel):
    datastore: Path | None = Field(
        None,
        description="DReSD datastore file (.npz written by ralm.drafting.dense.DenseDatastore.save), loaded "
        "by every generator replica. None: dense drafting is off and requests with drafting='dense' get 400.",
    )
    build_passages: int = Field(
        0,
        ge=0,
        description="When the datastore file is missing: build one at replica start from the first N "
        "corpus passages (teacher-forced hidden states) and save it there. 0: a missing file is a start-up error.",
    )

    @field_validator("datastore")
    @classmethod
    def _npz(cls, v: Path | None) -> Path | None:
        if v is not None and Path(v).suffix != ".npz":
            raise ValueError("dense_drafting.datastore must be a .npz file")
        return v

    @property
    def enabled(self) -> bool:
        return self.datastore is not None


class KnnServeOptions(StrictModel):
    enabled: bool = Field(
        False, description="Serve KNN-LM requests (method 'knnlm-seq' or 'knnlm-spec'). Off: they get 400."
    )
    config: KnnLMConfig = Field(
        default_factory=KnnLMConfig,
        description="The token datastore, its index and the "
        "request defaults (k, temperature, lmbda, and the speculation's prefetch_size, spatial_next, "
        "cache_retrievals, max_stride); datastore_dir None: "
        "<work_dir>/knn-datastore.",
    )
    build: bool = Field(
        True,
        description="Build a missing (or stale) datastore when a generator replica starts "
        "(else that is a start-up error).",
    )
    n_passages: int | None = Field(None, ge=1, description="Corpus passages in a datastore built at start (None: all).")


class ShardingOptions(StrictModel):
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


class VerifierOptions(StrictModel):
    batching: bool = Field(
        True, description="Batch KB calls across in-flight requests (off: each call is searched on its own)."
    )
    window_ms: float = Field(
        1000.0,
        ge=0,
        le=5000,
        description="Longest wait to fill a batch after its first query (a batch leaves earlier when every request in flight is waiting, see flush_when_all_waiting).",
    )
    max_batch: int = Field(64, ge=1, description="A batch is sent as soon as this many queries wait.")
    max_inflight: int = Field(1, ge=1, description="Batches in flight at once per retriever.")
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


class PoolOptions(StrictModel):
    size: int = Field(
        32,
        ge=1,
        description="Coordinators (request slots) ready when the server starts: a burst of this many runs at once without starting anything.",
    )
    max_size: int = Field(
        256, ge=1, description="Most coordinators (= most requests in flight); further requests queue."
    )
    slots_per_host: int = Field(
        C.POOL_SLOTS_PER_HOST,
        ge=1,
        description="Coordinators per coordinator host actor (one process; each request still has its own coordinator, cache and checkpoints). A new host starts only when every host is full.",
    )
    headroom: int = Field(
        16,
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


class IngressOptions(StrictModel):
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


class StateOptions(StrictModel):
    # a rejected store config may hold a password: never echo it in errors
    model_config = ConfigDict(hide_input_in_errors=True)  # and StrictModel's

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


def _all_retrievers() -> list[str]:
    return list(kinds())


class AppConfig(StrictModel):
    """Everything the served application needs. Every field has a default: ``{}`` is the demo."""

    # state.store may hold a (rejected) password: errors name fields, never echo input values
    model_config = ConfigDict(hide_input_in_errors=True)  # and StrictModel's

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
        description="Generator preset; fills generator settings not given explicitly (see deployments.config.preset).",
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


__all__ = [
    "PRESETS",
    "AppConfig",
    "AutoscalingOptions",
    "DenseDraftingOptions",
    "GeneratorDeploymentOptions",
    "IngressOptions",
    "KnnServeOptions",
    "PoolOptions",
    "ShardingOptions",
    "StateOptions",
    "VerifierOptions",
    "preset",
]
