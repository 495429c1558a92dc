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


def test_c_handler_sees_native_code_replace_a_python_handler():
    """What ``ralmspec serve`` watches for (Ray's native code putting its own SIGTERM handler
    back after start): ``signal.getsignal`` keeps naming the Python function, the C-level
    handler says what the process will really run."""
    import ctypes
    import ctypes.util
    import signal

    from actors.signals import c_handler

    def python_handler(signum, frame):
        pass

    old = signal.signal(signal.SIGUSR1, python_handler)
    try:
        ours = c_handler(signal.SIGUSR1)
        assert ours not in (None, 0, 1)
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.signal(int(signal.SIGUSR1), ctypes.c_void_p(1))  # native code installs SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) is python_handler  # Python does not notice
        assert c_handler(signal.SIGUSR1) == 1 != ours
        signal.signal(signal.SIGUSR1, python_handler)
        assert c_handler(signal.SIGUSR1) == ours
    finally:
        signal.signal(signal.SIGUSR1, old)
