"""``ralmspec bench knn``: KNN-LM baseline against speculative retrieval, side by side.

For each datastore index (exact: the flat index, scanned in bf16 with a proven error
bound where the CPU allows it, else FAISS IndexFlatL2, optionally padded with far-away
random vectors to emulate a large datastore's search cost; approximate: HNSW) and each
``k``, every prompt runs the baseline (:func:`ralm.knnlm.run_knn_seq`, one KB retrieval
per token) and then each speculative configuration (fixed strides ``s=N``, ``S`` for
OS3, ``S@G`` for OS3 with gamma cap G, a ``P`` prefix for prefetching) back to back.
Every speculative output is compared token by token with the baseline's; any difference
makes the command exit non-zero. The notes give the KB latency by batch size (is
verification flat in the batch?), the strides OS3 chose and each configuration's
settings. Writes ``knn_bench.json`` and ``knn_bench.md``.

The cache and stride settings (``--prefetch-size``, ``--spatial-next``,
``--cache-retrievals``, ``--max-stride``) default to :class:`~ralm.config.KnnLMConfig`'s,
so ``--configs PS`` measures what a user gets. A configuration may set its own with
``;FIELD=VALUE`` (:data:`KNN_FIELDS` go to its KnnLMConfig, any other field to its
SpecConfig), so two settings run side by side on the same prompts, e.g. the library's
defaults before 2026-11-27 against today's::

    --configs "PS;prefetch_size=256;spatial_next=10;cache_retrievals=8;max_stride=16,PS"

Example (the datastore of 2,000 passages is built once into DIR and reused):

    ralmspec bench knn --passages 2000 --datastore-dir DIR -n 5 --max-new-tokens 64 \
        --pad-to 4000000 --ks 16,1024 --indexes flat --configs PS,Ps=16
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from cluster.flags import SHARED, Default, add_shared
from cluster.report import (
    KNN_COLUMNS,
    ConfigRuns,
    exactness_status,
    machine_note,
    markdown_table,
    summarize,
    write_report,
)
from ralm import constants as C
from ralm.config import GeneratorConfig, KnnLMConfig, RequestConfig, SpecConfig
from ralm.corpus import Corpus, load_questions

log = logging.getLogger(__name__)


def add_knn_bench_args(p: argparse.ArgumentParser) -> None:
    add_shared(
        p,
        model=str(C.DEMO_MODEL_DIR),
        corpus=Default(C.DEMO_CORPUS, help=SHARED["corpus"].help + ", the datastore's source"),
    )
    p.add_argument("--passages", type=int, default=400, help="datastore = the first N passages of the corpus")
    p.add_argument(
        "--max-passage-tokens",
        type=int,
        default=C.KNN_MAX_PASSAGE_TOKENS,
        help="datastore build: each passage truncated to this many tokens",
    )
    p.add_argument(
        "--datastore-dir",
        type=Path,
        help="load the datastore from here if it matches, else build and save it there (default: <out>/datastore)",
    )
    add_shared(p, questions=None, num_questions=Default(5, help="prompts to run (questions)"), max_new_tokens=32)
    p.add_argument("--ks", default="1,16,256,1024", help="comma-separated k values (1..1024)")
    p.add_argument("--indexes", default="flat,hnsw", help="comma-separated subset of flat,hnsw")
    add_shared(
        p,
        configs=Default(
            C.KNN_DEFAULT_SPEC,
            help="RaLMSpec configurations, comma-separated (ralm.config.SpecConfig.parse): s=N (fixed stride) or "
            "S (OS3); prefix P to prefetch (e.g. Ps=8, PS); @G sets OS3's gamma cap (e.g. S@0.9); "
            f"append ;FIELD=VALUE to set a field for this configuration only ({', '.join(KNN_FIELDS)}: "
            "KnnLMConfig; others: SpecConfig). Default: PS, KNN-LM's default",
        ),
    )
    p.add_argument(
        "--prefetch-size",
        type=int,
        default=C.KNN_PREFETCH_SIZE,
        help="p for P configs: every KB search fetches the top-max(k, p) into the cache (<= 1024; "
        "KnnLMConfig.prefetch_size)",
    )
    p.add_argument(
        "--cache-entries",
        type=int,
        default=0,
        help="speculative cache capacity in entries (0: --cache-retrievals KB answers)",
    )
    p.add_argument(
        "--cache-retrievals",
        type=int,
        default=C.KNN_CACHE_RETRIEVALS,
        help="default cache capacity in KB answers, each p (n + 1) entries (KnnLMConfig.cache_retrievals)",
    )
    p.add_argument(
        "--cache-project-dims",
        type=int,
        default=C.KNN_CACHE_PROJECT_DIMS,
        help="speculative cache scans PCA-projected keys of this many dims (0: full keys; "
        "KnnLMConfig.cache_project_dims; never changes results)",
    )
    add_shared(
        p,
        scan=Default(
            "auto", help=SHARED["scan"].help + " (KnnLMConfig.scan)", choices=("auto", "faiss", "bf16", "int8")
        ),
        pad_to=0,
    )
    p.add_argument(
        "--lmbda", type=float, default=C.KNN_LAMBDA, help="lambda of argmax(lambda p_knn + (1 - lambda) p_lm)"
    )
    p.add_argument("--temperature", type=float, default=C.KNN_TEMPERATURE, help="T of p_knn ~ exp(-dist/T)")
    p.add_argument(
        "--spatial-next",
        type=int,
        default=C.KNN_SPATIAL_NEXT,
        help="n: each retrieved entry's n successors also go into the speculative cache",
    )
    p.add_argument("--hnsw-m", type=int, default=C.HNSW_M, help="HNSW graph degree M")
    p.add_argument("--hnsw-ef-construction", type=int, default=C.HNSW_EF_CONSTRUCTION, help="HNSW efConstruction")
    p.add_argument("--hnsw-ef-search", type=int, default=C.HNSW_EF_SEARCH, help="HNSW efSearch")
    p.add_argument(
        "--gamma-max",
        type=float,
        default=C.OS3_GAMMA_MAX,
        help="OS3 cap on the gamma estimate (the paper's 0.6 by default)",
    )
    p.add_argument(
        "--max-stride", type=int, default=C.KNN_MAX_STRIDE, help="OS3 upper bound on s (KnnLMConfig.max_stride)"
    )
    add_shared(p, threads=Default(1, help="torch and FAISS threads"))
    add_shared(p, warmup=1, out=Path("knn-bench-out"))


# KnnLMConfig fields a configuration may set with ;FIELD=VALUE (the rest of a name is SpecConfig's)
KNN_FIELDS = (
    "prefetch_size",
    "spatial_next",
    "cache_retrievals",
    "max_stride",
    "cache_max_entries",
    "cache_project_dims",
)


def _spec(name: str, gamma_max: float = C.OS3_GAMMA_MAX) -> SpecConfig:
    """A configuration's SpecConfig by its name (:meth:`ralm.config.SpecConfig.parse`; here
    typically ``[P]s=N`` or ``[P]S[@G]``, its ``;FIELD=VALUE`` settings of :data:`KNN_FIELDS`
    left out: :func:`_knn_for` takes those), with this benchmark's gamma cap for S. KNN-LM has
    no asynchronous verification, so a name with A is an error."""
    head, *settings = name.split(";")
    spec_name = ";".join([head] + [x for x in settings if x.partition("=")[0].strip() not in KNN_FIELDS])
    flags = SpecConfig.parse(spec_name)
    if flags.async_verify:
        raise ValueError(
            f"KNN-LM speculation config {name!r}: asynchronous verification (A) is not supported "
            "for KNN-LM; use [P]s=N or [P]S[@G]"
        )
    return SpecConfig.parse(spec_name, **({"gamma_max": gamma_max} if flags.adaptive_stride else {}))


def _knn_for(name: str, base: KnnLMConfig) -> KnnLMConfig:
    """``base`` with the configuration's own ``;FIELD=VALUE`` settings of :data:`KNN_FIELDS`."""
    upd = {}
    for setting in name.split(";")[1:]:
        key, eq, value = (x.strip() for x in setting.partition("="))
        if eq and key in KNN_FIELDS:
            upd[key] = value
    return KnnLMConfig.model_validate({**base.model_dump(), **upd}) if upd else base


def _load_or_build(args, engine, corpus):
    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.knnlm import Datastore, DatastoreError, build_datastore, model_fingerprint

    d = args.datastore_dir or (args.out / "datastore")
    fp = model_fingerprint(engine)
    want_hnsw = "hnsw" in args.indexes
    try:
        ds = Datastore.load(d, corpus=corpus, fingerprint=fp)
        if (
            ds.manifest.get("n_passages") != min(args.passages, len(corpus))
            or ds.manifest.get("max_passage_tokens") != args.max_passage_tokens
        ):
            raise DatastoreError("different size")
        if want_hnsw and (ds.hnsw is None or ds.manifest.get("hnsw", {}).get("m") != args.hnsw_m):
            ds.build_hnsw(args.hnsw_m, args.hnsw_ef_construction, progress=True)
            ds.save(d)
        log.info("loaded %r from %s", ds, d)
        return ds, d, False
    except DatastoreError as e:
        log.info("building the datastore (%s)", e)
    ds = build_datastore(
        engine,
        corpus,
        n_passages=args.passages,
        max_passage_tokens=args.max_passage_tokens,
        hnsw=want_hnsw,
        hnsw_m=args.hnsw_m,
        hnsw_ef_construction=args.hnsw_ef_construction,
        progress=True,
    )
    ds.save(d)
    return ds, d, True


def knn_bench_main(args) -> int:
    import faiss
    import torch
    from tqdm import tqdm

    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.engine import LMEngine
    from ralm.knnlm import KnnRetriever, knn_settings, new_cache, run_knn_seq, run_knn_spec  # lazy: as above

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    for k in ks:
        if not 1 <= k <= C.KNN_MAX_K:
            raise SystemExit(f"k={k} is outside 1..{C.KNN_MAX_K}")
    kinds = [x.strip() for x in args.indexes.split(",") if x.strip()]
    for kind in kinds:
        if kind not in ("flat", "hnsw"):
            raise SystemExit(f"unknown index {kind!r}: use flat or hnsw")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    specs = {c: _spec(c, args.gamma_max) for c in configs}
    args.out.mkdir(parents=True, exist_ok=True)

    engine = LMEngine.from_config(GeneratorConfig(model=args.model, torch_threads=args.threads))
    corpus = Corpus.load(args.corpus, limit=args.passages)
    ds, ds_dir, built = _load_or_build(args, engine, corpus)
    prompts = load_questions(args.questions or C.DEMO_QUESTIONS, limit=args.num_questions + args.warmup)
    warm, timed = prompts[: args.warmup], prompts[args.warmup :]
    if not timed:
        timed, warm = prompts, []
    req = RequestConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    notes = [
        f"# ralmspec bench knn: {len(timed)} prompts x {args.max_new_tokens} tokens (EOS ignored), "
        f"generator {args.model}, datastore {len(ds):,} entries x {ds.dim} dims from "
        f"{ds.manifest['n_passages']} passages of {args.corpus}, lambda={args.lmbda}, temperature={args.temperature}, "
        f"n={args.spatial_next}, S: Beta-posterior gamma per position bucket (S@bayes: one gamma; S@G: the paper's OS3 capped at G), max stride {args.max_stride}, "
        f"P prefetch size {args.prefetch_size}, cache capacity "
        f"{args.cache_entries or f'max(4096, {args.cache_retrievals} p (n + 1)), p = entries fetched per query'}, "
        f"cache scan {args.cache_project_dims or 'full'} dims, threads={args.threads} "
        f"(unless a configuration sets its own: see its settings below)",
        machine_note(),
    ]
    rows, per_request = [], []
    t_all = time.perf_counter()
    for kind in kinds:
        kb = KnnRetriever(
            ds, kind, pad_to=args.pad_to if kind == "flat" else 0, hnsw_ef_search=args.hnsw_ef_search, scan=args.scan
        )
        notes.append(f"KB {kind}: {kb!r}")
        if kb.padded_rows:
            notes.append(
                f"Note: the flat index is padded to {kb.padded_rows:,} rows ({len(ds):,} entries + "
                f"{kb.padded_rows - len(ds):,} random vectors of norm {C.KNN_PAD_NORM_FACTOR:g} x the "
                f"largest key norm, never returned) to emulate a large datastore's search cost; "
                f"results are unchanged."
            )
        for k in ks:
            knn = KnnLMConfig(
                k=k,
                lmbda=args.lmbda,
                temperature=args.temperature,
                index=kind,
                spatial_next=args.spatial_next,
                pad_to=args.pad_to if kind == "flat" else 0,
                cache_max_entries=args.cache_entries,
                cache_retrievals=args.cache_retrievals,
                cache_project_dims=args.cache_project_dims,
                scan=args.scan,
                prefetch_size=args.prefetch_size,
                max_stride=args.max_stride,
            )
            knns = {c: _knn_for(c, knn) for c in configs}
            for c in configs:
                notes.append(f"{kind} k={k} {c}: settings {knn_settings(kb, knns[c], specs[c])}")
            for p in warm:
                run_knn_seq(p, engine, kb, knn, req)
                for c in configs:
                    run_knn_spec(p, engine, kb, knns[c], req, specs[c])
            base = ConfigRuns("baseline")
            res = {c: ConfigRuns(c) for c in configs}
            caches: dict[str, list[Any]] = {c: [] for c in configs}
            kb.batch_s.clear()
            for p in tqdm(timed, desc=f"{kind} k={k}"):
                b = run_knn_seq(p, engine, kb, knn, req)
                base.results.append(b)
                base.identical.append(True)
                row = {"index": kind, "k": k, "prompt": p, "seq": b.stats.as_dict(), "seq_tokens": b.tokens}
                for c in configs:
                    cache = new_cache(kb, knns[c], specs[c])
                    r = run_knn_spec(p, engine, kb, knns[c], req, specs[c], cache=cache)
                    caches[c].append(cache)
                    ok = r.tokens == b.tokens
                    res[c].results.append(r)
                    res[c].identical.append(ok)
                    row[c] = {"identical": ok, **r.stats.as_dict()}
                    if not ok:
                        log.error("OUTPUT DIFFERS: index=%s k=%d config=%s prompt=%r", kind, k, c, p)
                per_request.append(row)
            where = {"index": kind + (f"(pad {kb.padded_rows:,})" if kb.padded_rows else ""), "k": k}
            block = [summarize(base, base, pooled_strides=True, **where)]
            block += [summarize(base, res[c], caches=caches[c], pooled_strides=True, **where) for c in configs]
            rows += block
            notes.append(
                f"{kind} k={k}: KB latency by batch size (ms, mean over calls): "
                + ", ".join(f"{b}: {1000 * t / n:.0f} ({n})" for b, (n, t) in sorted(kb.batch_s.items()))
            )
            for c in configs:
                strides = [x for r in res[c].results for x in r.stats.strides]
                if specs[c].adaptive_stride and strides:
                    hist = {x: strides.count(x) for x in sorted(set(strides))}
                    notes.append(f"{kind} k={k} {c}: strides chosen (size: windows) {hist}")
            log.info("%s k=%d: %s", kind, k, ", ".join(f"{r.config} {r.speedup:.2f}x" for r in block))
        notes.append(f"KB stats {kind}: {kb.stats}")
    # (every row here has its index label: summarize(**where))
    share = [r for r in rows if r.config == "baseline" and r.index is not None and r.index.startswith("flat")]
    if share:
        notes.append(
            "Baseline retrieval share (flat): " + ", ".join(f"k={r.k}: {r.retrieval_share:.0%}" for r in share)
        )
    md = markdown_table(rows, notes, KNN_COLUMNS)
    write_report(
        args.out,
        "knn_bench",
        {
            "notes": notes,
            "summary": [r.as_dict() for r in rows],
            "requests": per_request,
            "datastore": ds.manifest,
            "datastore_dir": str(ds_dir),
            "datastore_built": built,
            "argv": sys.argv,
            "args": {k: str(v) for k, v in vars(args).items() if k != "func"},
            "wall_s": time.perf_counter() - t_all,
        },
        md,
        default=str,
    )
    print(md)
    print(f"wrote {args.out}/knn_bench.json, knn_bench.md")
    return exactness_status(
        sum(r.requests - r.identical for r in rows), "speculative KNN-LM outputs differ from the baseline"
    )
