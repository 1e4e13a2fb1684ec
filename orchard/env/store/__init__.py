"""State stores of the orchestrator: the interface and the embedded SQLite implementation."""

from orchard.env.store.base import (
    JOB_DONE,
    JOB_STATUSES,
    SANDBOX_STATUSES,
    IdempotencyRecord,
    JobRecord,
    SandboxRecord,
    StateStore,
)
from orchard.env.store.sqlite import SQLiteStore

__all__ = [
    "JOB_DONE",
    "JOB_STATUSES",
    "SANDBOX_STATUSES",
    "IdempotencyRecord",
    "JobRecord",
    "SQLiteStore",
    "SandboxRecord",
    "StateStore",
]
