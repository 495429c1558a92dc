"""The served benchmark's report: per-row statistics (modes, where the time went), the markdown of
``ralmspec bench served`` and the one-request rows comparing served with in-process latency."""

from __future__ import annotations

from statistics import fmean

from cluster.report import table


def one_request_rows(rows: list[dict], ref: dict[tuple[str, str], dict], questions: list[str]) -> list[dict]:
    """Served (1 in flight, batching on) against in-process mean latency, per (retriever, method)."""
    out = []
    for r in rows:
        key = (r["retriever"], r["method"])
        if r["concurrency"] != 1 or not r["batching"] or not r.get("gen_batching", True) or key not in ref:
            continue
        ip = ref[key]["mean_s"]
        out.append(
            {
                "retriever": r["retriever"],
                "method": r["method"],
                "served_mean_s": r["mean_s"],
                "in_process_mean_s": ip,
                "served_over_in_process": r["mean_s"] / ip if ip else None,
            }
        )
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def mode_stats(outs: list[dict]) -> dict:
    """Generation-side statistics of a row's answers (pooled over the requests)."""
    st = [o["stats"] for o in outs]
    g = lambda name: sum(s.get(name, 0) or 0 for s in st)  # noqa: E731
    return {
        "tokens_per_forward": _ratio(g("generated_tokens"), g("forward_passes")),
        "acceptance_rate": _ratio(g("accepted_tokens"), g("drafted_tokens")),
        "accepted_per_verify_pass": _ratio(g("accepted_tokens"), g("draft_rounds")),
        "doc_kv_hit_rate": _ratio(g("doc_kv_docs_reused"), g("doc_kv_docs_reused") + g("doc_kv_misses")),
        "doc_kv_bytes_reused_per_request": g("doc_kv_bytes_reused") / len(st) if st else 0.0,
        "exact": all(o.get("exact", True) for o in outs),
    }


WORK_FIELDS = (
    "steps",
    "gen_steps",
    "spec_steps",
    "regenerated_tokens",
    "context_tokens_computed",
    "context_tokens_reused",
    "async_steps_kept",
    "async_steps_discarded",
    "async_windows_declined",
    "direct_steps",
    "load_direct_steps",
)


def generator_work(outs: list[dict]) -> dict:
    """What the generator computed per request (means): committed steps, steps run (speculative,
    discarded and corrections included), tokens thrown away by rollbacks, context tokens fed
    to the model (a re-prefill after a rollback or a lost KV session) and reused from the
    request's KV session, asynchronous steps kept and discarded, direct steps (and those the
    shared load chose); plus the stride decisions summed by reason."""
    st = [o["stats"] for o in outs]
    if not st:
        return {}
    out: dict = {f"work_{k}": fmean(s.get(k) or 0 for s in st) for k in WORK_FIELDS}
    reasons: dict[str, int] = {}
    for s in st:
        for r, n in (s.get("stride_reasons") or {}).items():
            reasons[r] = reasons.get(r, 0) + n
    out["stride_reasons"] = reasons
    return out


def time_breakdown(outs: list[dict], lats: list[float]) -> dict:
    """Where a row's mean latency went, per request (seconds): waiting for a coordinator
    (``queue_s``, from the server), in the generator (``gen_s``: G), in retrieval (``kb_s``:
    R, KB waits and the local cache), and the rest (``overhead_s``: HTTP, Ray calls and
    queues outside the loop = latency - queue - the loop's own time)."""
    st = [o["stats"] for o in outs]
    if not st:
        return {}
    queue = fmean(s.get("queue_s") or 0.0 for s in st)
    loop = fmean(s.get("total_time_s") or 0.0 for s in st)
    return {
        "queue_s": queue,
        "gen_s": fmean(s.get("gen_time_s") or 0.0 for s in st),
        "kb_s": fmean(s.get("retrieval_time_s") or 0.0 for s in st),
        "overhead_s": max(0.0, fmean(lats) - queue - loop),
    }


def to_markdown(rows: list[dict], meta: dict, notes: list[str], one: list[dict] | None = None) -> str:
    """The served benchmark's report: header, notes, one row per measurement and, when
    measured, the 1-request served-vs-in-process rows."""
    lines = [
        "# Served benchmark: RaLMSeq vs RaLMSpec under concurrent load",
        "",
        f"Server {meta['url']}, model `{meta['model']}`, {meta['requests']} requests per row, "
        f"{meta['max_new_tokens']} new tokens each. Latency is per request (HTTP round trip); "
        f"throughput is requests finished per second of wall time. `q/search`: queries per KB "
        f"search sent by the verifier (cross-request batching); `KB s`: the verifier's seconds in "
        f"KB searches during the row; `req/batch`: requests per batch; `wait spec`: whether a batch "
        f"was held for requests running a speculation window (`-`: the server's setting).",
        "",
    ]
    lines += [f"> {n}" for n in notes] + ([""] if notes else [])

    def f2(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "-"

    def name(method: str) -> str:
        return "RaLMSeq" if method == "seq" else "RaLMSpec " + method[5:-1]

    lines += table(
        [
            "retriever",
            "method",
            "gen batching",
            "batching",
            "wait spec",
            "concurrency",
            "req/s",
            "tokens/s",
            "p50 (s)",
            "p95 (s)",
            "mean (s)",
            "q/search",
            "KB s",
            "req/batch",
            "tok/fwd",
            "accept",
            "doc-KV hit",
            "identical",
        ],
        (
            [
                r["retriever"],
                name(r["method"]),
                "on" if r.get("gen_batching", True) else "off",
                "on" if r["batching"] else "off",
                {None: "-", True: "on", False: "off"}[r.get("wait_for_speculating")],
                r["concurrency"],
                f"{r['throughput_rps']:.2f}",
                f"{r['tokens_per_s']:.1f}",
                f"{r['p50_s']:.2f}",
                f"{r['p95_s']:.2f}",
                f"{r['mean_s']:.2f}",
                f"{r['queries_per_search']:.2f}" if r["queries_per_search"] else "-",
                f2(r.get("kb_time_s")),
                f"{r['requests_per_batch']:.2f}" if r["requests_per_batch"] else "-",
                f2(r.get("tokens_per_forward")),
                f2(r.get("acceptance_rate")),
                f2(r.get("doc_kv_hit_rate")),
                f"{r['identical']}/{r['requests']}",
            ]
            for r in rows
        ),
        align="lllllrrrrrrrrrrrrr",
    )
    timed = [r for r in rows if "queue_s" in r]
    if timed:
        lines += [
            "",
            "## Where a request's time went (mean seconds per request)",
            "",
            "`queue`: waiting for a coordinator; `generator` (G) and `retrieval` (R, KB waits and the "
            "local cache) inside the RaLM loop; `overhead`: the rest of the HTTP round trip (the "
            "ingress, Ray calls and queues outside the loop).",
            "",
        ]
        lines += table(
            [
                "retriever",
                "method",
                "batching",
                "concurrency",
                "latency",
                "queue",
                "generator",
                "retrieval",
                "overhead",
            ],
            (
                [
                    r["retriever"],
                    name(r["method"]),
                    "on" if r["batching"] else "off",
                    r["concurrency"],
                    f"{r['mean_s']:.2f}",
                    f"{r['queue_s']:.2f}",
                    f"{r['gen_s']:.2f}",
                    f"{r['kb_s']:.2f}",
                    f"{r['overhead_s']:.2f}",
                ]
                for r in timed
            ),
            align="llllrrrrr",
        )
    worked = [r for r in rows if "work_gen_steps" in r]
    if worked:
        lines += [
            "",
            "## What the generator computed (mean per request)",
            "",
            "`steps`: committed; `gen steps`: every generator step run (speculative, discarded and "
            "corrections included); `regen tok`: tokens thrown away by rollbacks; `ctx computed` / "
            "`ctx reused`: context tokens fed to the model before a step (re-prefills after a "
            "rollback or a lost KV session) / taken from the request's KV session; `async kept/disc`: "
            "asynchronous steps kept / discarded / windows verified synchronously by the overlap check; `direct (load)`: direct steps (of them, chosen by "
            "the shared load); `decisions`: stride decisions by reason, summed over the row.",
            "",
        ]
        lines += table(
            [
                "method",
                "concurrency",
                "steps",
                "gen steps",
                "regen tok",
                "ctx computed",
                "ctx reused",
                "async kept/disc/declined",
                "direct (load)",
                "decisions",
            ],
            (
                [
                    name(r["method"]),
                    r["concurrency"],
                    f"{r['work_steps']:.1f}",
                    f"{r['work_gen_steps']:.1f}",
                    f"{r['work_regenerated_tokens']:.1f}",
                    f"{r['work_context_tokens_computed']:.0f}",
                    f"{r['work_context_tokens_reused']:.0f}",
                    f"{r['work_async_steps_kept']:.1f}/{r['work_async_steps_discarded']:.1f}"
                    f"/{r['work_async_windows_declined']:.1f}",
                    f"{r['work_direct_steps']:.1f} ({r['work_load_direct_steps']:.1f})",
                    ", ".join(f"{k} {v}" for k, v in sorted(r.get("stride_reasons", {}).items())) or "-",
                ]
                for r in worked
            ),
            align="lrrrrrrrrl",
        )
    if one:
        lines += ["", "## One request in flight: served against the in-process engine", ""]
        lines += table(
            ["retriever", "method", "served mean (s)", "in-process mean (s)", "served / in-process"],
            (
                [
                    o["retriever"],
                    name(o["method"]),
                    f"{o['served_mean_s']:.2f}",
                    f"{o['in_process_mean_s']:.2f}",
                    f"{o['served_over_in_process']:.2f}x",
                ]
                for o in one
            ),
            align="llrrr",
        )
    return "\n".join(lines) + "\n"
