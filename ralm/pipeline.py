"""Build a whole in-process RaLM from a :class:`~ralm.config.RalmConfig`.

This is what the CLI, the benchmark and the tests' factories use; the serving layer
builds the same parts inside Ray actors and deployments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ralm.config import RalmConfig, RequestConfig, SpecConfig
from ralm.corpus import Corpus
from ralm.engine import LMEngine
from ralm.errors import ConfigError
from ralm.generator import LocalGenerator
from ralm.job import RalmJob
from ralm.methods import DOCUMENT_METHODS
from ralm.results import RalmResult
from ralm.retrieval.base import Retriever
from ralm.retrieval.factory import ensure_index, load_retriever
from ralm.retrievers import check_kind, entry
from ralm.seq import run_seq
from ralm.spec import run_spec

log = logging.getLogger(__name__)

__all__ = ["PIPELINE_METHODS", "Pipeline", "check_kind"]

# the methods :meth:`Pipeline.answer` runs: the document-level ones of the method table
# (the KNN-LM methods need a token datastore and run in ralm.knnlm)
PIPELINE_METHODS: tuple[str, ...] = DOCUMENT_METHODS


@dataclass
class Pipeline:
    cfg: RalmConfig
    corpus: Corpus
    engine: LMEngine
    retrievers: dict[str, Retriever] = field(default_factory=dict)

    @property
    def generator(self) -> LocalGenerator:
        return LocalGenerator(self.engine, self.corpus)

    @classmethod
    def from_config(
        cls,
        cfg: RalmConfig,
        kinds: tuple[str, ...] | None = None,
        build_missing: bool = True,
        engine: LMEngine | None = None,
        corpus: Corpus | None = None,
        progress: bool = True,
    ) -> Pipeline:
        """Load the corpus, the engine and the retrievers (building missing indexes)."""
        kinds = tuple(check_kind(k) for k in (kinds or (cfg.retriever.kind,)))
        corpus = corpus or Corpus.load(cfg.corpus)
        engine = engine or LMEngine.from_config(cfg.generator)
        retrievers = {}
        for kind in kinds:
            rcfg = cfg.retriever.model_copy(update={"kind": kind})
            if not entry(kind).scan:  # padding emulates a larger flat index: scanned kinds only
                rcfg = rcfg.model_copy(update={"pad_to": 0})
            index_dir = cfg.index_dir(kind)
            if build_missing:
                ensure_index(rcfg, corpus, index_dir, progress=progress)
            retrievers[kind] = load_retriever(rcfg, corpus, index_dir)
        return cls(cfg, corpus, engine, retrievers)

    def retriever(self, kind: str) -> Retriever:
        check_kind(kind)
        if kind not in self.retrievers:
            raise ConfigError(
                f"retriever {kind!r} is not loaded in this pipeline (loaded: {', '.join(self.retrievers)})"
            )
        return self.retrievers[kind]

    def job(
        self, question: str, kind: str | None = None, method: str = "spec", spec: SpecConfig | None = None
    ) -> RalmJob:
        """The :class:`~ralm.job.RalmJob` of a question under this pipeline's defaults: the
        config's retriever, spec and request options unless given."""
        if method not in PIPELINE_METHODS:
            raise ConfigError(f"unknown method {method!r}: use one of {', '.join(PIPELINE_METHODS)}")
        return RalmJob(
            question=question,
            method=method,
            retriever=check_kind(kind or self.cfg.retriever.kind),
            spec=spec or self.cfg.spec,
            request=self.cfg.request,
        )

    def run(self, job: RalmJob, executor=None) -> RalmResult:
        """Answer one document-level job with RaLMSeq or RaLMSpec (``executor``: RaLMSpec's
        asynchronous-verification pool; None: its own)."""
        if job.info.knn or job.retriever is None:
            raise ConfigError(
                f"method {job.method!r} is not run by a pipeline: use one of {', '.join(PIPELINE_METHODS)}"
            )
        kb = self.retriever(job.retriever)
        if job.info.speculative:
            return run_spec(job.question, self.generator, kb, job.request, job.spec, executor=executor)
        return run_seq(job.question, self.generator, kb, job.request)

    def answer(
        self,
        question: str,
        kind: str | None = None,
        method: str = "spec",
        spec: SpecConfig | None = None,
        req: RequestConfig | None = None,
    ) -> RalmResult:
        """Answer one question with RaLMSeq (``method='seq'``) or RaLMSpec (``'spec'``)."""
        job = self.job(question, kind, method, spec)
        return self.run(job if req is None else job.model_copy(update={"request": req}))
