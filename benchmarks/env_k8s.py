"""What does the Kubernetes backend cost the sandbox service, where does a sandbox's time go, and does a replica's
death lose anything?

The cluster is EMULATED: an in-process API server (kmock-style: pods, secrets, networkpolicies over real HTTP,
the official client talking to it) and a simulated kubelet that runs each pod's init container and exec agent as
local processes on their own loopback address (tests/env/k8s). The numbers measure our service's overhead
(the client, the API calls, the watch, the agent over HTTP), not a real cluster's scheduling or image pulls.

1. Sandboxes through a service, the Kubernetes backend against the local backend in the same run, each service a
   child process (`orchard env serve`'s code) with SQLite: `--total` sandboxes, each created, given `--execs`
   commands (`true`) and deleted, `--concurrency` of them in flight (a slot starts its next sandbox when one is
   deleted, so pods and their loopback addresses are recycled). Reported: how many went through whole, the
   latencies, and the service process's own CPU (user + system, from /proc/<pid>/stat, its children excluded)
   per API request (creates + execs + deletes).
2. Where the time goes on the Kubernetes backend. A create: the emulated API server stamps when the sandbox's
   Secret, NetworkPolicy and Pod arrive and when the kubelet reports the pod Running and Ready; the client stamps
   the request and the answer. An exec: the job's own timestamps (queued, started, completed, in the service)
   and the agent's `duration_s` of the command itself, against the client's latency. Medians over all sandboxes.
3. The replica kill: two `orchard env serve --backend kubernetes --store redis://...` processes behind one
   round-robin TCP front, `--kill-sandboxes` sandboxes x 4 execs, replica A SIGKILLed after a quarter of the
   execs are answered: every exec must be answered once or reported lost, none run twice, no sandbox lost.

    python benchmarks/env_k8s.py                       # 1,000 sandboxes (150 in flight), kill run 200 x 4
    python benchmarks/env_k8s.py --total 40 --concurrency 10 --kill-sandboxes 10      # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests/env/k8s"), str(HERE.parent / "tests/env")]
from env_latency import machine  # noqa: E402

NAMESPACE = "orchard-bench"
MAX_IN_FLIGHT = 250
"""The simulated kubelet's pod addresses: one /24 (.2 to .254), less a margin for pods being deleted."""


def quantile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))] if ordered else float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` itself (all its threads; not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


class ApiStamps:
    """When the emulated API server saw each sandbox object arrive, and each pod turn Running and Ready."""

    def __init__(self, api: Any) -> None:
        self.at: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        api.on_event.append(self._on_event)
        update_status = api.update_status

        def stamped(namespace: str, name: str, status: dict[str, Any]) -> bool:
            if status.get("phase") == "Running":
                ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                            for c in status.get("conditions", []))
                self._stamp(name, "ready" if ready else "running")
            return update_status(namespace, name, status)

        api.update_status = stamped  # the kubelet calls it through the instance

    def _on_event(self, kind: str, resource: str, obj: dict[str, Any]) -> None:
        if kind == "ADDED":
            self._stamp(obj["metadata"]["name"], resource)

    def _stamp(self, name: str, what: str) -> None:
        with self._lock:
            self.at.setdefault((name, what), time.perf_counter())


async def lifecycles(url: str, key: str, total: int, concurrency: int, execs: int, prefix: str) -> dict[str, Any]:
    """`total` sandboxes, each created, given `execs` x `true` and deleted, `concurrency` at once."""
    from orchard.env import AsyncSandboxClient

    created: dict[str, tuple[float, float]] = {}
    exec_rows: list[dict[str, float]] = []
    deletes: list[float] = []
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}  # kind -> one whole message of it (with its cause chain: errno, sandbox)
    succeeded = 0
    ids = iter(f"{prefix}-{i:05d}" for i in range(total))

    # a create waits for its pod: on a loaded machine longer than the client's default 60 s, after which the
    # client would give up on a create the service still finishes (the first full run lost 355 of 1,000 so)
    async with AsyncSandboxClient(url, key, auto_cleanup=False, timeout=600) as client:

        async def one(sandbox_id: str) -> None:
            nonlocal succeeded
            sandbox = None
            try:
                start = time.perf_counter()
                sandbox = await client.create(sandbox_id=sandbox_id)
                created[sandbox_id] = (start, time.perf_counter())
                for _ in range(execs):
                    t = time.perf_counter()
                    job = await sandbox.exec("true")
                    latency = time.perf_counter() - t
                    if not job.ok:
                        raise RuntimeError(f"exec {job.status}: {job.error}")
                    exec_rows.append({"latency": latency, "queued": job.started_at - job.created_at,
                                      "run": job.completed_at - job.started_at, "command": job.duration_s})
                t = time.perf_counter()
                await sandbox.delete()
                deletes.append(time.perf_counter() - t)
                succeeded += 1
            except Exception as exc:
                # one line per kind of failure: the sandbox's id and its pod's address would make each unique
                kind = re.sub(r"\b\d+(\.\d+){3}\b", "<ip>", str(exc).replace(sandbox_id, "<id>"))
                errors[f"{type(exc).__name__}: {kind[:160]}"] += 1
                examples.setdefault(f"{type(exc).__name__}: {kind[:160]}", str(exc))
                if sandbox is not None:
                    with contextlib.suppress(Exception):
                        await sandbox.delete()

        async def slot() -> None:
            for sandbox_id in ids:  # one shared iterator: each slot takes the next id when it is free
                await one(sandbox_id)

        start = time.perf_counter()
        await asyncio.gather(*(slot() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        left = [s["sandbox_id"] for s in await client.list_sandboxes()]  # creates the client gave up on
        for sandbox_id in left:
            with contextlib.suppress(Exception):
                await (await client.sandbox(sandbox_id)).delete()
    creates = [done - began for began, done in created.values()]
    return {"total": total, "succeeded": succeeded, "errors": dict(errors.most_common(5)),
            "error_examples": [examples[kind] for kind, _ in errors.most_common(5)], "wall_s": wall,
            "left_after": len(left),
            "create_p50_ms": 1e3 * quantile(creates, 0.5), "create_p99_ms": 1e3 * quantile(creates, 0.99),
            "exec_p50_ms": 1e3 * quantile([r["latency"] for r in exec_rows], 0.5),
            "exec_p99_ms": 1e3 * quantile([r["latency"] for r in exec_rows], 0.99),
            "delete_p50_ms": 1e3 * quantile(deletes, 0.5), "created": created, "execs": exec_rows}


def service_run(backend: str, api_url: str, args: argparse.Namespace) -> dict[str, Any]:
    from orchard.env.backends.kubernetes import API_URL_ENV
    from orchard.env.embedded import serve

    env = {API_URL_ENV: api_url, "ORCHARD_K8S_NAMESPACE": NAMESPACE, "ORCHARD_K8S_WATCH_TIMEOUT": "5",
           "ORCHARD_K8S_READY_TIMEOUT": "300"}
    with mock.patch.dict(os.environ, env), serve(backend=backend, in_process=False, allow_weak_isolation=True, startup_timeout_s=300,
                                                  max_concurrent_execs=args.concurrency) as svc:
        assert svc.process is not None
        # one sandbox first: the backend's start (the watch, the sweep) is not per-request work
        asyncio.run(lifecycles(svc.url, svc.api_key, 1, 1, 1, "warm"))
        cpu_before = cpu_seconds(svc.process.pid)
        row = asyncio.run(lifecycles(svc.url, svc.api_key, args.total, args.concurrency, args.execs, "bench"))
        cpu = cpu_seconds(svc.process.pid) - cpu_before
    requests = args.total * (args.execs + 2)  # attempted: a create, the execs and a delete per sandbox
    return {**row, "cpu_s": cpu, "requests": requests, "cpu_ms_per_request": 1e3 * cpu / requests}


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def create_breakdown(stamps: ApiStamps, created: dict[str, tuple[float, float]]) -> list[tuple[str, float]]:
    """Medians (ms) of the phases of a create, between the stamps of the client and of the API server."""
    from orchard.env.backends.kubernetes.manifests import object_name

    phases: dict[str, list[float]] = {name: [] for name, *_ in CREATE_PHASES}
    for sandbox_id, (began, answered) in created.items():
        name = object_name(sandbox_id)
        at = {what: stamps.at.get((name, what)) for what in ("secrets", "networkpolicies", "pods", "running",
                                                              "ready")}
        at["request"], at["answer"] = began, answered
        if any(v is None for v in at.values()):
            continue
        for phase, start, end in CREATE_PHASES:
            phases[phase].append(at[end] - at[start])
    return [(phase, median_ms(values)) for phase, values in phases.items()]


CREATE_PHASES = [
    ("client -> service -> the Secret's POST arrives", "request", "secrets"),
    ("Secret -> NetworkPolicy -> Pod POSTs", "secrets", "pods"),
    ("kubelet: pod -> init container done, agent started (Running)", "pods", "running"),
    ("agent start -> readiness probe answered (Ready)", "running", "ready"),
    ("Ready -> the watch tells the service -> the client's answer", "ready", "answer"),
    ("whole create, as the client sees it", "request", "answer"),
]


def exec_breakdown(rows: list[dict[str, float]]) -> list[tuple[str, float]]:
    pick = {
        "the command itself (the agent's duration_s)": lambda r: r["command"],
        "service -> agent -> service, less the command": lambda r: r["run"] - r["command"],
        "queued in the service (lock, slot)": lambda r: r["queued"],
        "client <-> service (HTTP, request parsing, store writes)": lambda r: r["latency"] - r["run"] - r["queued"],
        "whole exec, as the client sees it": lambda r: r["latency"],
    }
    return [(phase, median_ms([f(r) for r in rows if r["command"] is not None])) for phase, f in pick.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", type=int, default=1000, help="sandboxes per backend: create, execs, delete")
    parser.add_argument("--concurrency", type=int, default=150,
                        help=f"sandboxes in flight at once (at most {MAX_IN_FLIGHT}: a loopback address each)")
    parser.add_argument("--execs", type=int, default=4, help="commands per sandbox")
    parser.add_argument("--kill-sandboxes", type=int, default=200, help="sandboxes of the replica kill run (0: "
                        "skip it)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.total < 1 or args.execs < 0:
        parser.error("--total must be >= 1 and --execs >= 0")
    if not 1 <= args.concurrency <= MAX_IN_FLIGHT or not 0 <= args.kill_sandboxes <= MAX_IN_FLIGHT:
        parser.error(f"--concurrency must be in 1..{MAX_IN_FLIGHT} and --kill-sandboxes in 0..{MAX_IN_FLIGHT}")

    from _redis import start_redis_server
    from k8s_emulator import ApiEmulator
    from k8s_kubelet import SimulatedKubelet
    from k8s_replicas import replica_kill_run, two_replicas

    results: dict[str, Any] = {"machine": machine(), "cluster": "emulated (kmock-style API + simulated kubelet)",
                               "args": vars(args)}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="orchard-bench-k8s-")))
        api = stack.enter_context(ApiEmulator())
        stamps = ApiStamps(api)
        kubelet = SimulatedKubelet(api, tmp / "kubelet")
        stack.callback(kubelet.stop)
        rows = {name: service_run(backend, api.url, args) for name, backend in
                (("local", "local"), ("kubernetes", "orchard.env.backends.kubernetes:from_environment"))}
        results["leftovers_after_service_runs"] = {r: len(api.list(r, NAMESPACE))
                                                   for r in ("pods", "secrets", "networkpolicies")}
        results["create_breakdown_ms"] = create_breakdown(stamps, rows["kubernetes"]["created"])
        results["exec_breakdown_ms"] = {name: exec_breakdown(row["execs"]) for name, row in rows.items()}
        results["service"] = {name: {k: v for k, v in row.items() if k not in ("created", "execs")}
                              for name, row in rows.items()}
        if args.kill_sandboxes:
            redis_url = stack.enter_context(start_redis_server())
            with two_replicas(api.url, NAMESPACE, redis_url, "bench-key", tmp / "replicas") as (a, b, front):
                report = asyncio.run(replica_kill_run(a, b, front, "bench-key", redis_url,
                                                      sandboxes=args.kill_sandboxes, execs=4))
            leftovers = {r: [o["metadata"]["name"] for o in api.list(r, NAMESPACE)]
                         for r in ("pods", "secrets", "networkpolicies")}
            results["kill"] = {"sandboxes": args.kill_sandboxes, "execs": args.kill_sandboxes * 4,
                               **report.counts(), "killed_after": report.answered_before_kill,
                               "ran_by": dict(report.ran_by), "problems": report.problems()[:10],
                               "ran_twice": sum(n > 1 for n in report.runs.values()),
                               "sandboxes_lost": len(set(report.sandboxes) - set(report.listed_after)),
                               "objects_left": sum(map(len, leftovers.values())), "wall_s": report.wall_s}
    report_results(results, args)


def report_results(results: dict[str, Any], args: argparse.Namespace) -> None:
    rows = results["service"]
    print(f"# env_k8s — {results['machine']}")
    print("# the cluster is EMULATED (kmock-style API server + simulated kubelet, pods as local processes): these")
    print("# numbers are our service's overhead on the Kubernetes backend, not a real cluster's")
    print(f"\n{args.total} sandboxes per backend (create -> {args.execs} x `true` -> delete), {args.concurrency} in "
          "flight, one service process, SQLite; CPU = the service process's user + system per API request")
    print("| backend | went through | sandboxes/s | create p50 / p99 ms | exec p50 / p99 ms | delete p50 ms | "
          "service CPU s | CPU ms / request |\n|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['succeeded']} / {row['total']} | {row['total'] / row['wall_s']:.2f} | "
              f"{row['create_p50_ms']:.0f} / {row['create_p99_ms']:.0f} | {row['exec_p50_ms']:.1f} / "
              f"{row['exec_p99_ms']:.1f} | {row['delete_p50_ms']:.0f} | {row['cpu_s']:.1f} | "
              f"{row['cpu_ms_per_request']:.2f} |")
    k, loc = rows["kubernetes"], rows["local"]
    print(f"| kubernetes / local | | {(k['total'] / k['wall_s']) / (loc['total'] / loc['wall_s']):.2f}x | "
          f"{k['create_p50_ms'] / loc['create_p50_ms']:.2f}x | {k['exec_p50_ms'] / loc['exec_p50_ms']:.2f}x | "
          f"{k['delete_p50_ms'] / loc['delete_p50_ms']:.2f}x | | "
          f"{k['cpu_ms_per_request'] / loc['cpu_ms_per_request']:.2f}x |")
    for name, row in rows.items():
        if row["errors"]:
            print(f"{name} errors:", *(f"{n} x {e}" for e, n in row["errors"].items()), sep="\n  ")
            print(f"{name}: one whole message of each kind (with its cause chain):",
                  *row["error_examples"], sep="\n  ")
    print("sandboxes still listed after each run, then deleted:", {n: r["left_after"] for n, r in rows.items()},
          "; objects left in the emulated cluster after both:", results["leftovers_after_service_runs"])
    print("\nwhere a create's time goes, Kubernetes backend (medians, ms)\n| phase | ms |\n|---|---|")
    for phase, ms in results["create_breakdown_ms"]:
        print(f"| {phase} | {ms:.1f} |")
    print("\nwhere an exec's time goes (medians, ms; the parts' medians need not add up to the whole's)")
    print("| phase | local | kubernetes |\n|---|---|---|")
    by_backend = results["exec_breakdown_ms"]
    for (phase, ms_local), (_, ms_k8s) in zip(by_backend["local"], by_backend["kubernetes"], strict=True):
        print(f"| {phase} | {ms_local:.2f} | {ms_k8s:.2f} |")
    if "kill" in results:
        kill = results["kill"]
        print(f"\nreplica kill: 2 replicas (Redis store) behind one round-robin front, {kill['sandboxes']} sandboxes "
              f"x 4 execs, replica A SIGKILLed after {kill['killed_after']} answers")
        print("| execs | ok | reported lost | errors | ran twice / lost sandboxes / objects left | run by A, B | "
              "exec phase s |\n|---|---|---|---|---|---|---|")
        print(f"| {kill['execs']} | {kill.get('ok', 0)} | {kill.get('lost', 0)} | {kill.get('error', 0)} | "
              f"{kill['ran_twice']} / {kill['sandboxes_lost']} / {kill['objects_left']} | "
              f"{kill['ran_by'].get('a', 0)}, {kill['ran_by'].get('b', 0)} | {kill['wall_s']:.1f} |")
        if kill["problems"]:
            print("problems:", *kill["problems"], sep="\n  ")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
