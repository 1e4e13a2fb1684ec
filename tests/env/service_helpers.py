"""Shared helpers of the service and client tests: which backend the real service runs, and a loopback TCP
proxy that injects a dropped connection."""

from __future__ import annotations

import importlib.util
import socket
import threading
from pathlib import Path

HERE = Path(__file__).parent


def backend_spec() -> str:
    """The real LocalBackend once it exists; until then the development double."""
    if importlib.util.find_spec("orchard.env.backends.local") is not None:
        return "local"
    import sys

    sys.path.insert(0, str(HERE))
    return "service_fake_backend:factory"


class DroppingProxy:
    """Relays TCP between a client and `target` on loopback. For the first `drops` requests whose head
    contains `trigger`, it forwards the request to the server, waits for the server's response to begin (so
    the server has accepted and handled it), then closes the client's connection without relaying it: the
    client sees the connection drop after the server did the work."""

    def __init__(self, target: tuple[str, int], trigger: bytes, drops: int = 1) -> None:
        self.target = target
        self.trigger = trigger
        self.drops_left = drops
        self.dropped = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        drop_next_answer = threading.Event()

        def client_to_server() -> None:
            try:
                while data := client.recv(65536):
                    if self.trigger in data:
                        with self._lock:
                            if self.drops_left > 0:
                                self.drops_left -= 1
                                drop_next_answer.set()
                    upstream.sendall(data)
            except OSError:
                pass

        threading.Thread(target=client_to_server, daemon=True).start()
        try:
            while data := upstream.recv(65536):
                if drop_next_answer.is_set():
                    # The server has begun to answer, so it accepted and ran the request: drop the line.
                    self.dropped += 1
                    return
                client.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def close(self) -> None:
        self._stop = True
        self._listener.close()
