"""``ralmspec bench served``: the served system under concurrent load.

For every retriever, cross-request batching on and off, RaLMSeq and the RaLMSpec
configurations asked for, and every concurrency level (default 1, 4, 16), it sends the
same ``n`` questions through HTTP (``POST /v1/ralm/generate``) with that many requests in
flight (a request shed with 503/429 and ``Retry-After`` is sent again after that delay, a
bounded number of times, and counted in the row's ``retries``) and reports throughput
(requests/s, tokens/s) and p50/p95 latency, plus the verifier's batching (queries per KB
search). Every answer is compared token by token with the server's RaLMSeq answer for the
same question; a difference makes the command exit non-zero. ``--options`` adds request fields to every request (a generation-side
mode: drafting, several documents, FLARE, ...); rows then also report tokens per forward
pass, drafting acceptance and the doc-KV hit rate.

Runs against a server (``--url``) or starts the app of ``serve_config.yaml`` in-process.
Switching batching needs the admin API (``ingress.admin: true``, always on for the
in-process server); without it only the server's current setting is measured.
Writes ``served_bench.json`` and ``served_bench.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean

from cluster.bench.open_loop import check_server, open_loop_main
from cluster.bench.served_report import generator_work, mode_stats, one_request_rows, time_breakdown, to_markdown
from cluster.flags import SHARED, Default, add_shared
from cluster.native_client import Client
from cluster.report import machine_note, write_report
from cluster.serve import DEFAULT_SERVE_CONFIG, app_entry, apply_overrides, load_serve_config, start_local_app
from ralm import constants as C
from ralm.config import RalmConfig, SpecConfig
from ralm.corpus import load_questions

log = logging.getLogger(__name__)


def add_served_bench_args(p: argparse.ArgumentParser) -> None:
    add_shared(
        p,
        url=None,
        serve_config=None,
        port=Default(8000, help="HTTP port of the in-process server"),
        pad_to=Default(help="in-process server: " + SHARED["pad_to"].help, unset="the server's"),
        questions=None,
        num_questions=Default(16, help="requests per measurement"),
        concurrency=Default("1,4,16", many=True),
        retrievers="edr",
    )
    p.add_argument(
        "--methods",
        default="seq,spec:PSA",
        help="comma-separated: seq, or spec:<config> (base or any of P/S/A; append @G to set "
        "OS3's gamma cap, e.g. spec:PSA@0.9)",
    )
    p.add_argument("--batching", default="on,off", help="cross-request batching settings to measure: on,off")
    p.add_argument(
        "--gen-batching",
        default="on",
        help="generator settings to measure, each on a freshly started in-process server: on (invariant forward, "
        "continuous batching, KV sessions) and/or off (generator.invariant=false: one step at a time, re-prefill)",
    )
    p.add_argument(
        "--wait-for-speculating",
        default="",
        help="verifier settings to measure side by side (on,off): whether a batch is held for requests "
        "that are speculating (default: the server's setting only)",
    )
    add_shared(p, window_ms=None)
    p.add_argument("--max-inflight", type=int, help="verifier batches in flight per retriever (default: the server's)")
    add_shared(p, max_new_tokens=64)
    p.add_argument(
        "--options",
        type=_options,
        default=None,
        help="JSON object of extra request fields sent with every request (the RaLMSeq reference "
        'included), to measure a generation-side mode, e.g. \'{"drafting": "ngram", '
        '"num_docs": 2}\' (any option of POST /v1/ralm/generate but question, retriever, '
        "method, spec and max_new_tokens)",
    )
    add_shared(p, warmup=Default(1, help=SHARED["warmup"].help + ", run at the highest concurrency"))
    p.add_argument("--timeout", type=float, default=900.0, help="HTTP timeout per request (s)")
    add_shared(p, out=Path("bench-out/served"))
    p.add_argument(
        "--rate",
        help="open loop instead of --concurrency: comma-separated Poisson arrival rates (requests/s), "
        "-n requests per rate and method, latency versus rate (cluster/bench/open_loop.py)",
    )
    p.add_argument(
        "--duration", type=float, help="open loop: wall-time bound of each rate's run, s (default 3 x n / rate)"
    )
    p.add_argument("--slo", type=float, help="open loop: latency SLO for goodput, s (default 3x RaLMSeq's lone)")
    p.add_argument("--lone", type=int, default=8, help="open loop: lone (one at a time) requests per RaLMSpec method")
    p.add_argument(
        "--no-in-process",
        dest="in_process",
        action="store_false",
        help="skip the in-process reference (by default, when the server is started here, the same "
        "requests first run one at a time through the in-process engine with the same config, "
        "and the 1-request served latency is reported against it)",
    )


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (p in 0..100)."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = (len(xs) - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


RESERVED = ("question", "retriever", "method", "spec", "max_new_tokens")


def _options(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--options is not valid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("--options must be a JSON object")
    bad = sorted(set(obj) & set(RESERVED))
    if bad:
        raise argparse.ArgumentTypeError(f"--options may not set {', '.join(bad)} (the benchmark sets them)")
    return obj


def _on_off(text: str) -> list[bool]:
    """``"on,off"`` -> ``[True, False]``."""
    try:
        return [{"on": True, "off": False}[x.strip()] for x in str(text).split(",") if x.strip()]
    except KeyError as e:
        raise SystemExit(f"expected a comma-separated list of on/off, got {text!r}") from e


def _parse_methods(spec: str) -> list[tuple[str, str | None]]:
    """'seq,spec:PSA@0.9' -> [('seq', None), ('spec', 'PSA@0.9')]; a bare 'spec' is 'spec:base'.
    The configuration is in :meth:`SpecConfig.parse`'s grammar (``;FIELD=VALUE`` included:
    'spec:PSA;shared_kb_direct_at=0'), the same the server parses from the request's ``spec``
    field; every one is checked here, before any request."""
    out: list[tuple[str, str | None]] = []
    for m in (x.strip() for x in spec.split(",") if x.strip()):
        if m == "seq":
            out.append(("seq", None))
        elif m == "spec" or m.startswith("spec:"):
            name = m.split(":", 1)[1] if ":" in m else "base"
            SpecConfig.parse(name)
            out.append(("spec", name))
        else:
            raise ValueError(f"unknown method {m!r}: use seq or spec:<config>")
    return out


def _label(method: str, spec: str | None) -> str:
    """'spec[PSA@0.9]': the P/S/A letters in canonical order (or 'base'), then the name's fixed
    stride, gamma cap and settings as written (a row label, never parsed back)."""
    if method == "seq":
        return "seq"
    name = spec or "base"
    sc = SpecConfig.parse(name)
    head, semi, settings = name.partition(";")
    body, at, cap = head.partition("@")
    letters = "".join(c for c, on in (("P", sc.prefetch), ("S", sc.adaptive_stride), ("A", sc.async_verify)) if on)
    fixed = f"s={sc.stride}" if "s=" in body else ""
    return f"spec[{(letters + fixed) or 'base'}{at}{cap}{semi}{settings}]"


def _measure(client: Client, bodies: list[dict], concurrency: int) -> tuple[list[dict], list[float], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as ex:
        outs = list(ex.map(client.generate, bodies))
    wall = time.perf_counter() - t0
    return [o for o, _ in outs], [dt for _, dt in outs], wall


def run_served_bench(
    client: Client,
    questions: list[str],
    kinds: list[str],
    methods: list[tuple[str, str | None]],
    levels: list[int],
    batching: list[bool],
    max_new: int,
    warmup: int,
    window_ms: float | None = None,
    progress: bool = True,
    options: dict | None = None,
    max_inflight: int | None = None,
    speculating_waits: Sequence[bool] = (),
) -> tuple[list[dict], list[str]]:
    notes: list[str] = []
    extra = dict(options or {})
    if extra:
        notes.append(
            f"every request (the RaLMSeq reference too) carried the options {json.dumps(extra, sort_keys=True)}"
        )
    can_switch = client.admin({}) is not None
    if not can_switch:
        notes.append("the server's admin API is off: batching was measured at its current setting only")
        current = next(iter(client.stats()["verifiers"].values()))["batching"]
        batching = [current]
    policy = {k: v for k, v in (("window_ms", window_ms), ("max_inflight", max_inflight)) if v is not None}
    if policy and can_switch:
        client.admin(policy)
    if can_switch:
        admin_state = client.admin({})
        if admin_state is None:  # it answered a moment ago (can_switch)
            raise RuntimeError("the server's admin API went off during the benchmark")
        current = admin_state.get(kinds[0], {})
        notes.append(
            "verifier policy when batching is on: "
            + ", ".join(
                f"{k} {current[k]}"
                for k in ("window_ms", "max_batch", "max_inflight", "flush_when_all_waiting", "wait_for_speculating")
                if k in current
            )
        )
    rows = []
    for kind in kinds:
        if warmup:  # untimed; at the highest concurrency, so the coordinator pool has grown
            wq = (questions * max(levels))[: max(warmup, max(levels))]
            _measure(
                client,
                [{"question": q, "retriever": kind, "method": "seq", "max_new_tokens": max_new, **extra} for q in wq],
                max(levels),
            )
        ref: dict[str, list[int]] = {}
        for q in questions:  # RaLMSeq reference answers (untimed)
            out, _ = client.generate(
                {"question": q, "retriever": kind, "method": "seq", "max_new_tokens": max_new, **extra}
            )
            ref[q] = out["tokens"]
        waits: list[bool | None] = list(speculating_waits) if can_switch and speculating_waits else [None]
        for b, wait in [(on, w) for on in batching for w in (waits if on else [None])]:
            if can_switch:
                client.admin({"batching": b, **({} if wait is None else {"wait_for_speculating": wait})})
            for method, spec in methods:
                for c in levels:
                    bodies = [
                        {
                            "question": q,
                            "retriever": kind,
                            "method": method,
                            "max_new_tokens": max_new,
                            **({"spec": spec} if spec else {}),
                            **extra,
                        }
                        for q in questions
                    ]
                    if can_switch:
                        client.admin({"reset_stats": True})
                    retries0 = client.retries.retries
                    outs, lats, wall = _measure(client, bodies, c)
                    retries = client.retries.retries - retries0
                    vst = client.stats()["verifiers"].get(kind, {})
                    n_tok = sum(len(o["tokens"]) for o in outs)
                    identical = sum(o["tokens"] == ref[q] for o, q in zip(outs, questions))
                    row = {
                        "retriever": kind,
                        "method": _label(method, spec),
                        "batching": b,
                        "wait_for_speculating": wait,
                        "concurrency": c,
                        "requests": len(outs),
                        "identical": identical,
                        "wall_s": wall,
                        "throughput_rps": len(outs) / wall if wall else 0.0,
                        "tokens_per_s": n_tok / wall if wall else 0.0,
                        "mean_s": fmean(lats),
                        "p50_s": percentile(lats, 50),
                        "p95_s": percentile(lats, 95),
                        "kb_calls_per_request": fmean(o["stats"]["kb_calls"] for o in outs),
                        "kb_searches": vst.get("searches"),
                        "kb_time_s": vst.get("kb_time_s"),  # the verifier's time in KB searches
                        "queries_per_search": (vst["searched_queries"] / vst["searches"])
                        if vst.get("searches")
                        else None,
                        "requests_per_batch": vst.get("mean_submissions_per_batch"),
                        "options": extra,
                        "retries": retries,  # shed answers sent again (their latency includes the wait)
                        **time_breakdown(outs, lats),
                        **mode_stats(outs),
                        **generator_work(outs),
                    }
                    rows.append(row)
                    if progress:
                        print(
                            f"{kind} {row['method']:<10} batching={'on ' if b else 'off'} c={c:<3} "
                            f"{row['throughput_rps']:.2f} req/s p50={row['p50_s']:.2f}s p95={row['p95_s']:.2f}s "
                            f"identical={identical}/{len(outs)}",
                            file=sys.stderr,
                        )
        if can_switch:
            client.admin({"batching": True})
    shed = client.retries.as_dict()
    if shed["retries"]:
        notes.append(
            f"{shed['retries']} requests were shed (503/429 with Retry-After) and sent again after that delay "
            f"(per row: `retries`; their latency includes the wait); reasons: {shed['reasons']}"
        )
    return rows, notes


def in_process_latencies(
    ralm: dict,
    questions: list[str],
    kinds: list[str],
    methods: list[tuple[str, str | None]],
    max_new: int,
    options: dict | None = None,
) -> dict[tuple[str, str], dict]:
    """Mean latency of each (retriever, method) answering ``questions`` one at a time with
    the in-process engine (:class:`ralm.pipeline.Pipeline`) and the server's RalmConfig:
    the reference for "served latency at 1 request is close to in-process"."""
    import gc

    from ralm.pipeline import Pipeline  # lazy: torch and the model, for the in-process reference only

    cfg = RalmConfig.model_validate(ralm)
    req = cfg.request.model_copy(update={"max_new_tokens": max_new, **(options or {})})
    pipe = Pipeline.from_config(cfg, kinds=tuple(kinds), progress=False)
    out: dict[tuple[str, str], dict] = {}
    try:
        for kind in kinds:
            pipe.answer(questions[0], kind, "seq", req=req)  # warm-up, untimed
            for method, spec in methods:
                sc = None
                if method == "spec":
                    if spec is None:  # _parse_methods names a configuration for every spec method
                        raise ValueError("method 'spec' without a configuration name")
                    sc = SpecConfig.parse(spec, **cfg.spec.model_dump())
                lats, toks = [], []
                for q in questions:
                    kb = pipe.retriever(kind)
                    getattr(kb.scorer, "clear_caches", lambda: None)()
                    t0 = time.perf_counter()
                    r = pipe.answer(q, kind, method, spec=sc, req=req)
                    lats.append(time.perf_counter() - t0)
                    toks.append(list(r.tokens))
                out[(kind, _label(method, spec))] = {"mean_s": fmean(lats), "tokens": toks}
    finally:
        del pipe
        gc.collect()
    return out


def _run_one_server(args, questions, kinds, methods, levels, batching, gen_on: bool, want_ref: bool):
    """Start the in-process app (generator batching ``gen_on``) unless ``--url`` is given, run
    every measurement against it, shut it down: (rows, notes, in-process reference, url, model)."""
    url = args.url
    started_here = False
    ref: dict = {}
    if not url:
        ns = argparse.Namespace(
            port=args.port, admin=True, pad_to=args.pad_to, retrievers=",".join(dict.fromkeys(kinds))
        )
        data = apply_overrides(load_serve_config(args.serve_config or DEFAULT_SERVE_CONFIG), ns)
        app_entry(data)["args"].setdefault("ralm", {}).setdefault("generator", {})["invariant"] = gen_on
        if want_ref and getattr(args, "in_process", True) and 1 in levels:
            print("in-process reference (same config, one request at a time)...", file=sys.stderr)
            ref = in_process_latencies(
                app_entry(data)["args"].get("ralm", {}),
                questions,
                kinds,
                methods,
                args.max_new_tokens,
                getattr(args, "options", None),
            )
        print(f"starting the server in-process (generator batching {'on' if gen_on else 'off'})...", file=sys.stderr)
        url = start_local_app(data)
        started_here = True
    client = Client(url, args.timeout)
    try:
        model = client.http.get("/v1/models").json()["data"][0]["id"]
        rows, notes = run_served_bench(
            client,
            questions,
            kinds,
            methods,
            levels,
            batching,
            args.max_new_tokens,
            args.warmup,
            args.window_ms,
            options=getattr(args, "options", None),
            max_inflight=getattr(args, "max_inflight", None),
            speculating_waits=_on_off(getattr(args, "wait_for_speculating", "")),
        )
        if started_here and args.pad_to:
            notes.append(
                f"the EDR index was padded to {args.pad_to} rows with random vectors of norm "
                f"1e-3 (search cost of a Wikipedia-scale KB; results unchanged)"
            )
    finally:
        if started_here:
            from ray import serve

            serve.shutdown()
    return rows, notes, ref, url, model


def served_bench_main(args: argparse.Namespace) -> int:
    """Entry point of ``ralmspec bench served``; returns 1 if any answer differed from RaLMSeq's."""
    questions = load_questions(args.questions or C.DEMO_QUESTIONS)
    n = args.num_questions
    if n > len(questions):
        questions = questions * (n // len(questions) + 1)
    questions = questions[:n]
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    kinds = [k.strip() for k in args.retrievers.split(",") if k.strip()]
    methods = _parse_methods(args.methods)
    if getattr(args, "rate", None) is not None:  # open loop: its input is checked before the server
        try:
            return open_loop_main(args, questions, [(m, s, _label(m, s)) for m, s in methods])
        except (ValueError, ConnectionError) as e:
            raise SystemExit(f"error: {e}") from None
    if args.url:
        try:
            check_server(args.url)
        except ConnectionError as e:
            raise SystemExit(f"error: {e}") from None
    batching = _on_off(args.batching)
    gen_settings = _on_off(args.gen_batching)
    if args.url and gen_settings != [True]:
        raise SystemExit("--gen-batching off needs the in-process server (no --url): it restarts the app per setting")
    rows: list[dict] = []
    # the CPU and its kernels (an in-process server's; a --url server may run elsewhere)
    notes: list[str] = [machine_note() + ("" if not args.url else " (this client's machine)")]
    ref: dict = {}
    url, model = args.url, ""
    for gen_on in gen_settings:
        part, part_notes, part_ref, url, model = _run_one_server(
            args, questions, kinds, methods, levels, batching, gen_on, want_ref=not ref
        )
        for r in part:
            r["gen_batching"] = gen_on
        rows += part
        notes += [n for n in part_notes if n not in notes]
        ref = ref or part_ref
    meta = {
        "url": url,
        "model": model,
        "requests": len(questions),
        "max_new_tokens": args.max_new_tokens,
        "concurrency": levels,
        "retrievers": kinds,
        "methods": [m for m, _ in methods],
        "options": getattr(args, "options", None) or {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    one = one_request_rows(rows, ref, questions)
    md = to_markdown(rows, meta, notes, one)
    write_report(
        Path(args.out),
        "served_bench",
        {"meta": meta, "notes": notes, "rows": rows, "one_request_vs_in_process": one},
        md,
        indent=2,
    )
    print(md)
    bad = [r for r in rows if r["identical"] != r["requests"]]
    if bad:
        print(f"error: {len(bad)} configurations returned answers that differ from RaLMSeq", file=sys.stderr)
        return 1
    return 0
