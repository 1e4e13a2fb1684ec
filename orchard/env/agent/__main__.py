"""`python -m orchard.env.agent --root DIR [--port N | --uds PATH]`: serve one workspace over HTTP.

Meant for a sandbox that is a pod or machine of its own (the Kubernetes backend runs its standard-library twin,
`orchard.env.backends.kubernetes.pod_agent`, instead: same routes and answers, except that only the pod agent
answers a repeated `request_id` with its first answer, since only the Kubernetes backend retries). There the pod
is the isolation boundary, so `--isolation process-group` is the usual choice; on a machine with bubblewrap, `auto`
isolates each command as the local backend does. The bearer token is read from an
environment variable (never from the command line, where other users could read it in /proc).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from orchard._extras import requires_extra
from orchard.env.agent.core import SandboxAgent
from orchard.env.agent.files import Workspace
from orchard.env.agent.isolation import BUBBLEWRAP, PROCESS_GROUP, Isolation, Limits, probe_bubblewrap
from orchard.env.agent.server import create_agent_app

logger = logging.getLogger("orchard.env.agent")


def build_agent(args: argparse.Namespace) -> SandboxAgent:
    """The agent the command line describes (creating and chowning the workspace root if needed)."""
    root = os.path.abspath(args.root)
    os.makedirs(root, exist_ok=True)
    run_as: tuple[int, int] | None = None
    if os.geteuid() == 0:
        run_as = (args.uid, args.gid if args.gid is not None else args.uid)
        os.chown(root, *run_as)
    mode = args.isolation
    if mode == "auto":
        problem = probe_bubblewrap(run_as)
        mode = BUBBLEWRAP if problem is None else PROCESS_GROUP
        if problem is not None:
            logger.warning("COMMANDS ARE NOT ISOLATED (%s); using process groups", problem)
    workspace = Workspace(
        root,
        mount=args.mount if mode == BUBBLEWRAP else root,
        uid=run_as[0] if run_as else None,
        gid=run_as[1] if run_as else None,
    )
    limits = Limits(pids=args.pids, memory_mb=args.memory_mb, cpu=args.cpu)
    iso = Isolation(workspace, mode=mode, network=args.network, limits=limits, run_as=run_as)
    return SandboxAgent(iso)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchard.env.agent", description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="the workspace directory on this machine")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=8765, help="TCP port (default 8765)")
    where.add_argument("--uds", help="serve on this Unix socket instead of TCP")
    p.add_argument("--host", default="127.0.0.1", help="TCP address to bind (default loopback)")
    p.add_argument("--isolation", choices=["auto", BUBBLEWRAP, PROCESS_GROUP], default="auto")
    p.add_argument("--mount", default="/workspace", help="where commands see the workspace (bubblewrap)")
    p.add_argument("--network", action="store_true", help="let commands use the network (bubblewrap)")
    p.add_argument("--uid", type=int, default=65534, help="uid commands run as when started as root")
    p.add_argument("--gid", type=int, default=None, help="gid commands run as (default: the uid)")
    p.add_argument("--pids", type=int, default=256)
    p.add_argument("--memory-mb", type=int, default=4096)
    p.add_argument("--cpu", type=float, default=None)
    p.add_argument("--token-env", default="ORCHARD_AGENT_TOKEN", help="env variable holding the bearer token")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    with requires_extra("env"):
        import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    agent = build_agent(args)
    app = create_agent_app(agent, token=os.environ.get(args.token_env) or None)
    where = f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}"
    print(f"orchard exec agent on {where} (isolation: {agent.isolation.mode})", flush=True)
    if args.uds:
        uvicorn.run(app, uds=args.uds, log_level="warning")
    else:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
