"""``ralmspec bench burst``'s measurement against the real HTTP app over the in-process backend
(no Ray: the bench's own accounting is what is tested; its run on the served topology is a
benchmark whose result is in docs/results/)."""

from __future__ import annotations

import argparse

from cluster.bench.burst_bench import _batching, measure_bursts, ray_rss_mib, to_markdown
from cluster.http_retry import RetryPolicy
from ralm.errors import Overloaded
from tests.cluster.bench.test_soak import QUESTIONS, DriftingBackend, live_app  # noqa: F401  (fixture)
from tests.deployments.test_ingress_http import InProcessBackend


def _args(**over):
    base = dict(model="scripted", num_questions=3, max_new_tokens=6, burst=12, burst_tokens=6, client_timeout=30.0)
    return argparse.Namespace(**{**base, **over})


class ShedFirst(InProcessBackend):
    """Sheds every request after the ``answer``-th with a Retry-After too long to wait out."""

    def __init__(self, answer: int):
        super().__init__()
        self.answer = answer

    def _result(self, job, on_commit=None):
        if len(self.jobs) >= self.answer:
            self.jobs.append(job)
            raise Overloaded("full", 3600.0)
        return super()._result(job, on_commit)


def test_a_healthy_server_answers_every_burst_identically(live_app):  # noqa: F811
    r = measure_bursts(live_app(InProcessBackend()), QUESTIONS, _args())
    assert r["wrong_or_lost"] == 0 and r["startup_to_first_answer_s"] > 0
    assert [b["identical"] for b in r["bursts"]] == [3, 3]
    assert all(b["throughput_ratio"] > 0 for b in r["bursts"])
    bb = r["big_burst"]
    assert (bb["answered"], bb["shed"], bb["lost_or_failed"], bb["wrong"]) == (12, 0, 0, 0)
    md = to_markdown(r)
    assert "| first burst |" in md and "answered 12, shed 0, lost or failed 0, wrong 0" in md


def test_wrong_answers_and_sheds_are_counted(live_app):  # noqa: F811
    r = measure_bursts(live_app(DriftingBackend(drift_after=5)), QUESTIONS, _args(burst=0))
    assert r["wrong_or_lost"] > 0 and min(b["identical"] for b in r["bursts"]) < 3
    # 1 first answer + 3 alone + 2 x 3 bursts + 3 references = 13 answered; the big burst is shed
    quick = RetryPolicy(max_retries=1, max_delay_s=0.01)
    r = measure_bursts(live_app(ShedFirst(answer=13)), QUESTIONS, _args(), retry=quick)
    bb = r["big_burst"]
    assert bb["answered"] == 0 and bb["shed"] == 12 and bb["lost_or_failed"] == 0 and r["wrong_or_lost"] == 0


def test_batching_is_measured_between_two_stats_answers():
    before = {
        "generator": {"batching": {"iterations": 10, "mean_batch": 1.0}},
        "verifiers": {"edr": {"batches": 4, "submissions": 4}},
    }
    after = {
        "generator": {"batching": {"iterations": 20, "mean_batch": 3.0}},
        "verifiers": {"edr": {"batches": 6, "submissions": 20}},
    }
    out = _batching(before, after)
    assert out["generator_mean_batch"] == (60 - 10) / 10 and out["verifier_edr_mean_batch"] == 16 / 2
    assert _batching(after, after)["generator_mean_batch"] is None
    assert ray_rss_mib() >= 0
