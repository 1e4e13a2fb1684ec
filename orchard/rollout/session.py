"""How a model call names its recording-proxy session: shared by the proxy, which files each call under a session,
and a harness program, which sends its calls (light: a harness program imports it without the proxy's server).

Session key, first that applies: the path prefix ``/sessions/{id}/v1/...``; the header `SESSION_HEADER`; the
request's ``user`` field; else `DEFAULT_SESSION`.
"""

from __future__ import annotations

__all__ = ["DEFAULT_SESSION", "SESSION_HEADER"]

SESSION_HEADER = "X-Session-Id"
"""The header that files a program's model call under its episode's proxy session."""

DEFAULT_SESSION = "default"
"""The session of a call that names none."""
