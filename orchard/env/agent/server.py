"""The exec agent as a small HTTP service, for a sandbox that is a pod or machine of its own.

Run `python -m orchard.env.agent --root DIR [--port N | --uds PATH]`. One agent serves one workspace. Routes
(JSON unless said otherwise; bytes travel base64-encoded in JSON, raw in file bodies):

    GET  /health                         {"status": "ok", "isolation": ..., "workdir": ...}   (no auth)
    POST /exec          {command, cwd?, env?, timeout_s?, stdin_b64?, max_output_bytes?}
                        -> {exit_code, stdout_b64, stderr_b64, stdout_truncated, stderr_truncated,
                            timed_out, duration_s}
    PUT  /files?path=P[&mode=OCTAL]      raw body -> 204
    PUT  /files/archive?path=DIR         raw tar or tar.gz body -> {entries, bytes} (`orchard.env.agent.archive`)
    GET  /files?path=P[&max_bytes=N]     -> raw body
    GET  /files/list?path=P[&recursive=true] -> {"files": [{path, size, is_dir, mode, mtime}]}
    POST /apply_patch   {patch}          -> like /exec
    GET  /resources                      -> {cpu, memory_mb, pids, disk_bytes}
    WS   /pty?cols=C&rows=R[&command=...]  binary frames both ways (keystrokes in, output out); a text
                        frame {"resize": [cols, rows]} resizes; the socket closes when the terminal ends.

Errors: 400 for bad input and paths that leave the workspace (`{"detail", "error": "path_escape"}` for the
latter), 404 for a missing file (`{"detail", "error": "not_found"}`), 401 without the token, 500 with
`{"detail"}` for anything else: the JSON the pod agent (`orchard.env.backends.kubernetes.pod_agent`) answers,
where the Kubernetes backend reads `error` to tell a path escape and a missing file from other failures.
Unlike the pod agent, this one does not deduplicate a `request_id` (the field is ignored): no client retries it
(the Kubernetes backend, the one client that retries, always talks to the pod agent; the local backend calls
the agent in-process).
When the environment variable named by `--token-env` (default ORCHARD_AGENT_TOKEN) is set, every route but
/health needs `Authorization: Bearer <token>` (compared in constant time; also on the WebSocket, as a header,
never in the URL).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
from dataclasses import asdict
from typing import Any

from orchard._extras import requires_extra

with requires_extra("env"):
    from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response, WebSocket
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field

from orchard.env.agent.core import SandboxAgent
from orchard.env.backends.base import ExecRequest, ExecResult, PathEscapeError


class ExecBody(BaseModel):
    command: str | list[str]
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = 600.0
    stdin_b64: str | None = None
    max_output_bytes: int = 1 << 20


class PatchBody(BaseModel):
    patch: str


def result_json(r: ExecResult) -> dict[str, Any]:
    """An ExecResult as the agent's JSON (stdout/stderr base64-encoded)."""
    return {
        "exit_code": r.exit_code,
        "stdout_b64": base64.b64encode(r.stdout).decode(),
        "stderr_b64": base64.b64encode(r.stderr).decode(),
        "stdout_truncated": r.stdout_truncated,
        "stderr_truncated": r.stderr_truncated,
        "timed_out": r.timed_out,
        "duration_s": r.duration_s,
    }


def create_agent_app(agent: SandboxAgent, *, token: str | None = None) -> FastAPI:
    """A FastAPI app serving `agent` (see the module docstring for the routes)."""
    app = FastAPI(title="orchard exec agent", version="1")

    def authorize(authorization: str | None) -> None:
        if token is None:
            return
        given = (authorization or "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(given, token.encode()):
            raise HTTPException(401, "missing or wrong bearer token")

    def auth(authorization: str | None = Header(default=None)) -> None:
        authorize(authorization)

    @app.exception_handler(PathEscapeError)
    async def _escape(_: Request, e: PathEscapeError) -> JSONResponse:
        return JSONResponse({"detail": str(e), "error": "path_escape"}, status_code=400)

    @app.exception_handler(FileNotFoundError)
    async def _missing(_: Request, e: FileNotFoundError) -> JSONResponse:
        return JSONResponse({"detail": str(e), "error": "not_found"}, status_code=404)

    @app.exception_handler(Exception)
    async def _broken(_: Request, e: Exception) -> JSONResponse:
        # JSON with the cause, as the pod agent answers (FastAPI's own 500 is a bare "Internal Server Error")
        return JSONResponse({"detail": f"{type(e).__name__}: {e}"}, status_code=500)

    @app.exception_handler(ValueError)
    async def _bad(_: Request, e: ValueError) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=400)

    @app.exception_handler(IsADirectoryError)
    @app.exception_handler(NotADirectoryError)
    async def _kind(_: Request, e: OSError) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=400)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "isolation": agent.isolation.mode, "workdir": agent.workspace.mount}

    @app.post("/exec", dependencies=[Depends(auth)])
    async def exec_(body: ExecBody) -> dict[str, Any]:
        try:
            stdin = base64.b64decode(body.stdin_b64, validate=True) if body.stdin_b64 is not None else None
        except binascii.Error as e:
            raise ValueError(f"stdin_b64 is not valid base64: {e}") from e
        request = ExecRequest(
            command=body.command,
            cwd=body.cwd,
            env=body.env,
            timeout_s=body.timeout_s,
            stdin=stdin,
            max_output_bytes=body.max_output_bytes,
        )
        return result_json(await agent.exec(request))

    @app.put("/files", status_code=204, dependencies=[Depends(auth)])
    async def put_file(request: Request, path: str = Query(...), mode: str | None = None) -> Response:
        try:
            mode_int = int(mode, 8) if mode is not None else None
        except ValueError as e:
            raise ValueError(f"mode must be octal digits, got {mode!r}") from e
        await agent.write_file(path, await request.body(), mode_int)
        return Response(status_code=204)

    @app.put("/files/archive", dependencies=[Depends(auth)])
    async def put_archive(request: Request, path: str = Query(...)) -> dict[str, Any]:
        return asdict(await agent.extract_archive(path, await request.body()))

    @app.get("/files", dependencies=[Depends(auth)])
    async def get_file(path: str = Query(...), max_bytes: int | None = None) -> Response:
        return Response(await agent.read_file(path, max_bytes), media_type="application/octet-stream")

    @app.get("/files/list", dependencies=[Depends(auth)])
    async def list_files(path: str = ".", recursive: bool = False) -> dict[str, Any]:
        return {"files": [asdict(f) for f in await agent.list_files(path, recursive)]}

    @app.post("/apply_patch", dependencies=[Depends(auth)])
    async def apply_patch(body: PatchBody) -> dict[str, Any]:
        return result_json(await agent.apply_patch(body.patch))

    @app.get("/resources", dependencies=[Depends(auth)])
    async def resources() -> dict[str, Any]:
        return asdict(await agent.resources())

    @app.websocket("/pty")
    async def pty(ws: WebSocket, cols: int = 80, rows: int = 24, command: str | None = None) -> None:
        try:
            authorize(ws.headers.get("authorization"))
        except HTTPException:
            await ws.close(code=4401)
            return
        await ws.accept()
        try:
            session = await agent.open_pty(command, cols=cols, rows=rows)
        except ValueError as e:
            await ws.close(code=4400, reason=str(e)[:120])
            return

        async def pump_out() -> None:
            async for chunk in session.read():
                await ws.send_bytes(chunk)

        async def pump_in() -> None:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                if msg.get("bytes") is not None:
                    await session.write(msg["bytes"])
                elif msg.get("text") is not None:
                    c, r = json.loads(msg["text"])["resize"]
                    await session.resize(int(c), int(r))

        out = asyncio.create_task(pump_out())
        inp = asyncio.create_task(pump_in())
        try:
            await asyncio.wait({out, inp}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (out, inp):
                t.cancel()
                if t.done() and not t.cancelled():
                    t.exception()  # a malformed frame or a dropped socket only ends the session
            await session.close()
            with contextlib.suppress(Exception):
                await ws.close()

    return app
