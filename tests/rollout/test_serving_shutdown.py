"""A server stopped with a request in flight ends quietly: the cancelled request is no error of the app (no ASGI
traceback in the run's console), while a real error in the app is still reported."""

import asyncio

import httpx
from fastapi import FastAPI

from orchard.rollout.serving import serve_app


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(60)

    @app.get("/broken")
    async def broken():
        raise RuntimeError("a real bug in the app")

    return app


def test_a_request_cut_off_at_shutdown_prints_nothing_but_a_real_error_is_reported(capfd):
    async def main():
        async with serve_app(_app(), shutdown_timeout_s=1) as url, httpx.AsyncClient() as client:
            assert (await client.get(f"{url}/broken")).status_code == 500
            slow = asyncio.create_task(client.get(f"{url}/slow", timeout=30))
            await asyncio.sleep(0.5)  # in flight when the block ends: cancelled after the 1 s grace
        slow.cancel()

    asyncio.run(main())
    err = capfd.readouterr().err
    assert "a real bug in the app" in err  # the app's own error: reported with its traceback
    assert err.count("Traceback") == 1 and "CancelledError" not in err
    assert "timeout graceful shutdown exceeded" not in err
