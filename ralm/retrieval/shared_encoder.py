"""One process-wide :class:`~ralm.retrieval.encoder.DenseEncoder` per (model name, device).

Loading an encoder reads its weights, so the index builder
(:mod:`ralm.retrieval.index_build`), the retriever loader (:mod:`ralm.retrieval.factory`,
which re-exports :func:`get_encoder`) and the shards all take it from here.
"""

from __future__ import annotations

import threading

from ralm.retrieval.encoder import DenseEncoder

_encoders: dict[tuple[str, str], DenseEncoder] = {}
_enc_lock = threading.Lock()


def get_encoder(name: str = "local:all-MiniLM-L6-v2", device: str = "cpu") -> DenseEncoder:
    """A process-wide shared :class:`~ralm.retrieval.encoder.DenseEncoder` per (name, device)."""
    key = (str(name), str(device))
    with _enc_lock:
        enc = _encoders.get(key)
        if enc is None:
            enc = DenseEncoder(name, device=device)
            _encoders[key] = enc
        return enc
