"""A streaming HTTP response that always closes its body iterator.

Starlette's :class:`~starlette.responses.StreamingResponse` stops iterating its body when
the client goes away (a failed ``send`` or an ``http.disconnect``), but it does not close
the iterator: an async generator suspended at a ``yield`` is closed only when the garbage
collector finalizes it. A streamed RaLM request cancels its work in that generator's
``finally``, so with the stock response a client that leaves can keep a coordinator and the
generator busy until a later garbage collection (measured: a 128-token stream that the
client left after one chunk ran all 128 steps). This response closes the iterator itself,
shielded from the cancellation that ended the response, so the request stops at its next
step however the client left.
"""

from __future__ import annotations

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """:class:`StreamingResponse` whose body iterator is closed as soon as the response ends
    (finished, client gone, or cancelled), not when it is garbage-collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
