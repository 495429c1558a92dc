"""``ralmspec gpu-check`` on this CPU (its tiny-shape path, as CI runs it): every section runs,
the report names the verdicts, a model that fails the invariance proof is reported as
serving one step at a time with the reason and fails the run, and the budget cuts inside
an arm.

The whole check runs in a child process that refuses to import what a bare GPU host lacks
(FAISS, Ray, pyserini, Redis, the dense encoder's packages) and has ``TRITON_INTERPRET=1``
set before triton's first import, so the Triton sections run the kernels in the
interpreter; the other tests run in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch.nn.functional as F

from cluster.bench.batch_bench import run_arm
from cluster.bench.gpu_check import GpuCheck, main
from ralm import constants as C
from ralm.batching.invariant import InvariantLinear

pytestmark = pytest.mark.unit

SMALL = ["--shapes", "llama-tiny", "--requests", "3", "--new-tokens", "8", "--forward-batches", "1,4"]
SMALL += ["--scan-shapes", "5000x64", "--dense", "6000x64", "--e2e-pad-to", "0", "--e2e-questions", "1"]

#: what a bare GPU host with torch, transformers and triton (and the bundle's pydantic) lacks
ABSENT = ("faiss", "ray", "pyserini", "redis", "sentence_transformers", "jnius", "fastapi", "starlette", "httpx")

BARE_HOST = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on a bare GPU host)")
sys.meta_path.insert(0, Absent())
from cluster.bench.gpu_check import main
code = main(sys.argv[1:])
print("IMPORTED:", sorted({{m.split(".")[0] for m in sys.modules}} & set({ABSENT!r})))
sys.exit(code)
"""


def _bare_host(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(C.PACKAGE_ROOT))
    return subprocess.run(
        [sys.executable, "-c", BARE_HOST, *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=C.PACKAGE_ROOT,
        env=env,
    )


def test_gpu_check_runs_every_section_on_a_bare_host_cpu_and_writes_json_and_markdown(tmp_path):
    sections = "env,compile,bits,proof,long,exact,forward,scan,dense,e2e"
    args = [*SMALL, "--dtypes", "float32,bfloat16", "--sections", sections, "--out", str(tmp_path)]
    run = _bare_host(args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "IMPORTED: []" in run.stdout
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert res["env"]["device"] == "cpu" and res["env"]["torch"]
    for dtype in ("float32", "bfloat16"):
        comp = res["compile"]["device"][dtype]  # the sweep in the interpreter
        # 2 matmuls, 2 norms, the gated activation, 3 attention launches (contiguous, paged,
        # paged with the rotation) per head dimension and group
        assert comp["ok"] and comp["compiled"] == 2 + 2 + 1 + 1 * 2 * 3
        bits = res["bits"][dtype]
        assert bits["ok"] and bits["matmul"]["products"] == 82 and bits["matmul"]["differing_rows"] == 0
        assert bits["attention"]["differing"] == [] and bits["paged"]["differing_rows"] == 0
        assert bits["paged"]["max_position"] == 1099
        assert bits["rotary"] == {"rows": 20, "differing_rows": 0}  # the fused rotation is torch's, bit for bit
        row = res["proof"][f"llama-tiny/{dtype}"]
        assert row["batching"] and row["proof"]["ok"] and row["proof"]["dtype"] == dtype
        long = res["long"][f"llama-tiny/{dtype}"]
        assert long["identical"] and long["context_tokens"] == 600 and long["compared_tokens"] == 8
        exact = res["exact"][f"llama-tiny/{dtype}/n3"]
        assert exact["identical"] == exact["requests"] == 3 and exact["batched_tok_s"] > 0 and not exact["cut"]
        fwd = res["forward"][f"llama-tiny/{dtype}"]
        assert fwd["batch1"]["plain_ms"] > 0 and fwd["batch4"]["invariant_ms"] > 0
    assert res["scan"]["5000x64"]["batch16"]["same_top20_as_alone"] == "16/16"
    dense = res["dense"]["6000x64"]  # the exact device scan, on the CPU device here
    assert dense["batch1"]["exact_top20_contained"] == "1/1" and dense["batch16"]["exact_top20_contained"] == "16/16"
    assert 20 <= dense["batch16"]["candidates_per_query"] < 600 and dense["batch16"]["ms"] > 0
    assert dense["batch16"]["product"] == "float32" and dense["batch16"]["to_host_per_query"] < 600
    assert dense["tf32_after_build"] == {"product": "float64", "exact_top20_contained": "16/16"}
    e2e = res["e2e"]  # no FAISS, no encoder package: the stand-in encoder, an exact host scan
    assert e2e["encoder"].startswith("stand-in") and e2e["device"] == {"skipped": "no CUDA device"}
    host = e2e["host"]
    assert host["identical"] == "1/1" and host["differing"] == 0 and host["scan"].startswith(("int8", "bf16"))
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| llama-tiny/float32/n3 | 3/3 |" in md and "| llama-tiny/bfloat16 | on |" in md
    assert "| float32 | ok | 11 |" in md and "| bfloat16 | 0 rows in 0/82 products | none | 0/20 rows" in md
    assert "| 6000x64 | 16 |" in md and "| 6000x64 | 16, TF32 on after the build |" in md
    assert "FAIL" not in run.stdout


def test_e2e_runs_ralmseq_against_psa_on_the_proof_generator(tmp_path):
    assert main([*SMALL, "--dtypes", "float32", "--sections", "proof,e2e", "--out", str(tmp_path)]) == 0
    e2e = json.loads((tmp_path / "gpu-check.json").read_text())["e2e"]
    assert e2e["generator"] == "llama-tiny/float32" and e2e["device"] == {"skipped": "no CUDA device"}
    host = e2e["host"]
    assert host["identical"] == "1/1" and host["differing"] == 0 and host["ralmseq_s"] > 0 and host["psa_s"] > 0
    assert host["psa_kb_calls"] <= host["ralmseq_kb_calls"] and 0 < host["ralmseq_retrieval_share"] < 1


def test_a_model_that_fails_the_proof_is_reported_off_with_its_reason_and_fails_the_run(tmp_path, monkeypatch, capsys):
    plain = InvariantLinear.forward

    def forward(self, x):  # a GEMM that changes algorithm above 24 rows (as cuBLAS does with M)
        if x.reshape(-1, x.shape[-1]).shape[0] <= 24:
            return plain(self, x)
        b = None if self.bias is None else self.bias.double()
        return F.linear(x.double(), self.weight.double(), b).to(x.dtype)

    monkeypatch.setattr(InvariantLinear, "forward", forward)
    args = [*SMALL, "--dtypes", "float32", "--sections", "env,proof,exact", "--out", str(tmp_path)]
    assert main(args) == 1  # batching turned off by a failed proof fails the check
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    row = res["proof"]["llama-tiny/float32"]
    assert row["batching"] is False and "whole-model invariance proof failed" in row["reason_off"]
    assert res["exact"] == {}  # only engines that batch are compared
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| llama-tiny/float32 | off |" in md and "prefill in chunks of 37 vs one pass differs" in md
    assert "FAIL: proof llama-tiny/float32: batching off" in capsys.readouterr().out


def test_a_section_that_raises_fails_the_run(tmp_path, capsys):
    args = [*SMALL, "--dtypes", "float32", "--sections", "env,dense", "--dense", "0x64", "--out", str(tmp_path)]
    assert main(args) == 1
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert "error" in res["dense"] and "FAIL: section dense raised" in capsys.readouterr().out


def test_a_spent_budget_skips_the_remaining_sections(tmp_path):
    assert main([*SMALL, "--dtypes", "float32", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert all("skipped" in res[s] for s in ("env", "compile", "bits", "proof", "long", "exact", "forward", "e2e"))


def test_quick_is_bfloat16_at_16_and_64_in_flight_with_32_tokens_and_a_300_s_budget():
    import argparse

    from cluster.bench.gpu_check import QUICK_SECTIONS, add_gpu_check_args

    p = argparse.ArgumentParser()
    add_gpu_check_args(p)
    check = GpuCheck(p.parse_args(["--quick", "--device", "cuda"]))  # nothing touches the device yet
    assert check.dtypes == ["bfloat16"] and check.requests == [16, 64] and check.new_tokens == 32
    assert check.budget_s == 300 and check.sections == list(QUICK_SECTIONS) and check.forward_batches == (1, 64)
    full = GpuCheck(p.parse_args(["--device", "cuda"]))
    assert full.dtypes == ["bfloat16", "float16", "float32"] and full.new_tokens == 64 and full.budget_s == 480
    assert GpuCheck(p.parse_args(["--quick", "--device", "cuda", "--dtypes", "float32"])).dtypes == ["float32"]


def test_the_budget_cuts_inside_an_arm_and_a_cut_arm_is_compared_on_its_prefix(tmp_path):
    """An arm whose deadline passes stops every request before its next step (reported
    ``cut``); the exactness row then compares the common prefix of each pair."""
    from transformers import AutoTokenizer

    from cluster.bench.random_models import random_model
    from ralm.config import GeneratorConfig
    from ralm.engine import LMEngine

    tok = AutoTokenizer.from_pretrained(str(C.DEMO_MODEL_DIR))
    import torch

    model = random_model("llama-tiny", tok, torch.float32, "cpu")
    e = LMEngine(model, tok, GeneratorConfig(model=str(C.DEMO_MODEL_DIR), device="cpu", invariant=False))
    reqs = [([5, 6, 7, 8], "a document"), ([9, 10], "another one")]
    whole = run_arm(e, reqs, 1, 6, 2, True)
    assert not whole["cut"] and [len(o) for o in whole["outputs"]] == [6, 6]
    cut = run_arm(e, reqs, 2, 6, 2, False, deadline=time.perf_counter())
    assert cut["cut"] and cut["outputs"] == [[], []]
    check = GpuCheck(Namespace(**{**vars(_args()), "out": tmp_path}))
    row = check._against_alone(whole["outputs"], 10.0, {"outputs": [whole["outputs"][0][:4], [-1]], "tokens_per_s": 5})
    assert row["identical"] == 1 and row["compared_tokens"] == 5 and row["cut"]


def _args() -> Namespace:
    import argparse

    from cluster.bench.gpu_check import add_gpu_check_args

    p = argparse.ArgumentParser()
    add_gpu_check_args(p)
    return p.parse_args([])


def test_an_e2e_arm_that_would_start_after_the_budget_is_skipped_device_arm_first():
    from cluster.bench.gpu_e2e import e2e_runs

    out = e2e_runs(None, "cuda", 1000, 1, 4, lambda: None, "index", deadline=0.0)
    assert [k for k in out if k in ("device", "host")] == ["device", "host"]
    assert out["device"] == out["host"] == {"skipped": "time budget"}


def test_the_profile_counts_runtime_calls_by_exact_name():
    from types import SimpleNamespace as E

    from cluster.bench.gpu_check import SYNC_CALLS, _calls

    events = [E(key="cudaStreamSynchronize", count=3), E(key="cudaLaunchKernel", count=10), E(key="aten::mm", count=4)]
    events.append(E(key="cudaStreamSynchronizeX", count=5))  # not a sync: names match exactly
    assert _calls(events, SYNC_CALLS) == 3 and _calls(events, ("cudaLaunchKernel",)) == 10
