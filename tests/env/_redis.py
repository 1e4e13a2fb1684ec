"""A real redis-server for the store tests, on a free loopback port with a temporary directory."""

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
