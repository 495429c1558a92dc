"""The Markdown report of ``ralmspec bench gen`` (:mod:`cluster.bench.gen_bench`): prefill with and
without doc-KV reuse, and n-gram vs dense drafting, from the benchmark's JSON."""

from __future__ import annotations

from cluster.report import table


def gen_bench_markdown(o: dict) -> str:
    """The report of one ``bench gen`` run (its JSON object ``o``)."""
    f = lambda x: "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))  # noqa: E731
    L = ["# bench-gen", ""]
    if o.get("args"):
        L += ["Arguments: " + ", ".join(f"`{k}={v}`" for k, v in o["args"].items() if k != "out"), ""]
    if "prefill" in o:
        p = o["prefill"]
        L += [
            "## (a) prefill per step, doc-KV reuse (RaLMSeq loop, every step timed, median of repetitions)",
            "",
            f"One-token forward (fixed cost of a forward pass): {f(p['forward_overhead_ms'])} ms. Without reuse a "
            "step runs one forward per document and one for the context; a full hit runs only the context's.",
            "",
        ]
        L += table(
            [
                "docs / cache scope",
                "query window",
                "steps",
                "doc + ctx tokens/step",
                "with reuse ms",
                "without ms",
                "**speed-up**",
                "one forward ms (speed-up)",
                "token ratio",
                "docs reused/computed",
                "full-hit steps",
                "hit steps: with / without ms",
                "miss steps: with / without ms",
                "identical",
            ],
            (
                [
                    k,
                    r.get("query_window", "-"),
                    r["steps"],
                    f"{r['doc_tokens_per_step']:.0f} + {r['context_tokens_per_step']:.0f}",
                    f(r["prefill_ms_per_step_with"]),
                    f(r["prefill_ms_per_step_without"]),
                    f"**{r['speedup']:.2f}x**",
                    f"{f(r.get('prefill_ms_per_step_one_forward'))} ({f(r.get('speedup_vs_one_forward'))}x)",
                    f"{r['token_ratio']:.2f}x",
                    f"{r['docs_reused']}/{r['docs_computed']}",
                    r["full_hit_steps"],
                    f"{f(r['hit_steps_ms_with'])} / {f(r['hit_steps_ms_without'])}",
                    f"{f(r['miss_steps_ms_with'])} / {f(r['miss_steps_ms_without'])}",
                    f"{r['identical']}/{r['requests']}",
                ]
                for k, r in p.items()
                if isinstance(r, dict)
            ),
        )
        L += [
            "",
            "Without: the engine's exact computation without the cache (each document, then the context, "
            "one forward each). One forward: the same prompt in a single forward pass, what a server without "
            "reuse would run (not bit-identical to the engine's computation). Token ratio: (document + context "
            "tokens) / context tokens, the ceiling of a compute-bound prefill if every step were a full hit. "
            "Scope `request`: the doc-KV cache is cleared before every request (reuse across iterations only); "
            "`run`: cleared once per repetition, reused across the run's requests.",
            "",
        ]
    if "decode" not in o:
        return "\n".join(L) + "\n"
    L += [f"## (b) decode (dense datastore: {o['dense_datastore']})", ""]
    L += table(
        ["drafting", "fwd/token", "fewer fwd x", "acceptance", "accepted/verify", "decode s/token"],
        (
            [
                k,
                f(r["forward_passes_per_token"]),
                f(r.get("fewer_forwards_x")),
                f(r["acceptance_rate"]),
                f(r["accepted_per_verify_pass"]),
                f(r["decode_s_per_token"]),
            ]
            for k, r in o["decode"].items()
        ),
    )
    L += ["", "## (c) end to end", "", f"RaLMSeq plain: {f(o['end_to_end']['seq_plain_s'])} s/request", ""]
    L += table(
        ["config", "s/request", "speed-up", "identical"],
        (
            [k, f(r["mean_s"]), f(r["speedup"]), f"{r['identical_to_seq']}/{r['requests']}"]
            for k, r in o["end_to_end"].items()
            if isinstance(r, dict)
        ),
    )
    L += ["", "## (d) drafting vs plain: identical outputs and divergences", ""]
    for k, r in o["identical"].items():
        L.append(
            f"- {k}: {r['identical']}/{r['requests']} identical; divergences: "
            + (
                ", ".join(
                    f"pos {d['position']} gap {d['top2_gap']:.2e} near_tie={d['near_tie']}" for d in r["divergences"]
                )
                or "none"
            )
        )
    return "\n".join(L) + "\n"
