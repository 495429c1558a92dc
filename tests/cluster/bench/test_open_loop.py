"""The open-loop load generator's parts that need no server (cluster/bench/open_loop.py):
Poisson schedules, the figures of a run, the capacity rule, and clear errors for bad input."""

from __future__ import annotations

import socket
from statistics import fmean

import pytest

from cluster.bench.open_loop import (
    Outcome,
    arrival_times,
    capacity,
    check_fits,
    check_server,
    parse_rates,
    summarize,
)
from cluster.bench.served_bench import add_served_bench_args, served_bench_main


def _args(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_served_bench_args(p)
    return p.parse_args(argv)


def test_arrivals_are_poisson_at_the_rate_and_the_same_for_every_method():
    times = arrival_times(4000, 2.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert fmean(gaps) == pytest.approx(0.5, rel=0.05)  # exponential gaps of mean 1 / rate
    cv = (fmean([(g - fmean(gaps)) ** 2 for g in gaps]) ** 0.5) / fmean(gaps)
    assert cv == pytest.approx(1.0, rel=0.1)  # an exponential's coefficient of variation is 1
    assert arrival_times(50, 2.0) == arrival_times(50, 2.0)  # the same schedule for every method
    assert arrival_times(50, 2.0) != arrival_times(50, 3.0)


@pytest.mark.parametrize("text", ["0", "-1", "0.5,0", "abc", ""])
def test_a_rate_of_zero_or_less_or_not_a_number_is_refused(text):
    with pytest.raises(ValueError, match="--rate"):
        parse_rates(text)
    assert parse_rates("0.25, 1,2") == [0.25, 1.0, 2.0]


def test_a_duration_that_cannot_fit_the_requests_is_refused():
    with pytest.raises(ValueError, match="cannot fit 20 requests at 0.5 requests/s"):
        check_fits(20, [2.0, 0.5], duration_s=30.0)
    with pytest.raises(ValueError, match="--duration must be above 0"):
        check_fits(20, [2.0], duration_s=0)
    check_fits(20, [2.0], duration_s=60.0)  # 10 s of arrivals fit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_server_at_the_url_is_a_clear_error(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ConnectionError, match=f"no ralmspec server answers at {url}"):
        check_server(url, timeout_s=2.0)
    # the command says so in one line, before any request
    args = _args(["--url", url, "--rate", "1", "-n", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no ralmspec server answers"):
        served_bench_main(args)
    args = _args(["--url", url, "--rate", "0", "-n", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="every rate must be above 0"):
        served_bench_main(args)
    args = _args(["--url", url, "--rate", "0.1", "-n", "8", "--duration", "10", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="cannot fit 8 requests"):
        served_bench_main(args)


def test_a_runs_figures_count_shed_lost_identical_and_goodput():
    outs = [
        Outcome(0.0, "ok", 1.0, 0.2, [1, 2]),
        Outcome(0.5, "ok", 2.0, 0.4, [3]),
        Outcome(1.0, "ok", 4.0, 0.3, [4]),  # answered after the SLO
        Outcome(1.5, "shed", error="HTTP 503"),
        Outcome(2.0, "lost", error="unanswered at the run's bound"),
    ]
    s = summarize(outs, [[1, 2], [3], [9], [5], [6]], slo_s=2.5)
    assert (s["requests"], s["ok"], s["shed"], s["lost"], s["identical"]) == (5, 3, 1, 1, 2)
    span = 5.0  # first arrival (0) to the last answer (1.0 + 4.0)
    assert s["throughput_rps"] == pytest.approx(3 / span) and s["goodput_rps"] == pytest.approx(2 / span)
    assert s["p50_s"] == 2.0 and s["p99_s"] == pytest.approx(3.96) and s["ttft_p50_s"] == 0.3
    assert s["errors"] == ["HTTP 503", "unanswered at the run's bound"]


def test_capacity_is_the_highest_rate_under_three_times_the_lone_latency():
    rows = [
        {"rate": 2.0, "p99_s": 2.9, "ok": 8, "requests": 8},
        {"rate": 0.5, "p99_s": 1.5, "ok": 8, "requests": 8},
        {"rate": 1.0, "p99_s": 2.5, "ok": 8, "requests": 8},
        {"rate": 4.0, "p99_s": 30.0, "ok": 8, "requests": 8},
    ]
    assert capacity(rows, lone_s=1.0) == 2.0
    assert capacity(rows, lone_s=0.4) is None  # not even the lowest rate
    # one bound for every method (the SLO goodput counts): factor 1 makes lone_s the bound itself
    assert capacity(rows, lone_s=2.6, factor=1.0) == 1.0 and capacity(rows, lone_s=3.0, factor=1.0) == 2.0
    rows[1]["ok"] = 7  # a lost request at the lowest rate: no rate is sustained
    assert capacity(rows, lone_s=1.0) is None
