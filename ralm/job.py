"""One request, fully resolved: :class:`RalmJob`, the typed object that travels from the edge to the loop.

A job is built once, where a request enters the system - the HTTP API
(:func:`deployments.api.build_job`), the CLI, the evaluation job (:meth:`EvalItem.job
<cluster.eval_items.EvalItem.job>`) - with every server or job default already applied and
every option validated. From there it is passed as it is: to a coordinator actor (Ray
pickles pydantic models), to the KNN-LM server, to :meth:`ralm.pipeline.Pipeline.run`. No
one downstream re-validates it, fills in defaults or rebuilds it from a dict.

Worked example (what ``POST /v1/ralm/generate {"question": "q", "spec": "PSA"}`` becomes
on a server whose first retriever is ``edr``)::

    RalmJob(question="q", method="spec", retriever="edr",
            spec=SpecConfig(prefetch=True, adaptive_stride=True, async_verify=True, ...),
            request=RequestConfig(max_new_tokens=64, ...), request_id="9f0c...")

>>> job = RalmJob(question="q", method="seq", retriever="sr")
>>> job.info.speculative, job.knn
(False, None)
>>> RalmJob(question="q", method="knnlm-seq", retriever="sr")
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for RalmJob
  Value error, method 'knnlm-seq' retrieves from its token datastore: a KNN-LM job has no retriever (got 'sr') [type=value_error, input_value=..., input_type=dict]
    For further information visit ...
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.methods import MethodInfo, MethodName, method_info
from ralm.retrievers import RetrieverKind

# KnnLMConfig fields a request may set (the rest - datastore, index, scan - are the server's)
KNN_REQUEST_FIELDS = (
    "k",
    "temperature",
    "lmbda",
    "spatial_next",
    "cache_max_entries",
    "prefetch_size",
    "cache_retrievals",
    "max_stride",
)


class KnnRequestOptions(BaseModel):
    """A KNN-LM request's own settings, applied on top of the server's :class:`~ralm.config.KnnLMConfig`
    (None: the server's value). Their constraints are KnnLMConfig's, checked by :meth:`applied_to`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    k: int | None = Field(None, description="Neighbours retrieved per token (1..1024).")
    temperature: float | None = Field(None, description="T of p_knn ~ exp(-dist/T).")
    lmbda: float | None = Field(None, description="lambda: weight of p_knn in the interpolation (0..1).")
    spatial_next: int | None = Field(None, description="knnlm-spec: successors of each retrieved entry cached.")
    cache_max_entries: int | None = Field(None, description="knnlm-spec: speculative cache capacity (0: automatic).")
    prefetch_size: int | None = Field(None, description="knnlm-spec with P: entries fetched per KB query (<= 1024).")
    cache_retrievals: int | None = Field(None, description="knnlm-spec: automatic cache capacity, in KB answers.")
    max_stride: int | None = Field(None, description="knnlm-spec with S: upper bound on OS3's stride.")

    def applied_to(self, base: KnnLMConfig) -> KnnLMConfig:
        """``base`` with these settings on top, validated (ValidationError naming the field)."""
        return KnnLMConfig.model_validate({**base.model_dump(), **self.model_dump(exclude_none=True)})


# the per-request fields of KnnLMConfig are exactly KnnRequestOptions' (a broken edit fails at import)
if tuple(KnnRequestOptions.model_fields) != KNN_REQUEST_FIELDS:  # pragma: no cover
    raise ImportError("KnnRequestOptions must list exactly KNN_REQUEST_FIELDS")


class RalmJob(BaseModel):
    """One request with every option resolved: what a RaLM loop needs to answer it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    question: str = Field(description="The question (or the prompt, for completions and chat).")
    method: MethodName = Field("spec", description="The loop that answers it (ralm.methods).")
    retriever: RetrieverKind | None = Field(
        None, description="The knowledge base of a document-level method; None for KNN-LM (its own datastore)."
    )
    spec: SpecConfig = Field(default_factory=SpecConfig, description="RaLMSpec options (speculative methods).")
    request: RequestConfig = Field(default_factory=RequestConfig, description="Generation options.")
    knn: KnnRequestOptions | None = Field(
        None, description="KNN-LM settings of this request (KNN-LM methods only; None: the server's)."
    )
    request_id: str | None = Field(
        None, description="Names the request's checkpoint: the same id and job resume where it stopped."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RalmJob:
        info = method_info(self.method)
        if info.knn and self.retriever is not None:
            raise ValueError(
                f"method {self.method!r} retrieves from its token datastore: a KNN-LM job has no retriever "
                f"(got {self.retriever!r})"
            )
        if not info.knn and self.retriever is None:
            raise ValueError(f"method {self.method!r} needs a retriever (edr, adr or sr)")
        if self.knn is not None and not info.knn:
            raise ValueError(f"knn settings apply only to KNN-LM methods (method is {self.method!r})")
        return self

    @property
    def info(self) -> MethodInfo:
        """The method's row of the method table."""
        return method_info(self.method)

    @property
    def source(self) -> str:
        """Where its documents come from, as responses name it: the retriever, or ``"knn"``."""
        return self.retriever or "knn"

    def digest(self) -> str:
        """sha256 of everything but ``request_id``: a checkpoint resumes only the same job."""
        return hashlib.sha256(self.model_dump_json(exclude={"request_id"}).encode()).hexdigest()


__all__ = ["KNN_REQUEST_FIELDS", "KnnRequestOptions", "RalmJob"]
