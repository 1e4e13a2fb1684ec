"""What does the Kubernetes backend cost the sandbox service, and does a replica's death lose anything?

The cluster is EMULATED: an in-process API server (kmock-style: pods, secrets, networkpolicies over real HTTP,
the official client talking to it) and a simulated kubelet that runs each pod's init container and exec agent as
local processes on their own loopback address (tests/env/k8s). The numbers measure our service's overhead
(the client, the API calls, the watch, the agent over HTTP), not a real cluster's scheduling or image pulls.

1. Throughput and latency, the Kubernetes backend against the local backend in the same run, each service a
   child process (`orchard env serve`'s code) with SQLite: `--n` sandboxes created at once (sandboxes/s), then
   `--execs` commands in each (`true`; p50/p99 of each exec's latency through the service), then deletes.
2. The replica kill: two `orchard env serve --backend kubernetes --store redis://...` processes behind one
   round-robin TCP front, `--kill-sandboxes` sandboxes x 4 execs, replica A SIGKILLed after a quarter of the
   execs are answered: every exec must be answered once or reported lost, none run twice, no sandbox lost.

    python benchmarks/env_k8s.py                                  # --n 50 --execs 4, kill run 200 x 4
    python benchmarks/env_k8s.py --n 20 --kill-sandboxes 20       # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests/env/k8s"), str(HERE.parent / "tests/env")]
from env_latency import machine  # noqa: E402

NAMESPACE = "orchard-bench"


def quantile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


async def load(url: str, key: str, n: int, execs: int) -> dict[str, float]:
    from orchard.env import AsyncSandboxClient

    async with AsyncSandboxClient(url, key, auto_cleanup=False) as client:
        start = time.perf_counter()
        boxes = await asyncio.gather(*(client.create() for _ in range(n)))
        create_s = time.perf_counter() - start
        latencies: list[float] = []

        async def run(sandbox) -> None:
            for _ in range(execs):
                t = time.perf_counter()
                assert (await sandbox.exec("true")).ok
                latencies.append(time.perf_counter() - t)

        await asyncio.gather(*(run(b) for b in boxes))
        await asyncio.gather(*(b.delete() for b in boxes))
    return {"creates_per_s": n / create_s, "exec_p50_ms": 1e3 * quantile(latencies, 0.5),
            "exec_p99_ms": 1e3 * quantile(latencies, 0.99)}


def service_run(backend: str, api_url: str, n: int, execs: int) -> dict[str, float]:
    from orchard.env.backends.kubernetes import API_URL_ENV
    from orchard.env.embedded import serve

    env = {API_URL_ENV: api_url, "ORCHARD_K8S_NAMESPACE": NAMESPACE, "ORCHARD_K8S_WATCH_TIMEOUT": "5"}
    with mock.patch.dict(os.environ, env), serve(backend=backend, in_process=False,
                                                  allow_weak_isolation=True) as svc:
        return asyncio.run(load(svc.url, svc.api_key, n, execs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50, help="sandboxes created at once (at most 250: one "
                        "loopback address each)")
    parser.add_argument("--execs", type=int, default=4, help="commands per sandbox")
    parser.add_argument("--kill-sandboxes", type=int, default=200, help="sandboxes of the replica kill run")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if not 1 <= args.n <= 250 or not 1 <= args.kill_sandboxes <= 250:
        parser.error("--n and --kill-sandboxes must be in 1..250")

    from _redis import start_redis_server
    from k8s_emulator import ApiEmulator
    from k8s_kubelet import SimulatedKubelet
    from k8s_replicas import replica_kill_run, two_replicas

    results: dict[str, object] = {"machine": machine(), "cluster": "emulated (kmock-style API + simulated kubelet)"}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="orchard-bench-k8s-")))
        api = stack.enter_context(ApiEmulator())
        kubelet = SimulatedKubelet(api, tmp / "kubelet")
        stack.callback(kubelet.stop)
        rows = {name: service_run(backend, api.url, args.n, args.execs) for name, backend in
                (("local", "local"), ("kubernetes", "orchard.env.backends.kubernetes:from_environment"))}
        results["service"] = rows
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

    print(f"# env_k8s — {results['machine']}")
    print("# the cluster is EMULATED (kmock-style API server + simulated kubelet, pods as local processes): these")
    print("# numbers are our service's overhead on the Kubernetes backend, not a real cluster's")
    print(f"\n{args.n} sandboxes created at once, {args.execs} x `true` in each, one service process, SQLite")
    print("| backend | creates/s | exec p50 ms | exec p99 ms |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['creates_per_s']:.1f} | {row['exec_p50_ms']:.1f} | {row['exec_p99_ms']:.1f} |")
    k, loc = rows["kubernetes"], rows["local"]
    print(f"| kubernetes / local | {k['creates_per_s'] / loc['creates_per_s']:.2f}x | "
          f"{k['exec_p50_ms'] / loc['exec_p50_ms']:.2f}x | {k['exec_p99_ms'] / loc['exec_p99_ms']:.2f}x |")
    kill = results["kill"]
    print(f"\nreplica kill: 2 replicas (Redis store) behind one round-robin front, {kill['sandboxes']} sandboxes x 4 "
          f"execs, replica A SIGKILLed after {kill['killed_after']} answers")
    print("| execs | ok | reported lost | errors | ran twice / lost sandboxes / objects left | run by A, B | "
          "exec phase s |\n|---|---|---|---|---|---|---|")
    print(f"| {kill['execs']} | {kill.get('ok', 0)} | {kill.get('lost', 0)} | {kill.get('error', 0)} | "
          f"{kill['ran_twice']} / {kill['sandboxes_lost']} / {kill['objects_left']} | {kill['ran_by'].get('a', 0)}, "
          f"{kill['ran_by'].get('b', 0)} | {kill['wall_s']:.1f} |")
    if kill["problems"]:
        print("problems:", *kill["problems"], sep="\n  ")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
