"""The sandboxes a run uses: the service (one already running, or the embedded one for the run, with its shared
folders), where rollouts draw their sandboxes from (`PooledSandboxes`: a warm pool per stage), and the two for a
run's block (`pooled_sandboxes`)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from orchard.env.client import API_KEY_ENV
from orchard.env.client.aio import AsyncSandbox, AsyncSandboxClient
from orchard.env.client.pool import AsyncSandboxPool

__all__ = ["PooledSandboxes", "pooled_sandboxes", "sandbox_service"]


@contextlib.contextmanager
def sandbox_service(url: str | None, *, shared: Mapping[str, Callable[[Path], object]] | None = None,
                    ) -> Iterator[tuple[str, str]]:
    """Yields ``(url, api_key)``: ``url`` with the key from ``$SANDBOX_API_KEY``, or, for ``url=None``, the embedded
    service (local backend, SQLite state) started in a child process for the block and stopped after it.

    ``shared``: folders the embedded service shows every sandbox read-only at ``/.orchard-shared/<name>`` (see
    ``orchard.env.embedded.serve``), name -> a function that fills the empty directory it is given (the SWE
    domain's ``write_pytest_bundle``), called before the service starts; the folders are removed after it
    stops. A service given by ``url`` keeps what it shares: the functions are not called.
    """
    if shared is not None and (not isinstance(shared, Mapping) or not all(callable(f) for f in shared.values())):
        raise ValueError(f"shared must map names to functions that fill a directory, got {shared!r:.100}")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL or None, got {url!r}")
        yield url, os.environ.get(API_KEY_ENV, "")
        return
    from orchard.env.embedded import serve

    with contextlib.ExitStack() as stack:
        folders: dict[str, str] = {}
        if shared:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="orchard-shared-")))
            root.chmod(0o711)  # the sandboxes run as other uids: they must pass through to the folders
            for name, fill in shared.items():
                folder = root / name
                folder.mkdir(mode=0o755)
                folder.chmod(0o755)  # whatever the umask
                fill(folder)
                folders[name] = str(folder)
        service = stack.enter_context(serve(in_process=False, shared=folders or None))
        yield service.url, service.api_key


_CLIENT_DEFAULTS = {name: p.default for name, p in inspect.signature(AsyncSandboxClient.create).parameters.items()
                    if p.default is not inspect.Parameter.empty}
"""`AsyncSandboxClient.create`'s defaults: two requests that differ only in spelling a default out are the same."""


class PooledSandboxes:
    """Where a run's rollouts get their sandboxes: hand it to the harnesses in place of the client.

    ``await create(**options)`` is the client's, except while a stage holds a pool (`stage`): then a request for
    the sandboxes the pool makes (the client's defaults, an image, network blocked) is served from its sandboxes,
    created and started ahead (`orchard.env.AsyncSandboxPool`), and any other (a named ``sandbox_id``, other
    options) is created on the spot. The sandboxes handed out are the caller's to delete, as the client's are.

    Args:
        client: the ``AsyncSandboxClient`` that creates every sandbox (``base_url`` and ``api_key`` are its).
        cpu, memory: the resources every sandbox is requested with (``client.create``'s ``cpu`` / ``memory``,
            Kubernetes quantities such as ``"2"`` and ``"8Gi"``), added to each request and to each stage's pool
            unless the request names its own; None: the service's defaults.
        max_pool: the most sandboxes one stage's pool keeps ahead, whatever size the stage asks for (a run's cap on
            the service); None: no cap.
        pool_options: what a stage's pool makes its sandboxes with when the stage names no options: the options the
            domain's episodes create theirs with (only such requests are served from the pool); None: the
            client's defaults.
    """

    def __init__(self, client: AsyncSandboxClient, *, cpu: str | None = None, memory: str | None = None,
                 max_pool: int | None = None, pool_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(client, AsyncSandboxClient):
            raise ValueError(f"client must be an AsyncSandboxClient, got {type(client).__name__}")
        for name, value in (("cpu", cpu), ("memory", memory)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a Kubernetes quantity string or None, got {value!r}")
        if max_pool is not None and (isinstance(max_pool, bool) or not isinstance(max_pool, int) or max_pool < 0):
            raise ValueError(f"max_pool must be an int >= 0 or None, got {max_pool!r}")
        if pool_options is not None and not isinstance(pool_options, Mapping):
            raise ValueError(f"pool_options must be a mapping of client.create options or None, got {pool_options!r}")
        self.client = client
        self.resources = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
        """What every request is made with unless it names its own."""
        self.max_pool = max_pool
        self.pool_options = dict(pool_options or {})
        self.pool: AsyncSandboxPool | None = None
        """The current stage's pool (None between stages)."""

    @property
    def base_url(self) -> str:
        return self.client.base_url

    @property
    def api_key(self) -> str | None:
        return self.client.api_key

    async def create(self, **options: Any) -> AsyncSandbox:
        """A sandbox as ``client.create(**options)`` gives (with the run's ``resources``), from the stage's pool when
        it makes such ones."""
        options = {**self.resources, **options}
        pool = self.pool
        if pool is not None and {**_CLIENT_DEFAULTS, **options} == {**_CLIENT_DEFAULTS, **pool.create_options}:
            return await pool.acquire()
        return await self.client.create(**options)

    @contextlib.asynccontextmanager
    async def stage(self, size: int, **create_options: Any) -> AsyncIterator[AsyncSandboxPool]:
        """For the block, a pool of ``size`` sandboxes (at most ``max_pool``) made with ``create_options``
        (``pool_options`` when none) that `create` draws from; closed when the block ends, also on error: its idle
        sandboxes deleted, those being made waited for and deleted. Size it to the episodes the stage has in
        flight at once (0: every sandbox created on the spot). One stage at a time."""
        if self.pool is not None:
            raise RuntimeError("a stage already holds a pool: stages do not nest")
        if self.max_pool is not None:
            size = min(size, self.max_pool)
        pool = AsyncSandboxPool(self.client, size, **{**self.resources, **(create_options or self.pool_options)})
        pool.start()
        self.pool = pool
        try:
            yield pool
        finally:
            self.pool = None  # a rollout the stage left running creates its own from here on
            await asyncio.shield(pool.aclose())


@contextlib.asynccontextmanager
async def pooled_sandboxes(url: str | None, *, shared: Mapping[str, Callable[[Path], object]] | None = None,
                           cpu: str | None = None, memory: str | None = None, max_pool: int | None = None,
                           pool_options: Mapping[str, Any] | None = None) -> AsyncIterator[PooledSandboxes]:
    """A run's sandboxes for the block: the service (`sandbox_service`: ``url``, or the embedded one with
    ``shared``), a client, and the `PooledSandboxes` over it (``cpu``, ``memory``, ``max_pool``, ``pool_options``)
    that the harnesses create their sandboxes from; the client closed and an embedded service stopped after it.

    ``async with sandboxes.stage(n):`` around each stage gives it a warm pool sized to its ``n`` episodes at once.
    """
    with sandbox_service(url, shared=shared) as (base_url, api_key):
        async with AsyncSandboxClient(base_url, api_key) as client:
            yield PooledSandboxes(client, cpu=cpu, memory=memory, max_pool=max_pool, pool_options=pool_options)
