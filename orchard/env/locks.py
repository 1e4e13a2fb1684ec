"""A store lock held with a lease: waited for, renewed in the background while held, released at the end.

    async with StoreLock(store, "sandbox:abc", lease_s=30) as lock:
        ...
        ok = await store.put_job_fenced(job, lock.name, lock.token)

The lease bounds how long a holder that stops (killed, or paused by the OS or a debugger) keeps others out; the
fencing token makes sure that, if it comes back after its lease, its writes are refused (the store checks the
token with each fenced write, atomically). Renewal runs every third of the lease, so a holder must stall for two
thirds of it before it loses the lock.

A store that cannot be reached for a moment (`StateStore.unavailable_errors`) delays the lock, within `outage_s`:
taking it is tried again (a lock taken by a call whose answer was lost is free again when its lease ends), a
failed renewal is tried at the next tick, and a failed release leaves the lock to its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

from orchard._retry import backoff_s
from orchard.env.store.base import StateStore

logger = logging.getLogger(__name__)


class StoreLock:
    """Async context manager holding the store lock `name`.

    Args:
        store: where the lock lives (`StateStore.acquire_lock`).
        name: the lock's name; one holder at a time across every process using the store.
        lease_s: seconds the lock stays held without a renewal. Must be > 0.
        poll_s: first wait between attempts while another holder has it (doubles, jittered, up to 0.5 s or
            `poll_s` if longer; `orchard._retry.backoff_s`).
        outage_s: how long taking the lock waits for an unreachable store before the store's error is
            raised. Default 0: at once.

    Attributes:
        token: the fencing token while held (None before and after).
        lost: True once a renewal found the lease gone: writes with `token` are refused from then on.
    """

    def __init__(self, store: StateStore, name: str, lease_s: float, *, poll_s: float = 0.01,
                 outage_s: float = 0.0) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not isinstance(lease_s, (int, float)) or not lease_s > 0:
            raise ValueError(f"lease_s must be a number > 0, got {lease_s!r}")
        if not isinstance(poll_s, (int, float)) or not poll_s > 0:
            raise ValueError(f"poll_s must be a number > 0, got {poll_s!r}")
        if not isinstance(outage_s, (int, float)) or not outage_s >= 0:
            raise ValueError(f"outage_s must be a number >= 0, got {outage_s!r}")
        self.store, self.name, self.lease_s, self.poll_s = store, name, float(lease_s), float(poll_s)
        self.outage_s = float(outage_s)
        self.token: int | None = None
        self.lost = False
        self._renewer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StoreLock:
        tries, unreachable_since = 0, None
        loop = asyncio.get_running_loop()
        while True:
            try:
                token = await self.store.acquire_lock(self.name, self.lease_s)
            except self.store.unavailable_errors:
                if unreachable_since is None:
                    unreachable_since = loop.time()
                    logger.warning("taking lock %s: the store is unreachable; trying again for up to %g s",
                                   self.name, self.outage_s, exc_info=True)
                if loop.time() - unreachable_since >= self.outage_s:
                    raise
                token = None
            else:
                unreachable_since = None
            if token is not None:
                break
            # jittered: waiters do not retry in lockstep
            await asyncio.sleep(backoff_s(tries, base_s=self.poll_s, max_s=max(self.poll_s, 0.5)))
            tries += 1
        self.token, self.lost = token, False
        self._stop = asyncio.Event()
        self._renewer = asyncio.create_task(self._renew_forever(token, self._stop))
        return self

    async def _renew_forever(self, token: int, stop: asyncio.Event) -> None:
        # The loop ends on `stop`, not only on cancellation: a store client may turn the CancelledError that
        # interrupts a request into its own error (a connection or timeout error), which the retry below would
        # swallow, renewing a released lock forever and hanging __aexit__.
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.lease_s / 3)
            if stop.is_set():
                return
            try:
                renewed = await self.store.renew_lock(self.name, token, self.lease_s)
            except Exception:  # the store unreachable for a moment: the next tick tries again
                if not stop.is_set():
                    logger.warning("renewing lock %s failed", self.name, exc_info=True)
                continue
            if not renewed:
                self.lost = True
                logger.warning("lost the lease of lock %s (token %d)", self.name, token)
                return

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._renewer is not None:
            self._stop.set()
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        token, self.token = self.token, None
        if token is not None:
            try:
                await self.store.release_lock(self.name, token)
            except self.store.unavailable_errors:
                logger.warning("releasing lock %s failed: the store is unreachable; its lease ends it", self.name)
