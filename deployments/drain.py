"""Draining an ingress before the server stops: every request gets an answer.

When ``ralmspec serve`` is stopped (Ctrl-C, SIGTERM), it asks each ingress replica to drain
(:meth:`deployments.serve_ingress.Ingress.drain`) before Ray goes down. From then on:

- a new request is answered at once with 503 ``shutting_down`` and ``Retry-After``
  (``/healthz`` too, so a load balancer takes the replica out);
- a request in flight has ``grace_s`` seconds to finish; one that has not by then is
  cancelled and answered 503 ``shutting_down`` (a streamed response that has already begun
  is closed instead: its status line is gone).

So a client sees its answer or a 503 it may retry elsewhere, never a connection reset. The
drain is plain ASGI (no Ray): :class:`DrainMiddleware` wraps the app of
:func:`deployments.ingress.build_http_app`, and the tests drive it without a server.

Worked example: 3 requests in flight, ``drain(1.5)``: the two that finish within 1.5 s
return 200, the third is answered 503 at 1.5 s, and ``drain`` returns ``{"finished": 2,
"refused_in_flight": 1}`` plus any late arrivals under ``refused_new``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from deployments.api import error_body

SHUTTING_DOWN = "the server is shutting down: retry the request (on another replica, or once it is back)"


class Drain:
    """One replica's drain state, shared by its middleware and its ``drain`` call."""

    def __init__(self, retry_after_s: float = 5.0):
        self.retry_after_s = retry_after_s
        self.deadline: float | None = None  # time.monotonic() by which requests in flight must finish
        self.in_flight = 0
        self.counts = {"finished": 0, "refused_in_flight": 0, "refused_new": 0}
        self._started: asyncio.Event | None = None  # set once, when the drain begins (never cleared)

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def started(self) -> asyncio.Event:
        if self._started is None:
            self._started = asyncio.Event()
        return self._started

    async def drain(self, grace_s: float) -> dict[str, int]:
        """Start draining (new requests: 503), wait until the requests in flight are done or
        ``grace_s`` has passed (those left are answered 503 then); returns the counts."""
        if self.deadline is None:
            self.deadline = time.monotonic() + max(0.0, grace_s)
            self.started().set()
        # the cut requests answer right after the deadline; never wait much past it
        while self.in_flight and time.monotonic() < self.deadline + 1.0:
            await asyncio.sleep(0.02)
        return dict(self.counts)

    def reply_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(max(1, round(self.retry_after_s))).encode()), (b"connection", b"close")]


class DrainMiddleware:
    """ASGI middleware: while the replica drains, refuse new requests and cut those in flight
    at the drain's deadline, each with a 503 ``shutting_down`` (see the module docstring)."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(SHUTTING_DOWN, "service_unavailable", None, "shutting_down")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + self.drain.reply_headers(),
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        d = self.drain
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        if d.draining:
            d.counts["refused_new"] += 1
            return await self._refuse(send)
        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        d.in_flight += 1
        task = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        try:
            if d.deadline is None:
                begun = asyncio.ensure_future(d.started().wait())
                await asyncio.wait({task, begun}, return_when=asyncio.FIRST_COMPLETED)
                begun.cancel()
            if not task.done() and d.deadline is not None:
                await asyncio.wait({task}, timeout=max(0.0, d.deadline - time.monotonic()))
            if not task.done():  # the drain's deadline passed: cut it, answer 503
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                d.counts["refused_in_flight"] += 1
                if not started:
                    await self._refuse(send)
                return None
            if d.draining:
                d.counts["finished"] += 1
            return task.result()
        except asyncio.CancelledError:  # the server cancelled this call: so is the request
            task.cancel()
            raise
        finally:
            d.in_flight -= 1
