"""``ralmspec bench soak``: serve a mixed load for N minutes and watch for leaks and drift.

C client threads send requests back to back for ``--minutes``: RaLMSpec (PSA) and
RaLMSeq on every served retriever, whole and streamed answers, streams the client
abandons after the first chunk (a disconnect: the server must cancel and free the
request), and a few bad requests (which must get a 4xx). Every answer to the same
(question, retriever) must carry the same tokens, whatever the method, the load, or the
time: the exactness contract, checked on every request.

Every ``--interval`` seconds it samples, and writes to the report:

- success rate, p50 and p99 latency of the requests finished in the interval, and the
  retries of shed requests (a 503/429 with ``Retry-After`` is sent again after that delay,
  a bounded number of times, as a real client does: :mod:`cluster.http_retry`);
- the RSS and open file descriptors of every Ray actor and Serve replica on this machine
  (found by their process titles and read from ``/proc``), summed per actor class;
- the number of state-store keys when the server uses Redis (``--state-url``);
- the server's own counters (``/v1/ralm/stats``: pool waiting, rejected, cancelled).

The report (JSON, markdown, and a PNG of the series over time) ends with each process
class's RSS growth from the first sample after warm-up to the last.

Example::

    ralmspec bench soak --minutes 30 --concurrency 8 --out bench-out/soak
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.bench.soak_report import plot, to_markdown
from cluster.flags import SHARED, Default, add_shared
from cluster.http_retry import (
    Retried,
    RetryLog,
    call_with_retry,
    parse_retry_after,
    retry_after,
    send_with_retry,
    shed_reason,
)
from cluster.report import machine_note, write_report
from cluster.serve import DEFAULT_SERVE_CONFIG, app_entry, apply_overrides, load_serve_config, start_local_app
from ralm import constants as C
from ralm.corpus import load_questions

WARMUP_SAMPLES = 2  # growth is measured from the sample after these (caches fill first)


def add_soak_args(p: argparse.ArgumentParser) -> None:
    add_shared(p, minutes=Default(30.0, help="how long to serve the load, in minutes"))
    add_shared(p, concurrency=Default(8, help="client threads (requests in flight)"))
    p.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    add_shared(
        p,
        url=Default(help=SHARED["url"].help + " on this machine"),
        port=Default(8000, help="HTTP port of the in-process server"),
        retrievers=Default("edr,sr", help=SHARED["retrievers"].help + ": served and queried"),
        max_new_tokens=32,
        state_url=Default(help="the in-process server's state store, whose keys are counted: redis://..."),
        pad_to=0,
        seed=0,
        out=Path("bench-out/soak"),
    )


# ---------------------------------------------------------------------- the load
KINDS_OF_REQUEST = (  # (name, weight)
    ("spec", 45),
    ("seq", 20),
    ("stream", 15),
    ("abandon", 12),
    ("bad", 8),
)


class Recorder:
    """Finished requests (thread-safe) and the first answer per (question, retriever)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[float, str, str, float]] = []  # (t_end, kind, outcome, latency_s)
        self.answers: dict[tuple[str, str], list[int]] = {}
        self.mismatches: list[dict] = []
        self.retry_times: list[float] = []  # when each retry of a shed request was decided
        self.retries = RetryLog()

    def add(self, kind: str, outcome: str, latency: float) -> None:
        with self.lock:
            self.events.append((time.time(), kind, outcome, latency))

    def retried(self, res: Retried) -> None:
        """A request's sends: its retries (a shed answer, 503/429 with Retry-After, sent again)."""
        self.retries.add(res)
        if res.retries:
            with self.lock:
                self.retry_times += [time.time()] * res.retries

    def check(self, question: str, kind: str, tokens: list[int], how: str) -> bool:
        with self.lock:
            ref = self.answers.setdefault((question, kind), list(tokens))
            if ref != list(tokens):
                self.mismatches.append({"question": question, "retriever": kind, "how": how})
                return False
            return True


def _stream_attempt(http, comp: dict) -> Callable[[], tuple[Any, list[int] | None, float | None]]:
    """One streamed completion: (response, the answer's tokens or None, the delay of an
    ``overloaded`` error event (a stream shed after it started) or None)."""

    def attempt():
        with http.stream("POST", "/v1/completions", json=comp) as r:
            if r.status_code != 200:
                r.read()
                return r, None, None
            toks, shed = None, None
            for line in r.iter_lines():
                if line.startswith("data: {") and '"ralm"' in line:
                    toks = json.loads(line[6:])["ralm"]["tokens"]
                shed = _overloaded_delay(line) if shed is None else shed
            return r, toks, shed

    return attempt


def _overloaded_delay(line: str) -> float | None:
    """The ``retry_after`` of a stream's ``overloaded`` error event (the stream was shed
    after it started), else None."""
    if not (line.startswith("data: {") and '"error"' in line):
        return None
    err = json.loads(line[6:]).get("error") or {}
    if err.get("code") != "overloaded" or err.get("retry_after") is None:
        return None
    return parse_retry_after(str(err["retry_after"]))


def _stream_delay(out: tuple) -> float | None:
    """The delay before sending a shed stream again (503/429 with Retry-After, or its
    ``overloaded`` event), None for an answer to keep; ``out`` is (response, ..., event delay)."""
    r, shed = out[0], out[-1]
    return retry_after(r) if r.status_code != 200 else shed


def _stream_reason(out: tuple) -> str:
    r = out[0]
    return shed_reason(r) if r.status_code != 200 else "stream ended with an overloaded event"


def _one(http, rec: Recorder, rng: random.Random, questions: list[str], kinds: list[str], max_new: int) -> None:
    """One request of a random kind, sent as a real client sends it: a shed answer (503/429
    with Retry-After, or a stream's ``overloaded`` event) is retried after that delay, a
    bounded number of times (:mod:`cluster.http_retry`); still shed after that, it counts
    as its status (``http_503``)."""
    what = rng.choices([k for k, _ in KINDS_OF_REQUEST], [w for _, w in KINDS_OF_REQUEST])[0]
    q, kind = rng.choice(questions), rng.choice(kinds)
    body = {"question": q, "retriever": kind, "max_new_tokens": max_new}
    t0 = time.perf_counter()
    try:
        if what in ("spec", "seq"):
            body.update({"method": what} if what == "seq" else {"method": "spec", "spec": "PSA"})
            res = send_with_retry(lambda: http.post("/v1/ralm/generate", json=body))
            rec.retried(res)
            r = res.response
            ok = r.status_code == 200 and rec.check(q, kind, r.json()["tokens"], what)
            outcome = "ok" if ok else ("wrong" if r.status_code == 200 else f"http_{r.status_code}")
        elif what == "stream":
            comp = {"prompt": q, "retriever": kind, "max_tokens": max_new, "stream": True, "spec": "PSA"}
            sres = call_with_retry(_stream_attempt(http, comp), _stream_delay, reason_of=_stream_reason)
            rec.retried(sres)
            r, toks, _ = sres.response
            outcome = "no_result" if r.status_code == 200 else f"http_{r.status_code}"
            if toks is not None:
                outcome = "ok" if rec.check(q, kind, toks, "stream") else "wrong"
        elif what == "abandon":
            comp = {"prompt": q, "retriever": kind, "max_tokens": max_new, "stream": True, "method": "seq"}

            def abandon() -> tuple[Any, str, float | None]:
                with http.stream("POST", "/v1/completions", json=comp) as r:
                    if r.status_code == 200:
                        for line in r.iter_lines():  # got the first event; leave
                            return r, "ok", _overloaded_delay(line)
                    else:
                        r.read()
                    return r, "http_error", None

            ares = call_with_retry(abandon, _stream_delay, reason_of=_stream_reason)
            rec.retried(ares)
            outcome = ares.response[1]
        else:
            bad = rng.choice(
                [
                    {"question": "", "retriever": kind},
                    {"question": q, "retriever": "nope"},
                    {"question": q, "max_new_tokens": -1},
                    {"question": q, "spec": {"stride": "x"}},
                ]
            )
            res = send_with_retry(lambda: http.post("/v1/ralm/generate", json=bad))
            rec.retried(res)
            r = res.response
            outcome = "ok" if 400 <= r.status_code < 500 else f"http_{r.status_code}"
    except Exception as e:  # a connection error or a timeout: lost
        outcome = f"exc_{type(e).__name__}"
    rec.add(what, outcome, time.perf_counter() - t0)


def _client_loop(url: str, rec: Recorder, stop: threading.Event, seed: int, questions, kinds, max_new: int) -> None:
    import httpx

    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=600) as http:
        while not stop.is_set():
            _one(http, rec, rng, questions, kinds, max_new)


# ---------------------------------------------------------------------- sampling
def _proc_rss_fds(pid: int) -> tuple[float, int] | None:
    """(RSS in MiB, open file descriptors) of a process on this machine, from /proc."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            rss_kb = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        return rss_kb / 1024.0, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None


def _actor_processes() -> dict[str, list[int]]:
    """Process class -> pids on this machine: every Ray worker (its title is ``ray::<Class>``
    or ``ray::<Class>.<method>``; Serve replicas ``ray::ServeReplica:<app>:<Deployment>``),
    plus the raylet and the GCS server. Read from ``/proc``, so it needs no dashboard."""
    out: dict[str, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        title = argv[0].decode("utf-8", "replace") if argv else ""
        if title.startswith("ray::"):
            name = title[5:].split(" ", 1)[0].split(".", 1)[0]
            if name.startswith("ServeReplica:"):
                name = name.split(":")[-1]
            if name and name != "IDLE":
                out[name].append(int(d))
        elif title.endswith(("/raylet", "/gcs_server")):
            out[title.rsplit("/", 1)[1]].append(int(d))
    return out


def _redis_keys(url: str | None) -> tuple[int | None, int | None]:
    """(all keys, request checkpoints) in the state store's Redis; (None, None) without one.

    Checkpoints (``<prefix>:ckpt:<request id>``) must not pile up: a finished or cancelled
    request deletes its own, so their count stays near the number of requests in flight.
    """
    if not url:
        return None, None
    try:
        import redis

        r = redis.Redis.from_url(url)
        ckpts = sum(1 for _ in r.scan_iter(match="*:ckpt:*", count=1000))
        return int(r.dbsize()), ckpts
    except Exception:
        return None, None


def sample(url_stats, state_url: str | None) -> dict:
    procs = {}
    for cls, pids in _actor_processes().items():
        vals = [v for v in (_proc_rss_fds(p) for p in pids) if v is not None]
        procs[cls] = {
            "n": len(vals),
            "rss_mib": round(sum(v[0] for v in vals), 1),
            "fds": sum(v[1] for v in vals),
        }
    driver = _proc_rss_fds(os.getpid())
    keys, ckpts = _redis_keys(state_url)
    return {
        "t": time.time(),
        "processes": procs,
        "driver_rss_mib": round(driver[0], 1) if driver else None,
        "redis_keys": keys,
        "redis_checkpoints": ckpts,
        "server": url_stats(),
    }


def _percentile(vals: list[float], p: float) -> float | None:
    if not vals:
        return None
    s = sorted(vals)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def window_stats(events: list[tuple[float, str, str, float]], t0: float, t1: float) -> dict:
    """Success rate and p50/p99 latency of whole answers (spec, seq, stream) in [t0, t1)."""
    win = [e for e in events if t0 <= e[0] < t1]
    lat = [e[3] for e in win if e[2] == "ok" and e[1] in ("spec", "seq", "stream")]
    ok = sum(1 for e in win if e[2] == "ok")
    return {
        "requests": len(win),
        "ok": ok,
        "success_rate": round(ok / len(win), 4) if win else None,
        "p50_s": _percentile(lat, 50),
        "p99_s": _percentile(lat, 99),
    }


# ---------------------------------------------------------------------- run
def run_soak(url: str, args, questions: list[str], kinds: list[str]) -> dict:
    import httpx

    rec = Recorder()
    stop = threading.Event()

    def stats():
        try:
            s = httpx.get(url + "/v1/ralm/stats", timeout=30).json()
            pool = s.get("pool") or {}
            return {k: pool.get(k) for k in ("size", "waiting", "rejected", "cancelled")} | {
                "errors": s.get("errors"),
                "timeouts": s.get("timeouts"),
            }
        except Exception as e:
            return {"error": type(e).__name__}

    threads = [
        threading.Thread(
            target=_client_loop,
            args=(url, rec, stop, args.seed * 1000 + i, questions, kinds, args.max_new_tokens),
            daemon=True,
        )
        for i in range(args.concurrency)
    ]
    start = time.time()
    samples = [sample(stats, args.state_url) | window_stats([], 0, 0)]
    for t in threads:
        t.start()
    end = start + args.minutes * 60
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=round(args.minutes * 60), desc="soak", unit="s")
        last = start
        while time.time() < end:
            time.sleep(min(args.interval, max(0.0, end - time.time())))
            now = time.time()
            with rec.lock:
                events = list(rec.events)
            row = sample(stats, args.state_url) | window_stats(events, last, now)
            with rec.lock:
                row["retries"] = sum(1 for t in rec.retry_times if last <= t < now)
            samples.append(row)
            bar.update(round(now - last))
            bar.set_postfix(ok=row["ok"], req=row["requests"], p99=row["p99_s"])
            last = now
        bar.close()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=900)
    hung = sum(t.is_alive() for t in threads)
    with rec.lock:
        events = list(rec.events)
    return {
        "start": start,
        "samples": samples,
        "events": events,
        "mismatches": rec.mismatches,
        "hung_clients": hung,
        "retries": rec.retries.as_dict(),
    }


def summarize(res: dict) -> dict:
    events = res["events"]
    by_outcome: dict[str, int] = defaultdict(int)
    by_kind: dict[str, int] = defaultdict(int)
    for _, kind, outcome, _ in events:
        by_outcome[outcome] += 1
        by_kind[kind] += 1
    samples = res["samples"]
    first = min(WARMUP_SAMPLES, len(samples) - 1)
    base = samples[first]
    last = samples[-1]
    growth = {}
    for cls, now in last["processes"].items():
        b = base["processes"].get(cls)
        if b and b["rss_mib"]:
            growth[cls] = {
                "n": now["n"],
                "rss_mib_start": b["rss_mib"],
                "rss_mib_end": now["rss_mib"],
                "rss_growth_pct": round(100 * (now["rss_mib"] - b["rss_mib"]) / b["rss_mib"], 1),
                "fds_start": b["fds"],
                "fds_end": now["fds"],
            }
    whole = [e for e in events if e[1] in ("spec", "seq", "stream")]
    lat = [e[3] for e in whole if e[2] == "ok"]
    return {
        "requests": len(events),
        "by_kind": dict(by_kind),
        "by_outcome": dict(by_outcome),
        "answers_checked": sum(1 for e in whole if e[2] in ("ok", "wrong")),
        "wrong_answers": len(res["mismatches"]),
        "lost": sum(v for k, v in by_outcome.items() if k.startswith("exc_")),
        "hung_clients": res["hung_clients"],
        # shed answers (503/429 with Retry-After) sent again; gave_up: still shed after the bounded retries
        "retries": (res.get("retries") or {}).get("retries", 0),
        "retries_gave_up": (res.get("retries") or {}).get("gave_up", 0),
        "retry_reasons": (res.get("retries") or {}).get("reasons", {}),
        "p50_s": _percentile(lat, 50),
        "p99_s": _percentile(lat, 99),
        "growth_from_sample": first,
        "growth": growth,
        "redis_keys": [s.get("redis_keys") for s in samples],
        "redis_checkpoints": [s.get("redis_checkpoints") for s in samples],
    }


def soak_main(args: argparse.Namespace) -> int:
    """Entry point of ``ralmspec bench soak``; returns 1 on a wrong answer, a lost request or a hang."""
    questions = load_questions(C.DEMO_QUESTIONS)
    kinds = [k.strip() for k in args.retrievers.split(",") if k.strip()]
    url, started = args.url, False
    if not url:
        ns = argparse.Namespace(port=args.port, admin=True, pad_to=args.pad_to, retrievers=",".join(kinds))
        data = apply_overrides(load_serve_config(DEFAULT_SERVE_CONFIG), ns)
        if args.state_url:
            # checkpoints on, and the verified-KB cache for every served retriever
            app_entry(data)["args"]["state"] = {"store": {"url": args.state_url}, "kb_cache": kinds}
        print("starting the server in-process...", file=sys.stderr)
        url, started = start_local_app(data), True
    try:
        res = run_soak(url.rstrip("/"), args, questions, kinds)
    finally:
        if started:
            from ray import serve

            serve.shutdown()
    summary = summarize(res)
    meta = {
        "url": url,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "interval_s": args.interval,
        "retrievers": kinds,
        "max_new_tokens": args.max_new_tokens,
        "state_url": bool(args.state_url),
        "machine": machine_note(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.out)
    data = {"meta": meta, "summary": summary, "samples": res["samples"], "mismatches": res["mismatches"]}
    md = to_markdown(meta, summary, res["samples"])
    write_report(out, "soak", data, md, indent=2)
    plot(res["samples"], res["events"], res["start"], out / "soak.png")
    print(md)
    return 1 if summary["wrong_answers"] or summary["lost"] or summary["hung_clients"] else 0
