"""Typed configuration, shared by the Python API, the CLI and ``serve_config.yaml``.

Every field has a description; defaults come from :mod:`ralm.constants`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ralm import constants as C
from ralm.retrievers import RetrieverKind


class StrictModel(BaseModel):
    """The base of every configuration model: unknown keys are errors (a misspelt option in a
    YAML file fails validation instead of being ignored), and field names may start with
    ``model_`` (``model_sha256``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def _expand_user(p: Path | None) -> Path | None:
    """ "~/.cache/ralmspec" from YAML must mean the home directory in every entry point (the
    served app, the CLI and Python), never a directory literally named "~"."""
    return None if p is None else Path(p).expanduser()


class RetrieverConfig(StrictModel):
    kind: RetrieverKind = Field(
        "edr",
        description="A registered retriever kind (ralm.retrievers): edr: exact dense (FAISS flat IP); adr: approximate dense (FAISS HNSW); sr: sparse BM25 (pyserini Lucene).",
    )
    index_dir: Path | None = Field(
        None, description="Directory of a built index (with manifest.json). None: <work_dir>/indexes/<kind>."
    )

    encoder: str = Field(
        "local:all-MiniLM-L6-v2",
        description="Dense query/passage encoder: 'local:all-MiniLM-L6-v2' (384-d, the default) or 'mpnet' (= 'local:all-mpnet-base-v2', 768-d like DPR), both offline pip packages, sha256-checked; a local path; or any Hugging Face model name.",
    )
    hnsw_m: int = Field(C.HNSW_M, ge=4, le=256, description="HNSW graph degree M (adr).")
    hnsw_ef_construction: int = Field(C.HNSW_EF_CONSTRUCTION, ge=8, description="HNSW efConstruction (adr).")
    hnsw_ef_search: int = Field(C.HNSW_EF_SEARCH, ge=8, description="HNSW efSearch (adr).")
    bm25_k1: float = Field(C.BM25_K1, gt=0, description="BM25 k1 (sr).")
    bm25_b: float = Field(C.BM25_B, ge=0, le=1, description="BM25 b (sr).")
    pad_to: int = Field(
        0,
        ge=0,
        description="edr only: pad the flat index with random vectors up to this many rows to emulate Wikipedia-scale search cost (results unchanged; reported wherever used).",
    )
    rerank_margin: int = Field(
        C.RERANK_MARGIN, ge=1, description="Extra candidates fetched before exact float64 re-scoring."
    )
    dense_scan: Literal["auto", "faiss", "bf16", "int8", "gpu"] = Field(
        "auto",
        description="edr only: candidate scan of the flat index. 'bf16': a bfloat16 copy scanned with torch and a proven error bound (for CPUs with bf16 instructions); 'int8': the same with an int8 copy and exact integer products, on FBGEMM or torch._int_mm, whichever is exact here (FBGEMM first); 'faiss': FAISS's float32 kernels; 'gpu': a float16 copy scanned on the process's CUDA device with a proven bound (shards get a GPU with sharding.num_gpus); 'auto': times every exact path here (FAISS, bf16 where the CPU has bf16 instructions, the int8 scan on each exact kernel) at batch 1, 4 and 16 once per process, builds the cheapest scan and sends each batch size to whichever of it and FAISS was faster (an index under 65,536 rows is not timed: int8, else bf16, else FAISS); auto never picks 'gpu'. Candidates are always re-scored exactly: never changes results.",
    )
    faiss_threads: int = Field(
        C.FAISS_THREADS,
        ge=0,
        description="OpenMP threads FAISS may use (process-wide; 0 keeps FAISS's default of one per core). 1 avoids oversubscription when generation and asynchronous verification share the cores.",
    )

    _expand_index_dir = field_validator("index_dir", mode="after")(_expand_user)


class GeneratorConfig(StrictModel):
    model: str = Field(
        str(C.DEMO_MODEL_DIR),
        description="Causal LM: a local path, a Hugging Face hub name, a .gguf file, or a preset of a real pretrained model that installs offline (smollm2-135m; see docs/models.md).",
    )
    gguf_file: str | None = Field(
        None,
        description="GGUF weights file inside `model` (a directory or hub repo); transformers dequantizes it to `dtype`. Presets set it.",
    )
    model_sha256: str | None = Field(
        None,
        description="Expected sha256 of the GGUF file, checked at every load (a mismatch refuses to start). Presets carry their own.",
    )
    device: str = Field(
        "cpu", description="torch device: cpu, cuda, cuda:0, or 'auto' (spread layers over visible GPUs)."
    )
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="Weights/activation dtype.")
    max_doc_tokens: int = Field(C.MAX_DOC_TOKENS, ge=1, description="Retrieved document truncated to this many tokens.")
    max_prompt_tokens: int = Field(
        512, ge=1, description="Longest accepted question, in tokens; longer input is rejected."
    )
    max_new_tokens_limit: int = Field(
        128,
        ge=1,
        description="Most tokens a request may ask for (a request's own count is RequestConfig.max_new_tokens).",
    )
    doc_kv_cache_bytes: int = Field(
        256 * 2**20, ge=0, description="Byte budget of the per-engine doc-KV LRU (0 disables it)."
    )
    torch_threads: int = Field(
        1, ge=1, description="torch intra-op threads; fixed so numerics are the same in every process."
    )
    invariant: bool = Field(
        True,
        description="Run the batch- and chunk-invariant forward (docs/batching.md): a sequence's logits are the same bits alone or batched, prefilled at once or token by token. Enables continuous batching and KV sessions; false restores the plain forward (re-prefill every step, one step at a time).",
    )
    invariant_tile_rows: int = Field(
        C.INVARIANT_TILE_ROWS,
        ge=1,
        description="Linear layers run on row counts padded to a multiple of this; checked at load for row invariance.",
    )
    invariant_kernels: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="Kernels of the invariant forward: 'torch' (BLAS tiles / oneDNN linear layers and torch attention: the CPU path), 'triton' (batch-invariant Triton kernels for linear layers, norms and attention: fixed tiles, no split-K), 'auto' (triton for a model on a CUDA device, else torch). Either way the whole model must pass the invariance proof before batching turns on.",
    )
    proof_cache: bool = Field(
        True,
        description="Keep a passed whole-model invariance proof on disk (RALMSPEC_PROOF_CACHE, else ~/.cache/ralmspec/proofs; 'off' turns it off) under a key of the weights' bits, the shapes proved, the kernels, the software versions, this package's source and the machine, so a restart with the same key skips the proof (SmolLM2-135M: 47 s on 2 cores). A failed proof is never kept. false: prove on every load.",
    )
    kv_session_bytes: int = Field(
        2**30,
        ge=0,
        description="Byte budget of the in-flight requests' KV sessions (LRU); 0 recomputes the context every step.",
    )
    kv_pool: bool = Field(
        True,
        description="Keep the batched engine's KV (sessions and documents' KV) in one pool of fixed-size blocks with a block table per sequence: a document's KV is held once and shared by reference by every request on it, and every sequence of a forward is written and read in one operation per layer. false: each sequence in blocks of its own, doubling as it grows (the same tokens; no sharing of a document's KV).",
    )
    cuda_graphs: bool = Field(
        True,
        description="Replay each batched iteration (decode tokens, prefill chunks, drafted windows) as a CUDA graph, one per bucket of tokens, logit rows, sequences and block-table width, captured on first use: the same kernels on padded, fixed-address inputs, so the same tokens, with the host's per-forward work (transformers' modules, the kernel launches) gone. Applies on one CUDA device with the Triton kernels and the KV pool (kv_pool: true); elsewhere, and for KNN-LM feeds, every forward runs eagerly.",
    )
    fast_draft: int = Field(
        0,
        ge=0,
        le=32,
        description="Decode fast, verify exactly: before each batched iteration, draft up to this many tokens for every decoding step with the linear layers on torch's own (fast, not batch-invariant) kernels, then verify the window with one invariant forward, keeping the draft while it equals the invariant argmax. The tokens are the invariant forward's either way (exact by construction); it pays only where the plain kernels are faster and a forward's cost barely grows with its rows. 0: off.",
    )
    batch_token_budget: int = Field(
        C.BATCH_TOKEN_BUDGET, ge=1, description="Most tokens (prefill chunks + decode tokens) in one batched forward."
    )
    batch_max_sequences: int = Field(C.BATCH_MAX_SEQUENCES, ge=1, description="Most sequences in one batched forward.")


class SpecConfig(StrictModel):
    prefetch: bool = Field(
        False, description="P: insert the KB's top-p documents into the cache at start and at every verification."
    )
    prefetch_size: int = Field(20, ge=1, description="p, documents inserted per query when prefetching.")
    adaptive_stride: bool = Field(False, description="S: choose the speculation stride with OS3.")
    async_verify: bool = Field(False, description="A: run the next speculative step while a verification is in flight.")
    overlap_check: bool = Field(
        True,
        description="With A and adaptive strides (the default gamma estimates, not 'capped'): verify synchronously while overlapping measured no faster here. Each asynchronous window's verification-plus-extra-step phase is timed against its own speculative step plus a KB call that nothing overlapped; while the mean ratio (this request's windows and recent requests') is above 0.95, windows are verified one after the other, one in every 9 still overlapping to measure again. Where the generator and the KB share CPU cores the overlap saves nothing and its discarded steps cost; on a GPU generator beside a CPU KB it pays and stays on. Only timing changes, never tokens.",
    )
    stride: int = Field(3, ge=1, le=256, description="Fixed speculation stride s when adaptive_stride is off.")
    gamma_estimate: Literal["positional", "bayes", "capped"] = Field(
        "positional",
        description="How S estimates the speculation accuracy gamma. 'positional' (default): a gamma per step of the window, from the step's position in the request (committed steps 0, 1, 2-3, 4-7, ... doubling): the gamma_quantile quantile of a Beta posterior over that position bucket's matches and mismatches, started from the pooled accuracy (docs/design.md). 'bayes': one gamma for every step, the gamma_quantile quantile of a Beta(1 + matched steps, 1 + mismatches) posterior over the last 32 verifications, no cap. 'capped': the paper's OS3, the maximum-likelihood estimate over the last os3_window verifications capped at gamma_max.",
    )
    gamma_quantile: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="With gamma_estimate 'positional' or 'bayes': the posterior quantile used as gamma.",
    )
    gamma_prior: bool = Field(
        True,
        description="With gamma_estimate 'positional' or 'bayes': start each request's posterior from the evidence of this process's recent requests with the same knowledge base and settings (at most 32 pseudo-observations, from the last 8 requests), instead of from nothing. Changes strides, never outputs.",
    )
    os3_window: int = Field(5, ge=1, description="w: verifications used to estimate gamma (gamma_estimate 'capped').")
    gamma_max: float = Field(
        C.OS3_GAMMA_MAX, gt=0, lt=1, description="Cap on the gamma estimate (gamma_estimate 'capped')."
    )
    max_stride: int = Field(C.OS3_MAX_STRIDE, ge=1, description="Upper bound on the OS3 stride.")
    allow_direct: bool = Field(
        True,
        description="With S: let OS3 choose s = 0 (retrieve from the KB directly, as RaLMSeq does) when its model says speculation cannot pay off, e.g. when retrieval is much cheaper than a rollback. The cache still predicts each step ('shadow speculation') so gamma stays current.",
    )

    shared_kb_direct_at: int = Field(
        8,
        ge=0,
        description="On a knowledge base that batches several requests' calls (the served verifier): take direct steps, as RaLMSeq does, while at least this many requests share it (this one included; 0: never). Under such load RaLMSeq's requests step together and share every search, so speculation saves no KB work and only adds its own. Changes strides, never outputs.",
    )
    shared_kb_cost_model: bool = Field(
        True,
        description="On a knowledge base that batches several requests' calls (the served verifier): price a window's queries by what they add to searches that other requests' queries already pay for (the KB's batch cost curve), and take a direct step when that makes it cheaper than any window (docs/design.md, 'direct steps under shared load'). Changes strides, never outputs.",
    )

    @classmethod
    def named(cls, name: str, **overrides) -> SpecConfig:
        """A configuration by its paper name: base, P, S, A, PS, PA, SA, PSA."""
        name = name.upper()
        if name == "BASE":
            name = ""
        if set(name) - set("PSA"):
            raise ValueError(f"unknown RaLMSpec configuration {name!r}: use base or a combination of P, S, A")
        return cls(prefetch="P" in name, adaptive_stride="S" in name, async_verify="A" in name, **overrides)

    @classmethod
    def parse(cls, name: str, **defaults: Any) -> SpecConfig:
        """A configuration by its name: the one grammar of the CLI, the benchmarks and the
        evaluation job (:meth:`named` extended with fixed strides, the gamma cap and the
        served benchmark's ``spec:`` prefix)::

            NAME  = [spec:] BODY [@GAMMA | @bayes | @positional] {;FIELD=VALUE}
            BODY  = base | a combination of P, S, A | [P][A]s=N

        Letters are case-insensitive and in any order; ``s=N`` is lower case. ``P``: prefetch,
        ``S``: OS3 chooses the stride, ``A``: asynchronous verification, ``s=N``: fixed
        stride N (so not with ``S``), ``@GAMMA``: the paper's OS3 with this cap on its
        gamma estimate (``gamma_estimate='capped'``, ``gamma_max``; ``PSA@0.6`` is the
        paper's PSA; ``@bayes``: one Beta-posterior gamma for every step; ``@positional``, or
        nothing: a gamma per position bucket, the default); ``;FIELD=VALUE``: any other
        SpecConfig field set on top (``PSA;shared_kb_direct_at=0``). ``defaults``: other
        SpecConfig fields (a server's config, a benchmark's ``prefetch_size``, ...); what the
        name says overrides them, and the name alone decides P, S and A.

        Worked examples:

        ================  ============================================================
        name              configuration
        ================  ============================================================
        ``base``          no P/S/A: fixed stride ``stride`` (3 by default)
        ``P``             prefetching, fixed stride
        ``PSA``, ``asp``  prefetching, adaptive stride (Beta-posterior gamma per position), async verification
        ``s=4``           fixed stride 4, no P/S/A
        ``Ps=8``          prefetching, fixed stride 8 (the KNN-LM benchmark's form)
        ``PSA@0.6``       the paper's PSA: OS3 with its gamma estimate capped at 0.6
        ``PSA@0.9``       the same with the cap raised to 0.9
        ``PSA@bayes``     PSA with one Beta-posterior gamma for every step
        ``spec:PSA@0.9``  the same (the served benchmark's method form)
        ``PSA;max_stride=4``  PSA with OS3's stride capped at 4
        ================  ============================================================

        >>> SpecConfig.parse("PSA@0.9").gamma_max
        0.9
        >>> SpecConfig.parse("s=4", prefetch_size=64).model_dump(include={"stride", "prefetch_size"})
        {'prefetch_size': 64, 'stride': 4}

        Invalid names raise ValueError naming the problem, e.g. ``PQ``: "unknown RaLMSpec
        configuration 'PQ' ...", ``PSs=4``: "... a fixed stride s=N cannot be combined with S
        ...", ``s=0``: "invalid RaLMSpec configuration 's=0': stride: Input should be greater
        than or equal to 1" (the table in tests/ralm/test_config_names.py lists them all).
        """
        head, *settings = name.split(";")
        fields = {k: v for k, v in defaults.items() if k not in ("prefetch", "adaptive_stride", "async_verify")}
        for setting in settings:
            key, eq, value = (x.strip() for x in setting.partition("="))
            if not eq or key not in cls.model_fields or key in ("prefetch", "adaptive_stride", "async_verify"):
                raise ValueError(
                    f"bad setting {setting!r} in RaLMSpec configuration {name!r}: use ;FIELD=VALUE with a "
                    "SpecConfig field other than the P/S/A flags (the name's letters set those)"
                )
            fields[key] = value  # validated (and converted) with the whole configuration below
        body, at, cap = head.strip().partition("@")
        if body[:5].lower() == "spec:":
            body = body[5:]
        body = body.strip()
        if not body:
            raise ValueError(
                f"empty RaLMSpec configuration name {name!r}: use base, a combination of P, S, A, or [P][A]s=N"
            )
        if at and cap.strip().lower() in ("bayes", "positional"):
            fields["gamma_estimate"] = cap.strip().lower()  # NAME@ESTIMATE
        elif at:
            fields["gamma_estimate"] = "capped"  # NAME@CAP: the paper's capped estimate
            try:
                fields["gamma_max"] = float(cap)
            except ValueError:
                raise ValueError(
                    f"the gamma cap of RaLMSpec configuration {name!r} is not a number, bayes or positional: {cap!r}"
                ) from None
        letters, fixed, stride = body.partition("s=")
        flags = "" if letters.upper() == "BASE" and not fixed else letters.upper()
        if set(flags) - set("PSA"):
            raise ValueError(
                f"unknown RaLMSpec configuration {name!r}: use base, a combination of P, S, A, "
                "or [P][A]s=N, optionally followed by @GAMMA (e.g. PSA@0.9), @bayes or @positional"
            )
        if fixed:
            if "S" in flags:
                raise ValueError(
                    f"RaLMSpec configuration {name!r}: a fixed stride s=N cannot be combined "
                    "with S (OS3 chooses the stride)"
                )
            try:
                fields["stride"] = int(stride)
            except ValueError:
                raise ValueError(
                    f"the stride of RaLMSpec configuration {name!r} is not an integer: {stride!r}"
                ) from None
        try:
            return cls.named(flags, **fields)
        except ValidationError as e:
            raise ValueError(
                f"invalid RaLMSpec configuration {name!r}: "
                + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            ) from None


class RequestConfig(StrictModel):
    max_new_tokens: int = Field(128, ge=1, description="Tokens to generate at most.")
    generation_stride: int = Field(4, ge=1, description="k: tokens generated per retrieval.")
    query_window: int = Field(32, ge=1, description="Query = decoded last N tokens of question + generated text.")
    ignore_eos: bool = Field(
        False,
        description="Never stop at EOS: the EOS logit is masked, so every request generates max_new_tokens (fixed-length workloads for benchmarks, as in the RaLMSpec paper).",
    )
    # ---- generation-side acceleration (docs/design.md, "Generation-side acceleration": IDR2, DReSD); exact unless stated ----
    num_docs: int = Field(
        1,
        ge=1,
        le=8,
        description="Documents per prompt: [doc1]..[docn][context] with the KB's top-n in rank order. Their KV is reused through the doc-KV prefix tree (longest cached prefix of the document sequence); exact.",
    )
    drafting: Literal["none", "ngram", "dense"] = Field(
        "none",
        description="Draft tokens inside a step and verify them in one forward pass: 'ngram' (IGPG: copy from the documents/question), 'dense' (DReSD: hidden-state datastore attached to the engine). Same greedy tokens as 'none' up to float32 near-ties (a multi-token forward rounds differently).",
    )
    ngram_n: int = Field(C.NGRAM_N, ge=1, le=64, description="n-gram drafting: match the last N tokens of the context.")
    ngram_min_n: int = Field(
        C.NGRAM_MIN_N, ge=1, le=64, description="n-gram drafting: back off to matches down to this length."
    )
    ngram_m: int = Field(C.NGRAM_M, ge=1, le=256, description="n-gram drafting: tokens proposed per draft.")
    dense_num_drafts: int = Field(
        C.DENSE_NUM_DRAFTS,
        ge=1,
        le=32,
        description="dense drafting: drafts verified together in one batched forward pass.",
    )
    dense_draft_len: int = Field(C.DENSE_DRAFT_LEN, ge=1, le=256, description="dense drafting: tokens per draft.")
    dense_candidates: int = Field(
        C.DENSE_CANDIDATES,
        ge=1,
        le=1024,
        description="dense drafting: datastore neighbours fetched before keeping those whose first token is the model's next token.",
    )
    workload: Literal["fixed", "flare", "iter_retgen"] = Field(
        "fixed",
        description="Retrieval trigger/query: 'fixed' (every generation_stride tokens, query = last query_window tokens), 'flare' (a step ends before the first low-confidence token, then re-retrieve; generation_stride caps a step), 'iter_retgen' (iter_retgen_iterations iterations; query = question + the previous iteration's whole generation). All exact under RaLMSpec.",
    )
    flare_threshold: float = Field(
        0.4,
        gt=0,
        lt=1,
        description="FLARE: a token whose greedy probability is below this ends the step (it is regenerated after a new retrieval).",
    )
    iter_retgen_iterations: int = Field(
        4,
        ge=1,
        le=1024,
        description="Iter-RetGen: number of iterations; each generates ceil(max_new_tokens / iterations) tokens.",
    )
    idgr: bool = Field(
        False,
        description="IDGR instruction block (IDR2) listing related and unrelated doc ids and their relevance rank before the context. CHANGES OUTPUTS (a different prompt); off by default.",
    )
    idgr_unrelated: int = Field(2, ge=0, le=64, description="IDGR: lower-ranked retrieved doc ids listed as unrelated.")
    allow_inexact_shifted_reuse: bool = Field(
        False,
        description="IDR2 position-shifted doc-KV reuse: reuse a document's stand-alone KV at a later position in a multi-document prompt without recomputation. INEXACT: CHANGES OUTPUTS; off by default.",
    )

    @property
    def inexact_options(self) -> list[str]:
        """The options on that make the output differ from plain RaLMSeq's (IDGR: another prompt;
        shifted reuse: approximate KV). Empty: the request is exact."""
        return [name for name in ("idgr", "allow_inexact_shifted_reuse") if getattr(self, name)]

    @property
    def exact(self) -> bool:
        """True when the output is, by construction, the plain RaLMSeq output of this request
        (drafting included: it changes how a step computes, not what it means)."""
        return not self.inexact_options


class KnnLMConfig(StrictModel):
    """KNN-LM (token-level iterative RaLM): datastore, retrieval and interpolation."""

    k: int = Field(
        C.KNN_K, ge=1, le=C.KNN_MAX_K, description="Nearest datastore entries retrieved per generated token (1..1024)."
    )
    temperature: float = Field(
        C.KNN_TEMPERATURE,
        gt=0,
        description="T in p_knn(y) ~ sum over neighbours with value y of exp(-dist/T); dist is the exact float64 squared L2 distance.",
    )
    lmbda: float = Field(
        C.KNN_LAMBDA,
        ge=0,
        le=1,
        description="lambda: next token = argmax(lambda p_knn + (1 - lambda) p_lm), ties to the lowest token id.",
    )
    index: Literal["flat", "hnsw"] = Field(
        "flat",
        description="Datastore index: flat (exact, FAISS IndexFlatL2) or hnsw (approximate, FAISS IndexHNSWFlat L2); both re-scored exactly.",
    )
    hnsw_m: int = Field(C.HNSW_M, ge=4, le=256, description="HNSW graph degree M (index=hnsw).")
    hnsw_ef_construction: int = Field(C.HNSW_EF_CONSTRUCTION, ge=8, description="HNSW efConstruction (index=hnsw).")
    hnsw_ef_search: int = Field(
        C.HNSW_EF_SEARCH, ge=8, description="HNSW efSearch (index=hnsw); FAISS uses max(efSearch, candidates asked)."
    )
    pad_to: int = Field(
        0,
        ge=0,
        description="flat only: pad the index with far-away random vectors up to this many rows to emulate a large datastore's search cost (never returned; results unchanged; reported wherever used).",
    )
    scan: Literal["auto", "faiss", "bf16", "int8"] = Field(
        "auto",
        description="index=flat only: candidate scan. 'bf16': a bfloat16 copy of the keys (and padding) scanned with torch, one pass per verification batch (cost nearly flat in the batch size), with a proven error bound (each row's own norm), so the exact float64 re-scoring still returns exactly the top-k; 'int8': an int8 copy scanned with exact integer products (FBGEMM or torch's _int_mm) and a proven bound on the squared distance, for CPUs without bf16 instructions; 'faiss': FAISS IndexFlatL2; 'auto': bf16 when the CPU has bf16 instructions (AMX/AVX512-BF16) and the kernel passes its accumulation probe, else int8 where an integer product is exact here, else FAISS. Never changes results.",
    )
    rerank_margin: int = Field(
        C.KNN_RERANK_MARGIN,
        ge=1,
        description="Extra candidates (at least; k/8 for large k) fetched from FAISS before exact float64 re-scoring.",
    )
    spatial_next: int = Field(
        C.KNN_SPATIAL_NEXT,
        ge=0,
        description="n: after each KB retrieval, the retrieved entries and the n entries after each (same passage) go into the speculative cache (default 20; the paper's 10 left speculation right 0.55-0.78 of the time, docs/design.md).",
    )
    prefetch_size: int = Field(
        C.KNN_PREFETCH_SIZE,
        ge=1,
        le=C.KNN_MAX_K,
        description="p, entries fetched per KB query with prefetching (P): every verification fetches the top-max(k, p) and caches them with their successors; tokens still use the top-k. KNN-LM reads p here, not SpecConfig.prefetch_size (that counts documents). On an approximate index (HNSW) the top-p is a second search, asked only by verifications, never by direct steps.",
    )
    max_stride: int = Field(
        C.KNN_MAX_STRIDE,
        ge=1,
        le=256,
        description="Upper bound on the stride OS3 chooses for a KNN-LM request (S); KNN-LM reads it here, not SpecConfig.max_stride.",
    )
    cache_max_entries: int = Field(
        0,
        ge=0,
        description="Speculative cache capacity in entries (oldest evicted first); 0: max(KNN_CACHE_MIN_ENTRIES, cache_retrievals p (n + 1)), p = entries fetched per query (k, or the prefetch size with P), at most the datastore's size.",
    )
    cache_project_dims: int = Field(
        C.KNN_CACHE_PROJECT_DIMS,
        ge=0,
        description="The speculative cache scans its keys PCA-projected to this many dimensions (a lower bound of the L2 distance, then exact re-scoring: the cache's answer is unchanged, only cheaper to find); 0 or >= the key dimension: scan the full keys; requests with k > KNN_PROJECTED_MAX_K (256) always scan the full keys (the bound then needs thousands of candidates). The basis is fitted once per datastore, on first use.",
    )
    cache_retrievals: int = Field(
        C.KNN_CACHE_RETRIEVALS,
        ge=1,
        description="Default cache capacity in KB answers (each p (n + 1) entries); a verification inserts a whole window's answers at once, so this should not be below the usual stride. Used when cache_max_entries is 0.",
    )
    max_passage_tokens: int = Field(
        C.KNN_MAX_PASSAGE_TOKENS, ge=2, description="Datastore build: each passage is truncated to this many tokens."
    )
    datastore_dir: Path | None = Field(
        None, description="Directory of a built datastore (with manifest.json). None: <work_dir>/knn-datastore."
    )


class RalmConfig(StrictModel):
    corpus: Path = Field(C.DEMO_CORPUS, description="Corpus in pyserini JsonCollection JSONL (optionally .gz).")
    work_dir: Path = Field(C.DEFAULT_WORK_DIR, description="Where indexes and outputs are written.")
    retriever: RetrieverConfig = Field(default_factory=RetrieverConfig, description="Knowledge-base retriever.")
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig, description="Language model engine.")
    spec: SpecConfig = Field(default_factory=SpecConfig, description="Speculative retrieval options.")
    request: RequestConfig = Field(default_factory=RequestConfig, description="Per-request defaults.")

    @model_validator(mode="after")
    def _check(self) -> RalmConfig:
        if self.request.max_new_tokens > self.generator.max_new_tokens_limit:
            raise ValueError("request.max_new_tokens exceeds generator.max_new_tokens_limit")
        return self

    _expand_paths = field_validator("corpus", "work_dir", mode="after")(_expand_user)

    def index_dir(self, kind: str | None = None) -> Path:
        kind = kind or self.retriever.kind
        if self.retriever.index_dir is not None and kind == self.retriever.kind:
            return Path(self.retriever.index_dir)
        return Path(self.work_dir) / "indexes" / kind

    @classmethod
    def from_yaml(cls, path: str | Path) -> RalmConfig:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        return cls.model_validate(data)
