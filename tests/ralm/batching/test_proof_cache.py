"""Passed invariance proofs kept on disk: a new process (here a new model object with the same
weights) takes the verdict back instead of proving again; anything that can change the bits (a
weight, the shapes, the kernels' environment, the code) is another key; a failed proof is
never kept; a corrupt file is ignored; ``off`` and ``proof_cache: false`` turn it off."""

from __future__ import annotations

import json

import pytest
import torch

import ralm.batching.proof as proof_mod
import ralm.batching.proof_cache as pc
from ralm.batching.invariant import InvariantLinear, make_invariant
from ralm.batching.proof import prove_invariance
from tests.factories import tiny_causal_lm, tiny_engine, tiny_tokenizer

pytestmark = pytest.mark.unit

SHAPES = dict(max_sequences=4, token_budget=64)


def _model(seed: int = 0):
    """A fresh model object (as a new process loads it): the same weights for the same seed."""
    tok = tiny_tokenizer()
    return make_invariant(tiny_causal_lm("gpt2", len(tok), tok.eos_token_id, seed=seed))


def _no_prover(monkeypatch):
    """Any proof that runs from here on fails the test."""

    def refuse(*a, **k):
        raise AssertionError("the proof ran again")

    monkeypatch.setattr(proof_mod, "_Prover", refuse)


def test_a_passed_proof_is_taken_back_by_the_next_load_instead_of_running(tmp_path, monkeypatch):
    first = prove_invariance(_model(), **SHAPES, cache_dir=tmp_path)
    assert first.ok and not first.cached and len(list(tmp_path.glob("*.json"))) == 1
    _no_prover(monkeypatch)
    again = prove_invariance(_model(), **SHAPES, cache_dir=tmp_path)
    assert again.ok and again.cached and not again.reused
    assert (again.checks, again.comparisons, again.device) == (first.checks, first.comparisons, first.device)
    kept = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert kept["machine"]["torch"] == torch.__version__ and kept["verdict"]["ok"] is True


def test_a_changed_weight_shape_environment_or_source_is_another_key(monkeypatch):
    model = _model()
    key = pc.proof_key(model, 4, 64, 0)
    assert pc.proof_key(_model(), 4, 64, 0) == key  # a new object with the same bits: the same key
    with torch.no_grad():
        w = next(m for m in model.modules() if isinstance(m, InvariantLinear)).weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))  # one weight, one ulp
    assert pc.proof_key(model, 4, 64, 0) != key
    model = _model()
    assert pc.proof_key(model, 8, 64, 0) != key and pc.proof_key(model, 4, 128, 0) != key
    assert pc.proof_key(model, 4, 64, 1) != key
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # a capped instruction set
    assert pc.proof_key(model, 4, 64, 0) != key
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(pc, "source_digest", lambda: "another version of the code")
    assert pc.proof_key(model, 4, 64, 0) != key
    monkeypatch.undo()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert pc.proof_key(model, 4, 64, 0) != key
    finally:
        torch.set_num_threads(threads)


def test_a_failed_proof_is_never_kept(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(proof_mod, "packed_forward", broken)
    failed = prove_invariance(_model(), **SHAPES, cache_dir=tmp_path)
    assert not failed.ok and "no kernel for this shape" in failed.reason
    assert list(tmp_path.glob("*.json")) == []


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"key": "another", "verdict": {"ok": True}}), json.dumps([1, 2])]
)
def test_a_corrupt_or_foreign_file_is_ignored_and_the_proof_runs(tmp_path, content):
    model = _model()
    key = pc.proof_key(model, 4, 64, 0)
    (tmp_path / f"{key}.json").write_text(content)
    proof = prove_invariance(model, **SHAPES, cache_dir=tmp_path)
    assert proof.ok and not proof.cached and proof.forwards > 0
    assert json.loads((tmp_path / f"{key}.json").read_text())["key"] == key  # rewritten


def test_the_folder_comes_from_the_environment_and_off_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv(pc.PROOF_CACHE_ENV, str(tmp_path / "p"))
    assert pc.proof_cache_dir() == tmp_path / "p"
    monkeypatch.setenv(pc.PROOF_CACHE_ENV, "off")
    assert pc.proof_cache_dir() is None
    monkeypatch.delenv(pc.PROOF_CACHE_ENV)
    assert pc.proof_cache_dir().parts[-2:] == ("ralmspec", "proofs")


def test_an_engine_restart_takes_its_proof_from_the_cache_unless_told_not_to(tmp_path, monkeypatch):
    monkeypatch.setenv(pc.PROOF_CACHE_ENV, str(tmp_path))
    shapes = dict(batch_max_sequences=4, batch_token_budget=64)
    first = tiny_engine(**shapes)
    assert first.invariance_proof.ok and not first.invariance_proof.cached
    assert first.invariance_proof.as_dict()["cached"] is False
    assert tiny_engine(**shapes).invariance_proof.cached  # a restart: a new model, the same bits
    off = tiny_engine(**shapes, proof_cache=False)
    assert off.invariance_proof.ok and not off.invariance_proof.cached and off.invariance_proof.forwards > 0
