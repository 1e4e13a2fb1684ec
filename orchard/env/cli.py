"""`orchard env ...` subcommands: `orchard env serve` runs the embedded sandbox service in the foreground."""

from __future__ import annotations

import argparse
import os
import tempfile

from orchard.env.embedded import API_KEY_ENV, run_forever


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `env` (with `serve`) to the top-level `orchard` parser."""
    env = subparsers.add_parser("env", help="the sandbox service")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    serve = env_sub.add_parser(
        "serve",
        help="run the embedded sandbox service (LocalBackend + SQLite) on loopback",
        description="Runs the Orchard-Env-compatible sandbox API. Prints ORCHARD_ENV_URL=... and "
        "ORCHARD_ENV_API_KEY=... once it listens; export them as SANDBOX_BASE_URL / SANDBOX_API_KEY.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    serve.add_argument("--root", default=None, help="state + sandboxes directory (default: a new temp dir)")
    serve.add_argument("--api-key", default=None,
                       help=f"API key (default: ${API_KEY_ENV}, else a fresh random one)")
    serve.add_argument("--max-concurrent-execs", type=int, default=64)
    serve.add_argument("--max-pending-execs", type=int, default=None,
                       help="execs allowed to wait for a slot before 503 (default: unbounded)")
    serve.add_argument("--heartbeat-timeout", type=float, default=600.0,
                       help="seconds without a heartbeat before an idle sandbox is deleted")
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    root = args.root or tempfile.mkdtemp(prefix="orchard-env-")
    print(f"orchard env: state and sandboxes in {root}", flush=True)
    run_forever(root, host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV),
                log_level=args.log_level, max_concurrent_execs=args.max_concurrent_execs,
                max_pending_execs=args.max_pending_execs, heartbeat_timeout_s=args.heartbeat_timeout)
    return 0
