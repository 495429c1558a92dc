"""A client of the native API (``/v1/ralm/generate``, ``/v1/ralm/stats``, the verifier's admin
route) that acts as a real client does under load: an answer shed with 503/429 and
``Retry-After`` is sent again after that delay (:mod:`cluster.http_retry`). Used by
``ralmspec bench served``.
"""

from __future__ import annotations

import threading
import time

import httpx

from cluster.http_retry import RetryLog, send_with_retry


class Client:
    """A thread-safe client of one server's native API (one connection per thread)."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()
        self.retries = RetryLog()  # shed answers (503/429 with Retry-After) sent again

    @property
    def http(self):
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = httpx.Client(base_url=self.url, timeout=self.timeout)
        return c

    def generate(self, body: dict) -> tuple[dict, float]:
        """(answer, latency): a shed answer (503/429 with Retry-After) is sent again after that
        delay, a bounded number of times, as a real client does (the latency includes the
        waits); any other failure, or still shed after the retries, raises."""
        t0 = time.perf_counter()
        res = send_with_retry(lambda: self.http.post("/v1/ralm/generate", json=body))
        dt = time.perf_counter() - t0
        self.retries.add(res)
        r = res.response
        if r.status_code != 200:
            after = f" (after {res.retries} retries)" if res.retries else ""
            raise RuntimeError(f"HTTP {r.status_code}{after}: {r.text[:300]}")
        return r.json(), dt

    def admin(self, body: dict) -> dict | None:
        r = self.http.post("/v1/ralm/admin/verifier", json=body)
        if r.status_code == 403:
            return None
        r.raise_for_status()
        return r.json()

    def stats(self) -> dict:
        return self.http.get("/v1/ralm/stats").json()
