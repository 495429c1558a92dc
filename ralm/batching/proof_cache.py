"""Passed invariance proofs kept on disk, so that a restart on the same machine skips a proof
it already made.

The whole-model proof (:mod:`ralm.batching.proof`) is deterministic. Its verdict is a
function of:

- the model: every weight's bits, its config, and the invariant kernels ``make_invariant``
  chose for it;
- the shapes proved: sequences, token budget and seed;
- the software: torch, transformers, triton, and this package's own source;
- the machine: the device and its name, the CPU's instruction set as torch uses it, the
  thread count, and the environment variables that cap or steer the kernels (``ATEN_``,
  ``ONEDNN_``, ``DNNL_``, ``MKL_``, ``TRITON_``).

All of that is hashed into one key. A passed proof is written as ``<key>.json`` in the cache
folder, and a later load with the same key takes the verdict back (``cached``) instead of
running the proof again. SmolLM2-135M's proof takes about 47 s on 2 cores; hashing its
weights takes about 1 s. A failed proof is never kept: a refusal is derived again, with its
reason, on every load.

The folder is ``RALMSPEC_PROOF_CACHE``, else ``~/.cache/ralmspec/proofs``; ``off`` turns
the cache off (``generator.proof_cache: false`` does too). A corrupt or unreadable file is
ignored and the proof runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ralm import constants as C
from ralm.machine import cpu_name

log = logging.getLogger(__name__)

PROOF_CACHE_ENV = "RALMSPEC_PROOF_CACHE"
# environment variables that cap or steer the kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
# MKL_CBWR, TRITON_INTERPRET, ...); the thread count is read from torch itself (Ray sets
# OMP_NUM_THREADS per worker, which torch_threads overrides)
_KERNEL_ENV_PREFIXES = ("ATEN_", "ONEDNN_", "DNNL_", "MKL_", "TRITON_")


def proof_cache_dir() -> Path | None:
    """The cache folder, or None when ``RALMSPEC_PROOF_CACHE`` is ``off``."""
    value = os.environ.get(PROOF_CACHE_ENV)
    if value is not None and value.strip().lower() == "off":
        return None
    return Path(value or str(C.DEFAULT_WORK_DIR / "proofs")).expanduser()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of this package's Python source (any change to the code re-proves)."""
    root = Path(__file__).resolve().parents[1]  # the ralm package
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine(device: torch.device) -> dict[str, Any]:
    """What of the machine and the software decides which kernels run, and so the bits."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "python": platform.python_version(),
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_KERNEL_ENV_PREFIXES)},
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
        env["cuda"] = torch.version.cuda
    return env


def proof_key(model, max_sequences: int, token_budget: int, seed: int) -> str:
    """The key of a proof of ``model`` (already made invariant) at these shapes, on this machine."""
    h = hashlib.blake2b(digest_size=20)

    def add(obj: Any) -> None:
        h.update(json.dumps(obj, sort_keys=True, default=str).encode())
        h.update(b"\0")

    add(machine(next(model.parameters()).device))
    add(source_digest())
    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # where it was loaded from: the same model in another folder
    add(config)
    add([int(max_sequences), int(token_budget), int(seed), getattr(model, "_ralm_invariant", None)])
    for name, t in model.state_dict().items():  # weights and buffers, in the module's order
        add([name, list(t.shape), str(t.dtype)])
        b = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)  # the bits, whatever the dtype
        h.update(memoryview(b.numpy()))
    return h.hexdigest()


def load_verdict(folder: Path, key: str) -> dict | None:
    """The kept verdict of ``key`` (``InvarianceProof.as_dict()``), or None."""
    path = folder / f"{key}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable proof cache file %s (%s); proving again", path, e)
        return None
    if not isinstance(data, dict) or data.get("key") != key or data.get("verdict", {}).get("ok") is not True:
        log.warning("ignoring the proof cache file %s: not a passed proof of this key; proving again", path)
        return None
    return data["verdict"]


def store_verdict(folder: Path, key: str, verdict: dict, model) -> None:
    """Keep a passed verdict (written whole or not at all); a folder that cannot be written
    only costs the next load its proof."""
    if verdict.get("ok") is not True:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "key": key,
                    "verdict": verdict,
                    "model": getattr(model.config, "_name_or_path", None) or model.config.model_type,
                    "machine": machine(next(model.parameters()).device),
                },
                indent=1,
                default=str,
            )
        )
        os.replace(tmp, folder / f"{key}.json")
    except OSError as e:
        log.warning("could not keep the proof verdict in %s (%s)", folder, e)


__all__ = ["PROOF_CACHE_ENV", "load_verdict", "machine", "proof_cache_dir", "proof_key", "store_verdict"]
