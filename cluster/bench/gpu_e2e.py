"""``ralmspec gpu-check``'s ``e2e`` section: RaLMSeq against RaLMSpec (PSA) with the generator
on the device, retrieval by exact dense search (EDR) on the device, then on the host.

Both arms run the same questions (the demo set, a warm-up first) through the in-process
pipeline (:mod:`ralm.pipeline`) with the generator the ``proof`` section built (the batching
engine of the first shape and dtype that passed), the demo corpus's EDR index padded to
``pad_to`` rows, fixed-length generation (EOS masked) and every request's caches cleared
first, as ``ralmspec bench`` does:

- ``device``: the float16 device scan with its proven bound (``dense_scan: gpu``); only
  where the process sees a CUDA device. It runs first, as the split a GPU deployment
  serves, so a spent budget cuts the host arm rather than this one;
- ``host``: the candidate scan on the CPU, the split of the card's deployment (GPU
  generator, CPU retrieval).

Two kinds of host. Where FAISS and the dense encoder are installed, the retriever is the
demo EDR index as served (its encoder, ``dense_scan: auto`` on the host). On a bare GPU host
(torch, transformers and triton only) the passages and questions are encoded by a
stand-in encoder built from the generator's own input embeddings (:class:`StandInEncoder`,
384 dimensions like the default encoder), the host arm scans with the exact int8 (or
bfloat16) scan, and no FAISS is loaded; the output says ``encoder: stand-in``. RaLMSpec's
exactness does not depend on the encoder (both methods retrieve with the same one), and the
scan's cost depends on the rows and the dimension, not on what the vectors mean.

Per arm: the scan's label, RaLMSeq's and PSA's mean latency, the speed-up, each one's
retrieval share (the fraction of its latency outside the generator), the KB calls, and how
many PSA outputs equal RaLMSeq's (they must all). Retrieval here is in-process, not in
retrieval actors: the served split adds the actors' round trips to both methods.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cluster.bench.spec_bench import run_retriever
from cluster.report import table
from ralm import constants as C
from ralm.config import RalmConfig
from ralm.corpus import Corpus, load_questions
from ralm.retrieval.encoder import EncoderError, local_model_dir


class StandInEncoder:
    """A dense encoder made of the generator's input embeddings: a text's vector is the mean
    of its tokens' embeddings projected to ``dim`` by a fixed random matrix (seeded), unit
    length, float32. Each text is encoded alone, on the host, so a query's bits do not
    depend on its batch (the property the pipeline's exactness needs of an encoder)."""

    name = "stand-in (generator embeddings)"

    def __init__(self, model, tokenizer, dim: int = 384, max_tokens: int = 256, seed: int = 0):
        import torch

        emb = model.get_input_embeddings().weight.detach()
        proj = torch.randn(emb.shape[1], dim, generator=torch.Generator().manual_seed(seed)) / dim**0.5
        with torch.inference_mode():
            self._table = (emb.float() @ proj.to(emb.device)).cpu().numpy().astype(np.float64)  # (vocab, dim)
        self.tokenizer = tokenizer
        self.dim = int(dim)
        self.max_tokens = int(max_tokens)

    def _one(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: self.max_tokens] or [0]
        v = self._table[ids].mean(axis=0)
        return (v / (np.linalg.norm(v) or 1.0)).astype(np.float32)

    def encode_passages(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self._one(t) for t in texts])

    def encode_queries(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self._one(t) for t in texts]


def full_install() -> bool:
    """Whether FAISS and the default dense encoder's package are there (else: a bare GPU host)."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    try:
        local_model_dir(RalmConfig().retriever.encoder)
    except EncoderError:
        return False
    return True


def e2e_runs(
    engine,
    device: str,
    pad_to: int,
    n_questions: int,
    new_tokens: int,
    free: Callable[[], None],
    encoder: str = "auto",
    deadline: float | None = None,
) -> dict:
    """The two arms (``device`` first, the one the card deploys, then ``host``), each a dict
    of the numbers above (``skipped`` with the reason where an arm cannot run). ``encoder``:
    'index' (the served EDR index and encoder), 'stand-in' (:class:`StandInEncoder`, no
    FAISS), 'auto' (the first where :func:`full_install`, else the second). ``deadline`` (a
    ``time.perf_counter()`` value): an arm that would start after it is skipped, and no
    timed question starts after it (an arm cut so reports the questions it ran). Each arm
    also reports its build and run seconds, and says so on stderr as it goes."""
    # lazy: loads torch, transformers (and faiss with the index)
    from ralm.pipeline import Pipeline
    from ralm.retrieval import dense, int8_scan  # lazy: torch, as above

    standin = encoder == "stand-in" or (encoder == "auto" and not full_install())
    questions = load_questions(C.DEMO_QUESTIONS, limit=n_questions + 1)
    base = RalmConfig()
    out: dict[str, Any] = {
        "pad_to": pad_to,
        "questions": len(questions) - 1,
        "new_tokens": new_tokens,
        "encoder": "stand-in (generator embeddings, 384-d)" if standin else base.retriever.encoder,
    }
    parts = None  # the stand-in encoder and its passage vectors, made for the first arm that runs
    for arm in ("device", "host"):
        if arm == "device" and device != "cuda":
            out[arm] = {"skipped": "no CUDA device"}
            continue
        if deadline is not None and time.perf_counter() > deadline:
            out[arm] = {"skipped": "time budget"}
            continue
        if standin and parts is None:
            t = time.perf_counter()
            parts = _standin_parts(engine)
            _say(f"e2e: encoder ready in {time.perf_counter() - t:.1f} s")
        t_build = time.perf_counter()
        scan = "gpu" if arm == "device" else ("auto" if parts is None else _host_scan(int8_scan, parts[2].shape[1]))
        cfg = base.model_copy(
            update={
                "retriever": base.retriever.model_copy(update={"pad_to": pad_to, "dense_scan": scan}),
                "request": base.request.model_copy(update={"max_new_tokens": new_tokens, "ignore_eos": True}),
            }
        )
        if parts is None:
            pipe = Pipeline.from_config(cfg, kinds=("edr",), engine=engine)
        else:
            corpus, enc, vectors = parts
            kb = dense.DenseRetriever("edr", enc, vectors, pad_to=pad_to, dense_scan=scan)
            retrievers: dict[str, Any] = {"edr": kb}
            pipe = Pipeline(cfg, corpus, engine, retrievers)
        build_s = time.perf_counter() - t_build
        _say(f"e2e {arm}: index of {pad_to} rows built in {build_s:.1f} s")
        t_run = time.perf_counter()
        rows, _ = run_retriever(pipe, "edr", questions, ["PSA"], warmup=1, progress=False, deadline=deadline)
        seq, psa = rows
        run_s = time.perf_counter() - t_run
        _say(f"e2e {arm}: {psa.requests} questions through RaLMSeq and PSA in {run_s:.1f} s")
        out[arm] = {
            "build_s": round(build_s, 1),
            "run_s": round(run_s, 1),
            "questions_run": psa.requests,
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


def _say(line: str) -> None:
    """A progress line on stderr (gpu-check's log shows where an arm's time goes)."""
    print(line, file=sys.stderr, flush=True)


def _standin_parts(engine) -> tuple[Any, StandInEncoder, np.ndarray]:
    """The demo corpus, the stand-in encoder of ``engine``'s model and its passage vectors."""
    corpus = Corpus.load(C.DEMO_CORPUS)
    enc = StandInEncoder(engine.model, engine.tokenizer)
    return corpus, enc, enc.encode_passages([corpus.text(i) for i in range(len(corpus))])


def _host_scan(int8_scan, dim: int) -> str:
    """The exact CPU scan for a host without FAISS: int8 where a kernel is exact, else bfloat16
    (``int8_scan``: :mod:`ralm.retrieval.int8_scan`, imported by the caller)."""
    try:
        int8_scan.available("int8", dim)
        return "int8"
    except RuntimeError:
        return "bf16"


def e2e_markdown(e2e: dict) -> list[str]:
    """The section's table (no lines when it did not run)."""
    arms = [(k, v) for k, v in e2e.items() if isinstance(v, dict)]
    if not arms:
        return []
    rows = []
    for arm, r in arms:
        if "skipped" in r:
            rows.append((arm, r["skipped"], "", "", "", "", "", "", "", ""))
            continue
        rows.append(
            (
                arm,
                r["scan"],
                r.get("build_s", "-"),
                r.get("questions_run", "-"),
                r["ralmseq_s"],
                r["psa_s"],
                f"{r['speedup']:.2f}x",
                f"{r['ralmseq_retrieval_share']:.0%}",
                f"{r['psa_retrieval_share']:.0%}",
                r["identical"],
            )
        )
    head = (
        "retrieval on",
        "scan",
        "build s",
        "questions",
        "RaLMSeq s",
        "PSA s",
        "speed-up",
        "RaLMSeq retrieval",
        "PSA retrieval",
        "identical",
    )
    note = (
        f"End to end, EDR over the demo corpus padded to {e2e.get('pad_to')} rows (encoder: {e2e.get('encoder')}), "
        f"{e2e.get('questions')} questions, "
        f"{e2e.get('new_tokens')} new tokens, generator on the device (in-process retrieval)."
    )
    return [note, "", *table(head, rows), ""]
