"""A real redis-server for the store tests, on a free loopback port with a temporary directory; `RedisServer` is
one that a test stops and starts again on the same port, its data kept (an append-only file)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def start_redis_server() -> Iterator[str]:
    """Yields `redis://127.0.0.1:<port>/0`; the server and its directory are gone afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:  # never a skip: a run without it would pass without testing the Redis store
        pytest.fail("redis-server is not installed: install it (apt-get install redis-server; scripts/setup "
                    "does) to test the Redis state store", pytrace=False)
    import redis

    with tempfile.TemporaryDirectory(prefix="orchard-redis-") as tmp:
        port = _free_port()
        process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT)
        try:
            client = redis.Redis(port=port, socket_connect_timeout=0.5)
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {port}") from None
                    time.sleep(0.05)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.kill()
            process.wait()


class RedisServer:
    """A redis-server on a free loopback port that keeps its data across `stop()` and `start()`: an append-only
    file written at every command (`appendfsync always`), in `directory`. `url` stays the same."""

    def __init__(self, directory: str) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed: install it (apt-get install redis-server)", pytrace=False)
        self.directory, self.port = directory, _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", self.directory],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()  # answers only once the append-only file is loaded
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        """Shut the server down (SIGTERM: it flushes its append-only file and closes every connection)."""
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
            self.process = None
