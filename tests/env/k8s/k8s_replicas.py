"""Two orchestrator replicas on the Kubernetes backend and one Redis, behind one address, one SIGKILLed mid-run.

Each replica is a separate process, `orchard env serve --backend kubernetes --store redis://...`, talking to the
emulated API server of this process (`k8s_emulator`; pods run by `k8s_kubelet`). Clients reach both through
`RoundRobinFront`, one TCP address that hands each new connection to the next replica and skips one that
refuses it, as a Service's endpoints drop a dead pod. `replica_kill_run` is the proof of issue 15, used by
`test_k8s_replicas.py` (20 sandboxes x 4 execs) and `benchmarks/env_k8s.py` (200 x 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from k8s_kubelet import DIE_WITH_KUBELET

from orchard.env.backends.kubernetes import API_URL_ENV
from orchard.env.embedded import API_KEY_ENV, READY_PREFIX, parse_printed

REPO = str(Path(__file__).resolve().parents[3])


class RoundRobinFront:
    """One loopback address in front of several `(host, port)` upstreams; each accepted connection is piped to
    the next upstream in turn, or to the one after it when that one refuses the connection."""

    def __init__(self, upstreams: list[tuple[str, int]]) -> None:
        self.upstreams = upstreams
        self.connections: Counter[int] = Counter()
        """How many connections went to each upstream (by index)."""
        self._turn = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="round-robin-front", daemon=True)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def start(self) -> RoundRobinFront:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first, self._turn = self._turn, self._turn + 1
        for step in range(len(self.upstreams)):
            index = (first + step) % len(self.upstreams)
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstreams[index])
                break
            except OSError:
                continue
        else:  # nobody listens: the client sees its connection closed and retries
            writer.close()
            return
        self.connections[index] += 1
        # Cancelled by `stop`: end as a finished handler, or Python 3.11's stream callback logs the cancellation
        # of every connection still open as an error (it asks a cancelled task for its exception).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(1 << 16):
            sink.write(data)
            await sink.drain()
    except OSError:
        pass
    finally:  # one side gone (a killed replica resets its connections): the other side is closed too
        sink.close()


@dataclass
class Replica:
    process: subprocess.Popen[str]
    url: str
    output: list[str] = field(default_factory=list)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)


def start_replica(api_url: str, namespace: str, store: str, api_key: str, root: Path, *, lease_s: float,
                  reap_interval_s: float, startup_timeout_s: float = 300.0) -> Replica:
    """`orchard env serve --backend kubernetes --store <store>` as a child process; returns once it listens.
    `startup_timeout_s` only bounds a hang: importing the Kubernetes client and reconciling with the cluster took
    over 60 s for the second replica on a 2-core machine at load 20."""
    env = {**os.environ, API_URL_ENV: api_url, "ORCHARD_K8S_NAMESPACE": namespace,
           "ORCHARD_K8S_WATCH_TIMEOUT": "5", API_KEY_ENV: api_key,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    argv = [*DIE_WITH_KUBELET, sys.executable, "-m", "orchard", "env", "serve", "--backend", "kubernetes", "--store", store,
            "--root", str(root), "--replica-lease", str(lease_s), "--reap-interval", str(reap_interval_s)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    replica = Replica(process, "")
    assert process.stdout is not None
    deadline = time.monotonic() + startup_timeout_s
    while not replica.url:
        line = process.stdout.readline()
        if not line or time.monotonic() > deadline:
            stop_replica(replica)
            raise RuntimeError("a replica did not start:\n" + "".join(replica.output))
        replica.output.append(line)
        if line.startswith(READY_PREFIX):
            replica.url = parse_printed(line, READY_PREFIX)
    threading.Thread(target=lambda: replica.output.extend(process.stdout), daemon=True).start()  # type: ignore[arg-type]
    return replica


def stop_replica(replica: Replica) -> None:
    if replica.process.poll() is None:
        replica.process.terminate()
        try:
            replica.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()


@contextlib.contextmanager
def two_replicas(api_url: str, namespace: str, store: str, api_key: str, root: Path, *, lease_s: float = 3.0,
                 reap_interval_s: float = 0.5) -> Iterator[tuple[Replica, Replica, RoundRobinFront]]:
    """Replicas A and B and the front over both; all stopped afterwards (a killed one is left as it is)."""
    replicas: list[Replica] = []
    front = None
    try:
        for name in "ab":
            (root / name).mkdir(parents=True, exist_ok=True)
            replicas.append(start_replica(api_url, namespace, store, api_key, root / name, lease_s=lease_s,
                                          reap_interval_s=reap_interval_s))
        front = RoundRobinFront([r.address for r in replicas]).start()
        yield replicas[0], replicas[1], front
    finally:
        if front is not None:
            front.stop()
        for replica in replicas:
            stop_replica(replica)


@dataclass
class KillReport:
    """What a `replica_kill_run` saw. `runs[(sandbox, j)]` is how often exec j of a sandbox ran, counted in
    the sandbox's own log; `outcome[(sandbox, j)]` is "ok", "lost" or the error the client got."""

    sandboxes: list[str]
    outcome: dict[tuple[str, int], str]
    runs: dict[tuple[str, int], int]
    listed_after: list[str]
    answered_before_kill: int
    wall_s: float
    exec_latencies_s: list[float]
    audit_errors: dict[str, str]
    """Sandboxes whose log could not be read or that could not be deleted afterwards, with the error."""
    ran_by: Counter[str]
    """Answered jobs by the replica that ran them ("a", "b"), from the store's job records."""

    def problems(self) -> list[str]:
        """Every broken promise; empty when the run kept them all."""
        found = [f"{k}: {o}" for k, o in self.outcome.items() if o not in ("ok", "lost")]
        found += [f"{k} ran {n} times" for k, n in self.runs.items() if n > 1]
        found += [f"{k} answered ok but ran {self.runs.get(k, 0)} times" for k, o in self.outcome.items()
                  if o == "ok" and self.runs.get(k, 0) != 1]
        found += [f"sandbox {s} lost" for s in sorted(set(self.sandboxes) - set(self.listed_after))]
        found += [f"sandbox {s} afterwards: {e}" for s, e in sorted(self.audit_errors.items())]
        return found

    def counts(self) -> Counter[str]:
        return Counter(o if o in ("ok", "lost") else "error" for o in self.outcome.values())


async def replica_kill_run(a: Replica, b: Replica, front: RoundRobinFront, api_key: str, store: str, *,
                           sandboxes: int, execs: int, concurrency: int = 32,
                           kill_after: int | None = None) -> KillReport:
    """Create `sandboxes` sandboxes, alternately through A and through B (so half of them were made by the
    replica that dies), then run `execs` execs in each through the front, the execs of one sandbox in turn and
    up to `concurrency` sandboxes at once. Once `kill_after` execs (default a quarter) have been answered, A is
    SIGKILLed. Afterwards every sandbox's log is read, and the sandbox deleted, through the front (so by B)."""
    from orchard.env import AsyncSandboxClient
    from orchard.env.client import RetryPolicy

    kill_after = (sandboxes * execs) // 4 if kill_after is None else kill_after
    ids = [f"rk-{i:04d}" for i in range(sandboxes)]
    retry = RetryPolicy(max_attempts=12, backoff_base_s=0.1, backoff_max_s=2.0)
    direct = [AsyncSandboxClient(r.url, api_key, retry=retry, auto_cleanup=False) for r in (a, b)]
    client = AsyncSandboxClient(front.url, api_key, retry=retry, auto_cleanup=False)
    gate = asyncio.Semaphore(concurrency)
    outcome: dict[tuple[str, int], str] = {}
    job_ids: list[str] = []
    latencies: list[float] = []
    answered = 0

    async def create(i: int, sandbox_id: str) -> None:
        async with gate:
            await direct[i % 2].create(sandbox_id=sandbox_id)

    async def run(sandbox_id: str) -> None:
        nonlocal answered
        async with gate:
            sandbox = await client.sandbox(sandbox_id)
            for j in range(execs):
                start = time.perf_counter()
                try:
                    job = await sandbox.exec(f"echo {j} >> runs.log; sleep 0.05", timeout=60)
                    job_ids.append(job.job_id)
                    lost = job.failed and (job.error or "").startswith("lost:")
                    outcome[sandbox_id, j] = "ok" if job.ok else "lost" if lost else f"{job.status}: {job.error}"
                except Exception as exc:
                    outcome[sandbox_id, j] = f"{type(exc).__name__}: {exc}"
                latencies.append(time.perf_counter() - start)
                answered += 1
                if answered == kill_after:
                    a.process.send_signal(signal.SIGKILL)

    try:
        await asyncio.gather(*(create(i, s) for i, s in enumerate(ids)))
        start = time.perf_counter()
        await asyncio.gather(*(run(s) for s in ids))
        wall = time.perf_counter() - start
        a.process.wait(timeout=10)
        listed = sorted(s["sandbox_id"] for s in await client.list_sandboxes())
        runs: dict[tuple[str, int], int] = {}
        audit_errors: dict[str, str] = {}

        async def audit(sandbox_id: str) -> None:
            async with gate:
                sandbox = await client.sandbox(sandbox_id)
                try:
                    for line in (await sandbox.download("runs.log")).decode().split():
                        runs[sandbox_id, int(line)] = runs.get((sandbox_id, int(line)), 0) + 1
                except Exception as exc:
                    audit_errors[sandbox_id] = f"{type(exc).__name__}: {exc}"
                await sandbox.delete()

        await asyncio.gather(*(audit(s) for s in ids))
        ran_by = await _ran_by(store, job_ids)
    finally:
        for c in (*direct, client):
            await c.aclose()
    return KillReport(ids, outcome, runs, listed, kill_after, wall, latencies, audit_errors, ran_by)


async def _ran_by(store: str, job_ids: list[str]) -> Counter[str]:
    """Jobs by replica, "a" or "b": B is the one that ran the last job (answered after A's death)."""
    from orchard.env.store.redis_store import RedisStore

    redis = RedisStore(store)
    try:
        replicas = [(await redis.get_job(job_id)).replica for job_id in job_ids]  # type: ignore[union-attr]
    finally:
        await redis.close()
    survivor = replicas[-1]
    return Counter("b" if r == survivor else "a" for r in replicas)
