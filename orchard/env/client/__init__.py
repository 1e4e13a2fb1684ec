"""Clients of the sandbox service: `SandboxClient` (sync) and `AsyncSandboxClient` (asyncio)."""

from orchard.env.client._common import FileEntry, JobResult, PatchResult, RetryPolicy
from orchard.env.client.aio import AsyncPtyProcess, AsyncSandbox, AsyncSandboxClient
from orchard.env.client.pool import AsyncSandboxPool
from orchard.env.client.sync import PtyProcess, Sandbox, SandboxClient

__all__ = [
    "AsyncPtyProcess",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "AsyncSandboxPool",
    "FileEntry",
    "JobResult",
    "PatchResult",
    "PtyProcess",
    "RetryPolicy",
    "Sandbox",
    "SandboxClient",
]
