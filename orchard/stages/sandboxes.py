"""The sandbox service a run uses: one already running (its URL and key), or the embedded one for the run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from orchard.env.client._common import API_KEY_ENV

__all__ = ["sandbox_service"]


@contextlib.contextmanager
def sandbox_service(url: str | None) -> Iterator[tuple[str, str]]:
    """Yields ``(url, api_key)``: ``url`` with the key from ``$SANDBOX_API_KEY``, or, for ``url=None``, the embedded
    service (local backend, SQLite state) started in a child process for the block and stopped after it."""
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL or None, got {url!r}")
        yield url, os.environ.get(API_KEY_ENV, "")
        return
    from orchard.env.embedded import serve

    with serve(in_process=False) as service:
        yield service.url, service.api_key
