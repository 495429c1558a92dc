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


_DRIVER = """
import signal, sys
from actors.signals import c_handler, keep_driver_signal_handlers
if sys.argv[1] == "keep":
    keep_driver_signal_handlers()
signal.signal(signal.SIGTERM, lambda *a: None)
before = c_handler(signal.SIGTERM)
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
print("same" if c_handler(signal.SIGTERM) == before else "replaced")
ray.shutdown()
"""


def test_a_driver_that_keeps_its_handlers_still_has_its_sigterm_handler_after_ray_init():
    """``ralmspec serve`` calls ``keep_driver_signal_handlers`` before ``ray.init``: its SIGTERM
    handler is the one that runs during start-up, so a stop then never aborts (exit -6). Without
    the call, ``ray.init`` replaces it (which the test shows, so it can fail)."""
    import subprocess
    import sys

    from tests.actors.support import REPO

    def driver(mode: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", _DRIVER, mode], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1]

    assert driver("keep") == "same"
    assert driver("default") == "replaced"
