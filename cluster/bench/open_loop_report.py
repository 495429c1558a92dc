"""The open-loop sweep's report (:mod:`cluster.bench.open_loop`): a markdown page and the
latency-versus-rate plot, every method on the same axes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cluster.report import table


def name(method: str) -> str:
    """A row label for readers: ``seq`` -> RaLMSeq, ``spec[PSA]`` -> RaLMSpec PSA."""
    return "RaLMSeq" if method == "seq" else "RaLMSpec " + method[5:-1] if method.startswith("spec[") else method


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def to_markdown(result: dict, meta: dict, notes: Sequence[str]) -> str:
    """The page: how it was run, the lone latencies, one row per (method, rate), the capacity."""
    lone, rows, cap = result["lone"], result["rows"], result["capacity"]
    out = [
        "# Served benchmark, open loop: latency versus arrival rate",
        "",
        f"Server {meta['url']}, model `{meta['model']}`, retriever `{meta['retriever']}`, "
        f"{meta['requests']} requests per rate and method, {meta['max_new_tokens']} new tokens each, "
        f"Poisson arrivals (seed {result['seed']}; every method meets the same schedule at a rate), "
        f"each run bounded to {meta['duration_s']:g} s. Every request is streamed (`POST /v1/completions`): "
        "TTFT is the time to its first text. `shed`: answered 503/429 (not sent again); `lost`: failed or "
        f"unanswered at the bound. Goodput: answered within the SLO of {result['slo_s']:.2f} s, per second. "
        f"`identical`: tokens equal to RaLMSeq's lone answer. Command: `{meta['command']}`; {meta['created']}.",
        "",
        *[f"> {n}" for n in notes],
        "",
        "## Lone requests (one at a time)",
        "",
        *table(
            ["method", "requests", "median latency (s)", "identical"],
            [[name(m), v["requests"], _s(v["median_s"]), f"{v['identical']}/{v['requests']}"] for m, v in lone.items()],
        ),
        "",
        "## Per arrival rate",
        "",
        *table(
            [
                "method",
                "rate (req/s)",
                "p50 (s)",
                "p90 (s)",
                "p99 (s)",
                "TTFT p50 (s)",
                "TTFT p99 (s)",
                "throughput (req/s)",
                "goodput (req/s)",
                "shed",
                "lost",
                "identical",
                "KB queries / req",
                "direct steps / req",
            ],
            [
                [
                    name(r["method"]),
                    f"{r['rate']:g}",
                    _s(r["p50_s"]),
                    _s(r["p90_s"]),
                    _s(r["p99_s"]),
                    _s(r["ttft_p50_s"]),
                    _s(r["ttft_p99_s"]),
                    _s(r["throughput_rps"]),
                    _s(r["goodput_rps"]),
                    r["shed"],
                    r["lost"],
                    f"{r['identical']}/{r['requests']}",
                    _s(r.get("mean_kb_queries")),
                    _s(r.get("mean_direct_steps")),
                ]
                for r in rows
            ],
        ),
        "",
        "## Capacity",
        "",
        "The highest rate measured at which p99 latency stays under a bound, with every request answered "
        "and every lower rate too (`-`: not even the lowest rate): 3x the method's own lone latency, and "
        f"the SLO that goodput counts ({_s(result['slo_s'])} s, the same for every method).",
        "",
        *table(
            ["method", "lone (s)", "3x lone (s)", "highest rate (req/s)", "highest rate under the SLO (req/s)"],
            [
                [
                    name(m),
                    _s(lone[m]["median_s"]),
                    _s(3 * lone[m]["median_s"]),
                    _rate(c),
                    _rate(result["capacity_at_slo"][m]),
                ]
                for m, c in cap.items()
            ],
        ),
        "",
    ]
    return "\n".join(out)


def plot(result: dict, path: Path) -> None:
    """p50 (dashed) and p99 (solid) latency against the arrival rate, one colour per method,
    with each method's 3x-lone bound dotted."""
    import matplotlib  # lazy: plotting only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (method, lone) in enumerate(result["lone"].items()):
        rows = sorted((r for r in result["rows"] if r["method"] == method), key=lambda r: r["rate"])
        colour = f"C{i}"
        pts = [(r["rate"], r["p99_s"]) for r in rows if r["p99_s"] is not None]
        mid = [(r["rate"], r["p50_s"]) for r in rows if r["p50_s"] is not None]
        if pts:
            ax.plot(*zip(*pts), "-o", color=colour, label=f"{name(method)} p99")
        if mid:
            ax.plot(*zip(*mid), "--", color=colour, alpha=0.7, label=f"{name(method)} p50")
        ax.axhline(3 * lone["median_s"], color=colour, linestyle=":", linewidth=1, label=f"{name(method)} 3x lone")
    ax.set_xlabel("arrival rate (requests/s, Poisson)")
    ax.set_ylabel("latency (s)")
    ax.set_title("Served latency versus arrival rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
