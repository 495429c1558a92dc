"""``ralmspec gpu-check``: is exact batching safe on this machine's accelerator, and how fast is it?

One command for anyone with a GPU (users checking their hardware before deploying, and us).
It writes ``gpu-check.json`` and ``gpu-check.md`` under ``--out``, section by section as
they finish (a failing section is recorded and the next one runs):

``env``
    torch, transformers, triton, the device, its compute capability, and the project commit.
``compile``
    every Triton kernel (matmul, the norms, attention contiguous and paged) compiled and
    launched for each dtype x head dimension 64/128/256 x GQA group 1/4
    (:mod:`cluster.bench.gpu_compile`); on a CPU, compiled for ``sm_90`` instead, each
    kernel's shared memory against the H100's limit (or, under ``TRITON_INTERPRET=1``, the
    sweep run in the interpreter at small head dimensions).
``bits``
    the kernels' batch-invariance bit for bit, per dtype (:mod:`cluster.bench.gpu_bits`):
    matmul rows alone against 1-80, 200 and 512 rows; a query at position 70 alone, in a
    prefill, in chunks of 37, beside a 900-token sequence; paged against contiguous over
    random block tables to position 2,200 and past.
``proof``
    per model shape and dtype: does the generator pass the whole-model invariance proof
    (:mod:`ralm.batching.proof`) and so batch, or does it serve one step at a time, and why.
``long``
    one request with a 600-token context through the batch engine (its prefill runs in
    chunks, so some iterations emit no logits) against the same request alone.
``exact``
    per dtype that batches: the engine (its KV in the block pool, ``generator.kv_pool``), and
    the same with ``--fast-draft`` (``generator.fast_draft``: windows drafted on the plain
    kernels, verified by the invariant forward), with ``--requests`` (16, 64) requests in flight against
    each request alone (one at a time, no KV session): identical counts and tokens/s.
``forward``
    the invariant decode forward against the plain Hugging Face one at batch 1, 16 and 64
    (300-token context).
``scan``
    exact dense top-k on the device at 4M x 384 and 21M x 768 (float16 vectors and scores
    from one matrix product, top-20 of the scores), batch 1, 16 and 64: time, and whether
    each query's top-20 is the same alone as in the batch.
``dense``
    the exact dense scan a ``dense_scan: gpu`` retriever runs (:mod:`ralm.retrieval.device_scan`:
    float16 rows, float32 products, a proven bound) at ``--dense`` (4M x 384), batch 1 and 16:
    its candidate search's time, and whether every query's candidates contain its exact
    float64 top-20 (computed on the host).
``e2e``
    RaLMSeq against RaLMSpec (PSA) end to end with the ``proof`` section's generator on the
    device, EDR padded to ``--e2e-pad-to`` rows (4M), retrieval on the host and on the device
    (:mod:`cluster.bench.gpu_e2e`): speed-up, retrieval shares, identical outputs. On a bare
    GPU host (no FAISS, no dense encoder package) with a stand-in encoder built from the
    generator's embeddings, said so in the output.

``--quick``: bfloat16 only, 16 and 64 in flight, 32 new tokens, a 300 s budget (about 6
minutes on one H100 with the bundle's install). The budget is checked between sections,
between the dtypes and sizes inside them, and inside a generation arm (no request takes
another step once it is spent: the arm is reported ``cut`` and its outputs are compared as
prefixes). The exit status is 1 when a section failed, found a difference, or a dtype does
not batch (a failed compile or proof), else 0.

By default the models are random ones built from a config (no download): the Llama-3.2-1B
shape (16 layers, width 2048, 32/8 heads) with the demo tokenizer; ``--model`` takes any
Hugging Face name or path instead. On a CPU every shape is tiny (a smoke run in seconds,
which CI runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from cluster.bench.batch_bench import forward_cost, run_arm, workload_requests
from cluster.bench.gpu_dense import dense_markdown, exact_dense_scans, plain_topk_scans, scan_markdown
from cluster.bench.gpu_e2e import e2e_markdown, e2e_runs
from cluster.bench.random_models import SHAPES, random_model
from cluster.flags import SHARED, Default, add_shared
from cluster.report import table, write_report
from ralm import constants as C
from ralm.config import GeneratorConfig
from ralm.tensor_parallel.capacity import PRESET_SHAPES, ModelShape, rank_capacity

SECTIONS = ("env", "compile", "bits", "proof", "long", "forward", "scan", "dense", "exact", "e2e")
QUICK_SECTIONS = ("env", "compile", "bits", "proof", "long", "exact", "forward", "profile", "dense", "e2e")


def add_gpu_check_args(p: argparse.ArgumentParser) -> None:
    add_shared(p, model=Default(unset="random shapes (--shapes)"))
    p.add_argument(
        "--shapes",
        help=f"random model shapes, comma-separated, of {', '.join(SHAPES)} (default: llama-1b; tiny on CPU)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="bfloat16 only, 16 and 64 in flight, 32 new tokens, a 300 s budget (explicit flags still win)",
    )
    add_shared(
        p,
        dtypes=Default(
            help="dtypes to prove and run, comma-separated", unset="bfloat16,float16,float32; quick bfloat16"
        ),
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="the invariant forward's kernels (GeneratorConfig.invariant_kernels; auto: triton on a GPU)",
    )
    p.add_argument("--requests", default=None, help="requests in flight for the exactness check (default 16,64; CPU 4)")
    add_shared(
        p,
        new_tokens=Default(unset="64, quick 32; CPU 16"),
        stride=Default(4, help="tokens per step"),
        fast_draft=Default(4, help="exact: " + SHARED["fast_draft"].help),
    )
    p.add_argument("--forward-batches", default=None, help="decode forward batch sizes (default 1,16,64; quick 1,64)")
    p.add_argument(
        "--scan-shapes",
        dest="scan",
        help="dense scans ROWSxDIM, comma-separated (default 4Mx384,21Mx768; CPU 20000x384)",
    )
    p.add_argument(
        "--dense", default=None, help="exact device scans ROWSxDIM, comma-separated (default 4Mx384; CPU 20000x384)"
    )
    p.add_argument(
        "--sections",
        default=None,
        help=f"which sections to run, in order (default {','.join(SECTIONS)}; quick {','.join(QUICK_SECTIONS)}; "
        "also: profile, where a batch-64 decode forward spends its time)",
    )
    p.add_argument("--e2e-pad-to", type=int, help="e2e: EDR index rows (default 4M; CPU 20000)")
    p.add_argument("--e2e-questions", type=int, help="e2e: timed questions (default 5; CPU 2)")
    p.add_argument(
        "--e2e-encoder",
        default="auto",
        choices=["auto", "index", "stand-in"],
        help="e2e: the served EDR index and encoder, or a stand-in encoder from the generator's embeddings "
        "(no FAISS); auto: the index where FAISS and the encoder are installed",
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="stop work after this many seconds (default 480; quick 300)"
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--plan",
        metavar="MODEL",
        help="print what one rank of a --tp-way tensor-parallel replica of MODEL needs (weights, KV pool, "
        "bytes gathered per decode step) and whether it fits --plan-device-gib, then exit; needs no GPU. MODEL: "
        "a known shape (llama2-70b, llama2-13b, llama2-7b, llama3.2-1b, smollm2-135m), the llama2-70b-4gpu "
        "preset, or a local model folder with a config.json",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="--plan: tensor-parallel ranks (default 4 for the llama2-70b-4gpu preset, else 1)",
    )
    p.add_argument("--plan-sequences", type=int, default=C.BATCH_MAX_SEQUENCES, help="--plan: sequences in flight")
    p.add_argument("--plan-context", type=int, default=4096, help="--plan: positions per sequence")
    p.add_argument("--plan-dtype", default="float16", choices=["float16", "bfloat16", "float32"], help="--plan: dtype")
    p.add_argument("--plan-device-gib", type=float, default=80.0, help="--plan: memory of one device, GiB (0: none)")
    add_shared(p, out=Path("gpu-check-out"))


def _rows(spec: str) -> int:
    s = spec.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


class GpuCheck:
    """The sections, their shared state (the engines built by ``proof``) and the report."""

    def __init__(self, args):
        import torch

        self.args = args
        self.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.small = self.device == "cpu"
        self.t0 = time.perf_counter()
        self.res: dict[str, Any] = {"sections_s": {}}
        self.engines: dict[str, Any] = {}  # "shape/dtype" -> invariant engine that batches
        default_shapes = "llama-tiny,gpt2-tiny" if self.small else "llama-1b"
        self.shapes = [s for s in (args.shapes or default_shapes).split(",") if s]
        quick = bool(getattr(args, "quick", False))
        self.dtypes = [
            d for d in (args.dtypes or ("bfloat16" if quick else "bfloat16,float16,float32")).split(",") if d
        ]
        self.requests = [int(x) for x in (args.requests or ("4" if self.small else "16,64")).split(",") if x]
        self.new_tokens = args.new_tokens or (16 if self.small else 32 if quick else 64)
        self.budget_s = args.budget_s if args.budget_s is not None else (300.0 if quick else 480.0)
        self.sections = [x for x in (args.sections or ",".join(QUICK_SECTIONS if quick else SECTIONS)).split(",") if x]
        self.forward_batches = tuple(
            int(b) for b in (args.forward_batches or ("1,64" if quick else "1,16,64")).split(",") if b
        )
        self.scans = [
            tuple(_rows(v) for v in s.split("x"))
            for s in (args.scan or ("20000x384" if self.small else "4Mx384,21Mx768")).split(",")
            if s
        ]
        self.dense_sizes = [
            tuple(_rows(v) for v in s.split("x"))
            for s in (args.dense or ("20000x384" if self.small else "4Mx384")).split(",")
            if s
        ]

    # ------------------------------------------------------------------ plumbing
    def save(self) -> None:
        write_report(self.args.out, "gpu-check", self.res, markdown(self.res), default=str)

    @property
    def deadline(self) -> float:
        """The ``time.perf_counter()`` value at which the budget is spent."""
        return self.t0 + self.budget_s

    def spent(self) -> bool:
        return time.perf_counter() > self.deadline

    def run(self, names: list[str]) -> dict:
        for name in names:
            if self.spent():
                self.res[name] = {"skipped": f"the {self.budget_s:.0f} s budget was spent"}
                continue
            t = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                self.res[name] = getattr(self, name)()
            except Exception as e:  # a failing section is recorded; the next one runs
                self.res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            self.res["sections_s"][name] = round(time.perf_counter() - t, 1)
            print(json.dumps(self.res[name], default=str)[:2000], flush=True)
            self.save()
        self.save()
        return self.res

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.args.model or str(C.DEMO_MODEL_DIR))

    def build(self, shape: str, dtype: str, tok):
        """A model of ``shape`` (or ``--model``) in ``dtype`` on the device, the same weights every call."""
        import torch
        from transformers import AutoModelForCausalLM

        dt = getattr(torch, dtype)
        if self.args.model:
            return AutoModelForCausalLM.from_pretrained(self.args.model, dtype=dt).to(self.device).eval()
        return random_model(shape, tok, dt, self.device)

    def engine(self, model, tok, dtype: str, **cfg):
        # lazy: loads torch, and cli.build_parser imports this module for every command
        from ralm.engine import LMEngine

        name = self.args.model or str(C.DEMO_MODEL_DIR)
        gen = GeneratorConfig(model=name, device=self.device, dtype=dtype, invariant_kernels=self.args.kernels, **cfg)
        return LMEngine(model, tok, gen)

    # ------------------------------------------------------------------ sections
    def env(self) -> dict:
        import torch
        import transformers

        d: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "triton": _version("triton"),
            "device": self.device,
            "cpu": platform.processor() or platform.machine(),
        }
        if self.device == "cuda":
            p = torch.cuda.get_device_properties(0)
            d.update(
                gpu=torch.cuda.get_device_name(0),
                capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                memory_gib=round(p.total_memory / 2**30, 1),
                cuda=torch.version.cuda,
            )
        try:
            git = ("git", "-C", str(C.PACKAGE_ROOT))
            d["commit"] = subprocess.run(
                [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            # a checkout copied over another one (a GPU host's copy of a working tree) can
            # run code that is not its HEAD's: say so
            changed = subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            if d["commit"] and changed:
                d["commit"] += f"+{len(changed.splitlines())} changed files"
        except (OSError, subprocess.SubprocessError):
            d["commit"] = None
        return d

    def compile(self) -> dict:
        """The compile sweep on the device; on a CPU the sweep for ``sm_90`` (no GPU needed),
        or in the interpreter at small head dimensions where ``TRITON_INTERPRET=1``."""
        import os

        # lazy: loads torch and triton (which reads TRITON_INTERPRET when first imported)
        from cluster.bench import gpu_compile as G

        if self.device == "cuda":
            return {"device": G.device_sweep(self.device, self.dtypes, deadline=self.deadline)}
        if os.environ.get("TRITON_INTERPRET") == "1":
            shapes = ((40, 24, True), (8, 16, False))
            return {"device": G.device_sweep("cpu", self.dtypes, (16,), (1, 2), shapes, (24,), self.deadline, (24,))}
        return {"offline": G.offline_sweep(90, self.dtypes, deadline=self.deadline)}

    def bits(self) -> dict:
        # lazy: loads torch and triton, as above
        from cluster.bench.gpu_bits import bit_checks

        hd = 64 if not self.small else 16  # Llama-3.2-1B's head dimension
        return bit_checks(self.device, self.dtypes, hd, 4 if not self.small else 2, self.small, self.deadline)

    def long(self) -> dict:
        """One request with a 600-token context through each batching engine (its prefill is
        chunked: iterations that emit no logits) against the same request alone."""
        out: dict[str, Any] = {}
        data = C.PACKAGE_ROOT / "tests" / "data"
        for key, e in self.engines.items():
            if self.spent():
                out[key] = {"skipped": "time budget"}
                continue
            q, doc = workload_requests(e, data / "fixture_corpus.jsonl", data / "fixture_questions.jsonl", 1)[0]
            filler = e.tokenizer.encode(doc, add_special_tokens=False) or [1]
            ctx = (filler * (600 // len(filler) + 1))[: 600 - len(q)] + list(q)
            alone = self.engine(e.model, e.tokenizer, e.cfg.dtype, kv_session_bytes=0, cuda_graphs=False)
            ref = run_arm(alone, [(ctx, doc)], 1, self.new_tokens, self.args.stride, True, self.deadline)
            t = time.perf_counter()
            bat = run_arm(e, [(ctx, doc)], 1, self.new_tokens, self.args.stride, False, self.deadline)
            n = min(len(ref["outputs"][0]), len(bat["outputs"][0]))
            out[key] = {
                "context_tokens": len(ctx),
                "identical": ref["outputs"][0][:n] == bat["outputs"][0][:n],
                "compared_tokens": n,
                "cut": bool(ref["cut"] or bat["cut"]),
                "batched_s": round(time.perf_counter() - t, 2),
            }
            del alone
            self.free()
        return out

    def proof(self) -> dict:
        # lazy: loads torch, and cli.build_parser imports this module for every command
        from ralm.batching.invariant import invariant_kernels

        tok = self.tokenizer()
        out: dict[str, dict[str, Any]] = {}
        for shape in [self.args.model] if self.args.model else self.shapes:
            for dtype in self.dtypes:
                if self.spent():
                    out[f"{shape}/{dtype}"] = {"skipped": "time budget"}
                    continue
                t = time.perf_counter()
                e = self.engine(self.build(shape, dtype, tok), tok, dtype)
                key = f"{shape}/{dtype}"
                out[key] = {
                    "batching": e.batcher is not None,
                    "kernels": invariant_kernels(e.model),
                    "reason_off": e.invariant_error,
                    "proof": e.invariance_proof.as_dict() if e.invariance_proof else None,
                    # the load-time check of the iterations' CUDA graphs (IterationGraphs.check)
                    "cuda_graphs": _graph_stats(e),
                    "load_and_proof_s": round(time.perf_counter() - t, 1),
                }
                if e.batcher is not None:
                    self.engines[key] = e
                else:
                    del e
                self.free()
        return out

    def free(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def exact(self) -> dict:
        """Batched vs alone at each ``--requests`` level, every batching dtype at the smallest
        level first (the alone reference of a request is computed once and reused)."""
        out: dict[str, Any] = {}
        data = C.PACKAGE_ROOT / "tests" / "data"
        alone: dict[str, list[list[int]]] = {key: [] for key in self.engines}
        alone_s: dict[str, float] = {key: 0.0 for key in self.engines}
        alone_engines: dict[str, Any] = {}
        drafting: dict[str, Any] = {}  # engines with generator.fast_draft
        for n in sorted(self.requests):
            for key, e in self.engines.items():
                if self.spent():
                    out[f"{key}/n{n}"] = {"skipped": "time budget"}
                    continue
                if key not in alone_engines:  # the reference: each request alone, no KV session
                    alone_engines[key] = self.engine(
                        e.model, e.tokenizer, e.cfg.dtype, kv_session_bytes=0, cuda_graphs=False
                    )
                reqs = workload_requests(e, data / "fixture_corpus.jsonl", data / "fixture_questions.jsonl", n)
                done = len(alone[key])
                if done < n:
                    t = time.perf_counter()
                    r = run_arm(
                        alone_engines[key], reqs[done:], 1, self.new_tokens, self.args.stride, True, self.deadline
                    )
                    alone[key] += r["outputs"]
                    alone_s[key] += time.perf_counter() - t
                alone_tok_s = sum(len(o) for o in alone[key]) / max(alone_s[key], 1e-9)
                if self.spent():  # the reference used the budget up: nothing to compare against
                    out[f"{key}/n{n}"] = {"skipped": "time budget (during the alone reference)"}
                    continue
                bat = run_arm(e, reqs, n, self.new_tokens, self.args.stride, False, self.deadline)
                out[f"{key}/n{n}"] = self._against_alone(alone[key][:n], alone_tok_s, bat)
                out[f"{key}/n{n}"]["cuda_graphs"] = _graph_stats(e)
                if self.args.fast_draft:  # decode fast, verify exactly: the same requests, drafted
                    if key not in drafting:
                        drafting[key] = self.engine(e.model, e.tokenizer, e.cfg.dtype, fast_draft=self.args.fast_draft)
                    fd = run_arm(drafting[key], reqs, n, self.new_tokens, self.args.stride, False, self.deadline)
                    out[f"{key}/n{n}/fast-draft{self.args.fast_draft}"] = self._against_alone(
                        alone[key][:n], alone_tok_s, fd
                    )
                    out[f"{key}/n{n}/fast-draft{self.args.fast_draft}"]["cuda_graphs"] = _graph_stats(drafting[key])
                self.res["exact"] = out
                self.save()
        return out

    def _against_alone(self, alone: list[list[int]], alone_tok_s: float, arm: dict) -> dict:
        """An ``exact`` row: how many of ``arm``'s outputs (``run_arm``) equal each request
        alone, and its tokens/s against the requests run one at a time. Where the budget cut
        either run, their common prefix is compared (``cut``, ``compared_tokens``)."""
        pairs = [(a[: min(len(a), len(b))], b[: min(len(a), len(b))]) for a, b in zip(alone, arm["outputs"])]
        return {
            "requests": len(alone),
            "new_tokens": self.new_tokens,
            "identical": sum(a == b for a, b in pairs),
            "compared_tokens": sum(len(a) for a, _ in pairs),
            "cut": bool(arm.get("cut")) or any(len(a) < self.new_tokens for a in alone),
            "alone_tok_s": round(alone_tok_s, 1),
            "batched_tok_s": round(arm["tokens_per_s"], 1),
            "batched_over_alone": round(arm["tokens_per_s"] / alone_tok_s, 2),
        }

    def forward(self) -> dict:
        out = {}
        batches = self.forward_batches
        for key, e in self.engines.items():
            if self.spent():
                out[key] = {"skipped": "time budget"}
                continue
            shape, dtype = key.rsplit("/", 1)
            plain = self.build(shape, dtype, e.tokenizer)
            ctx = 300 if not self.small else 40
            # the batched iterations' CUDA graphs where the engine replays them (generator.cuda_graphs)
            graphs = "cuda" if _graph_stats(e) is not None else None
            out[key] = forward_cost(plain, e.model, ctx, 12 if not self.small else 3, batches, graphs=graphs)
            del plain
            self.free()
        return out

    def profile(self) -> dict:
        """Where a decode forward of 64 sequences (300-token contexts, in the KV pool) spends its time: wall
        time, the device's kernel time, kernel launches, and the top ops by self time
        (torch.profiler), for the first dtype that batches."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        # lazy: loads torch, and cli.build_parser imports this module for every command
        from ralm.batching import kv_pool, packed, paged_kv

        if not self.engines:
            return {"skipped": "no dtype batches"}
        key, e = next(iter(self.engines.items()))
        m = e.model
        batch, ctx = (64, 300) if not self.small else (8, 40)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, int(m.config.vocab_size), (batch, ctx + 1), generator=g).tolist()
        pool = kv_pool.KVPool.for_model(m)
        kvs = [paged_kv.PagedKV(pool) for _ in range(batch)]
        with torch.inference_mode():
            for kv, row in zip(kvs, ids):
                packed.packed_forward(m, [(kv, row[:ctx])], [])

            def step():
                for kv in kvs:
                    kv.crop(ctx)
                packed.packed_forward(m, [(kv, [row[ctx]]) for kv, row in zip(kvs, ids)])

            for _ in range(3):
                step()
            self.sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
            reps = 5
            t = time.perf_counter()
            with profile(activities=acts) as prof:
                for _ in range(reps):
                    step()
                self.sync()
            wall = (time.perf_counter() - t) / reps
        events = prof.key_averages()
        dev = "self_device_time_total" if self.device == "cuda" else "self_cpu_time_total"
        kernel_us = sum(getattr(ev, "self_device_time_total", 0) for ev in events) if self.device == "cuda" else 0

        def top(attr: str) -> list:
            rows = sorted(events, key=lambda ev: getattr(ev, attr, 0), reverse=True)[:12]
            return [[ev.key[:60], ev.count // reps, round(getattr(ev, attr, 0) / reps / 1e3, 3)] for ev in rows]

        return {
            "model": key,
            "batch": batch,
            "context": ctx,
            "wall_ms_per_forward": round(wall * 1e3, 2),
            "device_kernel_ms_per_forward": round(kernel_us / reps / 1e3, 2),
            "cpu_ops_ms_per_forward": round(sum(ev.self_cpu_time_total for ev in events) / reps / 1e3, 2),
            "ops_per_forward": sum(ev.count for ev in events if ev.key.startswith("aten::")) // reps,
            # the CUDA runtime calls the profiler saw on the host, per forward: kernel launches,
            # explicit waits for the device, scalar reads (.item(), a wait too) and copies
            "kernel_launches_per_forward": _calls(events, ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
            // reps,
            "syncs_per_forward": _calls(events, SYNC_CALLS) // reps,
            "scalar_reads_per_forward": _calls(events, ("aten::_local_scalar_dense",)) // reps,
            "memcpys_per_forward": _calls(events, ("cudaMemcpyAsync", "cudaMemcpy")) // reps,
            "top_by_self_device_ms": top(dev),
            "top_by_self_cpu_ms": top("self_cpu_time_total"),
        }

    def scan(self) -> dict:
        return plain_topk_scans(self.scans, self.device, self.sync, self.free)

    def dense(self) -> dict:
        return exact_dense_scans(self.dense_sizes, self.device, self.free)

    def e2e(self) -> dict:
        if not self.engines:
            return {"skipped": "no generator batches here (the proof section did not pass or did not run)"}
        key, engine = next(iter(self.engines.items()))
        pad = self.args.e2e_pad_to if self.args.e2e_pad_to is not None else (20_000 if self.small else 4_000_000)
        n = self.args.e2e_questions or (2 if self.small else 5)
        enc = getattr(self.args, "e2e_encoder", "auto")
        runs = e2e_runs(engine, self.device, pad, n, self.new_tokens, self.free, enc, deadline=self.deadline)
        return {"generator": key, **runs}


# CUDA runtime calls that make the host wait for the device
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent")


def _calls(events, names: tuple[str, ...]) -> int:
    """How many times the profiler saw any of ``names`` (exact keys) in ``events``."""
    return sum(ev.count for ev in events if ev.key in names)


def bits_failed(res: dict) -> list[str]:
    """The dtypes whose bit checks found a difference."""
    return [k for k, v in res.items() if isinstance(v, dict) and v.get("ok") is False]


def bits_markdown(res: dict) -> list[str]:
    """The section's table (no lines when it did not run)."""
    if not res:
        return []
    rows = [
        (
            k,
            f"{v['matmul']['differing_rows']} rows in {len(v['matmul']['differing_m'])}/{v['matmul']['products']} products",
            ", ".join(v["attention"]["differing"]) or "none",
            f"{v['paged']['differing_rows']}/{v['paged']['rows']} rows (positions to {v['paged']['max_position']})",
            f"{v['rotary']['differing_rows']}/{v['rotary']['rows']} rows" if "rotary" in v else "-",
        )
        for k, v in res.items()
        if isinstance(v, dict) and "matmul" in v
    ]
    head = (
        "dtype",
        "matmul rows differing",
        "position-70 query differs in",
        "paged vs contiguous differing",
        "fused rotation vs torch differing",
    )
    return [*table(head, rows), ""]


def compile_markdown(res: dict) -> list[str]:
    """The section's table (no lines when it did not run)."""
    if not res:
        return []
    lines: list[str] = []
    dev = res.get("device")
    if isinstance(dev, dict):
        rows = [
            (k, "ok" if v["ok"] else "FAILED", v["compiled"], v["seconds"], v.get("error", "")) for k, v in dev.items()
        ]
        lines += [*table(("dtype", "compile sweep", "configurations", "s", "error"), rows), ""]
    off = res.get("offline")
    if isinstance(off, dict) and "kernels" in off:
        bad = {k: v for k, v in off["kernels"].items() if not v["fits"]}
        lines.append(
            f"Compiled for {off['arch']} without a GPU: {len(off['kernels'])} configurations, "
            f"{len(bad)} over the {off['shared_limit_bytes']}-byte shared-memory limit or refused."
        )
        over = [(k, v.get("shared_bytes", "-"), v.get("error", "over the limit")) for k, v in bad.items()]
        lines += ["", *table(("kernel", "shared bytes", "why"), over)] if over else []
        lines.append("")
    return lines


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except ImportError:
        return None


def _done(res: dict, name: str) -> dict:
    """A section's results, or {} when it failed, was skipped or has not run."""
    v = res.get(name) or {}
    return {} if "error" in v or "skipped" in v else v


def _graph_stats(engine) -> dict | None:
    """An engine's CUDA-graph statistics (``IterationGraphs.stats``); None where it runs none."""
    graphs = engine.batch.graphs if engine.batch is not None else None
    return graphs.stats() if graphs is not None else None


def _graphs_cell(stats: dict | None) -> str:
    """An ``exact`` row's CUDA graphs: replays and captures, or why they were off."""
    if not stats:
        return "off"
    if stats.get("disabled_reason"):
        return "failed: " + str(stats["disabled_reason"]).replace("|", "/")[:120]
    return f"{stats['replays']} replays, {stats['captures']} captures"


def markdown(res: dict) -> str:
    """The report's tables (whatever sections have finished)."""
    env = _done(res, "env")
    lines = [
        "# ralmspec gpu-check",
        "",
        f"{env.get('date', '')}: {env.get('gpu', env.get('cpu', ''))} (capability {env.get('capability', '-')}), "
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, triton {env.get('triton')}, "
        f"commit {env.get('commit')}",
        "",
    ]
    rows: list[tuple[Any, ...]]
    lines += compile_markdown(_done(res, "compile"))
    lines += bits_markdown(_done(res, "bits"))
    proof = _done(res, "proof")
    if proof:
        rows = []
        for k, v in proof.items():
            p = v.get("proof") or {}
            verdict = f"{p.get('comparisons', 0)} comparisons, {p.get('seconds', 0)} s" if p else "-"
            why = (v.get("reason_off") or "").replace("|", "/")
            rows.append(
                (
                    k,
                    "on" if v["batching"] else "off",
                    v.get("kernels"),
                    verdict,
                    why,
                    _graphs_cell(v.get("cuda_graphs")),
                )
            )
        lines += [*table(("model/dtype", "batching", "kernels", "proof", "why off", "CUDA graphs at load"), rows), ""]
    exact = _done(res, "exact")
    if exact:
        rows = [
            (
                k,
                f"{v['identical']}/{v['requests']}",
                v["alone_tok_s"],
                v["batched_tok_s"],
                f"{v['batched_over_alone']}x",
                _graphs_cell(v.get("cuda_graphs")),
            )
            for k, v in exact.items()
            if "identical" in v
        ]
        head = ("model/dtype/in flight", "identical", "alone tok/s", "batched tok/s", "ratio", "CUDA graphs")
        lines += [*table(head, rows), ""]
    fwd = _done(res, "forward")
    if fwd:
        rows = [
            (
                k,
                b.removeprefix("batch"),
                f"{r['plain_ms']:.2f}",
                f"{r['invariant_ms']:.2f}",
                f"{r['invariant_over_plain']:.2f}x",
                f"{r['graph_ms']:.2f}" if "graph_ms" in r else "-",
                f"{r['graph_over_plain']:.2f}x" if "graph_ms" in r else "-",
                r.get("graph_identical", "-"),
            )
            for k, v in fwd.items()
            for b, r in v.items()
            if isinstance(r, dict)
        ]
        fwd_head = ("model/dtype", "batch", "plain ms", "invariant ms", "invariant/plain", "graph ms", "graph/plain")
        lines += [*table((*fwd_head, "graph = eager bits"), rows), ""]
    long = {k: v for k, v in _done(res, "long").items() if "identical" in v}
    if long:
        rows = [
            (k, v["context_tokens"], v["compared_tokens"], "yes" if v["identical"] else "NO") for k, v in long.items()
        ]
        lines += [*table(("600-token context", "context", "tokens compared", "identical to alone"), rows), ""]
    lines += scan_markdown(_done(res, "scan"))
    lines += dense_markdown(_done(res, "dense"))
    lines += e2e_markdown(_done(res, "e2e"))
    prof = _done(res, "profile")
    if prof:
        lines += [
            f"Decode forward of {prof['batch']} sequences ({prof['model']}, {prof['context']}-token contexts): "
            f"{prof['wall_ms_per_forward']} ms wall, {prof['device_kernel_ms_per_forward']} ms of device kernels, "
            f"{prof['cpu_ops_ms_per_forward']} ms in {prof['ops_per_forward']} torch ops on the host; "
            f"per forward {prof.get('kernel_launches_per_forward', '-')} kernel launches, "
            f"{prof.get('syncs_per_forward', '-')} waits for the device, "
            f"{prof.get('scalar_reads_per_forward', '-')} scalar reads, {prof.get('memcpys_per_forward', '-')} copies.",
            "",
        ]
        for by in ("device", "cpu"):
            rows = [(f"`{n}`", c, ms) for n, c, ms in prof[f"top_by_self_{by}_ms"]]
            lines += [*table((f"op (top by self {by} time)", "calls per forward", "ms per forward"), rows), ""]
    for name, v in res.items():
        if isinstance(v, dict) and ("error" in v or "skipped" in v):
            lines.append(f"- {name}: {v.get('error') or v.get('skipped')}")
    lines.append(f"\nSeconds per section: {res.get('sections_s')}")
    return "\n".join(lines) + "\n"


def failures(res: dict) -> list[str]:
    """Why the run fails (empty: it passes): a section that raised, a compile or bit check
    that failed, a dtype that does not batch (its compile or proof failed), a batched or
    RaLMSpec answer that differs, an exact scan that missed a top-20 row."""
    out = [f"section {k} raised {v['error'][:200]}" for k, v in res.items() if isinstance(v, dict) and "error" in v]
    comp = _done(res, "compile")
    out += [f"compile {k}: {v.get('error')}" for k, v in (comp.get("device") or {}).items() if v.get("ok") is False]
    off = (comp.get("offline") or {}).get("kernels") or {}
    out += [
        f"compile {k} for {comp['offline']['arch']}: {v.get('error', 'over the shared-memory limit')}"
        for k, v in off.items()
        if v.get("fits") is False
    ]
    out += [f"bits {k}: a kernel's bits change with the batch" for k in bits_failed(_done(res, "bits"))]
    out += [
        f"proof {k}: batching off ({v.get('reason_off')})"
        for k, v in _done(res, "proof").items()
        if v.get("batching") is False
    ]
    out += [
        f"long {k}: differs from the request alone"
        for k, v in _done(res, "long").items()
        if v.get("identical") is False
    ]
    out += [
        f"exact {k}: {v['identical']}/{v['requests']} identical"
        for k, v in _done(res, "exact").items()
        if "identical" in v and v["identical"] != v["requests"]
    ]
    for k, v in _done(res, "dense").items():
        for b, r in v.items():
            if isinstance(r, dict) and "exact_top20_contained" in r:
                held, n = r["exact_top20_contained"].split("/")
                if held != n:
                    out.append(f"dense {k} {b}: the exact top-20 escaped the candidates ({r['exact_top20_contained']})")
    out += [
        f"e2e {k}: RaLMSpec differs from RaLMSeq"
        for k, v in _done(res, "e2e").items()
        if isinstance(v, dict) and v.get("differing")
    ]
    return out


def plan_main(args) -> int:
    """``--plan``: one rank's capacity (:func:`ralm.tensor_parallel.capacity.rank_capacity`),
    printed and written as ``gpu-plan.json`` / ``.md`` under ``--out``."""
    model: Any = args.plan
    if Path(args.plan).is_dir():  # a local model folder: its config.json, no weights read
        from transformers import AutoConfig

        model = ModelShape.of_config(AutoConfig.from_pretrained(args.plan))
    ranks = args.tp if args.tp is not None else (4 if args.plan in PRESET_SHAPES else 1)
    cap = rank_capacity(
        model,
        ranks,
        args.plan_dtype,
        args.plan_sequences,
        args.plan_context,
        args.plan_device_gib or None,
    )
    text = cap.summary()
    print(text)
    write_report(args.out, "gpu-plan", cap.as_dict(), f"# ralmspec gpu-check --plan\n\n```\n{text}\n```\n")
    return 0 if cap.fits is not False else 1


def gpu_check_main(args) -> int:
    """Run the sections; exit status 1 when :func:`failures` finds any, else 0 (``--plan``:
    :func:`plan_main`)."""
    if getattr(args, "plan", None):
        return plan_main(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "triton" not in sys.modules and (args.device == "cpu" or not _cuda_available()):
        # the Triton sections on a CPU run the kernels in triton's interpreter, which triton
        # reads when it is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    check = GpuCheck(args)
    res = check.run(check.sections)
    print(markdown(res))
    bad = failures(res)
    for why in bad:
        print(f"FAIL: {why}")
    skipped = [k for k, v in res.items() if isinstance(v, dict) and "skipped" in v]
    if skipped:
        print(f"INCOMPLETE: the budget skipped {', '.join(skipped)}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ralmspec gpu-check", description=__doc__)
    add_gpu_check_args(p)
    return gpu_check_main(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
