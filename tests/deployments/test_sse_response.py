"""ClosingStreamingResponse closes its body generator when the client leaves, without waiting
for the garbage collector: the generator's ``finally`` is where a streamed request cancels
its work. Each test keeps a reference to the generator, so only an explicit close can run
its ``finally``."""

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from deployments.sse_response import ClosingStreamingResponse


def _body(log: list):
    async def gen():
        try:
            for i in range(1000):
                log.append(f"chunk {i}")
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)
        finally:
            log.append("closed")

    return gen()


def _scope(spec: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "method": "GET", "path": "/"}


def test_a_failed_send_closes_the_body_at_once():
    """ASGI 2.4: the server reports a gone client by failing ``send``; the generator, suspended
    at its second ``yield``, is closed before the response returns."""
    log: list = []
    body = _body(log)
    sent: list = []

    async def send(msg):
        if msg["type"] == "http.response.body":
            sent.append(msg)
            if len(sent) == 2:
                raise OSError("client gone")

    async def receive():
        await asyncio.sleep(3600)

    async def main():
        with pytest.raises(ClientDisconnect):
            await ClosingStreamingResponse(body)(_scope("2.4"), receive, send)
        return list(log)  # before asyncio.run's own clean-up closes every live generator

    assert asyncio.run(main()) == ["chunk 0", "chunk 1", "closed"]


def test_a_disconnect_while_sending_closes_the_body_at_once():
    """ASGI 2.3: ``http.disconnect`` arrives while a chunk is being sent (the generator sits at
    its ``yield``); the cancelled send leaves the generator suspended, and the response closes it."""
    log: list = []
    body = _body(log)

    async def main():
        blocked = asyncio.Event()
        n = 0

        async def send(msg):
            nonlocal n
            if msg["type"] == "http.response.body":
                n += 1
                if n == 2:
                    blocked.set()
                    await asyncio.sleep(3600)  # a slow client: cancelled by the disconnect

        async def receive():
            await blocked.wait()
            return {"type": "http.disconnect"}

        await asyncio.wait_for(ClosingStreamingResponse(body)(_scope("2.3"), receive, send), 10)
        return list(log)  # before asyncio.run's own clean-up closes every live generator

    assert asyncio.run(main()) == ["chunk 0", "chunk 1", "closed"]


def test_a_finished_body_is_sent_whole():
    async def short():
        yield "a"
        yield "b"

    sent: list = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        await asyncio.sleep(3600)

    asyncio.run(ClosingStreamingResponse(short())(_scope("2.4"), receive, send))
    assert [m.get("body") for m in sent[1:]] == [b"a", b"b", b""]
