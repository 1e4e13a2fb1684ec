"""A warm pool of sandboxes: created and started ahead, handed out on `acquire`, refilled in the background.

A sandbox's first command pays for starting its box (the local backend: 66-160 ms under load; a pod: seconds);
a pool pays it before anyone asks. The sandboxes are the client's, like any it creates: those still idle when
the pool closes are deleted, those handed out are the caller's to delete. Idle ones are kept alive with
heartbeats (a pool may sit idle through a training step longer than the service's heartbeat timeout), and one
the service no longer has is never handed out.

    async with AsyncSandboxPool(client, size=4) as pool:
        sandbox = await pool.acquire()        # created and started ahead; the pool makes another
        async with sandbox:
            ...
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from orchard.env.client._common import keepalive_interval_s
from orchard.env.client.aio import AsyncSandbox, AsyncSandboxClient
from orchard.env.errors import NotFoundError

logger = logging.getLogger(__name__)

__all__ = ["AsyncSandboxPool"]


class AsyncSandboxPool:
    """Keeps ``size`` sandboxes created and started (each has run ``warm_command``), ready for `acquire`.

    Args:
        client: the client that creates (and, when it closes, deletes) the sandboxes.
        size: how many sandboxes are kept ready (idle plus being made). 0 makes every `acquire` a plain create.
        warm_command: run once in each sandbox before it is handed out, so its box is already running.
            Default ``["true"]``. It must leave the workspace as it found it.
        create_options: keyword arguments of `AsyncSandboxClient.create` (image, block_network, env, ...), the
            same for every sandbox; ``sandbox_id`` is refused (a pool names none of them).

    A sandbox that could not be made ahead (the service refused it, its warm command failed) is counted in
    `failures` and logged, never handed out; `acquire` then creates one directly, whose errors it raises.

    An idle sandbox gets a heartbeat every third of its heartbeat timeout (the sandbox's ``heartbeat_timeout``
    as the service reports it; else the create options'; else the service's default, 600 s), so the service's
    reaper leaves it alone however long the pool sits idle. Handed out, it beats no more (the caller's use
    keeps it alive, and an abandoned one is reaped as any other), unless ``keepalive_s`` is among the create
    options: then the client's own heartbeat, which the pool leaves alone, keeps beating. `acquire` checks that
    the service still has an idle sandbox before it hands it out; one it lost anyway (a service restart, a
    reaper that ran while the pool's event loop was blocked) is counted in `lost`, deleted here, and the next
    idle one taken, or a new one made.
    """

    def __init__(self, client: AsyncSandboxClient, size: int, *, warm_command: Sequence[str] = ("true",),
                 **create_options: Any) -> None:
        if not isinstance(client, AsyncSandboxClient):
            raise ValueError(f"client must be an AsyncSandboxClient, got {type(client).__name__}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        if isinstance(warm_command, str) or not warm_command or not all(isinstance(a, str) for a in warm_command):
            raise ValueError(f"warm_command must be a non-empty list of strings, got {warm_command!r}")
        if "sandbox_id" in create_options:
            raise ValueError("create_options must not name a sandbox_id: the pool makes many sandboxes")
        self.client = client
        self.size = size
        self.warm_command = list(warm_command)
        self.create_options = create_options
        self.failures = 0
        """Sandboxes that could not be made ahead."""
        self.lost = 0
        """Idle sandboxes the service no longer had (or was deleting) when `acquire` came for them."""
        self._idle: collections.deque[AsyncSandbox] = collections.deque()
        self._making: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def idle(self) -> int:
        """Sandboxes ready to hand out now."""
        return len(self._idle)

    def start(self) -> None:
        """Begin making sandboxes up to `size` (in the background; `wait_filled` waits for them)."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        while len(self._idle) + len(self._making) < self.size:
            task = asyncio.get_running_loop().create_task(self._make_idle())
            self._making.add(task)
            task.add_done_callback(self._making.discard)

    async def wait_filled(self) -> None:
        """Wait until the sandboxes being made are made (or failed)."""
        while self._making:
            await asyncio.gather(*self._making, return_exceptions=True)

    async def acquire(self) -> AsyncSandbox:
        """A started sandbox from the pool (one the service still has ready: those it lost are dropped), or,
        when none is idle, a newly created one; either way the pool starts making a replacement. The sandbox is
        the caller's (delete it, or `async with` it)."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        while self._idle:
            sandbox = self._idle.popleft()
            if await self._still_ready(sandbox):
                self.start()
                if self.create_options.get("keepalive_s") is None:
                    await sandbox.stop_heartbeat()
                return sandbox
        self.start()
        return await self.client.create(**self.create_options)

    async def _still_ready(self, sandbox: AsyncSandbox) -> bool:
        """Whether the service still has the idle `sandbox`, ready; one it lost is counted and deleted."""
        try:
            status = (await sandbox.refresh()).get("status")
        except NotFoundError:
            status = "gone"
        except BaseException:
            self._idle.appendleft(sandbox)  # no answer (or cancelled): it stays the pool's
            raise
        if status == "ready":
            return True
        self.lost += 1
        logger.warning("pooled sandbox %s was lost while idle (%s): dropped", sandbox.sandbox_id, status)
        with contextlib.suppress(Exception):  # gone already, or on its way out: a 404 is fine
            await asyncio.shield(sandbox.delete())
        return False

    def _beat_interval_s(self, sandbox: AsyncSandbox) -> float:
        return keepalive_interval_s(sandbox.info, self.create_options.get("heartbeat_timeout"))

    async def _make_idle(self) -> None:
        try:
            sandbox = await self.client.create(**self.create_options)
        except Exception as exc:  # the service refused or failed: acquire creates directly and raises
            self.failures += 1
            logger.warning("a pooled sandbox could not be created: %s", exc)
            return
        try:
            started = await sandbox.exec(self.warm_command)
            ok = started.exit_code == 0
        except Exception as exc:
            ok, started = False, exc
        if ok and not self._closed:
            sandbox.start_heartbeat(self._beat_interval_s(sandbox))  # a no-op where keepalive_s started one
            self._idle.append(sandbox)
            return
        if not ok:
            self.failures += 1
            logger.warning("a pooled sandbox's warm command failed: %s", started)
        with contextlib.suppress(Exception):  # what stays behind is the client's to delete when it closes
            await asyncio.shield(sandbox.delete())

    async def aclose(self) -> None:
        """Stop refilling, wait for the sandboxes being made, and delete every idle one. Idempotent."""
        self._closed = True
        await self.wait_filled()
        idle, self._idle = list(self._idle), collections.deque()
        await asyncio.gather(*(s.delete() for s in idle), return_exceptions=True)

    async def __aenter__(self) -> AsyncSandboxPool:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.shield(self.aclose())
