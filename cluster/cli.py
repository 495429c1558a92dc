"""The ``ralmspec`` command line: one tool, one grammar.

    ralmspec index      --retriever edr|adr|sr|all        build indexes (progress bars, manifest)
    ralmspec generate   --retriever edr "question"        answer one question (SmolLM2-135M; --model demo), print statistics
    ralmspec serve                                        start the HTTP server (OpenAI-compatible + native API)
    ralmspec eval       --questions FILE ...              resumable batch evaluation (local or `ray job submit`)
    ralmspec gpu-check                                    exact batching on this accelerator: proof, identical counts, speed
    ralmspec report     [--check]                         regenerate docs/results/README.md from its manifest
    ralmspec bench NAME ...                               a benchmark:
        spec            RaLMSeq vs RaLMSpec configurations, side by side, in-process
        served          served throughput and latency at several concurrencies
        burst           a fresh server under bursts: throughput, sheds, memory
        soak            mixed load over time: leaks, drift, exactness
        gen             doc-KV reuse and drafting
        batching        continuous batching and KV sessions
        knn             KNN-LM speculation
        costs           unit costs of retrieval and generation
        paper-table     the RaLMSpec paper's grid on our profiles, beside its numbers
    ralmspec pad-corpus --to N --out FILE                 a corpus padded with generated passages
    ralmspec k8s                                          regenerate KubeRay manifests from serve_config.yaml
    ralmspec assets     corpus|questions|train|fixtures|embeddings   rebuild the shipped demo assets

``ralmspec COMMAND --help`` (``ralmspec bench NAME --help``) lists a command's flags with their
defaults. A flag means the same in every command that takes it (``--out``, ``--questions``,
``-n``, ``--max-new-tokens``, ...: cluster/flags.py defines each once). The former names
(``served-bench``, ``bench-knn``, ``costs``, ``bench --configs ...``, ...) still work.

Commands that build a pipeline read the same :class:`ralm.config.RalmConfig` (``--config
FILE.yaml``), with the most common fields overridable by flags. Its generator defaults to the
library's 4.5M-parameter demo model, except in ``generate`` and ``serve``, the commands a user
tries first: without ``--model`` or ``--config`` they run SmolLM2-135M-Instruct
(``cluster.serve.DEFAULT_MODEL``); ``--model demo`` is the demo model.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.config_args import load_config
from cluster.flags import MODEL_OR_DEMO, Default, HelpFormatter, add_shared, config_parent
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
    return importlib.import_module(f"cluster.assets.{ASSETS[args.what]}").main(args.rest) or 0


#: ``ralmspec assets WHAT`` -> the module of cluster/assets/ that rebuilds it
ASSETS = {
    "corpus": "build_corpus",
    "questions": "build_questions",
    "train": "train_generator",
    "fixtures": "make_fixtures",
    "embeddings": "export_embeddings",
}


@dataclass(frozen=True)
class Command:
    """A subcommand implemented in its own module: ``add_args(parser)`` adds its flags (the
    shared ones with :func:`cluster.flags.add_shared`), ``entry(args)`` runs it."""

    name: str
    module: str
    add_args: str
    entry: str
    help: str
    #: takes the RalmConfig flags (cluster.flags.config_parent)
    config: bool = False
    #: its wording of the RalmConfig's --model (None: the shared one)
    model: Default | None = None
    #: the names it had before it joined a group, still accepted (hidden from --help)
    legacy: str | None = None


#: --model of ``serve`` and ``generate``: SmolLM2 when neither --model nor --config is given
_SERVE_MODEL = Default(help=MODEL_OR_DEMO, unset=f"{DEFAULT_MODEL}, or the model of --config")

#: ``ralmspec NAME``: the commands that run the system, besides index and generate.
COMMANDS: tuple[Command, ...] = (
    Command(
        "serve",
        "cluster.serve",
        "add_serve_args",
        "serve_main",
        f"start the HTTP server (Ray Serve) from serve_config.yaml (generator: {DEFAULT_MODEL} unless --model/--config)",
        config=True,
        model=_SERVE_MODEL,
    ),
    Command(
        "eval",
        "cluster.eval_job",
        "add_eval_args",
        "eval_main",
        "resumable batch evaluation, RaLMSeq vs RaLMSpec (also under `ray job submit`)",
        config=True,
    ),
    Command(
        "gpu-check",
        "cluster.bench.gpu_check",
        "add_gpu_check_args",
        "gpu_check_main",
        "exact batching on this machine's GPU: the whole-model proof per dtype, batched vs alone, forward and scan speed",
    ),
    Command(
        "report",
        "cluster.results_page",
        "add_report_args",
        "report_main",
        "regenerate docs/results/README.md from docs/results/manifest.yaml (--check: fail if it is out of date)",
    ),
)

#: ``ralmspec NAME``: tools that prepare data and deployments.
TOOLS: tuple[Command, ...] = (
    Command(
        "pad-corpus",
        "cluster.pad_corpus",
        "add_pad_corpus_args",
        "pad_corpus_main",
        "a corpus padded with passages generated from its own term statistics (large-KB costs for sr/adr)",
    ),
    Command(
        "k8s",
        "cluster.k8s_gen",
        "add_k8s_args",
        "k8s_main",
        "regenerate the KubeRay manifests in k8s/ from serve_config.yaml",
    ),
)

#: ``ralmspec bench NAME``: the benchmarks.
BENCHES: tuple[Command, ...] = (
    Command(
        "spec",
        "cluster.bench.spec_bench",
        "add_bench_args",
        "bench_main",
        "RaLMSeq against RaLMSpec configurations, side by side, in-process",
        config=True,
    ),
    Command(
        "served",
        "cluster.bench.served_bench",
        "add_served_bench_args",
        "served_bench_main",
        "served throughput and latency at several concurrencies",
        legacy="served-bench",
    ),
    Command(
        "burst",
        "cluster.bench.burst_bench",
        "add_burst_bench_args",
        "burst_bench_main",
        "a fresh server's start-up, first and second bursts, and a big burst: throughput, sheds, memory",
        legacy="burst-bench",
    ),
    Command(
        "soak",
        "cluster.bench.soak",
        "add_soak_args",
        "soak_main",
        "serve a mixed load for N minutes; report success, latency, RSS, fds and Redis keys over time",
        legacy="soak",
    ),
    Command(
        "gen",
        "cluster.bench.gen_bench",
        "add_gen_bench_args",
        "gen_bench_main",
        "the generation side: doc-KV reuse, n-gram vs dense drafting",
        legacy="bench-gen",
    ),
    Command(
        "batching",
        "cluster.bench.batch_bench",
        "add_batch_bench_args",
        "batch_bench_main",
        "the generator: invariant forward cost, continuous batching and KV sessions",
        legacy="bench-batching",
    ),
    Command(
        "knn",
        "cluster.bench.knn_bench",
        "add_knn_bench_args",
        "knn_bench_main",
        "KNN-LM: per-token retrieval baseline vs speculation",
        legacy="bench-knn",
    ),
    Command(
        "costs",
        "cluster.bench.costs",
        "add_costs_args",
        "costs_main",
        "measured unit costs: retrieval at batch 1 and 16, prefill, decode",
        config=True,
        legacy="costs",
    ),
    Command(
        "paper-table",
        "cluster.bench.paper_table",
        "add_paper_table_args",
        "paper_table_main",
        "the RaLMSpec paper's grid (EDR/ADR/SR x base/P/S/A/PSA, KNN-LM k=16/1024) beside its published speed-ups",
        legacy="paper-table",
    ),
)

#: old command names -> the words that replace them
LEGACY_NAMES: dict[str, tuple[str, ...]] = {b.legacy: ("bench", b.name) for b in BENCHES if b.legacy}


def canonical_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` in today's grammar: a former command name (``served-bench``, ``bench-knn``,
    ``costs``, ...) becomes ``bench NAME``, and ``bench`` followed by a flag, the former
    spelling of ``bench spec``, becomes ``bench spec``."""
    argv = list(argv)
    if argv and argv[0] == "bench":
        if len(argv) > 1 and argv[1].startswith("-") and argv[1] not in ("-h", "--help"):
            return ["bench", "spec", *argv[1:]]
        return argv
    if argv and argv[0] in LEGACY_NAMES:
        return [*LEGACY_NAMES[argv[0]], *argv[1:]]
    return argv


def _add_command(sub, cmd: Command) -> argparse.ArgumentParser:
    mod = importlib.import_module(cmd.module)
    parents = [config_parent(model=cmd.model)] if cmd.config else []
    sp = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, parents=parents, formatter_class=HelpFormatter)
    getattr(mod, cmd.add_args)(sp)
    sp.set_defaults(func=getattr(mod, cmd.entry))
    return sp


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ralmspec``: every command and benchmark (old names: :func:`canonical_argv`)."""
    p = argparse.ArgumentParser(prog="ralmspec", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    pi = sub.add_parser(
        "index",
        help="build retrieval indexes",
        description="build retrieval indexes (progress bars, a manifest per index)",
        parents=[config_parent()],
        formatter_class=HelpFormatter,
    )
    add_shared(
        pi,
        retriever=Default("all", help="retriever kind: edr, adr, sr or all"),
        index_dir=Default(unset="<work-dir>/indexes/<kind>"),
    )
    pi.add_argument("--force", action="store_true", help="rebuild even if a valid index exists")
    pi.set_defaults(func=cmd_index)

    help_ = f"answer one question and print its statistics (generator: {DEFAULT_MODEL} unless --model/--config)"
    pg = sub.add_parser(
        "generate",
        help=help_,
        description=help_,
        parents=[config_parent(model=_SERVE_MODEL)],
        formatter_class=HelpFormatter,
    )
    pg.add_argument("question", help="the question")
    add_shared(pg, retriever="edr")
    pg.add_argument("--method", choices=GENERATE_METHODS, default="spec", help="RaLMSeq (seq) or RaLMSpec (spec)")
    add_shared(pg, spec="PSA", max_new_tokens=None)
    pg.add_argument("--json", action="store_true", help="print the result as JSON")
    pg.set_defaults(func=cmd_generate)

    for cmd in COMMANDS:
        _add_command(sub, cmd)

    pb = sub.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(b.name for b in BENCHES),
        description="benchmarks; `ralmspec bench NAME --help` for one",
        formatter_class=HelpFormatter,
    )
    bench = pb.add_subparsers(dest="bench", required=True, metavar="NAME")
    for b in BENCHES:
        _add_command(bench, b)

    for cmd in TOOLS:
        _add_command(sub, cmd)

    pa = sub.add_parser(
        "assets",
        help="rebuild the shipped demo assets",
        description="rebuild the shipped demo assets; `ralmspec assets WHAT --help` for one",
        formatter_class=HelpFormatter,
    )
    pa.add_argument("what", choices=list(ASSETS), help="which asset to rebuild")
    pa.add_argument("rest", nargs=argparse.REMAINDER, help="the asset builder's own flags")
    pa.set_defaults(func=cmd_assets)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(canonical_argv(sys.argv[1:] if argv is None else argv))
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
