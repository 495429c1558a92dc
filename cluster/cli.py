"""The ``ralmspec`` command line.

    ralmspec index    --retriever edr|adr|sr|all     build indexes (progress bars, manifest)
    ralmspec generate --retriever edr "question"     answer one question (SmolLM2-135M; --model demo), print statistics
    ralmspec bench    ...                            side-by-side RaLMSeq vs RaLMSpec benchmark
    ralmspec serve                                   start the HTTP server (OpenAI-compatible + native API)
    ralmspec served-bench ...                        served throughput/latency benchmark
    ralmspec burst-bench ...                         a fresh server under bursts: throughput, sheds, memory
    ralmspec soak --minutes 30 --concurrency 8       mixed load over time: leaks, drift, exactness
    ralmspec bench-gen ...                           doc-KV reuse and drafting benchmark
    ralmspec bench-batching ...                      continuous batching and KV sessions benchmark
    ralmspec gpu-check                               exact batching on this accelerator: proof, identical counts, speed
    ralmspec costs                                   unit costs of retrieval and generation
    ralmspec bench-knn ...                           KNN-LM speculation benchmark
    ralmspec paper-table                             the RaLMSpec paper's grid on our profiles, beside its numbers
    ralmspec eval     --questions FILE ...           resumable batch evaluation (local or `ray job submit`)
    ralmspec k8s                                     regenerate KubeRay manifests from serve_config.yaml
    ralmspec assets   corpus|questions|train|fixtures|embeddings  rebuild the shipped demo assets

Every command reads the same :class:`ralm.config.RalmConfig` (``--config FILE.yaml``),
with the most common fields overridable by flags. Its generator defaults to the library's
4.5M-parameter demo model, except in ``generate`` and ``serve``, the commands a user tries
first: without ``--model`` or ``--config`` they run SmolLM2-135M-Instruct
(``cluster.serve.DEFAULT_MODEL``); ``--model demo`` is the demo model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from cluster.config_args import add_config_args, load_config
from cluster.serve import DEFAULT_MODEL, cli_model, model_settings
from ralm.config import SpecConfig
from ralm.corpus import Corpus, CorpusError
from ralm.errors import ConfigError, RalmInputError
from ralm.methods import DOCUMENT_METHODS
from ralm.retrieval.index_build import build_index, check_kind, kinds as retriever_kinds, validate_index

# what `generate` runs: the document-level methods of the method table (the same tuple as
# ralm.pipeline.PIPELINE_METHODS; ralm.pipeline is not imported here because it loads torch)
GENERATE_METHODS: tuple[str, ...] = DOCUMENT_METHODS


def cmd_index(args) -> int:
    cfg = load_config(args)
    kinds = retriever_kinds() if args.retriever == "all" else (check_kind(args.retriever),)
    if args.index_dir and len(kinds) != 1:
        raise ConfigError("--index-dir needs a single --retriever (edr, adr or sr)")
    corpus = Corpus.load(cfg.corpus)
    for kind in kinds:
        out = args.index_dir or cfg.index_dir(kind)
        rcfg = cfg.retriever.model_copy(update={"kind": kind})
        if (out / "manifest.json").is_file() and not args.force:
            validate_index(out, rcfg, corpus)  # raises a clear error if stale or damaged
            print(f"{kind} index at {out} is up to date (use --force to rebuild)", file=sys.stderr)
            continue
        print(f"building {kind} index over {len(corpus)} passages -> {out}", file=sys.stderr)
        manifest = build_index(kind, corpus, out, rcfg, progress=True)
        print(f"built {kind} index in {manifest.get('build_seconds', 0):.1f} s", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    from ralm.pipeline import Pipeline  # lazy: the generate subcommand loads torch, the others need not

    args.model = cli_model(args)  # SmolLM2 unless --model or --config says otherwise
    cfg = load_config(args)
    if args.model is not None and not args.config:
        cfg = cfg.model_copy(update={"generator": cfg.generator.model_copy(update=model_settings(args.model))})
    kind = check_kind(args.retriever)
    pipe = Pipeline.from_config(cfg, kinds=(kind,))
    spec = SpecConfig.parse(args.spec) if args.method == "spec" else None
    res = pipe.answer(args.question, kind=kind, method=args.method, spec=spec)
    if args.json:
        print(json.dumps(res.as_dict(), indent=2))
        return 0
    print(res.text.strip())
    s = res.stats
    print("\n--- statistics ---")
    print(f"method={s.method} retriever={s.retriever} tokens={len(res.tokens)} finish={res.finish_reason}")
    print(
        f"steps={s.steps} kb_calls={s.kb_calls} kb_queries={s.kb_queries} rollbacks={s.rollbacks} "
        f"regenerated_tokens={s.regenerated_tokens} strides={s.strides} gamma={s.gamma}"
    )
    print(
        f"time total={s.total_time_s * 1000:.1f} ms generation={s.gen_time_s * 1000:.1f} ms "
        f"retrieval={s.retrieval_time_s * 1000:.1f} ms"
    )
    titles = [pipe.corpus.titles[d] if d is not None else "-" for d in s.doc_ids]
    print("documents: " + ", ".join(dict.fromkeys(titles)))
    return 0


def cmd_assets(args) -> int:
    import importlib

    mod = {
        "corpus": "build_corpus",
        "questions": "build_questions",
        "train": "train_generator",
        "fixtures": "make_fixtures",
        "embeddings": "export_embeddings",
    }[args.what]
    return importlib.import_module(f"cluster.assets.{mod}").main(args.rest) or 0


# (command, module, add-arguments function, entry point, takes the common flags, help)
_PLUGGED_COMMANDS = [
    (
        "bench",
        "cluster.bench.spec_bench",
        "add_bench_args",
        "bench_main",
        True,
        "benchmark RaLMSeq against RaLMSpec configurations",
    ),
    (
        "serve",
        "cluster.serve",
        "add_serve_args",
        "serve_main",
        True,
        f"start the HTTP server (Ray Serve) from serve_config.yaml (generator: {DEFAULT_MODEL} unless --model/--config)",
    ),
    (
        "served-bench",
        "cluster.bench.served_bench",
        "add_served_bench_args",
        "served_bench_main",
        False,
        "served throughput/latency benchmark at several concurrencies",
    ),
    (
        "burst-bench",
        "cluster.bench.burst_bench",
        "add_burst_bench_args",
        "burst_bench_main",
        False,
        "a fresh server's start-up, first and second bursts, and a big burst: throughput, sheds, memory",
    ),
    (
        "soak",
        "cluster.bench.soak",
        "add_soak_args",
        "soak_main",
        False,
        "serve a mixed load for N minutes; report success, latency, RSS, fds and Redis keys over time",
    ),
    (
        "bench-gen",
        "cluster.bench.gen_bench",
        "add_gen_bench_args",
        "gen_bench_main",
        False,
        "generation-side benchmark: doc-KV reuse, n-gram vs dense drafting",
    ),
    (
        "bench-batching",
        "cluster.bench.batch_bench",
        "add_batch_bench_args",
        "batch_bench_main",
        False,
        "generator benchmark: invariant forward cost, continuous batching and KV sessions",
    ),
    (
        "gpu-check",
        "cluster.bench.gpu_check",
        "add_gpu_check_args",
        "gpu_check_main",
        False,
        "exact batching on this machine's GPU: the whole-model proof per dtype, batched vs alone, forward and scan speed",
    ),
    (
        "costs",
        "cluster.bench.costs",
        "add_costs_args",
        "costs_main",
        True,
        "measured unit costs: retrieval at batch 1 and 16, prefill, decode",
    ),
    (
        "bench-knn",
        "cluster.bench.knn_bench",
        "add_knn_bench_args",
        "knn_bench_main",
        False,
        "KNN-LM benchmark: per-token retrieval baseline vs speculation",
    ),
    (
        "paper-table",
        "cluster.bench.paper_table",
        "add_paper_table_args",
        "paper_table_main",
        False,
        "the RaLMSpec paper's grid (EDR/ADR/SR x base/P/S/A/PSA, KNN-LM k=16/1024) beside its published speed-ups",
    ),
    (
        "pad-corpus",
        "cluster.pad_corpus",
        "add_pad_corpus_args",
        "pad_corpus_main",
        False,
        "a corpus padded with passages generated from its own term statistics (large-KB costs for sr/adr)",
    ),
    (
        "eval",
        "cluster.eval_job",
        "add_eval_args",
        "eval_main",
        True,
        "resumable batch evaluation, RaLMSeq vs RaLMSpec (also under `ray job submit`)",
    ),
    (
        "report",
        "cluster.results_page",
        "add_report_args",
        "report_main",
        False,
        "regenerate docs/results/README.md from docs/results/manifest.yaml (--check: fail if it is out of date)",
    ),
    (
        "k8s",
        "cluster.k8s_gen",
        "add_k8s_args",
        "k8s_main",
        False,
        "regenerate the KubeRay manifests in k8s/ from serve_config.yaml",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ralmspec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    pi = sub.add_parser("index", help="build retrieval indexes")
    add_config_args(pi)
    pi.add_argument("--retriever", default="all", help="edr, adr, sr or all")
    pi.add_argument("--index-dir", type=Path, help="output directory (default <work-dir>/indexes/<kind>)")
    pi.add_argument("--force", action="store_true", help="rebuild even if a valid index exists")
    pi.set_defaults(func=cmd_index)

    pg = sub.add_parser(
        "generate",
        help=f"answer one question and print its statistics (generator: {DEFAULT_MODEL} unless --model/--config)",
    )
    add_config_args(pg)
    pg.add_argument("question")
    pg.add_argument("--retriever", default="edr", help="edr, adr or sr")
    pg.add_argument("--method", choices=GENERATE_METHODS, default="spec")
    pg.add_argument(
        "--spec",
        default="PSA",
        help="RaLMSpec configuration: base, any of P, S, A, s=N; @G sets OS3's gamma cap (e.g. PSA@0.9)",
    )
    pg.add_argument("--max-new-tokens", type=int)
    pg.add_argument("--json", action="store_true", help="print the result as JSON")
    pg.set_defaults(func=cmd_generate)

    import importlib

    for name, module, add_args, entry, with_base, help_ in _PLUGGED_COMMANDS:
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_)
        if with_base:
            add_config_args(sp)
        getattr(mod, add_args)(sp)
        sp.set_defaults(func=getattr(mod, entry))

    pa = sub.add_parser("assets", help="rebuild shipped demo assets")
    pa.add_argument("what", choices=["corpus", "questions", "train", "fixtures", "embeddings"])
    pa.add_argument("rest", nargs=argparse.REMAINDER)
    pa.set_defaults(func=cmd_assets)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except (RalmInputError, ConfigError, CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # index mismatch/corruption errors derive from ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
