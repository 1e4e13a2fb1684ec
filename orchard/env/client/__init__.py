"""Clients of the sandbox service: `SandboxClient` (sync) and `AsyncSandboxClient` (asyncio), and the variables
they read their settings from (`BASE_URL_ENV`, `API_KEY_ENV`)."""

from orchard.env.client._common import (
    API_KEY_ENV,
    BASE_URL_ENV,
    FileEntry,
    JobResult,
    PatchResult,
    RetryPolicy,
)
from orchard.env.client.aio import AsyncPtyProcess, AsyncSandbox, AsyncSandboxClient, AsyncSnapshot
from orchard.env.client.pool import AsyncSandboxPool
from orchard.env.client.sync import PtyProcess, Sandbox, SandboxClient, Snapshot

__all__ = [
    "API_KEY_ENV",
    "BASE_URL_ENV",
    "AsyncPtyProcess",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "AsyncSandboxPool",
    "AsyncSnapshot",
    "FileEntry",
    "JobResult",
    "PatchResult",
    "PtyProcess",
    "RetryPolicy",
    "Sandbox",
    "SandboxClient",
    "Snapshot",
]
