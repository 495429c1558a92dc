"""Vectors for a padded corpus' generated passages, without encoding a million passages.

A padded corpus (:mod:`ralm.corpus_padding`) makes sparse retrieval cost what a large KB
costs. An approximate dense (HNSW) index over it needs a vector per passage, and encoding
is the slow part (the demo encoder does about 9 passages/s on two cores: a million would
take 30 hours). The real passages keep their real vectors; a generated passage ``i``, drawn
around topic passage ``t_i``, gets

    v_i = normalize(c * x[t_i] + (1 - c) * x[u_i])        (d,) float32, unit norm

where ``x`` are the real passages' vectors (rows, unit norm), ``u_i`` is another real
passage drawn uniformly (the generic half of the generated text), and ``c`` is
*calibrated*: a sample of generated passages is really encoded, and ``c`` is chosen so
that the synthesized vectors' mean cosine to their topic equals the encoded ones' (their
first moment; bisection, the mean cosine grows with c). Worked example: if encoded padding
passages have a mean cosine of 0.62 to their topic, and mixing at c = 0.55 gives 0.62 on the
same sample, every generated passage gets c = 0.55.

What this changes, stated with every result that uses it: a generated passage's vector is
near its topic's, as its encoding would be, but it is not its encoding; rankings over the
padded KB are rankings of these vectors (exact against them: the index and the exactness
contract do not care where a vector came from). The index manifest records the source
(``vectors.from``), so a result is never mistaken for one on encoded vectors.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ralm.corpus import Corpus

log = logging.getLogger(__name__)

CALIBRATION_SAMPLE = 200  # generated passages really encoded to calibrate c


def _normalize(v: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(v, axis=1, keepdims=True)
    return (v / np.maximum(n, 1e-12)).astype(np.float32)


def mix_vectors(real: np.ndarray, topics: np.ndarray, others: np.ndarray, c: float) -> np.ndarray:
    """``normalize(c x[topics] + (1 - c) x[others])``: ``(len(topics), d)`` float32."""
    return _normalize(c * real[topics].astype(np.float64) + (1.0 - c) * real[others].astype(np.float64))


def mean_topic_cosine(vectors: np.ndarray, real: np.ndarray, topics: np.ndarray) -> float:
    """Mean cosine between each row of ``vectors`` and its topic's real vector (rows unit norm)."""
    return float(np.mean(np.sum(vectors.astype(np.float64) * real[topics].astype(np.float64), axis=1)))


def calibrate_topic_weight(target: float, real: np.ndarray, topics: np.ndarray, others: np.ndarray) -> float:
    """The ``c`` in [0, 1] at which :func:`mix_vectors`' mean topic cosine equals ``target``
    (clipped to what the mix can reach: c = 0 gives the other passages' cosine, c = 1 gives 1)."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if mean_topic_cosine(mix_vectors(real, topics, others, mid), real, topics) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def padded_corpus_vectors(
    padded: Corpus,
    n_real: int,
    topics: np.ndarray,
    real: np.ndarray,
    encoder: Any,
    sample: int = CALIBRATION_SAMPLE,
    seed: int = 0,
) -> tuple[np.ndarray, dict]:
    """Vectors of every passage of ``padded``: the first ``n_real`` are ``real`` (the real
    passages', unit norm), the rest synthesized around their ``topics`` (module docstring).

    Returns ``((len(padded), d) float32, info)``, ``info`` holding ``c``, the calibration
    sample's size and both mean cosines (encoded and synthesized)."""
    n_pad = len(padded) - n_real
    if len(topics) != n_pad:
        raise ValueError(f"{len(topics)} topics for {n_pad} padding passages")
    if real.shape[0] != n_real:
        raise ValueError(f"{real.shape[0]} real vectors for {n_real} real passages")
    rng = np.random.default_rng(seed)
    others = rng.integers(n_real, size=n_pad)
    pick = np.sort(rng.choice(n_pad, size=min(sample, n_pad), replace=False))
    encoded = np.asarray(
        encoder.encode_passages([padded.text(n_real + int(i)) for i in pick], progress=False), dtype=np.float32
    )
    target = mean_topic_cosine(_normalize(encoded), real, topics[pick])
    c = calibrate_topic_weight(target, real, topics[pick], others[pick])
    out = np.empty((len(padded), real.shape[1]), dtype=np.float32)
    out[:n_real] = real
    for s in range(0, n_pad, 100_000):  # in chunks: float64 temporaries of 100k rows
        out[n_real + s : n_real + s + 100_000] = mix_vectors(real, topics[s : s + 100_000], others[s : s + 100_000], c)
    got = mean_topic_cosine(out[n_real + pick], real, topics[pick])
    info = {
        "topic_weight": round(c, 4),
        "sample": len(pick),
        "encoded_cosine": round(target, 4),
        "mixed_cosine": round(got, 4),
    }
    log.info("padding vectors: c = %.3f (mean topic cosine %.3f encoded, %.3f mixed)", c, target, got)
    return out, info
