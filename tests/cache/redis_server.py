"""A real ``redis-server`` for tests: free loopback port, private tmp dir, append-only file.

Used by the fixtures in tests/cache/conftest.py and by tests/cluster/test_eval_job.py.
There is no skip: without redis-server the tests fail and say how to install it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

INSTALL_HINT = (
    "redis-server is not installed: run `make system-deps` "
    "(or `apt-get install -y redis-server`); the Redis tests need a real server"
)


def redis_server_binary() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    return exe


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``restart()`` keeps the port and the data directory."""

    def __init__(self, tmp_dir: Path, password: str | None = None, port: int | None = None):
        self.exe = redis_server_binary()
        self.dir = Path(tmp_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text() if (self.dir / "redis.log").exists() else ""
                pytest.fail(f"redis-server exited with {self.proc.returncode}: {log[-2000:]}", pytrace=False)
            if self._answers():
                return self
            time.sleep(0.02)
        pytest.fail(f"redis-server did not come up on port {self.port} within {timeout}s", pytrace=False)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                data = s.recv(64)
                return data.startswith(b"+PONG") or data.startswith(b"-NOAUTH")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the server; SIGTERM makes Redis flush its append-only file and exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, down_s: float = 0.0, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        if down_s:
            time.sleep(down_s)
        self.start()

    def env(self) -> dict[str, str]:
        """Environment for a client process (password via the variable, never the URL)."""
        env = dict(os.environ)
        env.pop("RALMSPEC_REDIS_PASSWORD_FILE", None)
        if self.password:
            env["RALMSPEC_REDIS_PASSWORD"] = self.password
        else:
            env.pop("RALMSPEC_REDIS_PASSWORD", None)
        return env
