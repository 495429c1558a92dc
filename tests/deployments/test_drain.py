"""The ingress's drain (deployments/drain.py) on a real ASGI app: once it drains, requests
in flight finish within the grace or are answered 503 ``shutting_down``, and new ones get
503 at once, each with Retry-After; nothing is left unanswered."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from deployments.drain import Drain, DrainMiddleware


def app_with(drain: Drain) -> FastAPI:
    app = FastAPI()

    @app.get("/work")
    async def work(seconds: float):
        await asyncio.sleep(seconds)
        return {"slept": seconds}

    app.add_middleware(DrainMiddleware, drain=drain)
    return app


async def _drain_while_two_are_in_flight():
    drain = Drain(retry_after_s=2.0)
    transport = httpx.ASGITransport(app=app_with(drain))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        quick = asyncio.ensure_future(client.get("/work", params={"seconds": 0.2}))
        slow = asyncio.ensure_future(client.get("/work", params={"seconds": 30}))
        await asyncio.sleep(0.05)  # both in flight
        assert drain.in_flight == 2
        t0 = asyncio.get_running_loop().time()
        counts = await drain.drain(0.6)
        took = asyncio.get_running_loop().time() - t0
        late = await client.get("/work", params={"seconds": 0})
        return counts, took, await quick, await slow, late, drain


def test_in_flight_requests_finish_or_get_503_and_new_ones_get_503():
    counts, took, quick, slow, late, drain = asyncio.run(_drain_while_two_are_in_flight())
    assert quick.status_code == 200 and quick.json() == {"slept": 0.2}
    assert slow.status_code == 503
    assert slow.json()["error"]["code"] == "shutting_down" and slow.headers["retry-after"] == "2"
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert counts == {"finished": 1, "refused_in_flight": 1, "refused_new": 0}
    assert drain.counts["refused_new"] == 1 and drain.in_flight == 0
    assert 0.55 <= took < 1.5  # the slow one was cut at the grace, not waited for


async def _drain_idle():
    drain = Drain()
    transport = httpx.ASGITransport(app=app_with(drain))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        before = await client.get("/work", params={"seconds": 0})
        t0 = asyncio.get_running_loop().time()
        counts = await drain.drain(5.0)
        return before, counts, asyncio.get_running_loop().time() - t0


def test_an_idle_replica_drains_at_once_and_serves_normally_before():
    before, counts, took = asyncio.run(_drain_idle())
    assert before.status_code == 200
    assert counts == {"finished": 0, "refused_in_flight": 0, "refused_new": 0}
    assert took < 0.1
