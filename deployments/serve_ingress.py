"""The ingress as a Ray Serve deployment: the HTTP app of :mod:`deployments.ingress` over a
backend built inside the replica.

How the backend is injected. A Serve deployment is constructed in its replica process,
and the backend is a live object there (actor handles, an asyncio pool, a tokenizer), so
:func:`deployments.app.build_app` cannot build it and pass it in. It passes a *factory*
instead - an async function ``factory(app_config, *args) -> RalmBackend``, with its
arguments (the generator deployment's handle) - and the replica calls it in its async
constructor, the way Ray Serve LLM hands its server an engine class to start in the
replica. The FastAPI app is then built from that backend in ``__serve_build_asgi_app__``,
which Serve calls after the constructor (``@serve.ingress()`` without an app), so the
routes are the plain :func:`~deployments.ingress.build_http_app` ones, with no module-level
app or class-bound routes. Another backend (another topology, a test double) is another
factory; the HTTP layer does not change.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI
from ray import serve

from deployments.backend import BackendFactory, RalmBackend
from deployments.config import AppConfig
from deployments.drain import Drain
from deployments.ingress import API_KEY_ENV, API_KEY_FILE_ENV, IngressSettings, build_http_app, read_api_key

log = logging.getLogger(__name__)


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """Serve deployment: ``Ingress.bind(config, factory, *factory_args)``."""

    # Serve awaits an async constructor in the replica; Python's typing knows only sync ones
    async def __init__(self, config: dict, backend_factory: BackendFactory, *factory_args: Any):  # type: ignore[misc]
        self.cfg = AppConfig.model_validate(config)
        self.settings = IngressSettings.from_config(self.cfg, read_api_key())
        if self.settings.api_key:
            log.info(
                "ralmspec ingress: API key required (from %s)",
                API_KEY_FILE_ENV if os.environ.get(API_KEY_FILE_ENV) else API_KEY_ENV,
            )
        self.drain_state = Drain(retry_after_s=self.cfg.ingress.retry_after_s)
        self.backend: RalmBackend = await backend_factory(self.cfg, *factory_args)
        log.info(
            "ralmspec ingress ready: model %s, retrievers %s", self.settings.model_name, list(self.settings.retrievers)
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self.backend, self.settings, self.drain_state)

    async def drain(self, grace_s: float) -> dict[str, int]:
        """Called by ``ralmspec serve`` when it stops, before Ray goes down: new requests get
        503 at once, those in flight ``grace_s`` seconds to finish, then 503
        (:mod:`deployments.drain`). Returns the counts."""
        counts = await self.drain_state.drain(grace_s)
        log.info("ralmspec ingress drained: %s", counts)
        return counts


__all__ = ["Ingress"]
