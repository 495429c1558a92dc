"""What a request returns: its text and tokens with the statistics that explain its latency.

A core loop counts into a :class:`RequestStats` as it runs; when it ends it hands its
figures over in one frozen :class:`RalmResult`, which travels unchanged from the loop to the
HTTP response (through the coordinator actor and the backend, as ``RalmJob`` travels the other
way). Each figure is computed once, where it is known: the loop's by the loop, the time a
served request waited for a coordinator by the backend (:meth:`RalmResult.queued`, a new
result), the prompt's token count by the ingress that validated it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass
class RequestStats:
    method: str = "seq"  # "seq" (RaLMSeq) or "spec[P,S,A]" (RaLMSpec)
    retriever: str = ""
    steps: int = 0  # committed steps (one document each)
    kb_calls: int = 0  # calls to the knowledge base (a batch counts once)
    kb_queries: int = 0  # queries sent to the knowledge base
    spec_steps: int = 0  # speculative steps run (including discarded ones)
    cache_lookups: int = 0  # speculative steps' lookups and direct steps' shadow guesses
    verifications: int = 0
    matched_steps: int = 0  # speculative steps confirmed by verification
    shadow_hits: int = 0  # direct steps whose cache guess was the KB's answer
    rollbacks: int = 0
    regenerated_tokens: int = 0  # tokens thrown away by rollbacks
    async_steps_kept: int = 0  # async steps that became the next window's first step
    async_steps_discarded: int = 0
    async_windows_declined: int = 0  # windows verified synchronously by OS3's overlap check
    direct_steps: int = 0  # OS3 chose s = 0: plain KB retrieval for the step
    load_direct_steps: int = 0  # of those, taken because other requests shared the KB (ralm/stride/load_gate.py)
    stride_reasons: dict[str, int] = field(default_factory=dict)  # decisions by reason (ralm.stride.load_gate.REASONS)
    shared_queries: float | None = None  # other requests' queries per search at the last decision (served)
    strides: list[int] = field(default_factory=list)  # window size of each verification
    gamma: float | None = None  # final OS3 estimate of speculation accuracy
    gen_time_s: float = 0.0  # G: wall time inside the generator
    retrieval_time_s: float = 0.0  # R: everything else (KB waits, caches, encoding)
    total_time_s: float = 0.0
    doc_kv_hits: int = 0
    doc_ids: list[int | None] = field(default_factory=list)  # document used at each committed step (None: no hit)
    # ---- generation-side statistics (additive; summed over every step run, rolled back or not)
    workload: str = "fixed"  # fixed | flare | iter_retgen
    drafting: str = "none"  # none | ngram | dense
    forward_passes: int = 0  # model forward passes (context prefill + decode/verify)
    generated_tokens: int = 0  # tokens produced by those steps
    draft_rounds: int = 0  # verify passes that carried a draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens accepted
    doc_kv_misses: int = 0  # documents whose KV had to be computed
    doc_kv_docs_reused: int = 0  # documents whose KV came from the doc-KV cache
    doc_kv_bytes_reused: int = 0
    context_tokens_reused: int = 0  # context tokens whose KV came from the request's KV session
    context_tokens_computed: int = 0  # context tokens fed to the model before each step's first new token
    prefill_time_s: float = 0.0  # doc KV (misses) + context prefill
    decode_time_s: float = 0.0
    low_confidence_stops: int = 0  # FLARE: steps ended by a low-probability token
    gen_steps: int = 0  # generator steps run (committed, speculative, discarded, corrections)
    num_docs: int = 1  # documents per prompt
    exact: bool = True  # output is, by construction, plain RaLMSeq's (False: an inexact option is on)
    inexact_options: list[str] = field(default_factory=list)  # the options that made it inexact

    def set_request(self, req) -> RequestStats:
        """Record the request's generation-side modes (a :class:`~ralm.config.RequestConfig`)."""
        self.workload, self.drafting, self.num_docs = req.workload, req.drafting, req.num_docs
        self.inexact_options = list(req.inexact_options)
        self.exact = not self.inexact_options
        return self

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (drafting only)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_forward(self) -> float | None:
        """Generated tokens per model forward pass (1.0 for plain decoding; > 1 when drafts are accepted)."""
        return self.generated_tokens / self.forward_passes if self.forward_passes else None

    @property
    def accepted_per_verify_pass(self) -> float | None:
        """Draft tokens accepted per verifying forward pass (drafting only)."""
        return self.accepted_tokens / self.draft_rounds if self.draft_rounds else None

    @property
    def doc_kv_hit_rate(self) -> float | None:
        """Fraction of prompt documents whose KV came from the doc-KV cache."""
        n = self.doc_kv_docs_reused + self.doc_kv_misses
        return self.doc_kv_docs_reused / n if n else None

    def record_step(self, out) -> None:
        """Add one step's generation statistics (any StepOutput; missing fields count 0)."""
        g = lambda name: getattr(out, name, 0) or 0  # noqa: E731
        self.gen_steps += 1
        self.forward_passes += g("forward_passes")
        self.generated_tokens += len(out.tokens)
        self.draft_rounds += g("draft_rounds")
        self.drafted_tokens += g("drafted_tokens")
        self.accepted_tokens += g("accepted_tokens")
        self.doc_kv_misses += g("docs_computed")
        self.doc_kv_docs_reused += g("docs_reused")
        self.doc_kv_bytes_reused += g("kv_bytes_reused")
        self.context_tokens_reused += g("context_reused")
        self.context_tokens_computed += g("context_computed")
        self.prefill_time_s += g("prefill_s")
        self.decode_time_s += g("decode_s")
        self.low_confidence_stops += int(bool(g("low_confidence")))

    resumed_tokens: int = 0  # tokens taken from a verified prefix (a resumed request)
    resumed_steps: int = 0
    knn_k: int = 0  # KNN-LM: neighbours per token (0: a document-level request)
    cache_entries: int = 0  # KNN-LM: speculative cache size at the end of the request
    knn_settings: dict = field(default_factory=dict)  # KNN-LM: the settings it ran with (ralm.knnlm.knn_settings)

    @property
    def speculation_accuracy(self) -> float | None:
        """Fraction of verified speculative steps whose document was right."""
        checked = self.matched_steps + self.rollbacks
        return self.matched_steps / checked if checked else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["speculation_accuracy"] = self.speculation_accuracy
        d["acceptance_rate"] = self.acceptance_rate
        d["tokens_per_forward"] = self.tokens_per_forward
        d["accepted_per_verify_pass"] = self.accepted_per_verify_pass
        d["doc_kv_hit_rate"] = self.doc_kv_hit_rate
        return d


@dataclass
class VerifiedPrefix:
    """A request's verified prefix, to resume it from (e.g. a checkpoint of a coordinator that died).

    ``tokens``: the generated tokens already verified (after the question, EOS excluded), ending
    at a step boundary; ``doc_ids``: the KB document of each of those steps; ``eos``: the last
    step ended with EOS. Steps are deterministic, so resuming from a verified prefix returns
    exactly the tokens of a run from scratch.
    """

    tokens: list[int]
    doc_ids: list
    eos: bool = False

    def check(self, max_new_tokens: int) -> None:
        if len(self.tokens) > max_new_tokens:
            raise ValueError(
                f"verified prefix has {len(self.tokens)} tokens, more than max_new_tokens={max_new_tokens}"
            )
        if self.tokens and not self.doc_ids:
            raise ValueError("verified prefix has tokens but no steps")


@dataclass(frozen=True)
class RalmResult:
    """One request's answer: built once by the loop that ran it (:func:`ralm.seq.finish`),
    never changed after; the loop keeps no reference to it or to its ``stats``."""

    text: str
    tokens: list[int]  # generated tokens (EOS excluded)
    stats: RequestStats
    finish_reason: str = "length"  # "stop" (EOS) or "length"
    queue_s: float | None = None  # served: seconds it waited for a coordinator (None: not served)

    @property
    def exact(self) -> bool:
        """The output is, by construction, plain RaLMSeq's (no inexact option was on)."""
        return self.stats.exact

    def queued(self, queue_s: float) -> RalmResult:
        """This result, served after waiting ``queue_s`` seconds for a coordinator."""
        return replace(self, queue_s=queue_s)

    def stats_dict(self) -> dict:
        """The statistics as JSON: :meth:`RequestStats.as_dict`, and ``queue_s`` when served."""
        d = self.stats.as_dict()
        if self.queue_s is not None:
            d["queue_s"] = self.queue_s
        return d

    def as_dict(self) -> dict:
        """The result as JSON (the body of ``/v1/ralm/generate`` without the request's fields)."""
        return {
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "exact": self.exact,
            "stats": self.stats_dict(),
        }
