"""``ralmspec bench spec``: RaLMSeq against RaLMSpec configurations, side by side in one process.

For every question, every configuration runs back to back (interleaved, so machine
noise hits them alike), each request starting cold: empty doc-KV cache, no memoised
query encodings or BM25 document vectors left by another configuration's run. Every RaLMSpec
output is compared token by token with RaLMSeq's; any difference makes the command exit
non-zero. Writes ``bench.json``, ``bench.md`` and ``bench.png`` (stacked generation /
retrieval bars, like the RaLMSpec paper's Figure 4).

With ``--concurrency N`` (N > 1) each configuration instead runs all its questions as one
wave, N at a time through the shared engine (:mod:`cluster.concurrency`), starting from
the same cold state (caches cleared before each configuration's wave); every output is
still compared with RaLMSeq's for the same question, and the report adds each
configuration's wall time, requests/s and generated tokens/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import ralm.spec  # called as ralm.spec.run_spec, looked up at call time (tests swap in a broken one)
from cluster.concurrency import CONCURRENCY_HELP, check_concurrency, run_wave, verify_pool
from cluster.config_args import load_config
from cluster.flags import Default, add_shared
from cluster.report import (
    BENCH_COLUMNS,
    THROUGHPUT_COLUMNS,
    ConfigRuns,
    ConfigSummary,
    bench_header,
    exactness_status,
    latency_chart,
    machine_note,
    markdown_table,
    summarize,
    with_throughput,
    write_report,
)
from ralm import constants as C
from ralm.config import SpecConfig
from ralm.corpus import load_questions
from ralm.seq import run_seq
from ralm.stride.gamma_prior import PROCESS_PRIOR

log = logging.getLogger(__name__)

DEFAULT_CONFIGS = ["base", "P", "S", "A", "PSA", "s=2", "s=4", "s=8"]


def add_bench_args(p: argparse.ArgumentParser) -> None:
    add_shared(
        p,
        questions=None,
        num_questions=20,
        retrievers="edr,adr,sr",
        configs=",".join(DEFAULT_CONFIGS),
        max_new_tokens=None,
        out=Path("bench-out"),
        warmup=1,
    )
    p.add_argument(
        "--allow-eos",
        action="store_true",
        help="stop requests at EOS (default: fixed-length generation with EOS masked, as in the paper)",
    )
    add_shared(p, concurrency=Default(1, help=CONCURRENCY_HELP))


def run_retriever(
    pipe,
    kind: str,
    questions: list[str],
    configs: list[str],
    warmup: int,
    progress: bool = True,
    concurrency: int = 1,
    deadline: float | None = None,
) -> tuple[list[ConfigSummary], list[dict]]:
    """Every question through RaLMSeq and each configuration (after ``warmup`` untimed
    questions): the summary rows (RaLMSeq first) and one record per question, in question
    order. ``concurrency`` > 1: each configuration's questions run as one concurrent wave.
    ``deadline`` (a ``time.perf_counter()`` value; one at a time only): no timed question
    starts after it, so the rows cover the questions done by then (at least one)."""
    from tqdm import tqdm

    kb = pipe.retriever(kind)
    gen = pipe.generator
    req = pipe.cfg.request
    specs = {c: SpecConfig.parse(c) for c in configs}
    PROCESS_PRIOR.clear()  # every configuration's gamma prior starts empty (keyed by configuration)
    for q in questions[:warmup]:  # warm FAISS/Lucene/torch, untimed
        run_seq(q, gen, kb, req)
        for c in configs:
            ralm.spec.run_spec(q, gen, kb, req, specs[c])
    base = ConfigRuns("RaLMSeq")
    runs = {c: ConfigRuns(c) for c in configs}
    per_request: list[dict] = []

    def cold() -> None:
        # every request starts cold: no doc KV, no memoised query encodings or BM25
        # document vectors from an earlier configuration's run of the same question
        pipe.engine.clear_kv_caches()  # no request's KV session left by another configuration
        getattr(kb.scorer, "clear_caches", lambda: None)()

    if concurrency > 1:
        return _run_waves(pipe, kind, questions[warmup:], configs, specs, cold, concurrency)
    for i, q in enumerate(tqdm(questions[warmup:], desc=f"bench {kind}", disable=not progress)):
        if deadline is not None and i > 0 and time.perf_counter() > deadline:
            log.warning("time budget spent: %d of %d timed questions run", i, len(questions) - warmup)
            break
        cold()
        b = run_seq(q, gen, kb, req)
        base.results.append(b)
        base.identical.append(True)
        row = {"retriever": kind, "question": q, "seq": b.stats.as_dict(), "seq_tokens": len(b.tokens)}
        for c in configs:
            cold()
            r = ralm.spec.run_spec(q, gen, kb, req, specs[c])
            same = r.tokens == b.tokens
            runs[c].results.append(r)
            runs[c].identical.append(same)
            row[c] = {"identical": same, **r.stats.as_dict()}
            if not same:
                log.error("OUTPUT DIFFERS: retriever=%s config=%s question=%r", kind, c, q)
        per_request.append(row)
    rows = [summarize(base, base, retriever=kind)]
    rows += [summarize(base, runs[c], retriever=kind) for c in configs]
    return rows, per_request


def _run_waves(pipe, kind: str, questions: list[str], configs: list[str], specs: dict, cold, concurrency: int):
    """:func:`run_retriever` with ``concurrency`` > 1: RaLMSeq, then each configuration, as
    one wave of all ``questions`` run ``concurrency`` at a time, each wave from a cold start."""
    kb, gen, req = pipe.retriever(kind), pipe.generator, pipe.cfg.request

    def wave(name: str, answer) -> tuple[ConfigRuns, object]:
        cold()
        with verify_pool(concurrency) as pool:
            results, tp = run_wave(lambda q: answer(q, pool), questions, concurrency, lambda r: len(r.tokens))
        log.info("bench %s %s: %d requests in %.2f s", kind, name, tp.requests, tp.wall_s)
        return ConfigRuns(name, results), tp

    base, base_tp = wave("RaLMSeq", lambda q, pool: run_seq(q, gen, kb, req))
    base.identical = [True] * len(base.results)
    per_request = [
        {"retriever": kind, "question": q, "seq": b.stats.as_dict(), "seq_tokens": len(b.tokens)}
        for q, b in zip(questions, base.results)
    ]
    rows = [with_throughput(summarize(base, base, retriever=kind), base_tp)]
    for c in configs:
        runs, tp = wave(c, lambda q, pool, c=c: ralm.spec.run_spec(q, gen, kb, req, specs[c], executor=pool))
        for q, b, r, row in zip(questions, base.results, runs.results, per_request):
            same = r.tokens == b.tokens
            runs.identical.append(same)
            row[c] = {"identical": same, **r.stats.as_dict()}
            if not same:
                log.error("OUTPUT DIFFERS: retriever=%s config=%s question=%r", kind, c, q)
        rows.append(with_throughput(summarize(base, runs, retriever=kind), tp))
    return rows, per_request


def bench_main(args: argparse.Namespace) -> int:
    """Entry point of ``ralmspec bench spec``; returns 1 if any RaLMSpec output differed from RaLMSeq's."""
    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.pipeline import Pipeline, check_kind

    cfg = load_config(args)
    cfg = cfg.model_copy(update={"request": cfg.request.model_copy(update={"ignore_eos": not args.allow_eos})})
    kinds = tuple(check_kind(k.strip()) for k in args.retrievers.split(",") if k.strip())
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    parsed = [SpecConfig.parse(c) for c in configs]  # fail fast on a bad name
    check_concurrency(args.concurrency)
    questions = load_questions(args.questions or C.DEMO_QUESTIONS, limit=args.num_questions + args.warmup)
    warm, timed = questions[: args.warmup], questions[args.warmup :]
    if not timed:
        timed, warm = questions, []
    pipe = Pipeline.from_config(cfg, kinds=kinds)
    concurrency = check_concurrency(args.concurrency, pipe.engine)
    notes = bench_header(
        "bench", len(timed), cfg, kinds, f"{cfg.corpus} ({len(pipe.corpus)} passages)", concurrency=concurrency
    )
    if any(sc.adaptive_stride and sc.gamma_estimate != "capped" for sc in parsed):
        notes.append(
            "S with the default gamma estimate: each configuration's gamma prior starts empty and carries over "
            "between its own requests (the warm-up's included), as in a serving process; caches are cleared "
            "before every request."
        )
    notes.append(machine_note({k: r.scan_label for k in kinds if hasattr(r := pipe.retriever(k), "scan_label")}))
    all_rows: list[ConfigSummary] = []
    all_req: list[dict] = []
    t0 = time.perf_counter()
    for kind in kinds:
        rows, per_req = run_retriever(pipe, kind, warm + timed, configs, warmup=len(warm), concurrency=concurrency)
        all_rows += rows
        all_req += per_req
    md = markdown_table(all_rows, notes, BENCH_COLUMNS + (THROUGHPUT_COLUMNS if concurrency > 1 else []))
    write_report(
        args.out,
        "bench",
        {
            "notes": notes,
            "summary": [r.as_dict() for r in all_rows],
            "requests": all_req,
            "config": json.loads(cfg.model_dump_json()),
            "corpus_passages": len(pipe.corpus),
            "concurrency": concurrency,
            "wall_s": time.perf_counter() - t0,
            **({"batcher": pipe.engine.batcher.metrics()} if concurrency > 1 and pipe.engine.batcher else {}),
        },
        md,
    )
    latency_chart(all_rows, args.out / "bench.png")
    print(md)
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")
    return exactness_status(sum(r.requests - r.identical for r in all_rows), "RaLMSpec outputs differ from RaLMSeq")
