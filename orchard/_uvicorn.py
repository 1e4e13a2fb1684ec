"""What every uvicorn server of orchard shares: a quiet end (the service, the model server, the proxy)."""

from __future__ import annotations

import asyncio
import logging

__all__ = ["quiet_shutdown_cancellations"]


class _ShutdownCancellations(logging.Filter):
    """Drops uvicorn's report of requests it cancelled at shutdown: the "Cancel N running task(s)" line and the
    "Exception in ASGI application" traceback of each cancelled request. A request cut off because the server
    stopped (a harness program killed, an evaluation over) is how a run ends, not an error in the app; any other
    exception is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            return False
        return not (isinstance(record.msg, str) and record.msg.startswith("Cancel ")
                    and "timeout graceful shutdown exceeded" in record.msg)


def quiet_shutdown_cancellations() -> None:
    """Install `_ShutdownCancellations` on uvicorn's error logger (once; after a ``uvicorn.Config``, which
    configures that logger)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _ShutdownCancellations) for f in logger.filters):
        logger.addFilter(_ShutdownCancellations())
