"""A private redis-server for tests: the Redis tier's CPU tests and its GPU test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _missing() -> str:
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis client is not installed (pip install 'fastattn[redis]')"
    return ""


class Server:
    """A private redis-server on a free loopback port, no persistence."""

    def __init__(self, workdir):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.workdir = str(workdir)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--enable-debug-command", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


def start_server(tmp_path):
    why = _missing()
    if why:
        from fastattn import env as _env

        if _env.get("FASTATTN_REQUIRE_REDIS"):
            pytest.fail(f"FASTATTN_REQUIRE_REDIS=1 but {why}")
        pytest.skip(why)
    s = Server(tmp_path)
    s.start()
    return s


class FakeRedis:
    """The few commands the Redis tier reads with, over a dict of bytes (the property and
    limit tests feed it stored values without a server): STRLEN and GETRANGE, pipelined."""

    def __init__(self, values: dict):
        self.values = values

    def strlen(self, name) -> int:
        return len(self.values.get(name) or b"")

    def getrange(self, name, start: int, end: int) -> bytes:
        return (self.values.get(name) or b"")[start:end + 1]  # (Redis's end is inclusive)

    def pipeline(self, transaction: bool = True) -> "_Pipeline":
        return _Pipeline(self)


class _Pipeline:
    def __init__(self, redis: FakeRedis):
        self.redis, self.calls = redis, []

    def __getattr__(self, command):
        return lambda *args: self.calls.append((command, args))

    def execute(self) -> list:
        return [getattr(self.redis, command)(*args) for command, args in self.calls]
