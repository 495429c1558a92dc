"""``ralmspec served-bench --rate R1,R2,...``: open-loop load, latency versus arrival rate.

A closed-loop benchmark (a fixed number of requests in flight) slows its own arrivals when the
server slows down, so it never shows the rate at which latency explodes. Here requests arrive
as a Poisson process, whatever the server's state, as users' requests do:

- **Arrivals.** For each rate ``R`` (requests per second) the ``n`` questions arrive at
  exponential gaps of mean ``1/R``, from a seeded generator: every method meets the same
  schedule at a given rate. Each rate's run is bounded: ``--duration`` seconds after its start,
  a request still unanswered is cancelled and counted *lost*. The arrivals must fit that bound
  (``n / R`` at most ``--duration``), else the command refuses before any request.
- **Requests.** Every request is streamed (``POST /v1/completions``, ``stream: true``), so the
  client sees the *time to first token* (the first verified text) as well as the whole
  latency. A request answered 503 or 429 is *shed*: an open-loop client does not slow down,
  so it is not sent again. Any other failure is *lost*.
- **Lone requests.** Before the sweep, each method answers the questions one at a time: the
  lone latency (median) and, from RaLMSeq, the reference tokens. Every answer in the sweep is
  compared with that reference (*identical*).
- **Figures per method and rate.** p50 / p90 / p99 latency and time to first token,
  throughput (answered requests per second of the run), goodput (answered within the latency
  SLO, ``--slo`` seconds, default 3x RaLMSeq's lone latency), shed, lost, identical.
- **Capacity.** Per method, the highest rate whose p99 latency stays under 3x the method's
  lone latency, with nothing shed or lost.

Writes ``open_loop.json``, ``open_loop.md`` and ``open_loop.png`` (latency versus rate, every
method on the same axes) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from statistics import median

import httpx

from cluster.bench.open_loop_report import plot, to_markdown
from cluster.report import machine_note, write_report
from cluster.serve import DEFAULT_SERVE_CONFIG, apply_overrides, load_serve_config, start_local_app

SEED = 20261127
CAPACITY_FACTOR = 3.0  # a rate is sustained while p99 latency < this x the lone latency


def parse_rates(text: str) -> list[float]:
    """``"0.2,0.5,1"`` -> ``[0.2, 0.5, 1.0]``; every rate must be a number above 0."""
    rates = []
    for part in (x.strip() for x in str(text).split(",")):
        if not part:
            continue
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"--rate: {part!r} is not a number (requests per second)") from None
        if not r > 0:
            raise ValueError(f"--rate: every rate must be above 0 requests per second, got {part}")
        rates.append(r)
    if not rates:
        raise ValueError("--rate: give at least one rate (requests per second), e.g. --rate 0.2,0.5,1")
    return rates


def arrival_times(n: int, rate: float, seed: int = SEED) -> list[float]:
    """Seconds from the run's start at which ``n`` Poisson arrivals of ``rate`` per second
    come: the first at 0, then exponential gaps of mean ``1 / rate`` (seeded by the rate, so
    every method meets the same schedule).

    >>> arrival_times(3, 2.0)[0], len(arrival_times(3, 2.0)), arrival_times(3, 2.0) == arrival_times(3, 2.0)
    (0.0, 3, True)
    """
    rng = random.Random(f"{seed}:{rate!r}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def check_fits(n: int, rates: Sequence[float], duration_s: float) -> None:
    """Refuse a ``duration_s`` that cannot hold the arrivals of ``n`` requests at some rate:
    they take about ``n / rate`` seconds to arrive (the seeded schedule's own span is checked too)."""
    if duration_s <= 0:
        raise ValueError(f"--duration must be above 0 seconds, got {duration_s:g}")
    for r in rates:
        span = max(n / r, arrival_times(n, r)[-1])
        if span > duration_s:
            raise ValueError(
                f"--duration {duration_s:g} s cannot fit {n} requests at {r:g} requests/s: they take about "
                f"{span:.0f} s to arrive; raise --duration, lower -n or raise the rate"
            )


def check_server(url: str, timeout_s: float = 10.0) -> str:
    """The served model's id, or a clear error when no ralmspec server answers at ``url``."""
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ConnectionError(f"no ralmspec server answers at {url} ({type(e).__name__}: {e})") from None


@dataclass
class Outcome:
    """One request of an open-loop run."""

    arrival_s: float  # scheduled arrival, from the run's start
    status: str = "lost"  # ok | shed | lost
    latency_s: float | None = None  # arrival to the last chunk
    ttft_s: float | None = None  # arrival to the first chunk with text (None: no text came)
    tokens: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # the request's loop statistics (the ralm block)
    error: str = ""


def stream_once(http: httpx.Client, body: dict, timeout_s: float) -> Outcome:
    """Send one streamed completion and read it to its end, giving up ``timeout_s`` after
    sending it (closing the stream cancels the request on the server); the caller fills
    ``arrival_s``."""
    out = Outcome(arrival_s=0.0)
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    try:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}, timeout=timeout_s) as r:
            if r.status_code in (429, 503):
                out.status, out.error = "shed", f"HTTP {r.status_code}"
                return out
            if r.status_code != 200:
                r.read()
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            for line in r.iter_lines():
                if time.perf_counter() > deadline:
                    out.error = "unanswered at the run's bound"
                    return out
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = ev["error"]
                    out.status = "shed" if err.get("retry_after") is not None else "lost"
                    out.error = str(err.get("message", err))[:200]
                    return out
                if out.ttft_s is None and ev["choices"][0]["text"]:
                    out.ttft_s = time.perf_counter() - t0
                if "ralm" in ev:
                    out.tokens = list(ev["ralm"]["tokens"])
                    out.stats = ev["ralm"].get("stats", {})
            out.latency_s = time.perf_counter() - t0
            out.status = "ok" if out.stats or out.tokens else "lost"
    except (httpx.HTTPError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
    return out


def body_for(question: str, kind: str, method: str, spec: str | None, max_new: int, extra: dict) -> dict:
    """The streamed completion body of one request (greedy: the server's exact mode)."""
    return {
        "prompt": question,
        "retriever": kind,
        "method": method,
        "max_tokens": max_new,
        **({"spec": spec} if spec else {}),
        **extra,
    }


def run_rate(url: str, bodies: Sequence[dict], rate: float, duration_s: float) -> list[Outcome]:
    """One open-loop run: ``bodies[i]`` arrives at the i-th Poisson arrival of ``rate``; every
    request still unanswered ``duration_s`` after the start is given up (lost)."""
    times = arrival_times(len(bodies), rate)
    local = threading.local()
    start = time.perf_counter()

    def one(i: int) -> Outcome:
        c = getattr(local, "c", None)
        if c is None:
            c = local.c = httpx.Client(base_url=url.rstrip("/"))
        delay = start + times[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        left = start + duration_s - time.perf_counter()
        out = stream_once(c, bodies[i], max(left, 0.01)) if left > 0 else Outcome(arrival_s=0.0, error="not sent")
        out.arrival_s = times[i]
        if out.status == "lost" and not out.error:
            out.error = "unanswered at the run's bound"
        return out

    with ThreadPoolExecutor(max_workers=len(bodies)) as ex:
        return list(ex.map(one, range(len(bodies))))


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear-interpolated percentile (p in 0..100); None without values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([], 99)
    (2.5, None)
    """
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(outs: Sequence[Outcome], reference: Sequence[list[int]], slo_s: float) -> dict:
    """The figures of one (method, rate) run (see the module docstring). Throughput and
    goodput are per second of the run's span: first arrival to the last answer.

    >>> o = [Outcome(0.0, "ok", 1.0, 0.5, [1]), Outcome(1.0, "ok", 3.0, 1.0, [2]), Outcome(2.0, "shed")]
    >>> s = summarize(o, [[1], [9], [3]], slo_s=2.0)
    >>> s["ok"], s["shed"], s["lost"], s["identical"], s["throughput_rps"], s["goodput_rps"]
    (2, 1, 0, 1, 0.5, 0.25)
    """
    ok = [o for o in outs if o.status == "ok"]
    lats = [o.latency_s for o in ok if o.latency_s is not None]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    end = max((o.arrival_s + (o.latency_s or 0.0) for o in ok), default=0.0)
    span = max(end - min(o.arrival_s for o in outs), 1e-9) if outs else 1e-9
    within = sum(1 for o in ok if o.latency_s is not None and o.latency_s <= slo_s)
    stat_keys = ("steps", "kb_calls", "kb_queries", "rollbacks", "regenerated_tokens", "direct_steps")
    means = {
        f"mean_{k}": (sum(o.stats.get(k, 0) for o in ok) / len(ok)) if ok and any(k in o.stats for o in ok) else None
        for k in stat_keys
    }
    return {
        "requests": len(outs),
        "ok": len(ok),
        "shed": sum(o.status == "shed" for o in outs),
        "lost": sum(o.status == "lost" for o in outs),
        "identical": sum(o.status == "ok" and o.tokens == ref for o, ref in zip(outs, reference)),
        "p50_s": percentile(lats, 50),
        "p90_s": percentile(lats, 90),
        "p99_s": percentile(lats, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "throughput_rps": len(ok) / span,
        "goodput_rps": within / span,
        "errors": sorted({o.error for o in outs if o.error})[:5],
        **means,
    }


def capacity(rows: Sequence[dict], lone_s: float, factor: float = CAPACITY_FACTOR) -> float | None:
    """The highest rate of ``rows`` (one method's) whose p99 stays under ``factor`` x the lone
    latency with every request answered, and every lower rate too (None: not even the lowest).

    >>> rows = [{"rate": 0.5, "p99_s": 2.0, "ok": 8, "requests": 8}, {"rate": 1.0, "p99_s": 9.0, "ok": 8, "requests": 8}]
    >>> capacity(rows, lone_s=1.0)
    0.5
    """
    best = None
    for r in sorted(rows, key=lambda r: r["rate"]):
        if r["ok"] != r["requests"] or r["p99_s"] is None or r["p99_s"] >= factor * lone_s:
            break
        best = r["rate"]
    return best


@dataclass
class LoneRun:
    """One method's requests answered one at a time."""

    latencies: list[float]
    tokens: list[list[int]]

    @property
    def median_s(self) -> float:
        return median(self.latencies)


def lone_requests(url: str, bodies: Sequence[dict], timeout_s: float) -> LoneRun:
    """Answer ``bodies`` one at a time (streamed, as in the sweep); every one must succeed."""
    lats, toks = [], []
    with httpx.Client(base_url=url.rstrip("/")) as http:
        for b in bodies:
            o = stream_once(http, b, timeout_s)
            if o.status != "ok" or o.latency_s is None:
                raise RuntimeError(f"a lone request failed ({o.status}): {o.error}")
            lats.append(o.latency_s)
            toks.append(o.tokens)
    return LoneRun(lats, toks)


def run_open_loop(
    url: str,
    questions: Sequence[str],
    kind: str,
    methods: Sequence[tuple[str, str | None, str]],
    rates: Sequence[float],
    duration_s: float,
    max_new: int,
    slo_s: float | None = None,
    lone_n: int = 8,
    timeout_s: float = 900.0,
    extra: dict | None = None,
    progress: bool = True,
) -> dict:
    """The whole sweep; ``methods``: (method, spec config or None, label), RaLMSeq first.
    Returns ``{"lone": ..., "rows": ..., "capacity": ..., "slo_s": ...}``."""
    if not methods or methods[0][0] != "seq":
        raise ValueError("the open-loop sweep needs RaLMSeq (seq) first: it gives the reference answers")
    extra = dict(extra or {})
    bodies = {lab: [body_for(q, kind, m, s, max_new, extra) for q in questions] for m, s, lab in methods}
    lone: dict[str, dict] = {}
    reference: list[list[int]] = []
    for m, _, lab in methods:
        sample = bodies[lab] if m == "seq" else bodies[lab][: max(1, lone_n)]
        run = lone_requests(url, sample, timeout_s)  # RaLMSeq: every question, the reference
        if m == "seq":
            reference = run.tokens
        lone[lab] = {
            "median_s": run.median_s,
            "requests": len(run.latencies),
            "identical": sum(t == r for t, r in zip(run.tokens, reference)),
        }
        if progress:
            print(f"lone {lab}: median {run.median_s:.2f} s over {len(run.latencies)} requests", file=sys.stderr)
    slo = slo_s if slo_s is not None else CAPACITY_FACTOR * lone[methods[0][2]]["median_s"]
    rows = []
    for rate in rates:
        for _, _, lab in methods:
            t0 = time.perf_counter()
            outs = run_rate(url, bodies[lab], rate, duration_s)
            row = {"method": lab, "rate": rate, "wall_s": time.perf_counter() - t0, **summarize(outs, reference, slo)}
            rows.append(row)
            if progress:
                p99 = "-" if row["p99_s"] is None else f"{row['p99_s']:.2f}s"
                print(
                    f"rate {rate:g}/s {lab:<12} ok {row['ok']}/{row['requests']} shed {row['shed']} lost {row['lost']} "
                    f"p99 {p99} identical {row['identical']}",
                    file=sys.stderr,
                )
    own = {lab: [r for r in rows if r["method"] == lab] for _, _, lab in methods}
    cap = {lab: capacity(own[lab], lone[lab]["median_s"]) for lab in own}
    # the same bound for every method (the SLO goodput counts against): an operator sizes a
    # deployment for the users' SLO; the per-method rule above holds a method that is faster
    # alone to a tighter bound
    cap_slo = {lab: capacity(own[lab], slo, factor=1.0) for lab in own}
    return {"lone": lone, "rows": rows, "capacity": cap, "capacity_at_slo": cap_slo, "slo_s": slo, "seed": SEED}


def open_loop_main(args, questions: list[str], methods: Sequence[tuple[str, str | None, str]]) -> int:
    """``served-bench --rate``: check the input, start the in-process server unless ``--url``,
    run the sweep, write the report; returns 1 if any answer differed from RaLMSeq's."""
    rates = parse_rates(args.rate)
    kinds = [k.strip() for k in args.retrievers.split(",") if k.strip()]
    if len(kinds) != 1:
        raise ValueError("--rate measures one retriever at a time: give one in --retrievers")
    duration = args.duration if args.duration is not None else max(60.0, 3.0 * len(questions) / min(rates))
    check_fits(len(questions), rates, duration)
    url, started_here = args.url, False
    if url:
        model = check_server(url)
    else:
        ns = argparse.Namespace(port=args.port, admin=True, pad_to=args.pad_to, retrievers=kinds[0])
        data = apply_overrides(load_serve_config(args.serve_config or DEFAULT_SERVE_CONFIG), ns)
        print("starting the server in-process...", file=sys.stderr)
        url, started_here = start_local_app(data), True
        model = check_server(url)
    notes = [machine_note() + ("" if started_here else " (this client's machine)")]
    if started_here and args.pad_to:
        notes.append(
            f"the EDR index was padded to {args.pad_to} rows with random vectors of norm 1e-3 "
            "(search cost of a Wikipedia-scale KB; results unchanged)"
        )
    try:
        result = run_open_loop(
            url,
            questions,
            kinds[0],
            methods,
            rates,
            duration,
            args.max_new_tokens,
            slo_s=args.slo,
            lone_n=args.lone,
            timeout_s=args.timeout,
            extra=getattr(args, "options", None),
        )
    finally:
        if started_here:
            from ray import serve  # lazy: only when this process started the server

            serve.shutdown()
    meta = {
        "url": url,
        "model": model,
        "retriever": kinds[0],
        "requests": len(questions),
        "max_new_tokens": args.max_new_tokens,
        "rates": rates,
        "duration_s": duration,
        "command": "ralmspec " + " ".join(sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    md = to_markdown(result, meta, notes)
    out = write_report(args.out, "open_loop", {"meta": meta, "notes": notes, **result}, md, indent=2)
    plot(result, out[0].with_suffix(".png"))
    print(md)
    bad = [r for r in result["rows"] if r["identical"] != r["ok"]]
    bad += [m for m, v in result["lone"].items() if v["identical"] != v["requests"]]
    if bad:
        print(f"error: {len(bad)} runs returned answers that differ from RaLMSeq", file=sys.stderr)
        return 1
    return 0


__all__ = [
    "LoneRun",
    "Outcome",
    "arrival_times",
    "capacity",
    "check_fits",
    "check_server",
    "open_loop_main",
    "parse_rates",
    "run_open_loop",
    "summarize",
]
