"""How an HTTP body becomes a coordinator job (deployments/api.py), without Ray: every
per-request mode is validated by the core's own config models, unavailable modes are refused
with a clear 400, and inexact options are flagged."""

from __future__ import annotations

import pytest

from deployments.api import ApiError, GenerateRequest, build_job
from ralm.config import KnnLMConfig, RequestConfig, SpecConfig
from ralm.job import KnnRequestOptions, RalmJob

SERVER = dict(
    kinds=["edr", "sr"],
    default_method="spec",
    spec_defaults=SpecConfig.named("PSA"),
    request_defaults=RequestConfig(max_new_tokens=24),
    max_new_limit=128,
    knn_defaults=KnnLMConfig(k=8),
)
ALL_ON = {"dense_drafting": True, "knnlm": True}
ALL_OFF = {"dense_drafting": False, "knnlm": False}


def job(body: dict, features: dict = ALL_ON) -> RalmJob:
    b = GenerateRequest.model_validate({"question": "q", **body})
    return build_job(b, "q", b.max_new_tokens, "max_new_tokens", None, features=features, **SERVER)


def refused(body: dict, features: dict = ALL_ON) -> ApiError:
    with pytest.raises(ApiError) as e:
        job(body, features)
    assert e.value.status == 400
    return e.value


MODES = [
    {"drafting": "ngram", "ngram_n": 3, "ngram_min_n": 1, "ngram_m": 5},
    {"drafting": "dense", "dense_num_drafts": 2, "dense_draft_len": 8, "dense_candidates": 32},
    {"num_docs": 3},
    {"workload": "flare", "flare_threshold": 0.3},
    {"workload": "iter_retgen", "iter_retgen_iterations": 3},
    {"idgr": True, "idgr_unrelated": 1, "num_docs": 2},
    {"allow_inexact_shifted_reuse": True, "num_docs": 2},
    {"ignore_eos": True, "generation_stride": 2, "query_window": 16},
]


@pytest.mark.parametrize("fields", MODES, ids=lambda f: "+".join(f))
def test_every_mode_reaches_the_request_config(fields):
    j = job(fields)
    req = j.request
    for name, value in fields.items():
        assert getattr(req, name) == value
    assert req.max_new_tokens == 24  # the server's default is kept
    assert req.exact == (not (fields.get("idgr") or fields.get("allow_inexact_shifted_reuse")))
    assert j.method == "spec" and j.retriever == "edr" and j.spec == SERVER["spec_defaults"]


def test_inexact_options_are_named():
    assert RequestConfig(idgr=True).inexact_options == ["idgr"]
    assert RequestConfig(allow_inexact_shifted_reuse=True, idgr=True).inexact_options == [
        "idgr",
        "allow_inexact_shifted_reuse",
    ]
    assert RequestConfig(drafting="ngram", num_docs=4, workload="flare").exact


BAD = [
    ({"ngram_n": 0}, "ngram_n: Input should be greater than or equal to 1 (got 0)"),
    ({"ngram_m": 100000}, "ngram_m: Input should be less than or equal to 256"),
    ({"dense_candidates": 5000}, "dense_candidates: Input should be less than or equal to 1024"),
    ({"num_docs": 9}, "num_docs: Input should be less than or equal to 8"),
    ({"flare_threshold": 1.5}, "flare_threshold: Input should be less than 1"),
    ({"iter_retgen_iterations": 0}, "iter_retgen_iterations"),
    ({"idgr_unrelated": -1}, "idgr_unrelated"),
    ({"stride": 0}, "stride: Input should be greater than or equal to 1"),
    ({"knn": {"k": 4}}, "knn options apply only to methods knnlm-seq and knnlm-spec"),
    ({"method": "knnlm-spec", "knn": {"k": 0}}, "knn.k: Input should be greater than or equal to 1"),
    ({"method": "knnlm-spec", "knn": {"lmbda": 1.5}}, "knn.lmbda"),
    ({"method": "knnlm-spec", "spec": "SA"}, "asynchronous verification (A) is not supported for KNN-LM"),
    ({"method": "knnlm-seq", "num_docs": 2}, "num_docs does not apply to method 'knnlm-seq'"),
    ({"method": "knnlm-seq", "retriever": "edr"}, "retriever does not apply"),
    ({"retriever": "adr"}, "unknown retriever 'adr'"),
    ({"max_new_tokens": 1000}, "max_new_tokens must be between 1 and 128"),
]


@pytest.mark.parametrize("body,fragment", BAD, ids=[str(b) for b, _ in BAD])
def test_bad_values_are_refused_with_the_field_and_the_constraint(body, fragment):
    assert fragment in refused(body).message


@pytest.mark.parametrize(
    "body",
    [
        {"drafting": "x"},
        {"num_docs": "2"},
        {"idgr": "yes"},
        {"idgr": 1},
        {"flare_threshold": "0.5"},
        {"workload": "active"},
        {"knn": {"kk": 1}},
        {"method": "knnlm"},
    ],
)
def test_body_types_are_strict(body):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({"question": "q", **body})


def test_modes_the_server_does_not_enable_are_refused_clearly():
    e = refused({"drafting": "dense"}, ALL_OFF)
    assert e.message.startswith("dense drafting is not enabled on this server:") and e.param == "drafting"
    assert e.code == "mode_not_enabled"
    for method in ("knnlm-seq", "knnlm-spec"):
        e = refused({"method": method}, ALL_OFF)
        assert e.message.startswith("knnlm is not enabled on this server:") and e.param == "method"
    assert job({"drafting": "ngram"}, ALL_OFF).request.drafting == "ngram"


def test_knn_jobs():
    j = job({"method": "knnlm-spec", "spec": {"stride": 4}, "knn": {"k": 4, "lmbda": 0.5}, "max_new_tokens": 12})
    assert j.method == "knnlm-spec" and j.retriever is None and j.source == "knn"
    assert j.knn == KnnRequestOptions(k=4, lmbda=0.5)
    assert j.knn.applied_to(SERVER["knn_defaults"]).model_dump(include={"k", "lmbda", "temperature"}) == {
        "k": 4,
        "lmbda": 0.5,
        "temperature": SERVER["knn_defaults"].temperature,
    }
    assert j.spec.stride == 4 and j.spec.async_verify is False  # the server's A does not apply
    assert j.request.max_new_tokens == 12
    assert job({"method": "knnlm-seq"}).knn == KnnRequestOptions()


def test_the_spec_field_takes_the_one_configuration_grammar():
    """A name in SpecConfig.parse's grammar, on top of the server's spec defaults; an object of
    any SpecConfig field; the stride/prefetch_size shortcuts on top of either."""
    server = SERVER["spec_defaults"]
    assert job({"spec": "PS@0.9;max_stride=4"}).spec == SpecConfig.parse("PS@0.9;max_stride=4", **server.model_dump())
    assert job({"spec": "s=5"}).spec.stride == 5 and not job({"spec": "s=5"}).spec.adaptive_stride
    j = job({"spec": {"allow_direct": False, "gamma_prior": False}, "stride": 2, "prefetch_size": 7})
    assert (j.spec.allow_direct, j.spec.gamma_prior, j.spec.stride, j.spec.prefetch_size) == (False, False, 2, 7)
    assert j.spec.adaptive_stride == server.adaptive_stride  # fields not given keep the server's
    assert "bad setting 'nope=1'" in refused({"spec": "PSA;nope=1"}).message
    assert refused({"spec": {"max_stride": 0}}).param == "max_stride"


def test_a_job_is_typed_and_self_consistent():
    """What crosses to the coordinator is a frozen RalmJob: a KNN-LM job has no retriever, a
    document-level one has one, and knn settings belong to KNN-LM methods only."""
    from pydantic import ValidationError

    j = job({})
    with pytest.raises(ValidationError):
        j.question = "other"  # frozen
    assert j.digest() == job({}).model_copy(update={"request_id": "other"}).digest()
    assert j.digest() != job({"stride": 5}).digest()
    for bad in (
        {"method": "knnlm-seq", "retriever": "edr"},
        {"method": "seq"},
        {"method": "seq", "retriever": "edr", "knn": {"k": 4}},
        {"method": "seq", "retriever": "faiss"},
    ):
        with pytest.raises(ValidationError):
            RalmJob.model_validate({"question": "q", **bad})


def test_app_config_checks_modes():
    from deployments.app import AppConfig

    with pytest.raises(ValueError, match="dense_drafting.datastore"):
        AppConfig.model_validate({"ralm": {"request": {"drafting": "dense"}}})
    with pytest.raises(ValueError, match="knnlm.enabled"):
        AppConfig.model_validate({"default_method": "knnlm-spec"})
    with pytest.raises(ValueError, match=".npz"):
        AppConfig.model_validate({"dense_drafting": {"datastore": "/tmp/store.bin"}})
    cfg = AppConfig.model_validate({"ralm": {"work_dir": "/tmp/w"}, "knnlm": {"enabled": True}}).resolved()
    assert str(cfg.knnlm.config.datastore_dir) == "/tmp/w/knn-datastore"
    assert AppConfig.model_validate({}).resolved().dense_drafting.enabled is False


def test_request_stats_report_the_mode_statistics():
    from ralm.engine import StepOutput
    from ralm.results import RequestStats

    st = RequestStats().set_request(RequestConfig(drafting="ngram", num_docs=2, idgr=True))
    assert (st.drafting, st.num_docs, st.exact, st.inexact_options) == ("ngram", 2, False, ["idgr"])
    st.record_step(
        StepOutput(
            [1, 2, 3, 4],
            False,
            0.0,
            0.0,
            False,
            forward_passes=2,
            draft_rounds=1,
            drafted_tokens=4,
            accepted_tokens=2,
            docs_reused=1,
            docs_computed=1,
            kv_bytes_reused=100,
        )
    )
    d = st.as_dict()
    assert d["tokens_per_forward"] == 2.0 and d["acceptance_rate"] == 0.5 and d["accepted_per_verify_pass"] == 2.0
    assert d["doc_kv_hit_rate"] == 0.5 and d["doc_kv_bytes_reused"] == 100 and d["gen_steps"] == 1
    assert RequestStats().as_dict()["doc_kv_hit_rate"] is None


def documented_requests() -> list[tuple[str, str, dict]]:
    """(document, endpoint, JSON body) of every ``curl ... /v1/... -d '{...}'`` in the README and docs/."""
    import json
    import re

    from ralm import constants as C

    pattern = re.compile(r"(/v1/ralm/generate|/v1/completions)\b(?:(?!curl\b).)*?-d '(\{.*?\})'", re.S)
    out = []
    for doc in [C.PACKAGE_ROOT / "README.md", *sorted((C.PACKAGE_ROOT / "docs").glob("*.md"))]:
        for endpoint, body in pattern.findall(doc.read_text()):
            out.append((doc.name, endpoint, json.loads(body)))
    return out


def test_every_documented_request_body_is_accepted():
    """The request bodies users copy from the docs pass the server's own validation (the
    pydantic request models and the job builder), so none of them answers with a 400."""
    from deployments.api import CompletionRequest

    bodies = documented_requests()
    assert {e for _, e, _ in bodies} == {"/v1/ralm/generate", "/v1/completions"}
    assert len(bodies) >= 5
    for _doc, endpoint, body in bodies:
        if endpoint == "/v1/completions":
            b = CompletionRequest.model_validate(body)
            build_job(b, b.prompt, b.max_tokens, "max_tokens", None, features=ALL_ON, **SERVER)
        else:
            job(body)
