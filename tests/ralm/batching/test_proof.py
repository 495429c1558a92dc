"""The whole-model invariance proof: it passes on this machine's kernels for every family, and
it refuses a model whose kernels change bits where the per-layer probes do not look (a GEMM
that switches algorithm above 24 rows, as cuBLAS does on GPUs; an attention that differs for
long query chunks; an LM head that differs for several logit rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ralm.batching.invariant as inv
from ralm import constants as C
from ralm.batching.invariant import InvariantLinear, check_row_invariance, invariant_kernels
from ralm.batching.proof import prove_invariance
from tests.factories import tiny_engine

pytestmark = pytest.mark.unit


def test_the_proof_passes_for_every_family_on_this_machine(family_model):
    family, model = family_model
    proof = prove_invariance(model, max_sequences=16, token_budget=128)
    assert proof.ok, proof.reason
    assert proof.checks[:2] == ["chunked prefill (128 tokens)", f"drafted verification ({C.PROOF_DRAFT_TOKENS} tokens)"]
    assert [c for c in proof.checks if c.startswith("packed")] == [f"packed x{b}" for b in (2, 3, 5, 8, 16)]
    assert proof.comparisons > 100 and proof.device == "cpu" and proof.dtype == "float32"
    # the same model object proves once: a second engine over it gets the verdict back
    again = prove_invariance(model, max_sequences=16, token_budget=128)
    assert again.reused and not proof.reused and again.checks == proof.checks and again.ok
    assert not prove_invariance(model, max_sequences=8, token_budget=128).reused  # other shapes: proved anew


def _switches_above(rows: int):
    """An ``InvariantLinear.forward`` whose GEMM takes another algorithm (float64 accumulation,
    rounded) above ``rows`` rows: a stand-in for cuBLAS changing kernels with M on a GPU."""
    plain = InvariantLinear.forward

    def forward(self, x):
        n = x.reshape(-1, x.shape[-1]).shape[0]
        if n <= rows:
            return plain(self, x)
        b = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), self.weight.double(), b).to(x.dtype)

    return forward


def test_a_gemm_that_changes_bits_above_24_rows_is_refused_although_the_layer_probes_pass(monkeypatch):
    monkeypatch.setattr(InvariantLinear, "forward", _switches_above(24))
    engine = tiny_engine("llama")
    # the per-layer probes (at most 23 rows) accept the model ...
    assert invariant_kernels(engine.model) is not None
    layer = next(m for m in engine.model.modules() if isinstance(m, InvariantLinear))
    check_row_invariance(layer)
    # ... the whole-model proof does not: batching and sessions are off, and the engine says why
    proof = engine.invariance_proof
    assert proof is not None and not proof.ok
    assert engine.batcher is None and engine.batch is None
    assert engine.invariant_error == proof.reason
    assert "whole-model invariance proof failed on cpu in float32" in proof.reason
    # the first failing check names the shape: here the one-pass prefill of 512 rows; with
    # forwards of at most 24 tokens, the packed decode of 32 sequences (32 rows) instead
    assert "512-token prefill in chunks of 37 vs one pass differs" in proof.reason
    small = prove_invariance(engine.model, max_sequences=32, token_budget=24)
    assert not small.ok and "decode logits of a sequence packed with 31 others" in (small.reason or "")
    assert small.checks[-1] == "packed x16"
    # still serving, one step at a time: the same tokens every time
    q = engine.encode_question("still exact")
    a, b = engine.step("a document", q, 6), engine.step("a document", q, 6)
    assert a.tokens == b.tokens and len(a.tokens) + int(a.eos) >= 1


def test_an_attention_that_differs_for_long_query_chunks_fails_the_chunked_prefill_check(monkeypatch):
    """The packed forward's attention (not the one the load-time probe checks) differs for
    query chunks over 40 rows: only the chunked-prefill check can see it."""
    import ralm.batching.attention_backend as backends

    plain = backends.attend

    def attend(q, *args, **kwargs):
        out = plain(q, *args, **kwargs)
        return out * (1 + 2**-20) if q.shape[2] > 40 else out  # a long chunk: other bits

    monkeypatch.setattr(backends, "attend", attend)  # the torch backend's kernel
    engine = tiny_engine("gpt2")
    proof = engine.invariance_proof
    assert proof is not None and not proof.ok and proof.checks == []
    assert "prefill in chunks of 37 vs one pass differs" in (engine.invariant_error or "")
    assert engine.batcher is None


def test_a_head_that_differs_for_several_logit_rows_fails_the_drafted_check(monkeypatch):
    """The LM head differs at exactly as many rows as a drafted verification keeps (the layer
    probes try 1, 2, 5 and 23 rows)."""
    from tests.factories import tiny_causal_lm, tiny_tokenizer

    tok = tiny_tokenizer()
    plain = InvariantLinear.forward

    def forward(self, x):
        y = plain(self, x)
        n = x.reshape(-1, x.shape[-1]).shape[0]
        return y * (1 + 2**-20) if self.out_features == len(tok) and n == C.PROOF_DRAFT_TOKENS else y

    monkeypatch.setattr(InvariantLinear, "forward", forward)
    model = inv.make_invariant(tiny_causal_lm("opt", len(tok), tok.eos_token_id, seed=1))
    proof = prove_invariance(model, max_sequences=8, token_budget=64)
    assert not proof.ok and proof.checks == ["chunked prefill (64 tokens)"]
    assert f"{C.PROOF_DRAFT_TOKENS} drafted tokens verified in one forward" in (proof.reason or "")
    assert proof.as_dict()["ok"] is False and torch.isfinite(torch.tensor(proof.seconds))


def test_a_forward_that_raises_is_a_failed_proof_not_a_crash(monkeypatch):
    """A kernel that cannot run some shape (or a placement it does not handle) refuses
    batching with the error as the reason; the engine still starts."""
    import ralm.batching.proof as proof_mod

    plain = proof_mod.packed_forward

    def packed_forward(model, chunks, rows=None):
        if len(chunks) > 4:
            raise RuntimeError("no kernel for this shape")
        return plain(model, chunks, rows)

    monkeypatch.setattr(proof_mod, "packed_forward", packed_forward)
    engine = tiny_engine("opt")
    assert engine.batcher is None and engine.invariance_proof is not None
    assert "proof could not run on cpu in float32: RuntimeError: no kernel for this shape" in (
        engine.invariant_error or ""
    )
    # the first forward of more than 4 sequences: the drafted check's, next to 7 decode tokens
    assert engine.invariance_proof.checks == ["chunked prefill (512 tokens)"]
