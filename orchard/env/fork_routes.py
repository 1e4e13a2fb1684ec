"""The REST routes of snapshots and forks (`docs/env-api.md`, "Snapshots and forks"), added to the service's app by
`orchard.env.server.create_app`. The work is `orchard.env.forks.Forks`'."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from orchard._extras import requires_extra

with requires_extra("env"):
    from fastapi import FastAPI, Header, Request
    from fastapi.params import Depends
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field

from orchard.env.forks import ForkParams, Forks
from orchard.env.store.base import SandboxRecord, SnapshotRecord

Idempotent = Callable[[str | None, str, str, dict[str, Any], Callable[[], Awaitable[tuple[int, dict[str, Any]]]],
                       str | None], Awaitable[tuple[int, Any]]]
"""`(key, method, path, body, operation, resource_id) -> (status, body)`: the app's idempotency wrapper."""


class SnapshotRequest(BaseModel):
    snapshot_id: str | None = Field(None, description="Custom id; 409 if taken.")


class ForkRequest(BaseModel):
    sandbox_id: str | None = Field(None, description="The fork's custom id; 409 if taken.")
    timeout: int | None = Field(None, description="Seconds to wait for readiness (Orchard Env); echoed back.")
    ttl_seconds: float | None = Field(None, description="Hard lifetime of the fork.")
    heartbeat_timeout: float | None = Field(None, description="Idle seconds (no heartbeat/exec) before reaping.")


def snapshot_view(record: SnapshotRecord) -> dict[str, Any]:
    """A snapshot as the API shows it. `processes_carried` is always false: a snapshot holds the workspace's
    files only, and a fork starts with no process running."""
    return {
        "snapshot_id": record.snapshot_id,
        "sandbox_id": record.sandbox_id,
        "status": record.status,
        "created_at": record.created_at,
        "image": record.image,
        "block_network": record.block_network,
        "cpu": record.cpu or "",
        "memory": record.memory or "",
        "env": dict(record.env),
        "contents": "workspace",
        "processes_carried": False,
    }


def add_fork_routes(app: FastAPI, forks: Forks, auth: list[Depends], view: Callable[[SandboxRecord], dict[str, Any]],
                    idempotent: Idempotent) -> None:
    """Add the snapshot and fork routes to `app`, authorised by `auth`, sandboxes shown with `view`."""

    def fork_params(body: ForkRequest | None, key: str | None) -> ForkParams:
        params = ForkParams(**(body.model_dump() if body is not None else {}))
        if key is not None and params.sandbox_id is None:
            # fixed before the first attempt, so that a retry finds what the first attempt made
            params = dataclasses.replace(params, sandbox_id=uuid.uuid4().hex[:12])
        return params

    @app.post("/sandboxes/{sandbox_id}/snapshots", dependencies=auth)
    async def take_snapshot(sandbox_id: str, request: Request, body: SnapshotRequest | None = None,
                            idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        snapshot_id = (body.snapshot_id if body is not None else None) or (
            uuid.uuid4().hex[:12] if idempotency_key is not None else None)

        async def take() -> tuple[int, dict[str, Any]]:
            return 200, snapshot_view(await forks.snapshot(sandbox_id, snapshot_id))

        payload = body.model_dump() if body is not None else {}
        status, answer = await idempotent(idempotency_key, "POST", request.url.path, payload, take, snapshot_id)
        return JSONResponse(status_code=status, content=answer)

    @app.get("/snapshots", dependencies=auth)
    async def list_snapshots() -> dict[str, Any]:
        return {"snapshots": [snapshot_view(r) for r in await forks.list_snapshots()]}

    @app.get("/snapshots/{snapshot_id}", dependencies=auth)
    async def get_snapshot(snapshot_id: str) -> dict[str, Any]:
        return snapshot_view(await forks.get_snapshot(snapshot_id))

    @app.delete("/snapshots/{snapshot_id}", dependencies=auth)
    async def delete_snapshot(snapshot_id: str, request: Request,
                              idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        async def delete() -> tuple[int, dict[str, Any]]:
            await forks.delete_snapshot(snapshot_id)
            return 200, {"status": "deleted", "snapshot_id": snapshot_id}

        status, answer = await idempotent(idempotency_key, "DELETE", request.url.path, {}, delete, None)
        return JSONResponse(status_code=status, content=answer)

    @app.post("/sandboxes/{sandbox_id}/fork", dependencies=auth)
    async def fork_sandbox(sandbox_id: str, request: Request, body: ForkRequest | None = None,
                           idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        params = fork_params(body, idempotency_key)

        async def fork() -> tuple[int, dict[str, Any]]:
            return 200, view(await forks.fork(params, parent_id=sandbox_id))

        payload = body.model_dump() if body is not None else {}
        status, answer = await idempotent(idempotency_key, "POST", request.url.path, payload, fork, params.sandbox_id)
        return JSONResponse(status_code=status, content=answer)

    @app.post("/snapshots/{snapshot_id}/fork", dependencies=auth)
    async def fork_snapshot(snapshot_id: str, request: Request, body: ForkRequest | None = None,
                            idempotency_key: str | None = Header(None, alias="Idempotency-Key")) -> JSONResponse:
        params = fork_params(body, idempotency_key)

        async def fork() -> tuple[int, dict[str, Any]]:
            return 200, view(await forks.fork(params, snapshot_id=snapshot_id))

        payload = body.model_dump() if body is not None else {}
        status, answer = await idempotent(idempotency_key, "POST", request.url.path, payload, fork, params.sandbox_id)
        return JSONResponse(status_code=status, content=answer)
