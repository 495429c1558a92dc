"""Reports of the benchmarks: per-configuration summaries, markdown tables, JSON, the header
and the latency-breakdown chart.

``ralmspec bench spec`` and ``bench knn`` summarise each configuration with :func:`summarize`
(a :class:`ConfigSummary`) and render it with :func:`markdown_table`; ``bench served``,
``bench gen`` and ``bench costs`` render their own rows with :func:`table`; every benchmark writes
its ``<name>.json`` and ``<name>.md`` with :func:`write_report`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from ralm.machine import cpu_name
from ralm.results import RalmResult
from ralm.retrieval.bf16_scan import hardware_bf16
from ralm.retrievers import entry


@dataclass
class ConfigRuns:
    """One configuration's results, in question order, and whether each equals the baseline's."""

    name: str
    results: list[RalmResult] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)


@dataclass(kw_only=True)
class ConfigSummary:
    """One configuration's means over its requests, and its ratios against the baseline's.

    With T the mean latency and R the mean retrieval time of this configuration's requests,
    and T_base, R_base the baseline's (RaLMSeq, or the per-token KNN-LM baseline):

    - ``speedup`` = T_base / T
    - ``retrieval_eliminated`` = (T_base - T) / R_base: the RaLMSpec paper's E, the share of
      the baseline's retrieval time that the configuration removed (1: all of it; it can
      exceed 1 when generation got faster too, and is negative for a slow-down)
    - ``retrieval_share`` = R / T

    The other fields are means over the requests (``mean_stride``: see :func:`summarize`).
    ``retriever`` (bench) or ``index`` and ``k`` (bench-knn) say which block a row is in.
    """

    retriever: str | None = None
    index: str | None = None
    k: int | None = None
    config: str
    requests: int
    identical: int  # requests whose tokens equal the baseline's
    mean_latency_s: float
    generation_s: float  # mean wall time inside the generator
    retrieval_s: float  # mean of everything else (KB waits, caches, encoding)
    retrieval_share: float
    speedup: float
    retrieval_eliminated: float
    gamma: float | None  # mean final OS3 estimate of the speculation accuracy
    speculation_accuracy: float | None
    kb_calls: float
    rollbacks: float
    regenerated_tokens: float | None = None
    direct_steps: float | None = None  # steps where OS3 chose s = 0 (plain KB retrieval)
    mean_stride: float | None = None
    tokens: float | None = None
    cache_entries: float | None = None  # KNN-LM: speculative cache size at the end
    cache_lookup_ms: float | None = None  # KNN-LM: mean speculative cache lookup
    # with --concurrency N > 1: the configuration's requests ran N at a time as one wave
    concurrency: int | None = None
    wall_s: float | None = None  # wall time of the wave (of the waves, added up)
    requests_per_s: float | None = None  # requests / wall_s
    tokens_per_s: float | None = None  # generated tokens / wall_s

    # keys of results written before the fields were spelled out (docs/results/*.json)
    LEGACY_KEYS = {
        "latency_s": "mean_latency_s",
        "gen_s": "generation_s",
        "E": "retrieval_eliminated",
        "spec_accuracy": "speculation_accuracy",
        "lookup_ms": "cache_lookup_ms",
    }

    def as_dict(self) -> dict[str, Any]:
        """The JSON row (the block labels that do not apply are left out)."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v is not None or k not in _OMIT_IF_NONE}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> ConfigSummary:
        """A row read back from a results file, old key names included; unknown keys ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        data = {cls.LEGACY_KEYS.get(k, k): v for k, v in row.items()}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def coerce(cls, row: ConfigSummary | Mapping[str, Any]) -> ConfigSummary:
        return row if isinstance(row, ConfigSummary) else cls.from_dict(row)


_OMIT_IF_NONE = ("retriever", "index", "k", "concurrency", "wall_s", "requests_per_s", "tokens_per_s")


def with_throughput(row: ConfigSummary, tp: Any) -> ConfigSummary:
    """``row`` with the throughput of its wave(s) (``tp``: a :class:`cluster.concurrency.Throughput`)."""
    return dataclasses.replace(
        row,
        concurrency=tp.concurrency,
        wall_s=tp.wall_s,
        requests_per_s=tp.requests_per_s,
        tokens_per_s=tp.tokens_per_s,
    )


def summarize(
    base: ConfigRuns,
    runs: ConfigRuns,
    *,
    caches: Sequence[Any] | None = None,
    pooled_strides: bool = False,
    **labels: Any,
) -> ConfigSummary:
    """Means over ``runs``' requests and the ratios against ``base``'s means (see
    :class:`ConfigSummary`). ``mean_stride``: the mean over requests of each request's mean
    verification window, or with ``pooled_strides`` the mean over every window of every
    request. ``caches``: the KNN-LM speculative caches of the requests (``lookups`` and
    ``lookup_s`` each), for ``cache_entries`` and ``cache_lookup_ms``. ``labels``:
    ``retriever=``, or ``index=`` and ``k=``."""
    stats = [r.stats for r in runs.results]
    mean_latency = fmean(s.total_time_s for s in stats)
    retrieval = fmean(s.retrieval_time_s for s in stats)
    base_latency = fmean(r.stats.total_time_s for r in base.results)
    base_retrieval = fmean(r.stats.retrieval_time_s for r in base.results)
    gammas = [s.gamma for s in stats if s.gamma is not None]
    accuracies = [s.speculation_accuracy for s in stats if s.speculation_accuracy is not None]
    if pooled_strides:
        windows = [w for s in stats for w in s.strides]
        mean_stride = fmean(windows) if windows else None
    else:
        per_request = [fmean(s.strides) for s in stats if s.strides]
        mean_stride = fmean(per_request) if per_request else None
    lookups = sum(c.lookups for c in caches) if caches else 0
    return ConfigSummary(
        **labels,
        config=runs.name,
        requests=len(runs.results),
        identical=sum(runs.identical),
        mean_latency_s=mean_latency,
        generation_s=fmean(s.gen_time_s for s in stats),
        retrieval_s=retrieval,
        retrieval_share=retrieval / mean_latency if mean_latency else 0.0,
        speedup=base_latency / mean_latency if mean_latency else 0.0,
        retrieval_eliminated=(base_latency - mean_latency) / base_retrieval if base_retrieval else 0.0,
        gamma=fmean(gammas) if gammas else None,
        speculation_accuracy=fmean(accuracies) if accuracies else None,
        kb_calls=fmean(s.kb_calls for s in stats),
        rollbacks=fmean(s.rollbacks for s in stats),
        regenerated_tokens=fmean(s.regenerated_tokens for s in stats),
        direct_steps=fmean(s.direct_steps for s in stats),
        mean_stride=mean_stride,
        tokens=fmean(len(r.tokens) for r in runs.results),
        cache_entries=fmean(s.cache_entries for s in stats) if caches is not None else None,
        cache_lookup_ms=1000 * sum(c.lookup_s for c in caches) / max(1, lookups) if caches else None,
    )


# ---------------------------------------------------------------- markdown
def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    """The lines of a markdown table. ``align``: one character per column, ``r`` for a
    right-aligned one (``---:``); missing or anything else: the default (``---``)."""
    out = [
        "| " + " | ".join(headers) + " |",
        "|" + "".join("---:|" if align[i : i + 1] == "r" else "---|" for i in range(len(headers))),
    ]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _opt(v: float | None, places: int = 2) -> str:
    return "-" if v is None else f"{v:.{places}f}"


def _ms(v: float) -> str:
    return f"{v * 1000:.0f}"


Column = tuple[str, Callable[[ConfigSummary], str]]

_COLUMNS: dict[str, Column] = {
    c[0]: c
    for c in [
        ("retriever", lambda s: s.retriever),
        ("index", lambda s: s.index),
        ("k", lambda s: s.k),
        ("config", lambda s: s.config),
        ("mean latency ms", lambda s: _ms(s.mean_latency_s)),
        ("generation ms", lambda s: _ms(s.generation_s)),
        ("retrieval ms", lambda s: _ms(s.retrieval_s)),
        ("retrieval share", lambda s: f"{s.retrieval_share:.0%}"),
        ("speed-up", lambda s: f"{s.speedup:.2f}x"),
        ("retrieval eliminated", lambda s: _opt(s.retrieval_eliminated)),
        ("gamma", lambda s: _opt(s.gamma)),
        ("spec accuracy", lambda s: _opt(s.speculation_accuracy)),
        ("KB calls", lambda s: f"{s.kb_calls:.1f}"),
        ("rollbacks", lambda s: f"{s.rollbacks:.1f}"),
        ("regenerated tokens", lambda s: _opt(s.regenerated_tokens, 1)),
        ("direct steps", lambda s: _opt(s.direct_steps, 1)),
        ("mean stride", lambda s: _opt(s.mean_stride, 1)),
        ("cache lookup ms", lambda s: _opt(s.cache_lookup_ms)),
        ("identical", lambda s: f"{s.identical}/{s.requests}"),
        ("wall s", lambda s: _opt(s.wall_s)),
        ("requests/s", lambda s: _opt(s.requests_per_s)),
        ("tokens/s", lambda s: _opt(s.tokens_per_s, 1)),
    ]
}
_TIMES = [
    "mean latency ms",
    "generation ms",
    "retrieval ms",
    "retrieval share",
    "speed-up",
    "retrieval eliminated",
    "gamma",
    "spec accuracy",
    "KB calls",
    "rollbacks",
]
BENCH_COLUMNS = ["retriever", "config", *_TIMES, "regenerated tokens", "mean stride", "identical"]
THROUGHPUT_COLUMNS = ["wall s", "requests/s", "tokens/s"]  # --concurrency N > 1
KNN_COLUMNS = ["index", "k", "config", *_TIMES, "direct steps", "mean stride", "cache lookup ms", "identical"]


def markdown_table(
    rows: Sequence[ConfigSummary | Mapping[str, Any]],
    notes: Sequence[str],
    columns: Sequence[str] = tuple(BENCH_COLUMNS),
) -> str:
    """The header notes, a blank line and the summary table (``columns``: names from
    ``BENCH_COLUMNS`` / ``KNN_COLUMNS``, plus ``THROUGHPUT_COLUMNS``). Rows may be dicts read back from a results file."""
    cols = [_COLUMNS[c] for c in columns]
    lines = table([h for h, _ in cols], ([cell(s) for _, cell in cols] for s in map(ConfigSummary.coerce, rows)))
    return "\n".join([*notes, "", *lines]) + "\n"


# ---------------------------------------------------------------- header
def bench_header(
    tool: str, n_questions: int, cfg: Any, kinds: Sequence[str], corpus_desc: str, concurrency: int = 1
) -> list[str]:
    """Header lines of a benchmark/evaluation report (``cfg``: the RalmConfig), with the
    padding disclosure when the EDR index is padded and, above 1, the concurrency."""
    notes = [
        f"# ralmspec {tool}: {n_questions} questions, corpus {corpus_desc}, generator {cfg.generator.model}, "
        f"k={cfg.request.generation_stride}, max_new_tokens={cfg.request.max_new_tokens}"
    ]
    scanned = [k for k in kinds if entry(k).scan]
    if scanned and cfg.retriever.pad_to:
        notes.append(
            f"Note: the {'/'.join(k.upper() for k in scanned)} flat index is padded to {cfg.retriever.pad_to:,} rows with random "
            f"vectors that never outrank a real passage, to emulate Wikipedia-scale search cost; "
            f"results are unchanged."
        )
    if concurrency > 1:
        notes.append(
            f"Concurrency: {concurrency} requests at once per configuration, batched by the in-process engine; "
            f"caches cleared once per configuration; latencies are per request, throughput per configuration "
            f"(wall s, requests/s, generated tokens/s)."
        )
    return notes


ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "FAISS_OPT_LEVEL")


def isa_note() -> str:
    """The instruction sets the kernels use: torch's CPU capability, whether the CPU has bf16
    instructions, and any environment cap that restricts them (to emulate an older CPU)."""
    try:
        import torch

        note = f"torch kernels {torch.backends.cpu.get_cpu_capability()}, bf16 instructions {'yes' if hardware_bf16() else 'no'}"
    except Exception:  # no torch
        note = "torch not loaded"
    caps = [f"{k}={os.environ[k]}" for k in ISA_CAPS if os.environ.get(k)]
    return note + (f" (capped: {' '.join(caps)})" if caps else "")


def machine_note(scans: Mapping[str, str] | None = None) -> str:
    """The header line naming the CPU and, per retriever, the candidate-scan kernel in use
    (``bf16``: the torch bf16 scan; ``faiss``: FAISS's float32 kernels)."""
    line = f"Machine: {cpu_name()}, {os.cpu_count()} logical CPUs, {isa_note()}"
    if scans:
        line += "; candidate scan: " + ", ".join(f"{k} {v}" for k, v in scans.items())
    return line


# ---------------------------------------------------------------- files
def write_report(
    out: Path,
    stem: str,
    data: Mapping[str, Any],
    markdown: str,
    *,
    indent: int = 1,
    default: Callable[[Any], Any] | None = None,
) -> list[Path]:
    """Write ``<out>/<stem>.json`` and ``<out>/<stem>.md`` (creating ``out``); returns them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(data, indent=indent, default=default))
    paths[1].write_text(markdown)
    return paths


def exactness_status(different: int, what: str) -> int:
    """The exit status a benchmark returns for its exactness check: 0 when no output
    differs from the baseline's, else 1 after saying on stderr how many did (``what``
    names the compared outputs, e.g. "RaLMSpec outputs differ from RaLMSeq")."""
    if different:
        print(f"FAIL: {different} {what}", file=sys.stderr)
        return 1
    return 0


def latency_chart(rows: Sequence[ConfigSummary | Mapping[str, Any]], path: Path) -> None:
    """Stacked generation / retrieval bars of each configuration's mean latency, one panel
    per retriever, each bar labelled with its speed-up (like the RaLMSpec paper's Figure 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [ConfigSummary.coerce(r) for r in rows]
    kinds = list(dict.fromkeys(r.retriever for r in summaries))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rs = [r for r in summaries if r.retriever == kind]
        generation = [r.generation_s * 1000 for r in rs]
        retrieval = [r.retrieval_s * 1000 for r in rs]
        ax.bar([r.config for r in rs], generation, label="generation", color="#4c72b0")
        ax.bar([r.config for r in rs], retrieval, bottom=generation, label="retrieval", color="#dd8452")
        for i, r in enumerate(rs):
            ax.text(i, generation[i] + retrieval[i], f"{r.speedup:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_title(str(kind).upper())
        ax.set_ylabel("mean latency per request (ms)")
        ax.tick_params(axis="x", rotation=45)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
