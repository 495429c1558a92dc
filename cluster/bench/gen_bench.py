"""``ralmspec bench gen``: generation-side acceleration, measured (docs/design.md, "Generation-side acceleration").

(a) prefill time per step with and without doc-KV reuse (CICS, prefix tree) on the
    iterative RaLMSeq workload, for 1 and 3 documents per prompt: every step of every
    request timed, both arms in the same run and interleaved (alternating order), after
    a warm-up request, the median of ``--prefill-reps`` repetitions per step; the cache is
    cold at the start of every request (reuse across iterations only) and, in a second
    scope, warm across the run's requests (cleared once per repetition); ``--query-window``
    (a list) and ``--workload`` (fixed / FLARE / Iter-RetGen trigger) select the loop measured;
(b) decode: forward passes per generated token and draft acceptance, n-gram (IGPG) vs
    dense (DReSD, datastore from the model's own greedy generations on *other* questions);
(c) end to end: RaLMSeq plain vs RaLMSpec + doc-KV reuse + drafting;
(d) identical-output counts against plain RaLMSeq, and every drafting divergence with
    its top-2 logit gap (a float32 near-tie is < DIVERGENCE_GAP).
Writes gen_bench.json and gen_bench.md. ``--parts a`` runs only (a).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import fmean, median
from typing import TYPE_CHECKING, Any

from cluster.bench.gen_report import gen_bench_markdown
from cluster.flags import SHARED, Default, add_shared
from cluster.report import write_report
from ralm import constants as C
from ralm.config import GeneratorConfig, RequestConfig, RetrieverConfig, SpecConfig
from ralm.corpus import Corpus, load_questions
from ralm.generator import LocalGenerator
from ralm.retrieval.factory import get_encoder, load_retriever
from ralm.retrieval.index_build import build_index
from ralm.retrievers import entry
from ralm.seq import run_seq
from ralm.spec import run_spec

if TYPE_CHECKING:
    from ralm.results import RalmResult

TEST_DATA = C.PACKAGE_ROOT / "tests" / "data"


def add_gen_bench_args(p: argparse.ArgumentParser) -> None:
    add_shared(
        p,
        corpus=TEST_DATA / "fixture_corpus.jsonl",
        questions=TEST_DATA / "fixture_questions.jsonl",
        num_questions=Default(6, help="evaluation questions"),
    )
    p.add_argument(
        "--train-questions",
        type=int,
        default=12,
        help="questions (disjoint from the evaluation ones) whose generations build the dense datastore",
    )
    add_shared(
        p,
        retriever="edr",
        max_new_tokens=48,
        stride=Default(4, help="k for the prefill measurement"),
    )
    p.add_argument(
        "--query-window",
        default=None,
        help="(a): query = last N tokens of question + generated text; comma-separated to measure "
        "several (default: the library's 32)",
    )
    p.add_argument(
        "--workload",
        default="fixed",
        choices=["fixed", "flare", "iter_retgen"],
        help="(a): retrieval trigger of the measured loop (ralm.stride.workloads; stride = --stride)",
    )
    p.add_argument("--decode-stride", type=int, default=16, help="k for the decode / end-to-end measurement")
    add_shared(
        p,
        spec=Default("PSA", help="(c): " + SHARED["spec"].help),
        out=Path("gen-bench-out"),
        index_dir=Default(
            help="an already built index of --corpus for --retriever (validated)", unset="build one in a temp dir"
        ),
    )
    p.add_argument("--parts", default="abcd", help="which parts to run: a (prefill), b+d (decode), c (end to end)")
    p.add_argument("--prefill-docs", default="1,3", help="documents per prompt measured in (a)")
    p.add_argument("--prefill-reps", type=int, default=3, help="(a): repetitions per request and arm (median per step)")
    p.add_argument(
        "--prefill-scopes",
        default="request,run",
        help="(a): doc-KV cache cleared per 'request' (across iterations) and/or per 'run' (across requests)",
    )


def _setup(args):
    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.engine import LMEngine

    corpus = Corpus.load(args.corpus)
    questions = load_questions(args.questions)
    rcfg = RetrieverConfig(kind=args.retriever)
    enc = get_encoder(rcfg.encoder) if entry(rcfg.kind).family.encodes else None
    idx = getattr(args, "index_dir", None)
    if idx is None:
        idx = Path(tempfile.mkdtemp(prefix="gen-bench-idx-"))
        build_index(args.retriever, corpus, idx, rcfg, progress=False, encoder=enc)
    kb = load_retriever(rcfg, corpus, idx, encoder=enc)
    # KV sessions off in both arms: this measures the doc-KV prefill, and a step that continues
    # a request's session computes no document KV at all (bench-batching measures sessions)
    eng = LMEngine.from_config(GeneratorConfig(kv_session_bytes=0))
    nocache = LMEngine(eng.model, eng.tokenizer, eng.cfg.model_copy(update={"doc_kv_cache_bytes": 0}))
    return corpus, questions, kb, eng, LocalGenerator(eng, corpus), LocalGenerator(nocache, corpus)


def _dense_store(gen, kb, questions, req):
    """In-distribution datastore: greedy RaLMSeq generations, teacher-forced step by step."""
    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.drafting.dense import build_datastore, collect_sequences

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


class StepLog:
    """A generator that records every step's StepOutput, context and document lengths. With
    ``one_forward`` it first times the step's whole prompt as one forward pass
    (:func:`one_forward_s`), then runs the step (for its tokens; that step's time is not used)."""

    def __init__(self, gen, one_forward: bool = False):
        self.gen = gen
        self.one_forward = one_forward
        self.engine = gen.engine
        self.corpus = gen.corpus
        self.eos_token_id = gen.eos_token_id
        self.steps: list[tuple] = []

    def encode_question(self, question):
        return self.gen.encode_question(question)

    def decode(self, tokens):
        return self.gen.decode(tokens)

    def step(self, doc_id, context, k, ignore_eos=False, options=None):
        ids = [] if doc_id is None else ([doc_id] if not hasattr(doc_id, "__len__") else list(doc_id))
        n = options.num_docs if options is not None else len(ids)
        docs = [self.engine.doc_tokens(self.corpus.text(d)) for d in ids[:n]]
        one = one_forward_s(self.engine, [t for d in docs for t in d] + list(context)) if self.one_forward else None
        out = self.gen.step(doc_id, context, k, ignore_eos=ignore_eos, options=options)
        self.steps.append((out, len(context), sum(len(d) for d in docs), one))
        return out


def one_forward_s(eng, prompt: list[int]) -> float:
    """Wall time of one forward pass over the whole prompt ``[docs][context]`` (last position's
    logits only): what a server without doc-KV reuse would run. Not the engine's canonical
    computation (documents first, each on its own), so not bit-identical to it."""
    import torch

    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.doc_kv import last_logits_kwargs

    ids = torch.tensor([prompt], dtype=torch.long, device=eng.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        eng.model(input_ids=ids, use_cache=True, **last_logits_kwargs(eng.model))
        return time.perf_counter() - t0


def forward_overhead_ms(eng, reps: int = 30) -> float:
    """Median wall time of a one-token forward pass without a past: the fixed cost of a call."""
    import torch

    ids = torch.tensor([[1]], dtype=torch.long, device=eng.device)
    ts = []
    with torch.inference_mode():
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            eng.model(input_ids=ids, use_cache=True)
            ts.append(time.perf_counter() - t0)
    return 1e3 * median(ts[3:])


def measure_prefill(gen, gen_nc, kb, questions, req, reps: int = 3, scope: str = "request") -> dict:
    """Prefill time per step of RaLMSeq with doc-KV reuse (``gen``) and without (``gen_nc``,
    same model, cache capacity 0), every step of every request timed.

    The arms run in the same process, request by request, in rotating order, after one
    untimed warm-up request each; every request is repeated ``reps`` times per arm and each
    step's time is the median of its repetitions. Retrieval is real in every arm (as in the
    workload, between the steps; it is not part of the prefill time). ``scope='request'``: the doc-KV cache is
    cleared before every request (reuse across iterations only); ``'run'``: once per
    repetition, before the first request (reuse across iterations and requests; every
    repetition sees the same cache states). Speed-up = sum of the steps' times without /
    with. Exactness: the tokens of every request must be the same in both arms. A third arm,
    for reference, times each step's prompt as one forward pass (:func:`one_forward_s`) at
    the same point of the same loop."""
    if scope not in ("request", "run"):
        raise ValueError(f"unknown scope {scope!r}: 'request' or 'run'")
    eng = gen.engine
    arms = [("with", StepLog(gen)), ("without", StepLog(gen_nc)), ("one", StepLog(gen_nc, one_forward=True))]
    eng.clear_kv_caches()
    for _, g in arms:  # warm-up, every arm, not recorded
        run_seq(questions[0], g, kb, req)
    steps: dict = {}  # (request, step) -> {arm: [records of the repetitions]}
    identical = [True] * len(questions)
    t0 = time.perf_counter()
    for r in range(reps):
        if scope == "run":
            eng.clear_kv_caches()
        for qi, q in enumerate(questions):
            toks = {}
            for j in range(len(arms)):  # rotate the order of the arms
                arm, g = arms[(r + qi + j) % len(arms)]
                if arm == "with" and scope == "request":
                    eng.clear_kv_caches()
                g.steps = []
                toks[arm] = run_seq(q, g, kb, req).tokens
                for i, rec in enumerate(g.steps):
                    steps.setdefault((qi, i), {a: [] for a, _ in arms})[arm].append(rec)
            identical[qi] = identical[qi] and toks["with"] == toks["without"] == toks["one"]
    wall = time.perf_counter() - t0
    rows = []
    for key in sorted(steps):
        a, b = steps[key]["with"], steps[key]["without"]
        o = a[0][0]
        rows.append(
            dict(
                with_s=median(x[0].prefill_s for x in a),
                without_s=median(x[0].prefill_s for x in b),
                one_s=median(x[3] for x in steps[key]["one"]),
                reused=o.docs_reused,
                computed=o.docs_computed,
                hit=bool(o.doc_kv_hit),
                kv_bytes=o.kv_bytes_reused,
                ctx=a[0][1],
                doc=a[0][2],
            )
        )
    n = len(rows)
    sw, swo = sum(x["with_s"] for x in rows), sum(x["without_s"] for x in rows)
    hit = [x for x in rows if x["hit"]]
    miss = [x for x in rows if not x["hit"]]
    ms = lambda xs, key: 1e3 * fmean(x[key] for x in xs) if xs else None  # noqa: E731
    return {
        "scope": scope,
        "workload": req.workload,
        "query_window": req.query_window,
        "reps": reps,
        "requests": len(questions),
        "steps": n,
        "prefill_ms_per_step_with": 1e3 * sw / n,
        "prefill_ms_per_step_without": 1e3 * swo / n,
        "speedup": swo / sw,
        "prefill_ms_per_step_one_forward": 1e3 * sum(x["one_s"] for x in rows) / n,
        "speedup_vs_one_forward": sum(x["one_s"] for x in rows) / sw,
        "doc_tokens_per_step": fmean(x["doc"] for x in rows),
        "context_tokens_per_step": fmean(x["ctx"] for x in rows),
        "token_ratio": sum(x["doc"] + x["ctx"] for x in rows) / sum(x["ctx"] for x in rows),
        "docs_reused": sum(x["reused"] for x in rows),
        "docs_computed": sum(x["computed"] for x in rows),
        "kv_mib_reused": sum(x["kv_bytes"] for x in rows) / 2**20,
        "full_hit_steps": len(hit),
        "hit_steps_ms_with": ms(hit, "with_s"),
        "hit_steps_ms_without": ms(hit, "without_s"),
        "miss_steps_ms_with": ms(miss, "with_s"),
        "miss_steps_ms_without": ms(miss, "without_s"),
        "identical": sum(identical),
        "wall_s": wall,
    }


def gen_bench_main(args) -> int:
    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.drafting.exactness import first_divergence, first_index

    t_all = time.perf_counter()
    corpus, questions, kb, eng, gen, gen_nc = _setup(args)
    evalq = questions[: args.num_questions]
    trainq = questions[args.num_questions : args.num_questions + args.train_questions]
    out: dict = {"args": {k: str(v) for k, v in vars(args).items() if k != "func"}}

    # (a) prefill per step with vs without doc-KV reuse
    parts = set(getattr(args, "parts", "abcd"))
    if "a" in parts:
        pre: dict[str, Any] = {"forward_overhead_ms": forward_overhead_ms(eng)}
        windows: Sequence[int | None] = _ints(getattr(args, "query_window", None)) or [None]
        for qw, nd in ((qw, nd) for qw in windows for nd in _ints(getattr(args, "prefill_docs", "1,3"))):
            req = RequestConfig(
                max_new_tokens=args.max_new_tokens,
                generation_stride=args.stride,
                **({"query_window": qw} if qw else {}),
                workload=getattr(args, "workload", "fixed"),
                ignore_eos=True,
                num_docs=nd,
            )
            for scope in (x.strip() for x in str(getattr(args, "prefill_scopes", "request")).split(",") if x.strip()):
                key = f"{nd}_docs/{scope}" + (f"/window_{qw}" if len(windows) > 1 else "")
                pre[key] = measure_prefill(
                    gen, gen_nc, kb, evalq, req, reps=getattr(args, "prefill_reps", 3), scope=scope
                )
        out["prefill"] = pre
    if not parts & set("bcd"):
        return _write(args, out, t_all)

    # (b) decode: forward passes per token, n-gram vs dense (in-distribution)
    req0 = RequestConfig(max_new_tokens=args.max_new_tokens, generation_stride=args.decode_stride, ignore_eos=True)
    t0 = time.perf_counter()
    store, n_keys = _dense_store(gen, kb, trainq, req0)
    out["dense_datastore"] = {
        "entries": n_keys,
        "train_questions": len(trainq),
        "pca_dim": store.components.shape[0],
        "build_s": time.perf_counter() - t0,
    }
    eng.attach_dense_datastore(store)
    dec: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[RalmResult]] = {}
    for mode in ("none", "ngram", "dense"):
        req = req0.model_copy(update={"drafting": mode})
        rs = [run_seq(q, gen, kb, req) for q in evalq]
        runs[mode] = rs
        st = [r.stats for r in rs]
        fp, tok = sum(s.forward_passes for s in st), sum(s.generated_tokens for s in st)
        dr, ac = sum(s.drafted_tokens for s in st), sum(s.accepted_tokens for s in st)
        dec[mode] = {
            "forward_passes_per_token": fp / tok,
            "acceptance_rate": (ac / dr) if dr else None,
            "accepted_per_verify_pass": ac / max(1, sum(s.draft_rounds for s in st)),
            "decode_s_per_token": sum(s.decode_time_s for s in st) / tok,
            "gen_s_total": sum(s.gen_time_s for s in st),
        }
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
            dv = first_divergence(
                eng,
                [corpus.text(d)] if d is not None else [],
                gen.encode_question(q) + b.tokens[: i // req0.generation_stride * req0.generation_stride],
                b.tokens[i // req0.generation_stride * req0.generation_stride :],
                o.tokens[i // req0.generation_stride * req0.generation_stride :],
                True,
            )
            if dv is None:  # the two token lists differ at i, so first_divergence finds it
                raise RuntimeError(f"no divergence found in {mode!r} at token {i} of {q!r}")
            dd = dv.as_dict()
            dd["position"] += i // req0.generation_stride * req0.generation_stride  # in the request's tokens
            divs.append({"question": q, **dd, "near_tie": dv.near_tie()})
        ident[mode] = {
            "identical": sum(int(b.tokens == o.tokens) for b, o in zip(runs["none"], runs[mode])),
            "requests": len(evalq),
            "divergences": divs,
        }

    # (c) end to end: RaLMSeq plain (no doc-KV reuse) vs RaLMSpec + reuse + drafting
    spec = SpecConfig.parse(args.spec)
    e2e: dict[str, Any] = {}
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
            eng.clear_kv_caches()
            r = run_spec(q, gen, kb, req, spec)
            ts.append(r.stats.total_time_s)
            same += int(r.tokens == bt)
        e2e[f"spec[{args.spec}]+reuse+{mode}"] = {
            "mean_s": fmean(ts),
            "speedup": e2e["seq_plain_s"] / fmean(ts),
            "identical_to_seq": same,
            "requests": len(evalq),
        }
    out["end_to_end"] = e2e
    out["identical"] = ident
    return _write(args, out, t_all)


def _ints(spec) -> list[int]:
    """'32,128' -> [32, 128]; None or '' -> []."""
    return [int(x) for x in str(spec or "").split(",") if x.strip()]


def _write(args, out: dict, t_all: float) -> int:
    out["total_s"] = time.perf_counter() - t_all
    md = gen_bench_markdown(out)
    write_report(args.out, "gen_bench", out, md, indent=2, default=str)
    print(md)
    ok = all(r["identical"] == r["requests"] for k, r in out.get("prefill", {}).items() if isinstance(r, dict))
    return 0 if ok else 1
