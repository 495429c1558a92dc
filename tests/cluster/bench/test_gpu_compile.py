"""The compile sweep without a GPU: triton compiles the invariant kernels for ``sm_90`` (the
H100) down to a cubin with its own ``ptxas``, and each kernel's shared memory must fit the
H100's per-block limit. Runs in a child process without ``TRITON_INTERPRET`` (the kernels
must be real jitted functions, not the interpreter's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ralm import constants as C

pytestmark = pytest.mark.unit

SWEEP = """
import json, sys
from cluster.bench.gpu_compile import offline_sweep
dtypes, dims = sys.argv[1].split(","), [int(d) for d in sys.argv[2].split(",")]
print(json.dumps(offline_sweep(90, dtypes, dims, linear_shapes=((512, 2048, False), (64, 48, True)))))
"""


def _sweep(dtypes: str, dims: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(C.PACKAGE_ROOT), TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run(
        [sys.executable, "-c", SWEEP, dtypes, dims], capture_output=True, text=True, timeout=900, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _check(res: dict, dtypes: list[str], dims: list[int]) -> None:
    assert res["arch"] == "sm_90" and res["shared_limit_bytes"] == 227 * 1024
    rows = res["kernels"]
    want = {f"{p}attention/{t}/d{d}" for t in dtypes for d in dims for p in ("", "paged_")}
    want |= {f"{k}/{t}/d2048" for t in dtypes for k in ("rms_norm", "layer_norm")}
    want |= {f"matmul/{t}/{s}" for t in dtypes for s in ("512x2048", "64x48+bias")}
    want |= {f"rotary_kv_write/{t}/d{d}" for t in dtypes for d in dims}
    want |= {f"silu_mul/{t}/i8192" for t in dtypes}
    assert set(rows) == want
    assert all(r["fits"] for r in rows.values()), {k: r for k, r in rows.items() if not r["fits"]}
    for t in dtypes:  # one launch configuration: the two layouts take the same shared memory
        for d in dims:
            assert rows[f"attention/{t}/d{d}"]["shared_bytes"] == rows[f"paged_attention/{t}/d{d}"]["shared_bytes"]


def test_the_widest_attention_compiles_for_the_h100_within_its_shared_memory():
    """float32 at head dimension 256 (282,688 bytes with triton's default three stages: it
    would not load on an H100) and bfloat16 at 256, both layouts, plus matmul and norms."""
    res = _sweep("float32,bfloat16", "256")
    _check(res, ["float32", "bfloat16"], [256])
    assert res["kernels"]["attention/float32/d256"]["shared_bytes"] == 151616


@pytest.mark.slow
def test_every_kernel_dtype_and_head_dimension_compiles_for_the_h100():
    _check(_sweep("bfloat16,float16,float32", "64,128,256"), ["bfloat16", "float16", "float32"], [64, 128, 256])
