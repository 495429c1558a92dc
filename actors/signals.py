"""Keep the JVM's fatal-signal handlers when Ray starts or stops in the same process.

The JVM (pyserini/Lucene) uses SIGSEGV internally (implicit null checks, safepoint
polls) and handles it in its own handler. ``ray.init`` installs Ray's failure handler
for these signals and ``ray.shutdown`` resets them to the default, so a process that
started the JVM and then ran a Ray driver is killed (exit 139) the next time the JIT
takes one of its ordinary faults. Measured: handler address JVM -> Ray -> SIG_DFL.

:func:`preserve_fatal_signal_handlers` saves the handlers (``sigaction``) on entry and
restores them on exit; it is a no-op where ``sigaction`` is unavailable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)


class _SigAction(ctypes.Structure):
    # glibc's struct sigaction on Linux: handler, 1024-bit mask, int flags, restorer
    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * 16),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


@functools.cache  # find_library runs ldconfig: once per process (ralmspec serve polls c_handler)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def save_fatal_signal_handlers() -> dict[int, _SigAction]:
    libc = _libc()
    saved: dict[int, _SigAction] = {}
    if libc is None:
        return saved
    for sig in _SIGNALS:
        sa = _SigAction()
        if libc.sigaction(int(sig), None, ctypes.byref(sa)) == 0:
            saved[int(sig)] = sa
    return saved


def restore_fatal_signal_handlers(saved: dict[int, _SigAction]) -> None:
    libc = _libc()
    if libc is None:
        return
    for sig, sa in saved.items():
        libc.sigaction(sig, ctypes.byref(sa), None)


@contextmanager
def preserve_fatal_signal_handlers() -> Iterator[None]:
    """Run a block (``ray.init``, ``ray.shutdown``) without losing the current handlers."""
    saved = save_fatal_signal_handlers()
    try:
        yield
    finally:
        restore_fatal_signal_handlers(saved)


def keep_driver_signal_handlers() -> None:
    """Tell Ray not to install its native failure signal handler in this process (the driver);
    call before ``ray.init``. Ray's core worker installs absl's handler for SIGTERM too, in
    place of the driver's own: a SIGTERM that arrived while ``ralmspec serve`` was starting
    (after ``ray.init``, before the server put its handler back) ran Ray's handler, then ours,
    and the process aborted with exit -6. Only this process is affected: Ray's workers read
    the setting in their own processes, and keep the handler."""
    from ray._private import ray_constants  # lazy: this module is imported without Ray

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def c_handler(sig: int) -> int | None:
    """The address of the C-level handler the process has for ``sig`` now (None where
    ``sigaction`` is unavailable). Python's ``signal.getsignal`` cannot say: it returns the
    Python function even after native code (Ray's core worker) has put its own handler in
    its place."""
    libc = _libc()
    if libc is None:
        return None
    sa = _SigAction()
    if libc.sigaction(int(sig), None, ctypes.byref(sa)) != 0:
        return None
    return int(sa.handler or 0)
