"""The soak's report: the markdown summary and table of samples, and the plot over time."""

from __future__ import annotations

import time
from pathlib import Path

from cluster.report import table


def _f(v, places: int = 2) -> str:
    return "-" if v is None else f"{v:.{places}f}"


def to_markdown(meta: dict, summary: dict, samples: list[dict]) -> str:
    s = summary
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(samples[0]["t"]))
    lines = [
        "# Soak: mixed load, leaks and drift over time",
        "",
        f"{meta['machine']}. Server {meta['url']}, {meta['concurrency']} clients back to back for "
        f"{meta['minutes']:g} minutes from {start}, retrievers {', '.join(meta['retrievers'])}, "
        f"{meta['max_new_tokens']} new tokens per answer, a sample every {meta['interval_s']:g} s"
        + ("; state store: Redis" if meta["state_url"] else "; state store: none (in-process)")
        + ".",
        "",
        "Load mix: RaLMSpec PSA and RaLMSeq answers, streamed answers, streams abandoned after "
        "the first event (the server must cancel them), and bad requests (which must get a 4xx). "
        "Every answer to a (question, retriever) is checked against the first one.",
        "",
        f"- requests: **{s['requests']}** ({', '.join(f'{k} {v}' for k, v in sorted(s['by_kind'].items()))})",
        f"- outcomes: {', '.join(f'{k} {v}' for k, v in sorted(s['by_outcome'].items()))}",
        f"- answers checked for exactness: {s['answers_checked']}, wrong: **{s['wrong_answers']}**; "
        f"lost (connection error or client timeout): **{s['lost']}**; hung clients: {s['hung_clients']}",
        f"- latency of whole answers: p50 {_f(s['p50_s'])} s, p99 {_f(s['p99_s'])} s",
        f"- retries of shed requests (503/429 with Retry-After, sent again after that delay): "
        f"{s.get('retries', 0)}; still shed after the bounded retries: {s.get('retries_gave_up', 0)}",
        "",
        f"## Memory and file descriptors (sample {s['growth_from_sample']} to the last)",
        "",
    ]
    rows = [
        (
            cls,
            g["n"],
            _f(g["rss_mib_start"], 1),
            _f(g["rss_mib_end"], 1),
            f"{g['rss_growth_pct']:+.1f}%",
            g["fds_start"],
            g["fds_end"],
        )
        for cls, g in sorted(s["growth"].items())
    ]
    lines += table(
        ["process class", "n", "RSS start MiB", "RSS end MiB", "growth", "fds start", "fds end"], rows, "lrrrrrr"
    )
    keys = [k for k in s["redis_keys"] if k is not None]
    if keys:
        lines += ["", f"Redis keys: first {keys[0]}, max {max(keys)}, last {keys[-1]}."]
    ckpts = [k for k in s.get("redis_checkpoints", []) if k is not None]
    if ckpts:  # a finished or cancelled request deletes its checkpoint: stays near the in-flight count
        lines[-1] += f" Request checkpoints among them: max {max(ckpts)}, last {ckpts[-1]}."
    lines += ["", "## Samples", ""]
    t0 = samples[0]["t"]
    srows = []
    for smp in samples[1:]:
        rss = sum(p["rss_mib"] for p in smp["processes"].values())
        fds = sum(p["fds"] for p in smp["processes"].values())
        srv = smp.get("server") or {}
        srows.append(
            (
                f"{(smp['t'] - t0) / 60:.1f}",
                smp["requests"],
                _f(smp["success_rate"], 3),
                _f(smp["p50_s"]),
                _f(smp["p99_s"]),
                f"{rss:.0f}",
                fds,
                "-" if smp.get("redis_keys") is None else smp["redis_keys"],
                "-" if smp.get("redis_checkpoints") is None else smp["redis_checkpoints"],
                srv.get("waiting", "-"),
                srv.get("cancelled", "-"),
                smp.get("retries", "-"),
            )
        )
    lines += table(
        [
            "min",
            "requests",
            "success",
            "p50 s",
            "p99 s",
            "RSS MiB (all actors)",
            "fds",
            "Redis keys",
            "checkpoints",
            "waiting",
            "cancelled",
            "retries",
        ],
        srows,
        "rrrrrrrrrrrr",
    )
    return "\n".join(lines) + "\n"


def plot(samples: list[dict], events: list, start: float, path: Path) -> None:
    """Four panels over time: success rate, p50/p99 latency, RSS per process class, fds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [(s["t"] - start) / 60 for s in samples[1:]]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    ax = axes[0][0]
    ax.plot(t, [s["success_rate"] for s in samples[1:]], marker=".")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success rate")
    ax = axes[0][1]
    ax.plot(t, [s["p50_s"] for s in samples[1:]], label="p50", marker=".")
    ax.plot(t, [s["p99_s"] for s in samples[1:]], label="p99", marker=".")
    ax.set_ylabel("latency (s)")
    ax.legend()
    classes = sorted({c for s in samples for c in s["processes"]})
    ax = axes[1][0]
    for c in classes:
        ax.plot(t, [s["processes"].get(c, {}).get("rss_mib") for s in samples[1:]], label=c)
    ax.set_ylabel("RSS (MiB, summed per class)")
    ax.set_xlabel("minutes")
    if classes:
        ax.legend(fontsize=7)
    ax = axes[1][1]
    for c in classes:
        ax.plot(t, [s["processes"].get(c, {}).get("fds") for s in samples[1:]], label=c)
    keys = [s.get("redis_keys") for s in samples[1:]]
    if any(k is not None for k in keys):
        ax2 = ax.twinx()
        ax2.plot(t, keys, "k--", label="Redis keys")
        ax2.set_ylabel("Redis keys")
    ax.set_ylabel("open fds")
    ax.set_xlabel("minutes")
    fig.suptitle(f"ralmspec bench soak: {len(events)} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
