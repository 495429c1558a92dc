"""Serving metrics on Ray's Prometheus endpoint, after real HTTP requests, with the names and
labels k8s/grafana-dashboard.json queries."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from ralm.config import RequestConfig
from tests.deployments.serving import app_args, free_port, serve_app

REQ = RequestConfig(max_new_tokens=24, generation_stride=4)
KINDS = ("edr",)
DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana-dashboard.json"
EXPECTED = {  # exported family -> labels the dashboard uses
    "ray_ralmspec_request_latency_seconds": {"retriever", "method"},
    "ray_ralmspec_kb_calls": {"retriever"},
    "ray_ralmspec_cache_hit_rate": {"retriever"},
    "ray_ralmspec_rollbacks": {"retriever"},
    "ray_ralmspec_gamma": {"retriever"},
    "ray_ralmspec_verifier_batch_size": {"retriever"},
    "ray_ralmspec_shard_latency_seconds": {"retriever", "shard"},
    "ray_ralmspec_generator_batch_size": set(),
    "ray_ralmspec_generator_tokens": set(),
    "ray_ralmspec_generator_busy_seconds": set(),
    "ray_ralmspec_generator_host_seconds": set(),
    "ray_ralmspec_stride_decisions": {"retriever", "reason"},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory, index_dirs, fixture_corpus, gen_model_dir, fixture_questions):
    from tests.actors.support import stop_ray

    mport = free_port()
    args = app_args(tmp_path_factory.mktemp("metrics-work"), index_dirs, fixture_corpus, gen_model_dir, KINDS, REQ)
    url = serve_app(args, metrics_export_port=mport)
    responses = []
    with httpx.Client(base_url=url, timeout=300) as client:
        for q in fixture_questions[:2]:
            for method, spec in (("seq", None), ("spec", "PSA")):
                body = {"question": q, "retriever": "edr", "method": method}
                if spec:
                    body["spec"] = spec
                r = client.post("/v1/ralm/generate", json=body)
                assert r.status_code == 200, r.text
                responses.append(r.json())
        yield {"url": url, "metrics_port": mport, "responses": responses}
    stop_ray()


def _scrape(port: int) -> dict:
    """family name -> list of (sample name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("ray_ralmspec_"):
            out[fam.name] = [(s.name, s.labels, s.value) for s in fam.samples]
    return out


@pytest.fixture(scope="module")
def metrics(served):
    """Scrape until every expected family is there (Ray exports every few seconds)."""
    deadline = time.time() + 90
    fams: dict = {}
    want_latency = len(served["responses"])
    while time.time() < deadline:
        try:
            fams = _scrape(served["metrics_port"])
        except OSError:
            fams = {}
        lat = sum(_values(fams, "ray_ralmspec_request_latency_seconds", "_count"))
        shards = [sum(_values(fams, "ray_ralmspec_shard_latency_seconds", "_count", shard=i)) for i in ("0", "1")]
        if set(EXPECTED) <= set(fams) and lat >= want_latency and min(shards) >= 1:
            break  # (each process exports on its own schedule: wait for all of them)
        time.sleep(2)
    return fams


def _values(fams, family, suffix="", **labels):
    return [
        v
        for n, lab, v in fams.get(family, [])
        if n == family + suffix and all(lab.get(k) == val for k, val in labels.items())
    ]


def test_every_dashboard_metric_is_exported_with_its_labels(metrics):
    missing = set(EXPECTED) - set(metrics)
    assert not missing, f"not exported: {sorted(missing)}; got {sorted(metrics)}"
    for fam, labels in EXPECTED.items():
        for _, lab, _ in metrics[fam]:
            assert labels <= set(lab), (fam, lab)


def test_request_latency_histogram(metrics, served):
    counts = _values(metrics, "ray_ralmspec_request_latency_seconds", "_count", retriever="edr")
    assert sum(counts) >= len(served["responses"])
    methods = {lab["method"] for n, lab, _ in metrics["ray_ralmspec_request_latency_seconds"]}
    assert {"seq", "spec[PSA]"} <= methods
    sums = _values(metrics, "ray_ralmspec_request_latency_seconds", "_sum", retriever="edr")
    assert sum(sums) > 0
    inf = _values(metrics, "ray_ralmspec_request_latency_seconds", "_bucket", retriever="edr", le="+Inf")
    assert sum(inf) == sum(counts)


def test_kb_calls_rollbacks_cache_and_gamma(metrics, served):
    kb = sum(_values(metrics, "ray_ralmspec_kb_calls", "_total", retriever="edr"))
    assert kb >= sum(r["stats"]["kb_calls"] for r in served["responses"]) > 0
    rb = sum(_values(metrics, "ray_ralmspec_rollbacks", "_total", retriever="edr"))
    assert rb >= sum(r["stats"]["rollbacks"] for r in served["responses"]) >= 0
    rates = _values(metrics, "ray_ralmspec_cache_hit_rate", "", retriever="edr", method="spec[PSA]")
    assert rates and all(0.0 <= v <= 1.0 for v in rates)
    gammas = _values(metrics, "ray_ralmspec_gamma", "", retriever="edr")
    assert gammas and all(0.0 <= v <= 1.0 for v in gammas)


def test_verifier_batches_and_shard_latency(metrics):
    batches = sum(_values(metrics, "ray_ralmspec_verifier_batch_size", "_count", retriever="edr"))
    assert batches >= 1
    # (Ray 2.60 computes a histogram's _sum from bucket midpoints, so it is only approximate)
    assert sum(_values(metrics, "ray_ralmspec_verifier_batch_size", "_sum", retriever="edr")) > 0
    le1 = sum(_values(metrics, "ray_ralmspec_verifier_batch_size", "_bucket", retriever="edr", le="1.0"))
    assert 0 <= le1 <= batches
    for shard in ("0", "1"):
        assert sum(_values(metrics, "ray_ralmspec_shard_latency_seconds", "_count", retriever="edr", shard=shard)) >= 1


def test_generator_batch_size_and_tokens(metrics, served):
    forwards = sum(_values(metrics, "ray_ralmspec_generator_batch_size", "_count"))
    assert forwards >= 1
    tokens = sum(_values(metrics, "ray_ralmspec_generator_tokens", "_total"))
    assert tokens > 0  # (each process exports on its own schedule: the count may trail the requests)
    assert sum(_values(metrics, "ray_ralmspec_generator_busy_seconds", "_total")) > 0
    assert sum(_values(metrics, "ray_ralmspec_generator_host_seconds", "_total")) > 0  # the loop around the forwards


def test_stride_decisions_are_counted_by_reason(metrics, served):
    """RaLMSpec's requests report why each stride was chosen, and the coordinator exports the
    counts by reason (the dashboard's stride-decisions panel)."""
    from ralm.stride.load_gate import REASONS

    spec = [r for r in served["responses"] if r["method"] != "seq"]
    assert spec and all(sum(r["stats"]["stride_reasons"].values()) >= 1 for r in spec)
    assert all(r["stats"]["stride_reasons"] == {} for r in served["responses"] if r["method"] == "seq")
    assert sum(_values(metrics, "ray_ralmspec_stride_decisions", "_total", retriever="edr")) > 0
    assert {lab["reason"] for _, lab, _ in metrics["ray_ralmspec_stride_decisions"]} <= set(REASONS)


def test_dashboard_queries_only_exported_metrics():
    """Every ray_ralmspec_* series the dashboard queries is one this module finds exported."""
    text = DASHBOARD.read_text()
    used = set(re.findall(r"ray_ralmspec_[a-z_]*[a-z]", text))
    exported = set()
    for fam in EXPECTED:
        exported |= {fam, fam + "_bucket", fam + "_count", fam + "_sum", fam + "_total"}
    assert used and used <= exported, sorted(used - exported)
    json.loads(text)
