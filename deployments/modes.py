"""Server-side support for the per-request generation modes that need state in the generator.

Most modes (n-gram drafting, several documents per prompt, FLARE, Iter-RetGen, IDGR,
shifted doc-KV reuse) need nothing but the request's :class:`~ralm.config.RequestConfig`:
the coordinator runs :func:`ralm.seq.run_seq` / :func:`ralm.spec.run_spec` with it and
each step carries its :class:`~ralm.drafting.StepOptions` to the generator. Two need data
that lives in every generator replica, and are switched on in the app config:

- **dense drafting** (DReSD) needs a datastore of hidden states
  (:class:`DenseDraftingOptions`; :func:`load_dense_datastore` attaches it to the engine);
- **KNN-LM** is a different, token-level loop (:mod:`ralm.knnlm`): it needs the model's
  hidden state at every token, so a KNN-LM request runs *inside* a generator replica
  (:class:`KnnServer`, calling :func:`ralm.knnlm.run_knn_seq` / :func:`~ralm.knnlm.run_knn_spec`
  as they are), with the token datastore loaded there. Its forward passes run one at a
  time on the engine's continuous batcher thread (between two batched iterations; under the
  replica's step lock with ``generator.invariant=false``), so RaLM steps of other requests
  interleave with it.

A request asking for a mode the server has not enabled gets a 400 from the ingress.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from deployments.config import DenseDraftingOptions, KnnServeOptions
from ralm.config import KnnLMConfig
from ralm.drafting.dense import DenseDatastore, build_datastore, collect_corpus
from ralm.errors import RalmInputError
from ralm.job import KNN_REQUEST_FIELDS, RalmJob
from ralm.knnlm import (
    Datastore,
    DatastoreError,
    build_datastore as build_knn_datastore,
    load_knn_retriever,
    model_fingerprint,
    run_knn_seq,
    run_knn_spec,
)
from ralm.knnlm.projection import projection_for
from ralm.methods import KNN_METHODS

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ dense drafting
def load_dense_datastore(opts: dict | DenseDraftingOptions | None, engine, corpus) -> dict | None:
    """Attach the configured DReSD datastore to ``engine`` (building it if allowed); returns
    a description for ``info()`` (None when dense drafting is off)."""
    opts = DenseDraftingOptions.model_validate(opts or {}) if not isinstance(opts, DenseDraftingOptions) else opts
    if not opts.enabled or opts.datastore is None:  # (enabled: a datastore is set)
        return None
    path = Path(opts.datastore).expanduser()
    built = False
    if not path.is_file():
        if not opts.build_passages:
            raise RalmInputError(
                f"dense_drafting.datastore {path} does not exist (set dense_drafting.build_passages "
                f"to build it at start, or build it with ralm.drafting.dense)"
            )
        n = min(opts.build_passages, len(corpus))
        log.info("building a dense drafting datastore from %d passages into %s", n, path)
        keys, values = collect_corpus(engine, (corpus.text(i) for i in range(n)))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}-{uuid.uuid4().hex[:8]}.npz")
        build_datastore(keys, values).save(tmp)
        os.replace(tmp, path)  # atomic: replicas may build at the same time
        built = True
    try:
        store = DenseDatastore.load(path)
    except Exception as e:
        raise RalmInputError(f"cannot load the dense drafting datastore {path}: {e}") from None
    hidden = engine.model.config.hidden_size if hasattr(engine.model.config, "hidden_size") else None
    if hidden is not None and store.mean is not None and len(store.mean) != hidden:
        raise RalmInputError(
            f"dense drafting datastore {path} has {len(store.mean)}-dim keys; "
            f"this model's hidden size is {hidden}: rebuild it with this model"
        )
    engine.attach_dense_datastore(store)
    return {"datastore": str(path), "entries": len(store), "built": built}


# ------------------------------------------------------------------ KNN-LM
class _ReplicaModel:
    """The engine's model, each forward pass one at a time with the replica's steps: on the
    continuous batcher's thread (``engine.batcher.call``) when the engine has one, else under
    the replica's step lock."""

    def __init__(self, engine, lock):
        self.engine, self.model, self.lock = engine, engine.model, lock
        self.config = engine.model.config

    def parameters(self):
        return self.model.parameters()

    def __call__(self, *args, **kwargs):
        batcher = self.engine.batcher
        if batcher is None:
            with self.lock:
                return self.model(*args, **kwargs)
        import torch

        # autograd modes are per thread: the forward runs in the caller's
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def forward():
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return self.model(*args, **kwargs)

        return batcher.call(forward).result()


class _KnnLM:
    """What the KNN-LM loops need of an LM (:class:`~ralm.engine.LMEngine`'s interface), its
    forward passes serialised with the replica's steps (:class:`_ReplicaModel`)."""

    def __init__(self, engine, lock):
        self.engine = engine
        self.model = _ReplicaModel(engine, lock)
        # with a batcher, the KNN-LM steppers feed through it (batched with the replica's steps)
        self.batcher = engine.batcher
        self.tokenizer = engine.tokenizer
        self.eos_token_id = engine.eos_token_id
        self.max_positions = engine.max_positions

    def encode_question(self, question: str) -> list[int]:
        return self.engine.encode_question(question)

    def decode(self, tokens) -> str:
        return self.engine.decode(tokens)


def _load_or_build_knn(opts: KnnServeOptions, engine, corpus):
    cfg = opts.config
    if cfg.datastore_dir is None:
        raise ValueError("knnlm.config.datastore_dir must be resolved before the replica starts")
    d = Path(cfg.datastore_dir).expanduser()
    fp = model_fingerprint(engine)
    want = min(opts.n_passages or len(corpus), len(corpus))
    try:
        ds = Datastore.load(d, corpus=corpus, fingerprint=fp)
        if opts.build and (
            ds.manifest.get("n_passages") != want
            or ds.manifest.get("max_passage_tokens") != min(cfg.max_passage_tokens, engine.max_positions)
        ):
            raise DatastoreError(f"datastore at {d} has another size than configured")
        return ds, False
    except DatastoreError as e:
        if not opts.build:
            raise
        log.info("building the KNN-LM datastore (%s)", e)
    ds = build_knn_datastore(
        engine,
        corpus,
        n_passages=want,
        max_passage_tokens=cfg.max_passage_tokens,
        hnsw=cfg.index == "hnsw",
        hnsw_m=cfg.hnsw_m,
        hnsw_ef_construction=cfg.hnsw_ef_construction,
        progress=False,
    )
    tmp = d.with_name(f".{d.name}-{uuid.uuid4().hex[:8]}")
    ds.save(tmp)
    try:
        if d.exists():
            shutil.rmtree(d)
        os.replace(tmp, d)
    except OSError:  # another replica was faster: use ours in memory
        shutil.rmtree(tmp, ignore_errors=True)
    return ds, True


class KnnServer:
    """The KNN-LM datastore and retriever of one generator replica; runs KNN-LM requests."""

    def __init__(self, opts: dict | KnnServeOptions, engine, corpus, lock):
        self.opts = KnnServeOptions.model_validate(opts) if not isinstance(opts, KnnServeOptions) else opts
        self.ds, self.built = _load_or_build_knn(self.opts, engine, corpus)
        self.kb = load_knn_retriever(self.ds, self.opts.config)
        projection_for(self.ds, self.opts.config.cache_project_dims)  # fit it now, not in the first request
        self.lm = _KnnLM(engine, lock)
        self.requests = 0

    def config_for(self, job: RalmJob) -> KnnLMConfig:
        """The server's KNN-LM configuration with the job's own settings on top."""
        return self.opts.config if job.knn is None else job.knn.applied_to(self.opts.config)

    def run(self, job: RalmJob):
        if not job.info.knn:
            raise RalmInputError(f"method {job.method!r} is not a KNN-LM method: use {' or '.join(KNN_METHODS)}")
        cfg = self.config_for(job)
        self.requests += 1
        if not job.info.speculative:
            return run_knn_seq(job.question, self.lm, self.kb, cfg, job.request)
        return run_knn_spec(job.question, self.lm, self.kb, cfg, job.request, job.spec)

    def info(self) -> dict:
        return {
            "entries": len(self.ds),
            "index": self.kb.name,
            "datastore": str(self.opts.config.datastore_dir),
            "built": self.built,
            "requests": self.requests,
            "defaults": {k: getattr(self.opts.config, k) for k in KNN_REQUEST_FIELDS},
        }


def knn_server(opts: dict | None, engine, corpus, lock) -> KnnServer | None:
    """A :class:`KnnServer` when KNN-LM is enabled in ``opts``, else None."""
    o = KnnServeOptions.model_validate(opts or {})
    return KnnServer(o, engine, corpus, lock) if o.enabled else None


__all__ = [
    "KnnServer",
    "KNN_REQUEST_FIELDS",
    "knn_server",
    "load_dense_datastore",
]
