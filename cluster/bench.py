"""``ralmspec bench``: RaLMSeq against RaLMSpec configurations, side by side in one process.

For every question, every configuration runs back to back (interleaved, so machine
noise hits them alike), each request starting cold: empty doc-KV cache, no memoised
query encodings or BM25 document vectors left by another configuration's run. Every RaLMSpec
output is compared token by token with RaLMSeq's; any difference makes the command exit
non-zero. Writes ``bench.json``, ``bench.md`` and ``bench.png`` (stacked generation /
retrieval bars, like the RaLMSpec paper's Figure 4).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

from ralm.config import SpecConfig
from ralm.results import RalmResult

log = logging.getLogger(__name__)

DEFAULT_CONFIGS = ["base", "P", "S", "A", "PSA", "s=2", "s=4", "s=8"]


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", type=Path, help="JSONL with a 'question' field (default: the demo set)")
    p.add_argument("-n", "--num-questions", type=int, default=20)
    p.add_argument("--retrievers", default="edr,adr,sr", help="comma-separated subset of edr,adr,sr")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated: base, any of P/S/A, s=N for a fixed stride; append @G to set OS3's gamma cap (e.g. PSA@0.9)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up questions")
    p.add_argument("--allow-eos", action="store_true",
                   help="stop requests at EOS (default: fixed-length generation with EOS masked, as in the paper)")


def parse_config(name: str, **defaults) -> SpecConfig:
    """'PSA' -> SpecConfig(P,S,A); 's=4' -> fixed stride 4 without P/S/A;
    'PSA@0.9' -> PSA with OS3's gamma cap raised from the paper's 0.6 to 0.9.
    ``defaults``: other SpecConfig fields (e.g. a server's), overridden by the name."""
    base, _, cap = name.partition("@")
    extra = {**defaults, **({"gamma_max": float(cap)} if cap else {})}
    if base.startswith("s="):
        return SpecConfig(**{**extra, "stride": int(base[2:])})
    return SpecConfig.named(base, **extra)


@dataclass
class ConfigRuns:
    name: str
    results: list[RalmResult] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)


def summarize(base: ConfigRuns, runs: ConfigRuns) -> dict:
    """Means over requests, and the ratios against the baseline's means."""
    T = fmean(r.stats.total_time_s for r in runs.results)
    G = fmean(r.stats.gen_time_s for r in runs.results)
    R = fmean(r.stats.retrieval_time_s for r in runs.results)
    Tb = fmean(r.stats.total_time_s for r in base.results)
    Rb = fmean(r.stats.retrieval_time_s for r in base.results)
    gammas = [r.stats.gamma for r in runs.results if r.stats.gamma is not None]
    accs = [r.stats.speculation_accuracy for r in runs.results if r.stats.speculation_accuracy is not None]
    return {
        "config": runs.name,
        "latency_s": T, "gen_s": G, "retrieval_s": R,
        "retrieval_share": R / T if T else 0.0,
        "speedup": Tb / T if T else 0.0,
        "E": (Tb - T) / Rb if Rb else 0.0,
        "gamma": fmean(gammas) if gammas else None,
        "spec_accuracy": fmean(accs) if accs else None,
        "kb_calls": fmean(r.stats.kb_calls for r in runs.results),
        "rollbacks": fmean(r.stats.rollbacks for r in runs.results),
        "regenerated_tokens": fmean(r.stats.regenerated_tokens for r in runs.results),
        "mean_stride": fmean(fmean(r.stats.strides) for r in runs.results if r.stats.strides) if any(r.stats.strides for r in runs.results) else None,
        "identical": sum(runs.identical), "requests": len(runs.results),
    }


def run_retriever(pipe, kind: str, questions: list[str], configs: list[str], warmup: int,
                  progress: bool = True) -> tuple[list[dict], list[dict]]:
    from tqdm import tqdm
    from ralm.seq import run_seq
    from ralm.spec import run_spec

    kb = pipe.retriever(kind)
    gen = pipe.generator
    req = pipe.cfg.request
    specs = {c: parse_config(c) for c in configs}
    for q in questions[:warmup]:                      # warm FAISS/Lucene/torch, untimed
        run_seq(q, gen, kb, req)
        for c in configs:
            run_spec(q, gen, kb, req, specs[c])
    base = ConfigRuns("RaLMSeq")
    runs = {c: ConfigRuns(c) for c in configs}
    per_request: list[dict] = []
    def cold() -> None:
        # every request starts cold: no doc KV, no memoised query encodings or BM25
        # document vectors from an earlier configuration's run of the same question
        pipe.engine.doc_kv.clear()
        getattr(kb.scorer, "clear_caches", lambda: None)()

    for q in tqdm(questions[warmup:], desc=f"bench {kind}", disable=not progress):
        cold()
        b = run_seq(q, gen, kb, req)
        base.results.append(b)
        base.identical.append(True)
        row = {"retriever": kind, "question": q, "seq": b.stats.as_dict(), "seq_tokens": len(b.tokens)}
        for c in configs:
            cold()
            r = run_spec(q, gen, kb, req, specs[c])
            same = r.tokens == b.tokens
            runs[c].results.append(r)
            runs[c].identical.append(same)
            row[c] = {"identical": same, **r.stats.as_dict()}
            if not same:
                log.error("OUTPUT DIFFERS: retriever=%s config=%s question=%r", kind, c, q)
        per_request.append(row)
    rows = [summarize(base, base)] + [summarize(base, runs[c]) for c in configs]
    for r in rows:
        r["retriever"] = kind
    return rows, per_request


def run_notes(tool: str, n_questions: int, cfg, kinds, corpus_desc: str) -> list[str]:
    """Header lines of a benchmark/evaluation report, with the padding disclosure when used."""
    notes = [f"# ralmspec {tool}: {n_questions} questions, corpus {corpus_desc}, generator {cfg.generator.model}, "
             f"k={cfg.request.generation_stride}, max_new_tokens={cfg.request.max_new_tokens}"]
    if "edr" in kinds and cfg.retriever.pad_to:
        notes.append(f"Note: the EDR flat index is padded to {cfg.retriever.pad_to:,} rows with random "
                     f"vectors that never outrank a real passage, to emulate Wikipedia-scale search cost; "
                     f"results are unchanged.")
    return notes


def markdown_table(rows: list[dict], notes: list[str]) -> str:
    head = ("| retriever | config | latency ms | G ms | R ms | R share | speed-up | E | gamma | "
            "spec acc | KB calls | rollbacks | regen tok | mean s | identical |")
    out = [head, "|" + "---|" * 15]
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"   # noqa: E731
    for r in rows:
        out.append(f"| {r['retriever']} | {r['config']} | {r['latency_s']*1000:.0f} | {r['gen_s']*1000:.0f} | "
                   f"{r['retrieval_s']*1000:.0f} | {r['retrieval_share']:.0%} | {r['speedup']:.2f}x | "
                   f"{f(r['E'])} | {f(r['gamma'])} | {f(r['spec_accuracy'])} | {r['kb_calls']:.1f} | "
                   f"{r['rollbacks']:.1f} | {r['regenerated_tokens']:.1f} | {f(r['mean_stride'], 1)} | "
                   f"{r['identical']}/{r['requests']} |")
    return "\n".join(notes + [""] + out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["retriever"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rs = [r for r in rows if r["retriever"] == kind]
        names = [r["config"] for r in rs]
        g = [r["gen_s"] * 1000 for r in rs]
        rr = [r["retrieval_s"] * 1000 for r in rs]
        ax.bar(names, g, label="G (generation)", color="#4c72b0")
        ax.bar(names, rr, bottom=g, label="R (retrieval)", color="#dd8452")
        for i, r in enumerate(rs):
            ax.text(i, g[i] + rr[i], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_title(kind.upper())
        ax.set_ylabel("mean latency per request (ms)")
        ax.tick_params(axis="x", rotation=45)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_main(args) -> int:
    from cluster.cli import load_config
    from ralm import constants as C
    from ralm.corpus import load_questions
    from ralm.pipeline import Pipeline, check_kind

    cfg = load_config(args)
    cfg = cfg.model_copy(update={"request": cfg.request.model_copy(update={"ignore_eos": not args.allow_eos})})
    kinds = tuple(check_kind(k.strip()) for k in args.retrievers.split(",") if k.strip())
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        parse_config(c)                               # fail fast on a bad name
    questions = load_questions(args.questions or C.DEMO_QUESTIONS, limit=args.num_questions + args.warmup)
    warm, timed = questions[: args.warmup], questions[args.warmup:]
    if not timed:
        timed, warm = questions, []
    pipe = Pipeline.from_config(cfg, kinds=kinds)
    notes = run_notes("bench", len(timed), cfg, kinds, f"{cfg.corpus} ({len(pipe.corpus)} passages)")
    all_rows, all_req = [], []
    t0 = time.perf_counter()
    for kind in kinds:
        rows, per_req = run_retriever(pipe, kind, warm + timed, configs, warmup=len(warm))
        all_rows += rows
        all_req += per_req
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown_table(all_rows, notes)
    (args.out / "bench.md").write_text(md)
    (args.out / "bench.json").write_text(json.dumps(
        {"notes": notes, "summary": all_rows, "requests": all_req,
         "config": json.loads(cfg.model_dump_json()), "wall_s": time.perf_counter() - t0}, indent=1))
    plot(all_rows, args.out / "bench.png")
    print(md)
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")
    diffs = sum(r["requests"] - r["identical"] for r in all_rows)
    if diffs:
        print(f"FAIL: {diffs} RaLMSpec outputs differ from RaLMSeq", file=sys.stderr)
        return 1
    return 0
