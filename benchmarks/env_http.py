"""What does one HTTP request cost the sandbox service and its async client, in CPU?

The workload of `env_scale.py` (N tasks at once, each creates a sandbox, runs `--commands` `echo` commands
with `wait: true`, deletes it) through `AsyncSandboxClient`, against the embedded service running as a child
process, but with `MemoryBackend` below: sandboxes are dict entries and `echo` is answered in the service's
own process without running anything. What is left is the HTTP path: uvicorn, the FastAPI app, the
orchestrator, SQLite, and the client. Reported: requests per second and CPU milliseconds per request of the
service process and of the client process (user + system), as the ratio to a floor measured in the same run:
the same number of requests from a bare asyncio-streams client to a bare asyncio-streams HTTP/1.1 responder
that answers each request with a fixed JSON body (what the Python event loop costs per request at least).

    python benchmarks/env_http.py                  # N = 300, 4 commands each (1,800 requests)
    python benchmarks/env_http.py --n 1000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine

from orchard.env.backends.base import ExecRequest, ExecResult, Resources, SandboxNotFoundError, SandboxSpec


class MemoryBackend:
    """Sandboxes as dict entries; a command `echo WORDS` answers WORDS and a newline, anything else exits 127."""

    name = "memory"
    isolation = "none"

    def __init__(self, root: Path | None = None) -> None:
        self.sandboxes: set[str] = set()

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> None:
        self.sandboxes.add(sandbox_id)

    async def delete(self, sandbox_id: str) -> None:
        self.sandboxes.discard(sandbox_id)

    async def exists(self, sandbox_id: str) -> bool:
        return sandbox_id in self.sandboxes

    async def list_ids(self) -> list[str]:
        return sorted(self.sandboxes)

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        if sandbox_id not in self.sandboxes:
            raise SandboxNotFoundError(sandbox_id)
        command = request.command
        words = shlex.split(command[-1] if isinstance(command, list) and command[:2] == ["bash", "-c"]
                            else command if isinstance(command, str) else shlex.join(command))
        if words[:1] == ["echo"]:
            return ExecResult(exit_code=0, stdout=(" ".join(words[1:]) + "\n").encode(), stderr=b"")
        return ExecResult(exit_code=127, stdout=b"", stderr=b"command not found\n")

    async def resources(self, sandbox_id: str) -> Resources:
        return Resources(cpu=None, memory_mb=None, pids=None, disk_bytes=0)

    async def close(self) -> None:
        self.sandboxes.clear()


def memory_backend(root: Path) -> MemoryBackend:
    """The `module:factory` the embedded service is started with (`--backend env_http:memory_backend`)."""
    return MemoryBackend(root)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a running process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def one_task(client, i: int, commands: int) -> bool:
    sb = await client.create()
    ok = True
    try:
        for k in range(commands):
            result = await sb.exec(f"echo task{i}-cmd{k}")
            ok &= result.ok and result.stdout == f"task{i}-cmd{k}\n"
    finally:
        await sb.delete()
    return ok


async def drive_service(url: str, key: str, n: int, commands: int) -> tuple[int, float]:
    from orchard.env import AsyncSandboxClient

    async with AsyncSandboxClient(url, key, timeout=600, max_connections=n) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_task(client, i, commands) for i in range(n)), return_exceptions=True)
        wall = time.perf_counter() - start
    for r in results:
        if isinstance(r, BaseException):
            print(f"error: {type(r).__name__}: {r}")
            break
    return sum(r is True for r in results), wall


FLOOR_BODY = b'{"status":"ok"}'
FLOOR_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                  % (len(FLOOR_BODY), FLOOR_BODY))


async def floor_server() -> None:
    """A bare HTTP/1.1 responder (keep-alive, bodies sized by content-length), for the floor's child process."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                writer.write(FLOOR_RESPONSE)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


async def drive_floor(port: int, n: int, requests_each: int) -> float:
    request = (b"POST /x HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 20\r\n"
               b"\r\n" + b'{"command":"echo x"}')

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(requests_each):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            json.loads(await reader.readexactly(length))
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - start


def measure_floor(n: int, requests_each: int) -> dict[str, float]:
    code = "import asyncio, env_http; asyncio.run(env_http.floor_server())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(child.stdout.readline())
        service_before, client_before = process_cpu(child.pid), self_cpu()
        wall = asyncio.run(drive_floor(port, n, requests_each))
        service, client = process_cpu(child.pid) - service_before, self_cpu() - client_before
    finally:
        child.kill()
        child.wait()
    return {"wall_s": wall, "service_cpu_s": service, "client_cpu_s": client, "requests": n * requests_each}


def measure_service(n: int, commands: int) -> dict[str, float]:
    from orchard.env.embedded import serve

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                             os.environ.get("PYTHONPATH")]))
    root = tempfile.mkdtemp(prefix="orchard-env-http-")
    try:
        with serve(root, in_process=False, backend="env_http:memory_backend") as svc:
            service_before, client_before = process_cpu(svc.process.pid), self_cpu()
            ok, wall = asyncio.run(drive_service(svc.url, svc.api_key, n, commands))
            service, client = process_cpu(svc.process.pid) - service_before, self_cpu() - client_before
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if ok != n:
        raise SystemExit(f"only {ok}/{n} tasks succeeded")
    return {"wall_s": wall, "service_cpu_s": service, "client_cpu_s": client, "requests": n * (commands + 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="concurrent sandboxes (and connections)")
    parser.add_argument("--commands", type=int, default=4, help="commands per sandbox")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the best (least CPU) is shown")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.n < 1 or args.commands < 0 or args.repeat < 1:
        raise SystemExit(f"--n and --repeat must be >= 1 and --commands >= 0, got {args.n}, {args.repeat}, "
                         f"{args.commands}")

    def best(runs: list[dict[str, float]]) -> dict[str, float]:
        return min(runs, key=lambda r: r["service_cpu_s"] + r["client_cpu_s"])

    floor = best([measure_floor(args.n, args.commands + 2) for _ in range(args.repeat)])
    service = best([measure_service(args.n, args.commands) for _ in range(args.repeat)])

    info = machine()
    print(f"# env_http: {args.n} sandboxes at once, create + {args.commands} execs (wait: true) + delete each, "
          "MemoryBackend (no sandboxes, no processes): the HTTP path alone")
    print(f"# machine: {info['machine']}; python {info['python']}; commit {info['commit']}")
    print(f"{'path':<8} {'requests':>8} {'wall s':>7} {'req/s':>7} {'service ms/req':>15} {'client ms/req':>14}")
    rows = {}
    for name, run in (("floor", floor), ("service", service)):
        req = run["requests"]
        rows[name] = {**run, "service_ms_per_req": 1e3 * run["service_cpu_s"] / req,
                      "client_ms_per_req": 1e3 * run["client_cpu_s"] / req}
        print(f"{name:<8} {req:8d} {run['wall_s']:7.2f} {req / run['wall_s']:7.0f} "
              f"{rows[name]['service_ms_per_req']:15.3f} {rows[name]['client_ms_per_req']:14.3f}")
    for side in ("service", "client"):
        ratio = rows["service"][f"{side}_ms_per_req"] / max(rows["floor"][f"{side}_ms_per_req"], 1e-9)
        print(f"{side} CPU per request: {ratio:.1f} x the floor")
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "n": args.n, "commands": args.commands, **rows}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
