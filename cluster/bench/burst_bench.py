"""``ralmspec bench burst``: how a freshly started server takes bursts, and what they cost in memory.

    ralmspec bench burst [--model demo] [-n 16] [--burst 256] [--max-new-tokens 64] [--out DIR]

On one server started here (the repository's serve config, the demo model unless
``--model``), in this order:

1. **start-up**: seconds from starting Ray and the app to the first answer;
2. **one at a time**: ``-n`` RaLMSeq requests sent one after another (the reference answers);
3. **first burst**: the same ``-n`` requests all at once, on the server as it came up (no
   warm-up burst before it), then a **second burst** of them; each burst's throughput is
   reported against one at a time (ratio of wall times), and every answer must equal the
   reference;
4. **big burst**: ``--burst`` requests at once (RaLMSeq and PSA mixed, ``--burst-tokens``
   each, ``--client-timeout`` per request, a shed answer retried after its Retry-After as a
   real client does): answered, shed (still refused after the retries) and lost or wrong
   (none allowed), and the peak summed RSS of the Ray processes sampled meanwhile.

Coordinator memory is taken from ``/v1/ralm/stats`` (each coordinator host's peak RSS) before
and after the big burst: the growth divided by the requests in flight is the memory per
extra request. The generator's and verifiers' batching statistics show whether the
requests of a burst stepped together (mean sequences per generator iteration, queries per
verifier batch). Writes ``burst.json`` and ``burst.md``; exit status 1 if an answer was
wrong or lost.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean

import httpx

from cluster.flags import MODEL_OR_DEMO, SHARED, Default, add_shared
from cluster.http_retry import DEFAULT_POLICY, RetryPolicy, send_with_retry
from cluster.report import machine_note, table, write_report
from cluster.serve import DEFAULT_SERVE_CONFIG, apply_overrides, load_serve_config, start_local_app
from ralm import constants as C
from ralm.corpus import load_questions

RAY_PROCESS_MARKERS = ("ray::", "raylet", "gcs_server", "ray/dashboard", "log_monitor", "ray_client_server")


def add_burst_bench_args(p: argparse.ArgumentParser) -> None:
    add_shared(
        p,
        model=Default("demo", help="the started server's " + MODEL_OR_DEMO),
        serve_config=None,
        port=Default(8000, help="HTTP port of the server started here"),
        questions=None,
        num_questions=Default(16, help="requests of the small bursts"),
        max_new_tokens=Default(64, help=SHARED["max_new_tokens"].help + ", small bursts"),
    )
    p.add_argument("--burst", type=int, default=256, help="requests of the big burst (0: skip it)")
    p.add_argument("--burst-tokens", type=int, default=32, help="tokens per request of the big burst")
    p.add_argument("--client-timeout", type=float, default=120.0, help="per-request client timeout (s), big burst")
    add_shared(p, out=Path("bench-out/burst"))


def ray_rss_mib() -> float:
    """Summed resident memory of this machine's Ray processes (workers, raylet, GCS), MiB."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not any(m in cmd for m in RAY_PROCESS_MARKERS):
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:  # the process ended meanwhile
            continue
    return total / 1024


class RssSampler:
    """Samples :func:`ray_rss_mib` every ``period_s`` in a thread; ``peak`` is the largest."""

    def __init__(self, period_s: float = 0.5):
        self.period_s, self.peak, self._stop = period_s, 0.0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, ray_rss_mib())
            self._stop.wait(self.period_s)

    def __enter__(self) -> RssSampler:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def _post(http: httpx.Client, body: dict, retry: RetryPolicy = DEFAULT_POLICY) -> tuple[str, list[int] | None, float]:
    """(outcome, tokens, seconds): ``ok``, ``shed`` (503/429 after the retries) or ``error``."""
    t0 = time.perf_counter()
    try:
        res = send_with_retry(lambda: http.post("/v1/ralm/generate", json=body), retry)
    except httpx.HTTPError as e:
        return f"error: {type(e).__name__}", None, time.perf_counter() - t0
    r = res.response
    dt = time.perf_counter() - t0
    if r.status_code == 200:
        return "ok", r.json()["tokens"], dt
    if r.status_code in (429, 503) and "retry-after" in r.headers:
        return "shed", None, dt
    return f"error: HTTP {r.status_code}", None, dt


def _at_once(
    url: str, bodies: list[dict], timeout: float, retry: RetryPolicy = DEFAULT_POLICY
) -> tuple[list[tuple[str, list[int] | None, float]], float]:
    local = threading.local()

    def one(body: dict):
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=url, timeout=timeout)
        return _post(local.http, body, retry)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(bodies)) as ex:
        out = list(ex.map(one, bodies))
    return out, time.perf_counter() - t0


def _counters(stats: dict) -> dict:
    """The cumulative batching counters of /v1/ralm/stats: generator iterations and the
    sequences they carried, and per verifier its batches and submissions."""
    gen = (stats.get("generator") or {}).get("batching") or {}
    it = gen.get("iterations", 0)
    out = {"gen_iterations": it, "gen_sequences": gen.get("mean_batch", 0.0) * it}
    for kind, v in (stats.get("verifiers") or {}).items():
        out[f"{kind}_batches"] = v.get("batches", 0)
        out[f"{kind}_submissions"] = v.get("submissions", 0)
    return out


def _batching(before: dict, after: dict) -> dict:
    """Mean sequences per generator iteration and submissions per verifier batch between two
    /v1/ralm/stats answers (how well the requests of a burst stepped together)."""
    a, b = _counters(before), _counters(after)
    d = {k: b.get(k, 0) - a.get(k, 0) for k in b}
    out = {"generator_mean_batch": d["gen_sequences"] / d["gen_iterations"] if d["gen_iterations"] else None}
    for kind in {k.rsplit("_", 1)[0] for k in d if k.endswith("_batches")}:
        n = d[f"{kind}_batches"]
        out[f"verifier_{kind}_mean_batch"] = d[f"{kind}_submissions"] / n if n else None
    return out


def run_burst_bench(args: argparse.Namespace) -> dict:
    """Start the server here (``--model`` on the serve config), measure, shut it down."""
    from ray import serve  # lazy: the measurement itself (measure_bursts) runs against any URL without Ray

    questions = load_questions(args.questions) if args.questions else load_questions(C.DEMO_QUESTIONS)
    ns = argparse.Namespace(port=args.port, model=args.model, serve_config=args.serve_config)
    data = apply_overrides(load_serve_config(args.serve_config or DEFAULT_SERVE_CONFIG), ns)
    t0 = time.perf_counter()
    url = start_local_app(data)
    try:
        return measure_bursts(url, questions, args, started=t0)
    finally:
        serve.shutdown()


def measure_bursts(
    url: str,
    questions: list[str],
    args: argparse.Namespace,
    started: float | None = None,
    retry: RetryPolicy = DEFAULT_POLICY,
) -> dict:
    """Every measurement of the module docstring against the server at ``url`` (``started``:
    ``time.perf_counter()`` when it was started, for the start-up time; ``retry``: how the
    big burst's clients retry a shed answer)."""
    qs = [questions[i % len(questions)] for i in range(args.num_questions)]
    report: dict = {"machine": machine_note(), "model": args.model, "requests": args.num_questions}
    t0 = time.perf_counter() if started is None else started
    http = httpx.Client(base_url=url, timeout=900)
    body = lambda q, n=args.max_new_tokens, **kw: {"question": q, "method": "seq", "max_new_tokens": n, **kw}  # noqa: E731
    outcome, _, _ = _post(http, body(qs[0]))
    report["startup_to_first_answer_s"] = time.perf_counter() - t0
    if outcome != "ok":
        raise RuntimeError(f"the first request failed: {outcome}")

    t1 = time.perf_counter()
    ref = []
    for q in qs:
        outcome, toks, _ = _post(http, body(q))
        if outcome != "ok":
            raise RuntimeError(f"a request sent alone failed: {outcome}")
        ref.append(toks)
    alone_s = time.perf_counter() - t1
    report["one_at_a_time_s"] = alone_s

    bursts = []
    for name in ("first burst", "second burst"):
        st0 = http.get("/v1/ralm/stats").json()
        out, wall = _at_once(url, [body(q) for q in qs], 900)
        st = http.get("/v1/ralm/stats").json()
        same = sum(o == "ok" and toks == r for (o, toks, _), r in zip(out, ref))
        bursts.append(
            {
                "name": name,
                "wall_s": wall,
                "throughput_ratio": alone_s / wall,
                "identical": same,
                "requests": len(qs),
                "mean_latency_s": fmean(dt for _, _, dt in out),
                "pool": st["pool"],
                **_batching(st0, st),
            }
        )
    report["bursts"] = bursts

    wrong = sum(b["requests"] - b["identical"] for b in bursts)
    if args.burst:
        mix = [
            body(
                questions[i % len(questions)], args.burst_tokens, **({"spec": "PSA", "method": "spec"} if i % 2 else {})
            )
            for i in range(args.burst)
        ]
        refs = {}
        for b in mix:  # the reference of each distinct question: RaLMSeq alone (PSA must equal it)
            if b["question"] not in refs:
                refs[b["question"]] = _post(http, body(b["question"], args.burst_tokens))[1]
        before = http.get("/v1/ralm/stats").json()  # after the references: the burst's own batching
        coord_before = (before.get("coordinators") or {}).get("rss_mib", 0.0)
        rss_idle = ray_rss_mib()
        with RssSampler() as rss:
            out, wall = _at_once(url, mix, args.client_timeout, retry)
        after = http.get("/v1/ralm/stats").json()
        coords = after.get("coordinators") or {}
        answered = [(b, o) for b, o in zip(mix, out) if o[0] == "ok"]
        bad = sum(toks != refs[b["question"]] for b, (_, toks, _) in answered)
        shed = sum(o[0] == "shed" for o in out)
        lost = len(out) - len(answered) - shed
        wrong += bad + lost
        report["big_burst"] = {
            "requests": args.burst,
            "tokens": args.burst_tokens,
            "client_timeout_s": args.client_timeout,
            "wall_s": wall,
            "answered": len(answered),
            "shed": shed,
            "lost_or_failed": lost,
            "wrong": bad,
            "errors": sorted({o[0] for o in out if o[0].startswith("error")}),
            "ray_rss_idle_mib": rss_idle,
            "ray_rss_peak_mib": rss.peak,
            "coordinator_hosts": coords.get("hosts", 0),
            "coordinator_rss_before_mib": coord_before,
            "coordinator_rss_peak_mib": coords.get("rss_mib", 0.0),
            "coordinator_mib_per_request": (coords.get("rss_mib", 0.0) - coord_before) / max(1, args.burst),
            "pool": after["pool"],
            **_batching(before, after),
        }
    report["wrong_or_lost"] = wrong
    return report


def to_markdown(r: dict) -> str:
    lines = [
        f"# ralmspec bench burst: model {r['model']}, {r['requests']} RaLMSeq requests",
        "",
        r["machine"],
        "",
        f"Start-up to the first answer: {r['startup_to_first_answer_s']:.1f} s; "
        f"{r['requests']} requests one at a time: {r['one_at_a_time_s']:.1f} s.",
        "",
    ]

    def num(v):
        return "-" if v is None else f"{v:.1f}"

    lines += table(
        [
            "burst",
            "wall (s)",
            "vs one at a time",
            "identical",
            "mean latency (s)",
            "gen. mean batch",
            "verifier mean batch",
        ],
        [
            [
                b["name"],
                f"{b['wall_s']:.1f}",
                f"x{b['throughput_ratio']:.2f}",
                f"{b['identical']}/{b['requests']}",
                f"{b['mean_latency_s']:.1f}",
                num(b["generator_mean_batch"]),
                ", ".join(f"{k.split('_')[1]} {num(v)}" for k, v in b.items() if k.startswith("verifier_")),
            ]
            for b in r["bursts"]
        ],
        "lrrrrrl",
    )
    bb = r.get("big_burst")
    if bb:
        lines += [
            "",
            f"Big burst: {bb['requests']} requests at once ({bb['tokens']} tokens, RaLMSeq and PSA mixed, "
            f"{bb['client_timeout_s']:g} s client timeout) in {bb['wall_s']:.1f} s: answered {bb['answered']}, "
            f"shed {bb['shed']}, lost or failed {bb['lost_or_failed']}, wrong {bb['wrong']}. Ray processes' summed "
            f"RSS {bb['ray_rss_idle_mib']:.0f} MiB idle, {bb['ray_rss_peak_mib']:.0f} MiB peak; coordinator hosts "
            f"{bb['coordinator_hosts']}, their RSS {bb['coordinator_rss_before_mib']:.0f} -> "
            f"{bb['coordinator_rss_peak_mib']:.0f} MiB ({bb['coordinator_mib_per_request']:.2f} MiB per request).",
        ]
    return "\n".join(lines) + "\n"


def burst_bench_main(args: argparse.Namespace) -> int:
    r = run_burst_bench(args)
    paths = write_report(args.out, "burst", r, to_markdown(r))
    print(to_markdown(r))
    print("wrote " + ", ".join(map(str, paths)), file=sys.stderr)
    return 1 if r["wrong_or_lost"] else 0
