"""``ralmspec bench costs``: measured unit costs of the parts on the demo corpus.

Retrieval per batch of 1 and of 16 queries for EDR, ADR and SR (query encoding/analysis
reported separately from the search itself), and the generator's prefill and per-token
decode. Medians over repeated runs with fresh queries, so no memo is hit.

``--scans faiss,int8,bf16`` also measures every exact-dense candidate scan side by side on
the EDR index (padded with ``--pad-to``): search time of already encoded queries at batch
1 and 16 (or ``--scan-batches``), and the last size's ratio to the first, the cost of a
verification batch against one query. ``int8:fbgemm`` and ``int8:int_mm`` force the int8
scan's kernel (:mod:`ralm.retrieval.int8_kernels`); ``int8-own-widths`` is the ``int_mm``
int8 scan with each batch multiplied at its own width (:mod:`ralm.retrieval.int8_widths`),
to show what the padding changes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import median

import numpy as np

from cluster.config_args import load_config
from cluster.flags import SHARED, Default, add_shared
from cluster.report import machine_note, table, write_report
from ralm.retrieval.dense import DenseRetriever
from ralm.retrieval.int8_kernels import IntMM
from ralm.retrieval.int8_scan import Int8Scan
from ralm.retrieval.scan_choice import auto_timings


def add_costs_args(p: argparse.ArgumentParser) -> None:
    add_shared(
        p,
        reps=7,
        retrievers="edr,adr,sr",
        out=Default(Path("bench-out"), help=SHARED["out"].help + ": costs.json and costs.md"),
    )
    p.add_argument(
        "--scans",
        default="",
        help="comma-separated EDR candidate scans to compare at batch 1 and 16 (faiss, int8, int8:fbgemm, int8:int_mm, bf16, auto: the one picked here); "
        "only the scans and the machine line are reported then; int8-own-widths: the int_mm int8 scan without its batch-width padding",
    )
    p.add_argument(
        "--scan-batches",
        default="1,16",
        help="comma-separated batch sizes --scans measures (the last one's ratio to the first is reported)",
    )


def _queries(corpus, n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out: list[str] = []
    while len(out) < n:
        words = corpus.text(int(rng.integers(len(corpus)))).split()
        if len(words) >= 24:
            s = int(rng.integers(0, len(words) - 24))
            out.append(" ".join(words[s : s + 24]))
    return out


def measure_retriever(kb, corpus, reps: int, salt: int = 0) -> dict:
    res = {}
    for bs in (1, 16):
        enc_t, search_t = [], []
        for r in range(reps):
            qs = _queries(corpus, bs, seed=100_000 * salt + 1000 * bs + r)
            t0 = time.perf_counter()
            reps_ = kb.scorer.encode(qs)  # memoised afterwards
            t1 = time.perf_counter()
            kb.batch_search(qs, 20)  # encoding now a memo hit
            t2 = time.perf_counter()
            enc_t.append(t1 - t0)
            search_t.append(t2 - t1)
            del reps_
        res[f"batch{bs}"] = {
            "encode_ms": median(enc_t) * 1000,
            "search_ms": median(search_t) * 1000,
            "per_query_ms": (median(enc_t) + median(search_t)) * 1000 / bs,
        }
    return res


def measure_scans(kb, corpus, scans: list[str], pad_to: int, reps: int, sizes: tuple[int, ...] = (1, 16)) -> dict:
    """Search-only time (queries encoded beforehand) of each dense scan over the EDR
    vectors padded to ``pad_to`` rows, at each batch size of ``sizes``; every scan's hits
    are checked equal to the first one's."""
    qs = {bs: [kb.scorer.encode(_queries(corpus, bs, seed=7000 + 100 * bs + r)) for r in range(reps)] for bs in sizes}
    out: dict = {}
    first: dict | None = None
    for scan in scans:
        t0 = time.perf_counter()
        own_widths = scan == "int8-own-widths"
        mode, _, kernel = ("int8:int_mm" if own_widths else scan).partition(":")
        r = DenseRetriever(
            "edr", kb.encoder, kb.scorer.vectors, pad_to=pad_to, dense_scan=mode, int8_kernel=kernel or None
        )
        if own_widths:
            low = r.scan.low
            if not isinstance(low, Int8Scan) or not isinstance(low.kernel, IntMM):
                raise SystemExit("int8-own-widths needs the int_mm int8 scan, which this machine cannot run exactly")
            low.kernel.pad_widths = False
        row: dict = {"path": r.scan_label + (" own widths" if own_widths else ""), "build_s": time.perf_counter() - t0}
        row["rows"] = r.n_rows
        if scan == "auto":  # the kernel timings it chose by, when both low-precision scans run here
            row["auto_kernel_ms"] = auto_timings(kb.scorer.dim)
        hits = {}
        for bs in sizes:
            r.search_vectors(list(qs[bs][0]), 20)  # warm-up
            ts = []
            for rep in range(reps):
                t1 = time.perf_counter()
                hits[(bs, rep)] = r.search_vectors(list(qs[bs][rep]), 20)
                ts.append(time.perf_counter() - t1)
            row[f"batch{bs}_ms"] = median(ts) * 1000
        row["ratio_last_to_first"] = row[f"batch{sizes[-1]}_ms"] / row[f"batch{sizes[0]}_ms"]
        if first is None:
            first = hits
        row["same_hits_as_first"] = hits == first
        out[scan] = row
        del r
    return out


def scans_markdown(out: dict) -> str:
    sizes = out["sizes"]
    rows = [
        (
            r["path"] if r["path"].split()[0] == scan.split("-")[0].split(":")[0] else f"{scan} ({r['path']})",
            f"{r['rows']:,}",
            *(f"{r[f'batch{bs}_ms']:.1f}" for bs in sizes),
            f"{r['ratio_last_to_first']:.2f}x",
            "yes" if r["same_hits_as_first"] else "NO",
        )
        for scan, r in out["scans"].items()
    ]
    return (
        "\n".join(
            [
                machine_note(),
                "",
                f"EDR candidate scans, search only (queries encoded beforehand), top-20, median of {out['reps']}:",
                "",
                *table(
                    ["scan", "rows", *(f"batch {bs} ms" for bs in sizes), f"{sizes[-1]} vs {sizes[0]}", "same hits"],
                    rows,
                ),
            ]
        )
        + "\n"
    )


def measure_generator(engine, corpus, reps: int) -> dict:
    doc = corpus.text(0)
    ctx = engine.encode_question("What does json.dumps do with a dictionary of lists and tuples?")
    ctx = (ctx * 8)[:100]
    pre, dec = [], []
    for r in range(reps):
        engine.clear_kv_caches()
        out = engine.step(corpus.text(r + 1), ctx, 16, ignore_eos=True)
        pre.append(out.prefill_s)
        dec.append(out.decode_s / 15)
    engine.clear_kv_caches()
    engine.step(doc, ctx, 1)
    warm = [engine.step(doc, ctx, 1).prefill_s for _ in range(reps)]
    n_doc = len(engine.doc_tokens(corpus.text(1)))
    return {
        "prefill_doc_and_context_ms": median(pre) * 1000,
        "prefill_context_only_ms": median(warm) * 1000,
        "decode_per_token_ms": median(dec) * 1000,
        "doc_tokens": n_doc,
        "context_tokens": len(ctx),
    }


def costs_markdown(out: dict, reps: int) -> str:
    """The costs table and the generator line, from :func:`costs_main`'s measurements."""
    rows = [
        (
            k.upper(),
            f"{r['batch1']['encode_ms']:.1f} / {r['batch1']['search_ms']:.1f}",
            f"{r['batch16']['encode_ms']:.1f} / {r['batch16']['search_ms']:.1f}",
            f"{r['batch16']['per_query_ms']:.1f} ms",
        )
        for k, r in out["retrievers"].items()
    ]
    g = out["generator"]
    lines = [
        f"Costs on {out['corpus_passages']} passages (median of {reps}):",
        "",
        *table(["part", "batch 1: encode / search ms", "batch 16: encode / search ms", "per query at 16"], rows),
        "",
        f"Generator: prefill of {g['doc_tokens']} doc + {g['context_tokens']} context tokens "
        f"{g['prefill_doc_and_context_ms']:.1f} ms (context only, doc KV reused: "
        f"{g['prefill_context_only_ms']:.1f} ms); decode {g['decode_per_token_ms']:.1f} ms/token.",
    ]
    return "\n".join(lines) + "\n"


def costs_main(args) -> int:
    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.pipeline import Pipeline, check_kind

    cfg = load_config(args)
    scans = [x.strip() for x in args.scans.split(",") if x.strip()]
    if scans:
        pad_to = cfg.retriever.pad_to
        cfg = cfg.model_copy(update={"retriever": cfg.retriever.model_copy(update={"pad_to": 0})})
        pipe = Pipeline.from_config(cfg, kinds=("edr",))
        sizes = tuple(int(x) for x in args.scan_batches.split(",") if x.strip())
        if not sizes or min(sizes) < 1:
            raise SystemExit(f"--scan-batches needs batch sizes >= 1, got {args.scan_batches!r}")
        res = {
            "reps": args.reps,
            "pad_to": pad_to,
            "sizes": list(sizes),
            "scans": measure_scans(pipe.retriever("edr"), pipe.corpus, scans, pad_to, args.reps, sizes),
        }
        md = scans_markdown(res)
        write_report(args.out, "scan-costs", res, md)
        print(md)
        return 0 if all(r["same_hits_as_first"] for r in res["scans"].values()) else 1
    kinds = tuple(check_kind(k.strip()) for k in args.retrievers.split(",") if k.strip())
    pipe = Pipeline.from_config(cfg, kinds=kinds)
    out = {
        "corpus_passages": len(pipe.corpus),
        "pad_to": cfg.retriever.pad_to,
        "retrievers": {
            k: measure_retriever(pipe.retriever(k), pipe.corpus, args.reps, salt=i) for i, k in enumerate(kinds)
        },
        "generator": measure_generator(pipe.engine, pipe.corpus, args.reps),
        "model": cfg.generator.model,
        "torch_threads": cfg.generator.torch_threads,
    }
    md = costs_markdown(out, args.reps)
    write_report(args.out, "costs", out, md)
    print(md)
    return 0
