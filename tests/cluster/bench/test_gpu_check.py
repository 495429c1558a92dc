"""``ralmspec gpu-check`` on this CPU (its tiny-shape path, as CI runs it): every section runs,
the report names the verdicts, and a model that fails the invariance proof is reported as
serving one step at a time, with the reason."""

from __future__ import annotations

import json

import pytest
import torch.nn.functional as F

from cluster.cli import main
from ralm.batching.invariant import InvariantLinear

pytestmark = pytest.mark.unit

SMALL = ["gpu-check", "--shapes", "llama-tiny", "--requests", "3", "--new-tokens", "8", "--forward-batches", "1,4"]
SMALL += ["--scan-shapes", "5000x64", "--dense", "6000x64", "--e2e-pad-to", "0", "--e2e-questions", "1"]


def test_gpu_check_runs_every_section_on_the_cpu_and_writes_json_and_markdown(tmp_path):
    assert main([*SMALL, "--dtypes", "float32,bfloat16", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert res["env"]["device"] == "cpu" and res["env"]["torch"]
    for dtype in ("float32", "bfloat16"):
        row = res["proof"][f"llama-tiny/{dtype}"]
        assert row["batching"] and row["proof"]["ok"] and row["proof"]["dtype"] == dtype
        exact = res["exact"][f"llama-tiny/{dtype}/n3"]
        assert exact["identical"] == exact["requests"] == 3 and exact["batched_tok_s"] > 0
        fwd = res["forward"][f"llama-tiny/{dtype}"]
        assert fwd["batch1"]["plain_ms"] > 0 and fwd["batch4"]["invariant_ms"] > 0
    assert res["scan"]["5000x64"]["batch16"]["same_top20_as_alone"] == "16/16"
    dense = res["dense"]["6000x64"]  # the exact device scan, on the CPU device here
    assert dense["batch1"]["exact_top20_contained"] == "1/1" and dense["batch16"]["exact_top20_contained"] == "16/16"
    assert 20 <= dense["batch16"]["candidates_per_query"] < 600 and dense["batch16"]["ms"] > 0
    # end to end: RaLMSeq and PSA on the proof's first batching generator, retrieval on the host
    # (the device arm needs CUDA); PSA's tokens equal RaLMSeq's
    e2e = res["e2e"]
    assert e2e["generator"] == "llama-tiny/float32" and e2e["device"] == {"skipped": "no CUDA device"}
    host = e2e["host"]
    assert host["identical"] == "1/1" and host["differing"] == 0 and host["ralmseq_s"] > 0 and host["psa_s"] > 0
    assert host["psa_kb_calls"] <= host["ralmseq_kb_calls"] and 0 < host["ralmseq_retrieval_share"] < 1
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| llama-tiny/float32/n3 | 3/3 |" in md and "| llama-tiny/bfloat16 | on |" in md
    assert "| 6000x64 | 16 |" in md and "| host |" in md and "| device | no CUDA device |" in md


def test_a_model_that_fails_the_proof_is_reported_off_with_its_reason_and_not_batched(tmp_path, monkeypatch):
    plain = InvariantLinear.forward

    def forward(self, x):  # a GEMM that changes algorithm above 24 rows (as cuBLAS does with M)
        if x.reshape(-1, x.shape[-1]).shape[0] <= 24:
            return plain(self, x)
        b = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), self.weight.double(), b).to(x.dtype)

    monkeypatch.setattr(InvariantLinear, "forward", forward)
    args = [*SMALL, "--dtypes", "float32", "--sections", "env,proof,exact", "--out", str(tmp_path)]
    assert main(args) == 0  # nothing batched, so nothing inexact
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    row = res["proof"]["llama-tiny/float32"]
    assert row["batching"] is False and "whole-model invariance proof failed" in row["reason_off"]
    assert res["exact"] == {}  # only engines that batch are compared
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| llama-tiny/float32 | off |" in md and "prefill in chunks of 37 vs one pass differs" in md


def test_a_spent_budget_skips_the_remaining_sections(tmp_path):
    assert main([*SMALL, "--dtypes", "float32", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert all("skipped" in res[s] for s in ("env", "proof", "exact", "forward", "scan", "e2e"))
