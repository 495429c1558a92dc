"""Ray must not take the JVM's SIGSEGV handler away (it resets it to SIG_DFL on shutdown,
after which the JVM's ordinary internal faults kill the process with exit 139)."""

from __future__ import annotations

from actors.signals import save_fatal_signal_handlers


def _handlers():
    return {sig: sa.handler for sig, sa in save_fatal_signal_handlers().items()}


def test_jvm_handlers_survive_ray_init_and_shutdown():
    from jnius import autoclass

    from ralm.retrieval.lucene_env import ensure_lucene
    from tests.actors.support import start_ray, stop_ray

    ensure_lucene()
    autoclass("java.lang.String")  # the JVM is up and owns SIGSEGV
    before = _handlers()
    assert before and all(before.values())
    start_ray(num_cpus=1)
    assert _handlers() == before
    stop_ray()
    assert _handlers() == before
