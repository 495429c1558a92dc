"""``ralmspec gpu-check``'s ``e2e`` section: RaLMSeq against RaLMSpec (PSA) with the generator
on the device, retrieval by exact dense search (EDR) on the host, then on the device.

Both arms run the same questions (the demo set, a warm-up first) through the in-process
pipeline (:mod:`ralm.pipeline`) with the generator the ``proof`` section built (the batching
engine of the first shape and dtype that passed), the demo corpus's EDR index padded to
``pad_to`` rows, fixed-length generation (EOS masked) and every request's caches cleared
first, as ``ralmspec bench spec`` does:

- ``host``: the candidate scan on the CPU (``dense_scan: auto``: the fastest exact CPU path
  the process measures), the split of the card's deployment (GPU generator, CPU retrieval);
- ``device``: the float16 device scan with its proven bound (``dense_scan: gpu``); only
  where the process sees a CUDA device.

Per arm: the scan's label, RaLMSeq's and PSA's mean latency, the speed-up, each one's
retrieval share (the fraction of its latency outside the generator), the KB calls, and how
many PSA outputs equal RaLMSeq's (they must all). Retrieval here is in-process, not in
retrieval actors: the served split adds the actors' round trips to both methods. It needs
what the pipeline needs (FAISS, the dense encoder): a machine where the project installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cluster.bench.spec_bench import run_retriever
from cluster.report import table
from ralm import constants as C
from ralm.config import RalmConfig
from ralm.corpus import load_questions


def e2e_runs(engine, device: str, pad_to: int, n_questions: int, new_tokens: int, free: Callable[[], None]) -> dict:
    """The two arms (``host``, ``device``), each a dict of the numbers above (``skipped``
    with the reason where an arm cannot run)."""
    # lazy: loads torch, transformers, faiss
    from ralm.pipeline import Pipeline

    questions = load_questions(C.DEMO_QUESTIONS, limit=n_questions + 1)
    base = RalmConfig()
    out: dict[str, Any] = {"pad_to": pad_to, "questions": len(questions) - 1, "new_tokens": new_tokens}
    for arm, scan in (("host", "auto"), ("device", "gpu")):
        if scan == "gpu" and device != "cuda":
            out[arm] = {"skipped": "no CUDA device"}
            continue
        cfg = base.model_copy(
            update={
                "retriever": base.retriever.model_copy(update={"pad_to": pad_to, "dense_scan": scan}),
                "request": base.request.model_copy(update={"max_new_tokens": new_tokens, "ignore_eos": True}),
            }
        )
        pipe = Pipeline.from_config(cfg, kinds=("edr",), engine=engine)
        rows, _ = run_retriever(pipe, "edr", questions, ["PSA"], warmup=1, progress=False)
        seq, psa = rows
        out[arm] = {
            "scan": getattr(pipe.retriever("edr"), "scan_label", scan),
            "ralmseq_s": round(seq.mean_latency_s, 3),
            "psa_s": round(psa.mean_latency_s, 3),
            "speedup": round(psa.speedup, 2),
            "ralmseq_retrieval_share": round(seq.retrieval_share, 3),
            "psa_retrieval_share": round(psa.retrieval_share, 3),
            "retrieval_eliminated": round(psa.retrieval_eliminated, 3),
            "ralmseq_kb_calls": seq.kb_calls,
            "psa_kb_calls": psa.kb_calls,
            "identical": f"{psa.identical}/{psa.requests}",
            "differing": psa.requests - psa.identical,
        }
        del pipe
        free()
    return out


def e2e_markdown(e2e: dict) -> list[str]:
    """The section's table (no lines when it did not run)."""
    arms = [(k, v) for k, v in e2e.items() if isinstance(v, dict)]
    if not arms:
        return []
    rows = []
    for arm, r in arms:
        if "skipped" in r:
            rows.append((arm, r["skipped"], "", "", "", "", "", ""))
            continue
        rows.append(
            (
                arm,
                r["scan"],
                r["ralmseq_s"],
                r["psa_s"],
                f"{r['speedup']:.2f}x",
                f"{r['ralmseq_retrieval_share']:.0%}",
                f"{r['psa_retrieval_share']:.0%}",
                r["identical"],
            )
        )
    head = ("retrieval on", "scan", "RaLMSeq s", "PSA s", "speed-up", "RaLMSeq retrieval", "PSA retrieval", "identical")
    note = (
        f"End to end, EDR over the demo corpus padded to {e2e.get('pad_to')} rows, {e2e.get('questions')} questions, "
        f"{e2e.get('new_tokens')} new tokens, generator on the device (in-process retrieval)."
    )
    return [note, "", *table(head, rows), ""]
