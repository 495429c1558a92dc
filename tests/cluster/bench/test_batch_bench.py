"""``ralmspec bench batching`` end to end on the project's model (tiny settings)."""

from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench.batch_bench import ARMS, add_batch_bench_args, batch_bench_main

pytestmark = pytest.mark.unit


def test_bench_batching_runs_every_arm_and_checks_every_request(tmp_path):
    p = argparse.ArgumentParser()
    add_batch_bench_args(p)
    args = p.parse_args(
        ["--concurrency", "1,3", "--new-tokens", "6", "--stride", "4", "--context", "40", "--reps", "2"]
        + ["--out", str(tmp_path)]
    )
    assert batch_bench_main(args) == 0  # every batched / session arm equal to the request alone
    data = json.loads((tmp_path / "bench-batching.json").read_text())
    rows = data["rows"]
    assert {(r["concurrency"], r["arm"]) for r in rows} == {(c, a) for c in (1, 3) for a in ARMS}
    for r in rows:
        assert r["tokens"] == 6 * r["requests"] and r["tokens_per_s"] > 0
        if r["arm"] != "plain-serial":
            assert r["identical"] == r["requests"]
            assert r["host_ms_per_iteration"] > 0 and 0 < r["host_share"] < 1  # the loop around the forwards
        else:
            assert "host_share" not in r  # the plain engine has no batching loop
    cost = data["forward_cost"]
    assert cost["batch1"]["plain_ms"] > 0 and cost["batch16"]["invariant_tokens_per_s"] > 0
    md = (tmp_path / "bench-batching.md").read_text()
    assert "Machine:" in md and "(a) Forward cost" in md and "batching+sessions" in md and "host share" in md
