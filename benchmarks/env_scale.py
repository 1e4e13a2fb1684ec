"""How many sandboxes can the embedded service take at once?

N tasks start together; each creates a sandbox, runs `--commands` commands in it one after another, and
deletes it, through `AsyncSandboxClient` against the embedded service (LocalBackend + SQLite) running as a
child process on loopback. Reported: success rate (a task succeeds when every call returned and every
command exited 0), wall time from the first create to the last delete, and p50/p90/max of create, exec and
delete latencies. Orchard Env reports 1,000 sandboxes in 26 s at 100 % on 8 nodes x 32 vCPU; our target is
1,000 at 100 % in <= 20 s on 2 cores.

`--client http` takes the path other clients take instead: plain httpx against the REST API, no retries, each
task creating, waiting for the sandbox (`GET /sandboxes/{id}/wait`), running its commands with `wait: true` and
deleting; `--mix mixed` runs the commands a user would (`python3 --version`, `ls /`, `cat /etc/os-release`,
`echo i`) instead of echoes (a task then succeeds when every command exited 0 and the echo came back).

    python benchmarks/env_scale.py                         # N = 1000, 4 commands each
    python benchmarks/env_scale.py --client http --mix mixed              # a plain HTTP client, mixed commands
    python benchmarks/env_scale.py --n 200 --max-concurrent-execs 32
    python benchmarks/env_scale.py --n 200 --backend local-per-command   # a bubblewrap per command instead
    python benchmarks/env_scale.py --root-parent /dev/shm                 # sandboxes on a tmpfs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine, percentiles


def process_cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children's) user + system CPU seconds of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def machine_busy() -> float:
    """CPU seconds all CPUs of the machine have been busy since boot (every process and the kernel's own
    threads: /proc/stat less idle and iowait). Namespace set-up and tear-down partly runs in kernel threads
    and is seen by no process's times; this counts it (and anything else running on the machine)."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def box_cpu(url: str, key: str) -> dict[str, float]:
    """CPU seconds the service's closed boxes reported, their own and their commands' (all of which is also
    in the service's reaped children's times: it reaps each sandbox's init, which reaped the box, which
    reaped its commands); empty without boxes (a bubblewrap per command)."""
    import httpx

    health = httpx.get(f"{url}/resources", headers={"X-API-Key": key}, timeout=30).json()["backend_health"]
    return health.get("box_cpu_s") or {}


async def one_task(client, i: int, commands: int, mix: str, lat: dict[str, list[float]]) -> bool:
    start = time.perf_counter()
    sb = await client.create()
    lat["create"].append(time.perf_counter() - start)
    ok = True
    try:
        for k in range(commands):
            start = time.perf_counter()
            command, expected = command_of(mix, i, k)
            result = await sb.exec(command)
            lat["exec"].append(time.perf_counter() - start)
            ok &= result.ok and (expected is None or result.stdout == expected)
    finally:
        start = time.perf_counter()
        await sb.delete()
        lat["delete"].append(time.perf_counter() - start)
    return ok


MIXED = ("python3 --version", "ls /", "cat /etc/os-release")


def command_of(mix: str, i: int, k: int) -> tuple[str, str | None]:
    """Task ``i``'s ``k``-th command and the stdout it must give (None: any, the exit status alone decides)."""
    if mix == "echo" or k % (len(MIXED) + 1) == len(MIXED):
        return f"echo task{i}-cmd{k}", f"task{i}-cmd{k}\n"
    return MIXED[k % (len(MIXED) + 1)], None


async def one_http_task(http, i: int, commands: int, mix: str, lat: dict[str, list[float]]) -> bool:
    """One task through the REST API as any HTTP client would call it: create, wait, exec (waiting), delete."""
    start = time.perf_counter()
    created = await http.post("/sandboxes", json={})
    created.raise_for_status()
    sandbox_id = created.json()["sandbox_id"]
    ok = True
    try:
        ready = await http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 600})
        ready.raise_for_status()
        lat["create"].append(time.perf_counter() - start)
        ok &= ready.json()["status"] == "ready"
        for k in range(commands):
            command, expected = command_of(mix, i, k)
            start = time.perf_counter()
            job = await http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": command, "wait": True,
                                                                         "timeout_seconds": 300})
            job.raise_for_status()
            lat["exec"].append(time.perf_counter() - start)
            body = job.json()
            ok &= body["exit_code"] == 0 and (expected is None or body["stdout"] == expected)
    finally:
        start = time.perf_counter()
        (await http.delete(f"/sandboxes/{sandbox_id}")).raise_for_status()
        lat["delete"].append(time.perf_counter() - start)
    return ok


async def run_http(url: str, key: str, n: int, commands: int, mix: str, pool: int, at_once: int | None = None,
                   ) -> tuple[int, float, dict[str, list[float]], list[str]]:
    import httpx

    lat: dict[str, list[float]] = {"create": [], "exec": [], "delete": []}
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    gate = asyncio.Semaphore(at_once or n)

    async def task(http, i: int) -> bool:
        async with gate:
            return await one_http_task(http, i, commands, mix, lat)

    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}, timeout=900, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(task(http, i) for i in range(n)), return_exceptions=True)
        wall = time.perf_counter() - start
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return sum(r is True for r in results), wall, lat, errors


async def run(url: str, key: str, n: int, commands: int, mix: str = "echo") -> tuple[int, float, dict[str, list[float]], list[str]]:
    from orchard.env import AsyncSandboxClient
    from orchard.env.client import RetryPolicy

    lat: dict[str, list[float]] = {"create": [], "exec": [], "delete": []}
    async with AsyncSandboxClient(url, key, timeout=600, max_connections=n,
                                  retry=RetryPolicy(max_attempts=8, backoff_base_s=0.5)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_task(client, i, commands, mix, lat) for i in range(n)),
                                       return_exceptions=True)
        wall = time.perf_counter() - start
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return sum(r is True for r in results), wall, lat, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000, help="concurrent sandboxes")
    parser.add_argument("--commands", type=int, default=4, help="commands per sandbox")
    parser.add_argument("--max-concurrent-execs", type=int, default=64)
    parser.add_argument("--backend", default="local", choices=["local", "local-per-command"],
                        help="local: a box per sandbox runs its commands; local-per-command: a bubblewrap each")
    parser.add_argument("--root-parent", default=None,
                        help="where the service's state and sandboxes live (default: the temp dir); a tmpfs such "
                             "as /dev/shm takes the file-system cost of create and delete out of the measurement")
    parser.add_argument("--client", default="orchard", choices=["orchard", "http"],
                        help="orchard: AsyncSandboxClient (retries); http: plain httpx against the REST API")
    parser.add_argument("--mix", default="echo", choices=["echo", "mixed"],
                        help="echo: `echo` commands; mixed: python3 --version, ls /, cat /etc/os-release, echo")
    parser.add_argument("--pool", type=int, default=None,
                        help="the http client's connection pool (default: one connection per sandbox)")
    parser.add_argument("--at-once", type=int, default=None,
                        help="the http client's tasks in flight at once (default: all N); httpx's connection pool "
                             "costs client CPU that grows with the requests it holds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.n < 1 or args.commands < 0:
        raise SystemExit(f"--n must be >= 1 and --commands >= 0, got {args.n}, {args.commands}")
    for name, value in (("--pool", args.pool), ("--at-once", args.at_once)):
        if value is not None and (args.client != "http" or value < 1):
            raise SystemExit(f"{name} must be >= 1 and goes with --client http, got {value}")

    from orchard.env.embedded import serve

    root = tempfile.mkdtemp(prefix="orchard-env-scale-", dir=args.root_parent)
    os.chmod(root, 0o711)
    try:
        with serve(root, in_process=False, backend=args.backend,
                   max_concurrent_execs=args.max_concurrent_execs) as svc:
            service_before = process_cpu(svc.process.pid)
            client_before = resource.getrusage(resource.RUSAGE_SELF)
            busy_before = machine_busy()
            if args.client == "http":
                ok, wall, lat, errors = asyncio.run(run_http(svc.url, svc.api_key, args.n, args.commands, args.mix,
                                                             args.pool or args.n, args.at_once))
            else:
                ok, wall, lat, errors = asyncio.run(run(svc.url, svc.api_key, args.n, args.commands, args.mix))
            busy = machine_busy() - busy_before
            client_after = resource.getrusage(resource.RUSAGE_SELF)
            service_after = process_cpu(svc.process.pid)
            boxes = box_cpu(svc.url, svc.api_key)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    info = machine()
    print(f"# env_scale: {args.n} sandboxes at once, {args.commands} {args.mix} commands each, client "
          f"{args.client}"
          f"{f' (pool {args.pool or args.n}, {args.at_once or args.n} at once)' if args.client == 'http' else ''}, "
          f"max_concurrent_execs {args.max_concurrent_execs}, backend {args.backend}, "
          f"root on {args.root_parent or tempfile.gettempdir()}")
    print(f"# machine: {info['machine']}; python {info['python']}; commit {info['commit']}")
    print(f"success {ok}/{args.n} ({100.0 * ok / args.n:.1f} %), wall {wall:.2f} s, "
          f"{args.n * args.commands / wall:.1f} execs/s")
    print(f"{'op':<7} {'count':>6} {'p50 s':>8} {'p90 s':>8} {'max s':>8}")
    rows = {}
    for op, samples in lat.items():
        if samples:
            rows[op] = percentiles(samples)
            print(f"{op:<7} {len(samples):6d} {rows[op]['p50']:8.3f} {rows[op]['p90']:8.3f} {max(samples):8.3f}")
    client_cpu = (client_after.ru_utime + client_after.ru_stime) - (client_before.ru_utime + client_before.ru_stime)
    reaped = service_after[1] - service_before[1]
    inside = boxes.get("boxes", 0.0) + boxes.get("commands", 0.0)
    box_part = (f"boxes {boxes.get('boxes', 0.0):.1f} and their commands {boxes.get('commands', 0.0):.1f} "
                f"({boxes.get('boxes_closed', 0)} boxes reported)")  # fmt: skip
    if not boxes:
        sandboxes = "bubblewrap and the commands"
    elif reaped >= inside:  # the service reaped the sandboxes' inits, and with them the boxes' times
        sandboxes = f"bubblewrap {reaped - inside:.1f}, {box_part}"
    else:  # a service that is no subreaper: the inits (and the boxes' times) went to the host's pid 1
        sandboxes = f"bubblewrap's outer processes; {box_part}"
    print(f"cpu seconds: client {client_cpu:.1f}, service process {service_after[0] - service_before[0]:.1f}, "
          f"its reaped children {reaped:.1f} ({sandboxes})")
    cores = os.cpu_count() or 1
    print(f"machine busy {busy:.1f} CPU-seconds during the run ({100 * busy / (cores * wall):.0f} % of "
          f"{cores} CPUs; every process and kernel thread, other work on the machine included)")
    met = ok == args.n and wall <= 20.0
    print(f"target (1,000 at 100 % in <= 20 s on 2 cores): {'met' if met and args.n >= 1000 else 'not met'}; "
          "Orchard Env: 1,000 in 26 s at 100 % on 8 x 32 vCPU")
    for error in errors[:5]:
        print("error:", error)
    if args.json:
        Path(args.json).write_text(json.dumps({"n": args.n, "ok": ok, "wall_s": wall, "backend": args.backend,
                                               "client": args.client, "mix": args.mix,
                                               "box_cpu_s": boxes, "machine_busy_s": busy, **info, **rows},
                                              indent=2))


if __name__ == "__main__":
    sys.exit(main())
