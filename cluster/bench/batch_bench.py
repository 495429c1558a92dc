"""``ralmspec bench batching``: the generator with and without continuous batching and KV sessions.

Three measurements, each side by side in one run (these machines are noisy):

(a) **forward cost**: the invariant forward against the plain one on the same weights, at
    batch 1 (one decode token after a ``--context``-token KV) and at batch 16 (16 such
    sequences in one forward: padded HF batch for the plain model, one packed forward over
    sequences in the KV pool for the invariant one);
(b) **generator throughput**: ``--concurrency`` levels (default 1, 4, 16, 32) of requests,
    each generating ``--new-tokens`` tokens in steps of ``--stride`` on one document, in six
    arms: the plain engine one step at a time (re-prefill, what a replica did before
    batching), sessions only (one step at a time), batching only (sessions off), both, both
    with each sequence's KV in its own buffers instead of the KV pool
    (``generator.kv_pool=false``: the pool's cost or gain, side by side), and both with
    ``--fast-draft`` windows drafted on the plain kernels and verified
    (``generator.fast_draft``);
(c) **per-request generation time** at ``--new-tokens`` with sessions against re-prefill:
    (b)'s concurrency-1 rows;
(d) **host cost of a decode iteration** (:func:`ralm.batching.op_count.decode_iteration_ops`):
    torch ops per iteration and per layer at batch 1, 16 and 64 (a pooled decode, 80
    positions of KV each), tensors built from Python data, and the host synchronisations an
    iteration makes on a GPU (the greedy tokens' transfer plus any host read in the forward).

Every arm's tokens are compared with the invariant engine's alone (batch 1, no session):
they must be identical (exit status 1 otherwise). The plain engine's tokens are a different
floating-point function; how many requests agree with it is reported, not required.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster.bench.random_models import SHAPES, random_model
from cluster.flags import SHARED, Default, add_shared
from cluster.report import exactness_status, machine_note, write_report
from ralm import constants as C
from ralm.config import GeneratorConfig
from ralm.corpus import Corpus, load_questions
from ralm.hf_cache import cache_kwargs, cache_of

ARMS = (
    "plain-serial",
    "sessions",
    "batching",
    "batching+sessions",
    "batching+sessions/buffers",
    "batching+sessions/fast-draft",
)


def add_batch_bench_args(p: argparse.ArgumentParser) -> None:
    add_shared(
        p,
        model=str(C.DEMO_MODEL_DIR),
        corpus=Path("tests/data/fixture_corpus.jsonl"),
        questions=Path("tests/data/fixture_questions.jsonl"),
        concurrency=Default("1,4,16,32", many=True),
        new_tokens=128,
        stride=4,
    )
    p.add_argument("--context", type=int, default=300, help="(a): KV length before the measured decode token")
    add_shared(p, reps=Default(20, help="(a): " + SHARED["reps"].help))
    p.add_argument("--arms", default=",".join(ARMS), help=f"(b) arms to run, of {', '.join(ARMS)}")
    add_shared(p, fast_draft=Default(4, help="(b) the fast-draft arm's generator.fast_draft"))
    p.add_argument(
        "--random-model",
        choices=sorted(SHAPES),
        help="instead of --model's weights, a randomly initialised model of this shape (built from a config, "
        "with --model's tokenizer): the cost structure of a bigger model without a download; its tokens mean nothing",
    )
    add_shared(p, out=Path("bench-batching-out"))


# ----------------------------------------------------------------------------- (a)
def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def forward_cost(
    plain_model, inv_model, context: int, reps: int, batches: tuple[int, ...] = (1, 16), graphs: str | None = None
) -> dict:
    """Decode-token latency and tokens/s at each of ``batches`` (default 1 and 16), plain vs
    invariant, on the models' device (a GPU is synchronised around each timed forward).

    ``graphs`` (``"cuda"`` or ``"eager"``): also the invariant forward replayed by
    :class:`~ralm.batching.iteration_graphs.IterationGraphs` (the engine's decode iterations with
    ``generator.cuda_graphs``), timed the same way, its logits compared bit for bit with the
    eager forward's of the same rep (``graph_identical``).

    The forwards alternate rep by rep (medians of ``reps`` each), so a noisy machine
    slows them alike."""
    import torch

    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.batching import iteration_graphs, kv_pool, packed, paged_kv

    g = torch.Generator().manual_seed(0)
    vocab = plain_model.config.vocab_size
    device = next(plain_model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    res: dict = {"context": context}
    with torch.inference_mode():
        for batch in batches:
            ids = torch.randint(1, vocab, (batch, context + 1), generator=g).to(device)
            past = cache_of(plain_model(input_ids=ids[:, :context], use_cache=True))
            lens = [len(layer.keys[0, 0]) for layer in past.layers]
            kvs = []
            pool = kv_pool.KVPool.for_model(inv_model)  # the engine's layout (generator.kv_pool)
            for b in range(batch):
                kv = paged_kv.PagedKV(pool)
                packed.packed_forward(inv_model, [(kv, ids[b, :context].tolist())], [])
                kvs.append(kv)
            runner = iteration_graphs.IterationGraphs(inv_model, pool, replay=graphs) if graphs else None  # type: ignore[arg-type]
            plain_t, inv_t, graph_t = [], [], []
            identical = 0
            for _ in range(reps + 2):  # the first two of each are warm-up (a graph's capture)
                for layer, n in zip(past.layers, lens):  # the same KV length every rep
                    layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
                sync()
                t0 = time.perf_counter()
                plain_model(input_ids=ids[:, context:], use_cache=True, **cache_kwargs(plain_model, past))
                sync()
                plain_t.append(time.perf_counter() - t0)
                for kv in kvs:
                    kv.crop(context)
                last = ids[:, context].tolist()
                chunks = [(kv, [last[b]]) for b, kv in enumerate(kvs)]
                sync()
                t0 = time.perf_counter()
                eager = packed.packed_forward(inv_model, chunks)
                sync()
                inv_t.append(time.perf_counter() - t0)
                if runner is not None:
                    for kv in kvs:
                        kv.crop(context)
                    sync()
                    t0 = time.perf_counter()
                    replayed = runner.forward(chunks, range(batch))
                    sync()
                    graph_t.append(time.perf_counter() - t0)
                    identical += replayed is not None and torch.equal(replayed, eager)
            plain_s, inv_s = _median(plain_t[2:]), _median(inv_t[2:])
            row = res[f"batch{batch}"] = {
                "plain_ms": plain_s * 1e3,
                "invariant_ms": inv_s * 1e3,
                "invariant_over_plain": inv_s / plain_s,
                "plain_tokens_per_s": batch / plain_s,
                "invariant_tokens_per_s": batch / inv_s,
            }
            if runner is not None:
                graph_s = _median(graph_t[2:])
                row.update(
                    graph_ms=graph_s * 1e3,
                    graph_over_plain=graph_s / plain_s,
                    graph_tokens_per_s=batch / graph_s,
                    graph_identical=f"{identical}/{reps + 2}",
                    graph_stats=runner.stats(),
                )
                runner.close()
    return res


# ----------------------------------------------------------------------------- (b), (c)
def workload_requests(engine, corpus_path: Path, questions_path: Path, n: int) -> list[tuple[list[int], str]]:
    corpus = Corpus.load(corpus_path)
    qs = load_questions(questions_path)
    return [(engine.encode_question(qs[i % len(qs)]), corpus.text(i % len(corpus))) for i in range(n)]


def run_arm(
    engine, reqs, concurrency: int, new_tokens: int, stride: int, serial: bool, deadline: float | None = None
) -> dict:
    """Run every request to ``new_tokens`` tokens; ``serial``: one step at a time (a lock).
    ``deadline`` (a ``time.perf_counter()`` value): no request takes another step after it,
    and the result says ``cut`` (its outputs are then prefixes)."""
    lock = threading.Lock() if serial else None
    out: list[list[int]] = [[] for _ in reqs]
    per_request_s: list[float] = [0.0] * len(reqs)

    def one(i):
        ctx, doc = list(reqs[i][0]), reqs[i][1]
        n0 = len(ctx)
        t0 = time.perf_counter()
        while len(ctx) - n0 < new_tokens:
            if deadline is not None and time.perf_counter() > deadline:
                break
            k = min(stride, new_tokens - (len(ctx) - n0))
            if lock is not None:
                with lock:
                    r = engine.step(doc, ctx, k, ignore_eos=True, owner=f"r{i}")
            else:
                r = engine.step(doc, ctx, k, ignore_eos=True, owner=f"r{i}")
            ctx += r.tokens
        per_request_s[i] = time.perf_counter() - t0
        engine.release(f"r{i}")
        out[i] = ctx[n0:]

    engine.clear_kv_caches()
    batcher = getattr(engine, "batcher", None)  # the batching loop (None: the plain engine)
    host0 = (batcher.host_s, batcher.forward_s, batcher.iterations) if batcher is not None else (0.0, 0.0, 0)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(reqs))))
    wall = time.perf_counter() - t0
    total = sum(len(t) for t in out)
    res = {
        "wall_s": wall,
        "tokens": total,
        "tokens_per_s": total / wall,
        "mean_request_s": sum(per_request_s) / len(per_request_s),
        "outputs": out,
        "cut": any(len(t) < new_tokens for t in out),
    }
    if batcher is not None and batcher.iterations > host0[2]:  # the loop ran: its host time
        host, fwd, n = batcher.host_s - host0[0], batcher.forward_s - host0[1], batcher.iterations - host0[2]
        res["host_ms_per_iteration"] = host * 1e3 / n
        res["host_share"] = host / (host + fwd) if host + fwd > 0 else 0.0
    return res


def batch_bench_main(args) -> int:
    import torch

    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.batching.invariant import invariant_kernels
    from ralm.engine import LMEngine  # lazy: as above

    levels = [int(x) for x in str(args.concurrency).split(",") if x]
    arms = [a for a in str(args.arms).split(",") if a]
    base = GeneratorConfig(model=args.model)
    if getattr(args, "random_model", None):
        plain, inv = _random_engines(base, args.random_model)
    else:
        plain = LMEngine.from_config(base.model_copy(update={"invariant": False}))
        inv = LMEngine.from_config(base)
    nosess = LMEngine(inv.model, inv.tokenizer, inv.cfg.model_copy(update={"kv_session_bytes": 0}))
    engines = {"plain-serial": plain, "sessions": inv, "batching": nosess, "batching+sessions": inv}
    variants = {  # batching+sessions with one generator option changed
        "batching+sessions/buffers": {"kv_pool": False},  # each sequence in its own buffers
        "batching+sessions/fast-draft": {"fast_draft": args.fast_draft},  # drafts on the plain kernels
    }
    for arm, update in variants.items():
        if arm in arms:
            engines[arm] = LMEngine(inv.model, inv.tokenizer, inv.cfg.model_copy(update=update))
    what = f"randomly initialised {args.random_model}" if getattr(args, "random_model", None) else args.model
    notes = [
        f"# ralmspec bench batching: generator {what}, {args.new_tokens} new tokens per request, stride {args.stride}",
        machine_note(),
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s); linear-layer kernel: "
        f"{torch.backends.cpu.get_cpu_capability()}, invariant linear layers on {invariant_kernels(inv.model)}",
        f"Date: {time.strftime('%Y-%m-%d')}",
    ]
    print("\n".join(notes), flush=True)
    cost = forward_cost(plain.model, inv.model, args.context, args.reps)
    print(json.dumps(cost), flush=True)
    host_cost = decode_host_cost(inv.model)
    print(json.dumps(host_cost), flush=True)
    rows, different, plain_agree, compared = [], 0, 0, 0
    for c in levels:
        reqs = workload_requests(inv, args.corpus, args.questions, c)
        ref = run_arm(nosess, reqs, 1, args.new_tokens, args.stride, serial=True)["outputs"] if c > 1 else None
        by_arm = {}
        for arm in arms:
            r = run_arm(engines[arm], reqs, c, args.new_tokens, args.stride, serial=arm in ("plain-serial", "sessions"))
            by_arm[arm] = r
            print(f"concurrency {c:3d} {arm:18s} {r['tokens_per_s']:8.1f} tok/s  wall {r['wall_s']:.2f}s", flush=True)
        want = ref or by_arm.get("batching", by_arm.get("batching+sessions", next(iter(by_arm.values()))))["outputs"]
        for arm, r in by_arm.items():
            same = sum(a == b for a, b in zip(r["outputs"], want))
            if arm == "plain-serial":
                plain_agree += same
                compared += len(reqs)
            else:
                different += len(reqs) - same
            rows.append(
                {
                    "concurrency": c,
                    "arm": arm,
                    **{k: v for k, v in r.items() if k != "outputs"},
                    "identical": same,
                    "requests": len(reqs),
                }
            )
        serial = by_arm.get("plain-serial")
        for row in rows[-len(by_arm) :]:
            row["speedup_vs_plain_serial"] = row["tokens_per_s"] / serial["tokens_per_s"] if serial else None
    md = _markdown(notes, cost, rows, plain_agree, compared, host_cost)
    write_report(
        args.out, "bench-batching", {"notes": notes, "forward_cost": cost, "host_cost": host_cost, "rows": rows}, md
    )
    print(md)
    return exactness_status(different, "outputs of batched/session arms differ from the invariant engine alone")


def decode_host_cost(model, batches: tuple[int, ...] = (1, 16, 64), context: int = 80) -> list[dict]:
    """(d): one pooled decode iteration's torch ops, per layer, tensors from Python data and host
    synchronisations (on a GPU: the greedy tokens' transfer, plus any host read in the forward)."""
    from ralm.batching.op_count import decode_iteration_ops  # lazy: loads torch

    rows = []
    for b in batches:
        r = decode_iteration_ops(model, b, context)
        r["host_syncs"] = 1 + r["host_reads"]
        rows.append(r)
    return rows


def _random_engines(base, name: str):
    """(plain engine, invariant engine) over two copies of one random model of shape ``name``."""
    import copy

    from transformers import AutoTokenizer

    # lazy: loads torch, and cli.build_parser imports this module for every command
    from ralm.engine import LMEngine

    tok = AutoTokenizer.from_pretrained(base.model)
    model = random_model(name, tok)
    plain = LMEngine(model, tok, base.model_copy(update={"invariant": False, "model": name}))
    inv = LMEngine(copy.deepcopy(model), tok, base.model_copy(update={"model": name}))
    return plain, inv


def _markdown(notes, cost, rows, plain_agree, compared, host_cost=()) -> str:
    lines = [*notes, ""]
    lines.append("## (a) Forward cost: invariant vs plain (median of reps)")
    lines.append("")
    lines.append("| batch | plain ms | invariant ms | invariant / plain | plain tok/s | invariant tok/s |")
    lines.append("|---:|---:|---:|---:|---:|---:|")
    for b in (1, 16):
        r = cost[f"batch{b}"]
        lines.append(
            f"| {b} | {r['plain_ms']:.2f} | {r['invariant_ms']:.2f} | {r['invariant_over_plain']:.2f}x | "
            f"{r['plain_tokens_per_s']:.0f} | {r['invariant_tokens_per_s']:.0f} |"
        )
    if host_cost:
        lines += ["", "## (d) Host cost of one pooled decode iteration (80 positions of KV each)", ""]
        lines.append("| batch | backend | torch ops + launches | per layer | tensors from Python data | host syncs |")
        lines.append("|---:|---|---:|---:|---:|---:|")
        for h in host_cost:
            lines.append(
                f"| {h['batch']} | {h['backend']} | {h['ops']} | {h['ops_per_layer']:.1f} | "
                f"{h['python_tensors']} | {h['host_syncs']} |"
            )
    lines += ["", "## (b) Generator throughput, (c) per-request generation time", ""]
    lines.append(
        "| concurrent | arm | tokens/s | vs plain serial | wall s | mean request s | host ms / iteration | host share | identical |"
    )
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        sp = r.get("speedup_vs_plain_serial")
        host = f"{r['host_ms_per_iteration']:.2f} | {r['host_share']:.0%}" if "host_share" in r else "- | -"
        lines.append(
            f"| {r['concurrency']} | {r['arm']} | {r['tokens_per_s']:.1f} | "
            f"{'' if sp is None else f'{sp:.2f}x'} | {r['wall_s']:.2f} | {r['mean_request_s']:.2f} | {host} | "
            f"{r['identical']}/{r['requests']} |"
        )
    lines += [
        "",
        "host ms / iteration, host share: the batching loop's time outside the model's forward (admitting, "
        "planning, packing, picking tokens), per iteration and as a share of the loop; - where no batching loop ran. "
        "identical: tokens equal to the invariant engine's for the request alone (batch 1, no session); "
        f"for plain-serial, agreement with that reference ({plain_agree}/{compared}), a different float function.",
    ]
    return "\n".join(lines) + "\n"
