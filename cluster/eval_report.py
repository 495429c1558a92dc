"""Reports of ``ralmspec eval`` (:mod:`cluster.eval_job`), built from the state store only.

The outputs are computed from what the store holds, never from what this process ran, so
a job resumed any number of times writes the same files: ``results.jsonl`` (one row per
item, with ``identical`` against the RaLMSeq row of the same question and retriever, and
``first_difference`` when it is not), ``summary.md`` / ``summary.json`` (the benchmark
table, over the questions whose baseline and every configuration are recorded: one
:class:`cluster.report.ConfigSummary` per retriever and configuration, with its fields
spelled out) and ``latency.png``. With ``--concurrency N`` (N > 1) the rows of the
configurations this run computed also carry the throughput of this run's waves (wall
time, requests/s, tokens/s), which, unlike the latencies, is a property of one run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.eval_items import SEQ, EvalItem
from cluster.report import (
    BENCH_COLUMNS,
    THROUGHPUT_COLUMNS,
    ConfigRuns,
    ConfigSummary,
    latency_chart,
    markdown_table,
    summarize,
    with_throughput,
)
from ralm.results import RalmResult, RequestStats


def _result_from_row(row: dict) -> RalmResult:
    names = {f.name for f in dataclasses.fields(RequestStats)}
    stats = RequestStats(**{k: v for k, v in row["stats"].items() if k in names})
    return RalmResult(row.get("text", ""), list(row["tokens"]), stats, row.get("finish_reason", "length"))


def build_report(
    rows_by_key: dict[str, dict], items: Sequence[EvalItem], configs: Sequence[str], kinds: Sequence[str]
) -> tuple[list[dict], list[ConfigSummary], dict[str, int]]:
    """(per-request rows in item order, summary rows, counts) from stored results."""
    out_rows: list[dict] = []
    counts = {
        "items": len(items),
        "recorded": 0,
        "missing": 0,
        "errors": 0,
        "compared": 0,
        "identical": 0,
        "different": 0,
    }
    seq_of: dict[tuple[int, str], dict] = {}
    for it in items:
        row = rows_by_key.get(it.key)
        if row is not None and it.config == SEQ:
            seq_of[(it.qid, it.retriever)] = row
    summary: list[ConfigSummary] = []
    for kind in kinds:
        base = ConfigRuns("RaLMSeq")
        runs = {c: ConfigRuns(c) for c in configs}
        for it in (i for i in items if i.retriever == kind):
            row = rows_by_key.get(it.key)
            if row is None:
                counts["missing"] += 1
                continue
            counts["recorded"] += 1
            row = dict(row)
            if "error" in row:
                counts["errors"] += 1
                row["identical"] = None
                out_rows.append(row)
                continue
            seq = seq_of.get((it.qid, it.retriever))
            if it.config == SEQ:
                row["identical"] = True
            elif seq is None or "error" in seq:
                row["identical"] = None  # baseline missing or failed: nothing to compare
            else:
                row["identical"] = row["tokens"] == seq["tokens"]
                counts["compared"] += 1
                counts["identical" if row["identical"] else "different"] += 1
                if not row["identical"]:
                    n = next(
                        (i for i, (a, b) in enumerate(zip(row["tokens"], seq["tokens"])) if a != b),
                        min(len(row["tokens"]), len(seq["tokens"])),
                    )
                    row["first_difference"] = n
            out_rows.append(row)
        # summary only over questions whose baseline and every config are recorded
        qtext = {it.qid: it.question for it in items if it.retriever == kind}
        complete = [
            q
            for q in sorted(qtext)
            if all(_ok(rows_by_key.get(EvalItem(q, qtext[q], kind, c).key)) for c in (SEQ, *configs))
        ]
        for q in complete:
            question = qtext[q]
            s = rows_by_key[EvalItem(q, question, kind, SEQ).key]
            base.results.append(_result_from_row(s))
            base.identical.append(True)
            for c in configs:
                r = rows_by_key[EvalItem(q, question, kind, c).key]
                runs[c].results.append(_result_from_row(r))
                runs[c].identical.append(r["tokens"] == s["tokens"])
        if complete:
            summary.append(summarize(base, base, retriever=kind))
            summary += [summarize(base, runs[c], retriever=kind) for c in configs]
    return out_rows, summary, counts


def _ok(row: dict | None) -> bool:
    return row is not None and "error" not in row


def write_outputs(
    out: Path,
    job_id: str,
    store,
    items: Sequence[EvalItem],
    configs: Sequence[str],
    kinds: Sequence[str],
    notes: list[str],
    throughput: Mapping[tuple[str, str], Any] | None = None,
) -> dict[str, Any]:
    """Write the job's outputs to ``out`` from what ``store`` holds under ``job_id``; returns
    ``{"counts", "summary" (the ConfigSummary rows), "markdown"}``. ``throughput``: this
    run's :class:`cluster.concurrency.Throughput` per (retriever, config name or ``seq``)."""
    rows_by_key = store.job_results(job_id)
    per_req, summary, counts = build_report(rows_by_key, items, configs, kinds)
    columns = list(BENCH_COLUMNS)
    if throughput:
        tp: dict[tuple[str | None, str], Any] = {
            (k, "RaLMSeq" if c == SEQ else c): t for (k, c), t in throughput.items()
        }
        summary = [
            with_throughput(r, tp[(r.retriever, r.config)]) if (r.retriever, r.config) in tp else r for r in summary
        ]
        columns += THROUGHPUT_COLUMNS
    runs = sorted({r["run_id"] for r in per_req if r.get("run_id")})
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w", encoding="utf-8") as fh:
        for r in per_req:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    notes = notes + [
        f"Job `{job_id}`: {counts['recorded']}/{counts['items']} requests recorded "
        f"(computed over {len(runs)} run(s)), {counts['errors']} errors; RaLMSpec outputs identical to "
        f"RaLMSeq: {counts['identical']}/{counts['compared']}."
    ]
    if counts["missing"]:
        notes.append(
            f"INCOMPLETE: {counts['missing']} requests are not recorded yet; rerun with --job-id {job_id} to finish."
        )
    md = markdown_table(summary, notes, columns) if summary else "\n".join(notes) + "\n"
    (out / "summary.md").write_text(md, encoding="utf-8")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "job_id": job_id,
                "notes": notes,
                "counts": counts,
                "runs": runs,
                "summary": [r.as_dict() for r in summary],
            },
            indent=1,
        )
    )
    if summary:
        latency_chart(summary, out / "latency.png")
    return {"counts": counts, "summary": summary, "markdown": md}
