"""State stores of the orchestrator: the interface, the embedded SQLite store and the Redis store of replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchard.env.store.base import (
    JOB_DONE,
    JOB_STATUSES,
    LOST_JOB_ERROR,
    SANDBOX_STATUSES,
    SNAPSHOT_STATUSES,
    IdempotencyRecord,
    JobRecord,
    SandboxRecord,
    SnapshotRecord,
    StateStore,
)
from orchard.env.store.sqlite import SQLiteStore

__all__ = [
    "JOB_DONE",
    "JOB_STATUSES",
    "LOST_JOB_ERROR",
    "SANDBOX_STATUSES",
    "SNAPSHOT_STATUSES",
    "IdempotencyRecord",
    "JobRecord",
    "RedisStore",
    "SQLiteStore",
    "SandboxRecord",
    "SnapshotRecord",
    "StateStore",
    "open_store",
]


def __getattr__(name: str) -> Any:
    # RedisStore needs the [redis] extra: imported when asked for, so the SQLite default works without it
    if name == "RedisStore":
        from orchard.env.store.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_store(store: str, default_path: str | Path) -> StateStore:
    """The store `store` names: "sqlite" (the embedded default, a file at `default_path`) or a
    `redis://host:port/db` URL (shared by the replicas that use the same URL), which must answer: an unreachable
    Redis raises ``ConnectionError`` here, in one line."""
    if store == "sqlite":
        return SQLiteStore(default_path)
    if isinstance(store, str) and store.startswith(("redis://", "rediss://", "unix://")):
        from orchard.env.store.redis_store import RedisStore

        shared = RedisStore(store)
        shared.check_reachable()
        return shared
    raise ValueError(f"store must be 'sqlite' or a redis://host:port/db URL, got {store!r}")
