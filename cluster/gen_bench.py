"""``ralmspec bench-gen``: generation-side acceleration, measured (DESIGN.md: IDR2, DReSD).

(a) prefill time per step with and without doc-KV reuse (CICS, prefix tree) on the
    iterative RaLMSeq workload, for 1 and 3 documents per prompt;
(b) decode: forward passes per generated token and draft acceptance, n-gram (IGPG) vs
    dense (DReSD, datastore from the model's own greedy generations on *other* questions);
(c) end to end: RaLMSeq plain vs RaLMSpec + doc-KV reuse + drafting;
(d) identical-output counts against plain RaLMSeq, and every drafting divergence with
    its top-2 logit gap (a float32 near-tie is < DIVERGENCE_GAP).
Writes gen_bench.json and gen_bench.md.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from statistics import fmean

from ralm import constants as C

TEST_DATA = C.PACKAGE_ROOT / "tests" / "data"


def add_gen_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", type=Path, default=TEST_DATA / "fixture_corpus.jsonl")
    p.add_argument("--questions", type=Path, default=TEST_DATA / "fixture_questions.jsonl")
    p.add_argument("-n", "--num-questions", type=int, default=6, help="evaluation questions")
    p.add_argument("--train-questions", type=int, default=12,
                   help="questions (disjoint from the evaluation ones) whose generations build the dense datastore")
    p.add_argument("--retriever", default="edr", choices=["edr", "adr", "sr"])
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--stride", type=int, default=4, help="k for the prefill measurement")
    p.add_argument("--decode-stride", type=int, default=16, help="k for the decode / end-to-end measurement")
    p.add_argument("--spec", default="PSA", help="RaLMSpec configuration for (c)")
    p.add_argument("--out", type=Path, default=Path("gen-bench-out"))


def _setup(args):
    from ralm.config import GeneratorConfig, RetrieverConfig
    from ralm.corpus import Corpus, load_questions
    from ralm.engine import LMEngine
    from ralm.generator import LocalGenerator
    from ralm.retrieval.factory import get_encoder, load_retriever
    from ralm.retrieval.index_build import build_index

    corpus = Corpus.load(args.corpus)
    questions = load_questions(args.questions)
    rcfg = RetrieverConfig(kind=args.retriever)
    enc = get_encoder(rcfg.encoder) if args.retriever != "sr" else None
    idx = Path(tempfile.mkdtemp(prefix="gen-bench-idx-"))
    build_index(args.retriever, corpus, idx, rcfg, progress=False, encoder=enc)
    kb = load_retriever(rcfg, corpus, idx, encoder=enc)
    eng = LMEngine.from_config(GeneratorConfig())
    nocache = LMEngine(eng.model, eng.tokenizer, eng.cfg.model_copy(update={"doc_kv_cache_bytes": 0}))
    return corpus, questions, kb, eng, LocalGenerator(eng, corpus), LocalGenerator(nocache, corpus)


def _dense_store(gen, kb, questions, req):
    """In-distribution datastore: greedy RaLMSeq generations, teacher-forced step by step."""
    from ralm.drafting.dense import build_datastore, collect_sequences
    from ralm.seq import run_seq

    ex = []
    for q in questions:
        r = run_seq(q, gen, kb, req)
        X = gen.encode_question(q) + r.tokens
        n_q = len(X) - len(r.tokens)
        for i, d in enumerate(r.stats.doc_ids):
            s, e = n_q + i * req.generation_stride, min(len(X), n_q + (i + 1) * req.generation_stride)
            if e > s:
                ex.append(([gen.corpus.text(d)] if d is not None else [], X, s, e))
    keys, vals = collect_sequences(gen.engine, ex)
    return build_datastore(keys, vals), len(keys)


def gen_bench_main(args) -> int:
    from ralm.config import RequestConfig, SpecConfig
    from ralm.drafting.exactness import first_divergence, first_index
    from ralm.seq import run_seq
    from ralm.spec import run_spec

    t_all = time.perf_counter()
    corpus, questions, kb, eng, gen, gen_nc = _setup(args)
    evalq = questions[: args.num_questions]
    trainq = questions[args.num_questions: args.num_questions + args.train_questions]
    out: dict = {"args": {k: str(v) for k, v in vars(args).items() if k != "func"}}

    # (a) prefill per step with vs without doc-KV reuse
    pre = {}
    for nd in (1, 3):
        req = RequestConfig(max_new_tokens=args.max_new_tokens, generation_stride=args.stride,
                            ignore_eos=True, num_docs=nd)
        row = {"with_reuse": [], "without_reuse": [], "identical": 0, "docs_reused": 0, "docs_computed": 0,
               "bytes_reused": 0}
        for q in evalq:
            eng.doc_kv.clear()                      # cold at the start of every request
            a = run_seq(q, gen, kb, req)
            b = run_seq(q, gen_nc, kb, req)
            row["with_reuse"].append(a.stats.prefill_time_s / a.stats.steps)
            row["without_reuse"].append(b.stats.prefill_time_s / b.stats.steps)
            row["identical"] += int(a.tokens == b.tokens)
            row["docs_reused"] += a.stats.doc_kv_docs_reused
            row["docs_computed"] += a.stats.doc_kv_misses
            row["bytes_reused"] += a.stats.doc_kv_bytes_reused
        w, wo = fmean(row.pop("with_reuse")), fmean(row.pop("without_reuse"))
        row.update(prefill_ms_per_step_with=1e3 * w, prefill_ms_per_step_without=1e3 * wo, speedup=wo / w,
                   requests=len(evalq))
        pre[f"{nd}_docs"] = row
    out["prefill"] = pre

    # (b) decode: forward passes per token, n-gram vs dense (in-distribution)
    req0 = RequestConfig(max_new_tokens=args.max_new_tokens, generation_stride=args.decode_stride, ignore_eos=True)
    t0 = time.perf_counter()
    store, n_keys = _dense_store(gen, kb, trainq, req0)
    out["dense_datastore"] = {"entries": n_keys, "train_questions": len(trainq), "pca_dim": store.components.shape[0],
                              "build_s": time.perf_counter() - t0}
    eng.attach_dense_datastore(store)
    dec, runs = {}, {}
    for mode in ("none", "ngram", "dense"):
        req = req0.model_copy(update={"drafting": mode})
        rs = [run_seq(q, gen, kb, req) for q in evalq]
        runs[mode] = rs
        st = [r.stats for r in rs]
        fp, tok = sum(s.forward_passes for s in st), sum(s.generated_tokens for s in st)
        dr, ac = sum(s.drafted_tokens for s in st), sum(s.accepted_tokens for s in st)
        dec[mode] = {"forward_passes_per_token": fp / tok, "acceptance_rate": (ac / dr) if dr else None,
                     "accepted_per_verify_pass": ac / max(1, sum(s.draft_rounds for s in st)),
                     "decode_s_per_token": sum(s.decode_time_s for s in st) / tok,
                     "gen_s_total": sum(s.gen_time_s for s in st)}
    for mode in ("ngram", "dense"):
        dec[mode]["fewer_forwards_x"] = dec["none"]["forward_passes_per_token"] / dec[mode]["forward_passes_per_token"]
    out["decode"] = dec

    # (d) identical outputs and divergences (per request: first divergence + its top-2 gap)
    ident = {}
    for mode in ("ngram", "dense"):
        divs = []
        for q, b, o in zip(evalq, runs["none"], runs[mode]):
            i = first_index(b.tokens, o.tokens)
            if i is None:
                continue
            d = b.stats.doc_ids[min(i // req0.generation_stride, len(b.stats.doc_ids) - 1)]
            dv = first_divergence(eng, [corpus.text(d)] if d is not None else [], gen.encode_question(q)
                                  + b.tokens[: i // req0.generation_stride * req0.generation_stride],
                                  b.tokens[i // req0.generation_stride * req0.generation_stride:],
                                  o.tokens[i // req0.generation_stride * req0.generation_stride:], True)
            dd = dv.as_dict()
            dd["position"] += i // req0.generation_stride * req0.generation_stride   # in the request's tokens
            divs.append({"question": q, **dd, "near_tie": dv.near_tie()})
        ident[mode] = {"identical": sum(int(b.tokens == o.tokens) for b, o in zip(runs["none"], runs[mode])),
                       "requests": len(evalq), "divergences": divs}

    # (c) end to end: RaLMSeq plain (no doc-KV reuse) vs RaLMSpec + reuse + drafting
    spec = SpecConfig.named(args.spec)
    e2e = {}
    base_t, base_tok = [], []
    for q in evalq:
        r = run_seq(q, gen_nc, kb, req0)
        base_t.append(r.stats.total_time_s)
        base_tok.append(r.tokens)
    e2e["seq_plain_s"] = fmean(base_t)
    for mode in ("none", "ngram", "dense"):
        req = req0.model_copy(update={"drafting": mode})
        ts, same = [], 0
        for q, bt in zip(evalq, base_tok):
            eng.doc_kv.clear()
            r = run_spec(q, gen, kb, req, spec)
            ts.append(r.stats.total_time_s)
            same += int(r.tokens == bt)
        e2e[f"spec[{args.spec}]+reuse+{mode}"] = {"mean_s": fmean(ts), "speedup": e2e["seq_plain_s"] / fmean(ts),
                                                  "identical_to_seq": same, "requests": len(evalq)}
    out["end_to_end"] = e2e
    out["identical"] = ident
    out["total_s"] = time.perf_counter() - t_all

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gen_bench.json").write_text(json.dumps(out, indent=2, default=str))
    (args.out / "gen_bench.md").write_text(_markdown(out))
    print(_markdown(out))
    return 0


def _markdown(o: dict) -> str:
    f = lambda x: "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))  # noqa: E731
    L = ["# bench-gen", "", "## (a) prefill per step, doc-KV reuse", "",
         "| docs | with reuse ms | without ms | speed-up | docs reused/computed | identical |", "|---|---|---|---|---|---|"]
    for k, r in o["prefill"].items():
        L.append(f"| {k} | {f(r['prefill_ms_per_step_with'])} | {f(r['prefill_ms_per_step_without'])} | "
                 f"{f(r['speedup'])} | {r['docs_reused']}/{r['docs_computed']} | {r['identical']}/{r['requests']} |")
    L += ["", f"## (b) decode (dense datastore: {o['dense_datastore']})", "",
          "| drafting | fwd/token | fewer fwd x | acceptance | accepted/verify | decode s/token |", "|---|---|---|---|---|---|"]
    for k, r in o["decode"].items():
        L.append(f"| {k} | {f(r['forward_passes_per_token'])} | {f(r.get('fewer_forwards_x'))} | "
                 f"{f(r['acceptance_rate'])} | {f(r['accepted_per_verify_pass'])} | {f(r['decode_s_per_token'])} |")
    L += ["", "## (c) end to end", "", f"RaLMSeq plain: {f(o['end_to_end']['seq_plain_s'])} s/request", "",
          "| config | s/request | speed-up | identical |", "|---|---|---|---|"]
    for k, r in o["end_to_end"].items():
        if isinstance(r, dict):
            L.append(f"| {k} | {f(r['mean_s'])} | {f(r['speedup'])} | {r['identical_to_seq']}/{r['requests']} |")
    L += ["", "## (d) drafting vs plain: identical outputs and divergences", ""]
    for k, r in o["identical"].items():
        L.append(f"- {k}: {r['identical']}/{r['requests']} identical; divergences: "
                 + (", ".join(f"pos {d['position']} gap {d['top2_gap']:.2e} near_tie={d['near_tie']}"
                              for d in r["divergences"]) or "none"))
    return "\n".join(L) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_gen_bench_args(p)
    return gen_bench_main(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
