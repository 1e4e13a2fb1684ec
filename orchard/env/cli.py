"""`orchard env ...` subcommands: `orchard env serve` runs the embedded sandbox service in the foreground."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import signal
import tempfile
from typing import Any

from orchard.env.embedded import API_KEY_ENV, BACKENDS, SHARED_HELP, parse_shared, run_forever

KUBERNETES = "kubernetes"
KUBERNETES_FACTORY = "orchard.env.backends.kubernetes:from_environment"
"""What `--backend kubernetes` hands the service (the embedded service takes other backends as module:factory)."""


STORE_ENV = "ORCHARD_ENV_REDIS_URL"
"""The default of ``--store`` (the deploy manifests' Redis component sets it on every replica)."""
EMPTY_STORE_SWEEP_ENV = "ORCHARD_ENV_ALLOW_EMPTY_STORE_SWEEP"
"""Set to 1 (or true, yes): ``--allow-empty-store-sweep`` (for a deployment, where the command line is fixed)."""


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `env` (with `serve`) to the top-level `orchard` parser."""
    env = subparsers.add_parser("env", help="the sandbox service", description="The sandbox service.")
    env_sub = env.add_subparsers(dest="env_command", metavar="{serve}")
    # `orchard env` alone is a question, not an error: show what it offers
    env.set_defaults(func=lambda args: _help(env))
    serve = env_sub.add_parser(
        "serve",
        help="run the embedded sandbox service (LocalBackend + SQLite or Redis) on loopback",
        description="Runs the Orchard-Env-compatible sandbox API. Once it listens it prints "
        "SANDBOX_BASE_URL=... and SANDBOX_API_KEY=... lines: export them, and the clients "
        "(SandboxClient, AsyncSandboxClient) find the service.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind")
    serve.add_argument("--port", type=int, default=0, help="port (0: any free port)")
    serve.add_argument("--root", default=None, help="state + sandboxes directory (None: a new temp dir)")
    serve.add_argument("--api-key", default=None,
                       help=f"API key (None: ${API_KEY_ENV}, else a fresh random one)")
    serve.add_argument("--backend", default="local", choices=(*BACKENDS, KUBERNETES),
                       help="local: bubblewrap where it works, a box per sandbox; local-per-command: a "
                       "bubblewrap per command; local-process-group: no bubblewrap (weak isolation); "
                       "kubernetes: a pod per sandbox, configured by ORCHARD_K8S_* variables "
                       "(docs/env-kubernetes.md)")
    serve.add_argument("--allow-weak-isolation", action="store_true",
                       help="without bubblewrap, still create sandboxes with block_network=true (refused "
                       "otherwise): their commands then reach the host's network and files")
    serve.add_argument("--store", default=os.environ.get(STORE_ENV) or "sqlite",
                       help="where the state lives: sqlite (a file in the state directory) or redis://host:port/db, "
                       f"shared by every replica started with the same URL (pip install 'orchard-rl[redis]'); "
                       f"${STORE_ENV} sets the default")
    serve.add_argument("--shared", action="append", default=[], help=SHARED_HELP)
    serve.add_argument("--max-concurrent-execs", type=int, default=64, help="execs running at once")
    serve.add_argument("--max-pending-execs", type=int, default=None,
                       help="execs allowed to wait for a slot before 503 (None: unbounded)")
    serve.add_argument("--heartbeat-timeout", type=float, default=600.0,
                       help="seconds without a heartbeat before an idle sandbox is deleted")
    serve.add_argument("--replica-lease", type=float, default=30.0,
                       help="seconds a replica's lease in a shared store lasts without renewal: once it ends, "
                       "another replica reports its queued and running jobs lost")
    serve.add_argument("--reap-interval", type=float, default=5.0,
                       help="seconds between reaper passes (expired sandboxes; with a shared store, the jobs "
                       "of replicas whose lease ended)")
    serve.add_argument("--allow-empty-store-sweep", action="store_true",
                       default=os.environ.get(EMPTY_STORE_SWEEP_ENV, "").strip().lower() in ("1", "true", "yes"),
                       help="on start, delete the sandboxes the backend holds even when the store holds none "
                       "(without it they are kept and an error logged: an empty store beside live sandboxes is "
                       f"usually a store that lost its data); ${EMPTY_STORE_SWEEP_ENV}=1 sets it")
    serve.add_argument("--max-snapshots", type=int, default=None,
                       help="snapshots that may exist at once; one more is refused with 403 (None: no bound)")
    serve.add_argument("--max-forks", type=int, default=None,
                       help="forked sandboxes that may exist at once; one more is refused with 403 (None: no bound)")
    serve.add_argument("--log-level", default="warning", help="uvicorn's log level")
    serve.set_defaults(func=_serve)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


_BIND_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def _serve(args: argparse.Namespace) -> int:
    temporary = args.root is None
    root = args.root or tempfile.mkdtemp(prefix="orchard-env-")
    print(f"orchard env: state and sandboxes in {root}", flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the handler it found: a default
    # handler would end the process before the temporary root is removed.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        run_forever(root, host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV),
                    backend=KUBERNETES_FACTORY if args.backend == KUBERNETES else args.backend,
                    allow_weak_isolation=args.allow_weak_isolation, log_level=args.log_level,
                    max_concurrent_execs=args.max_concurrent_execs, max_pending_execs=args.max_pending_execs,
                    heartbeat_timeout_s=args.heartbeat_timeout, store=args.store,
                    replica_lease_s=args.replica_lease, reap_interval_s=args.reap_interval,
                    allow_empty_store_sweep=args.allow_empty_store_sweep, shared=parse_shared(args.shared),
                    max_snapshots=args.max_snapshots, max_forks=args.max_forks)
    except OSError as exc:
        if exc.errno not in _BIND_ERRORS:
            raise
        raise OSError(exc.errno, f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from exc
    finally:
        signal.signal(signal.SIGTERM, previous)
        if temporary:  # a root we made is ours to remove; one the user named is theirs
            shutil.rmtree(root, ignore_errors=True)
    return 0
