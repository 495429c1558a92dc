"""The Ray Serve application builder that ``serve_config.yaml`` imports.

    import_path: deployments.app:build_app

``build_app(args)`` validates ``args`` (the ``args:`` block of the Serve config, or a
dict) as an :class:`~deployments.config.AppConfig` and returns the bound application: the
HTTP ingress (:mod:`deployments.serve_ingress`) over the generator deployment
(:mod:`deployments.generator`). The ingress replica builds its backend
(:func:`deployments.ray_backend.start_ray_backend`): per served retriever, the shard
actors and the verifier, and the pool of coordinators; missing indexes are built on first
start into ``ralm.work_dir``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from deployments.config import PRESETS, AppConfig, VerifierOptions

if TYPE_CHECKING:
    from ray.serve import Deployment


def build_app(args: dict | None = None):
    """Serve application builder: ``serve run deployments.app:build_app`` or ``serve_config.yaml``."""
    # Ray and the backend are imported only when an application is built (validating a
    # config, for one, needs neither)
    from ray.serve.config import BackpressureConfig

    from deployments.generator import generator_deployment  # lazy: Ray (see above)
    from deployments.ray_backend import start_ray_backend  # lazy: Ray
    from deployments.serve_ingress import Ingress  # lazy: Ray

    cfg = AppConfig.model_validate(dict(args or {})).resolved()
    gen = generator_deployment(cfg.generator_deployment).bind(
        cfg.ralm.generator.model_dump(mode="json"),
        str(cfg.ralm.corpus),
        cfg.generator_deployment.serialize_steps,
        cfg.dense_drafting.model_dump(mode="json"),
        cfg.knnlm.model_dump(mode="json"),
        cfg.generator_deployment.session_keys_per_replica,
    )
    # @serve.deployment made Ingress a Deployment; mypy does not apply class decorators
    ingress = cast("Deployment", Ingress).options(
        ray_actor_options={"num_cpus": cfg.ingress.num_cpus}
        | ({"resources": dict(cfg.ingress.resources)} if cfg.ingress.resources else {}),
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        # Serve's proxy refuses requests beyond these with 503 + Retry-After (a bounded queue)
        max_queued_requests=cfg.ingress.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=cfg.ingress.retry_after_s),
    )
    return ingress.bind(cfg.model_dump(mode="json"), start_ray_backend, gen)


__all__ = ["AppConfig", "VerifierOptions", "build_app", "PRESETS"]
