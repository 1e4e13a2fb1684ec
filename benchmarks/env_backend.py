"""What does the local backend itself cost per command, without the REST service in front of it?

Runs the same command through `LocalBackend.exec` in-process (bubblewrap with a box per sandbox, bubblewrap
per command, and the process-group fallback)
and as a raw `subprocess.run` in the same run, serially and then with `--concurrency` commands in flight over
`--sandboxes` sandboxes; reports latency percentiles, commands per second, and the CPU time per command of
this process and of its children (the sandboxing tools and the command), plus create/delete latency.

    python benchmarks/env_backend.py                 # 200 commands serially, 400 concurrently
    python benchmarks/env_backend.py --n 100 --concurrency 8 --root-parent /var/tmp
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_latency import machine, percentiles

from orchard.env.agent.box_client import BoxCpu
from orchard.env.backends.base import ExecRequest, SandboxSpec
from orchard.env.backends.local import LocalBackend

COMMAND = "echo hello"


def cpu_s() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def raw(n: int) -> dict[str, float]:
    lat = []
    c0 = cpu_s()
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["bash", "-c", COMMAND], capture_output=True, check=True)
        lat.append(time.perf_counter() - t)
    c1 = cpu_s()
    wall = sum(lat)
    return {**percentiles(lat), "per_s": n / wall, "self_ms": (c1[0] - c0[0]) / n * 1e3,
            "kids_ms": (c1[1] - c0[1]) / n * 1e3}  # fmt: skip


async def backend(
    use_bwrap: bool, n: int, concurrency: int, sandboxes: int, parent: str | None, box: bool = True
) -> dict[str, dict[str, float]]:
    root = tempfile.mkdtemp(prefix="orchard-bench-", dir=parent)
    # the process-group row measures the fallback as such: it must be allowed to run sandboxes
    b = LocalBackend(root, use_bwrap=use_bwrap, max_sandboxes=None, box=box, allow_weak_isolation=True)
    box0 = (BoxCpu.box_s, BoxCpu.commands_s)
    out: dict[str, dict[str, float]] = {}
    try:
        lat_create = []
        for i in range(sandboxes):
            t = time.perf_counter()
            await b.create(f"s{i}", SandboxSpec())
            lat_create.append(time.perf_counter() - t)
        out["create"] = percentiles(lat_create)

        async def one(i: int, lat: list[float]) -> None:
            t = time.perf_counter()
            r = await b.exec(f"s{i % sandboxes}", ExecRequest(COMMAND))
            lat.append(time.perf_counter() - t)
            assert r.exit_code == 0 and r.stdout == b"hello\n", r

        for name, width, count in (("serial", 1, n), (f"{concurrency} at once", concurrency, 2 * n)):
            lat: list[float] = []
            sem = asyncio.Semaphore(width)

            async def gated(i: int, lat: list[float] = lat, sem: asyncio.Semaphore = sem) -> None:
                async with sem:
                    await one(i, lat)

            c0, t0 = cpu_s(), time.perf_counter()
            await asyncio.gather(*(gated(i) for i in range(count)))
            wall = time.perf_counter() - t0
            c1 = cpu_s()
            out[name] = {**percentiles(lat), "per_s": count / wall, "self_ms": (c1[0] - c0[0]) / count * 1e3,
                         "kids_ms": (c1[1] - c0[1]) / count * 1e3}  # fmt: skip
        lat_delete = []
        for i in range(sandboxes):
            t = time.perf_counter()
            await b.delete(f"s{i}")
            lat_delete.append(time.perf_counter() - t)
        out["delete"] = percentiles(lat_delete)
        out["_isolation"] = {"name": b.isolation + (", box" if box and b.isolation == "bubblewrap" else "")}  # type: ignore[dict-item]
        # boxes report their CPU (their own, their commands') when deleted; bubblewrap's init hides it
        # from this process's children times
        out["_box_cpu"] = {"box_ms": (BoxCpu.box_s - box0[0]) / (3 * n) * 1e3,
                           "commands_ms": (BoxCpu.commands_s - box0[1]) / (3 * n) * 1e3}  # fmt: skip
    finally:
        await b.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--n", type=int, default=200, help="commands in the serial pass (twice as many concurrent)"
    )
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sandboxes", type=int, default=50)
    p.add_argument("--root-parent", default=None, help="where the sandboxes live (default: the temp dir)")
    args = p.parse_args()
    info = machine()
    print(f"# env_backend: `{COMMAND}` through LocalBackend.exec vs raw subprocess.run")
    print(f"# machine: {info['machine']}; python {info['python']}; commit {info['commit']}")
    base = raw(args.n)
    print(f"{'path':<36}{'p50 ms':>9}{'p90 ms':>9}{'cmd/s':>8}{'cpu self':>10}{'cpu kids':>10}{'p50/raw':>9}")

    def row(name: str, r: dict[str, float]) -> None:
        print(f"{name:<36}{r['p50'] * 1e3:>9.2f}{r['p90'] * 1e3:>9.2f}{r['per_s']:>8.0f}"
              f"{r['self_ms']:>8.2f}ms{r['kids_ms']:>8.2f}ms{r['p50'] / base['p50']:>9.2f}")  # fmt: skip

    row("raw subprocess.run (serial)", base)
    for use_bwrap, box in ((True, True), (True, False), (False, False)):
        try:
            res = asyncio.run(backend(use_bwrap, args.n, args.concurrency, args.sandboxes, args.root_parent,
                                      box=box))  # fmt: skip
        except Exception as e:  # bubblewrap required but unusable here
            print(f"{'bubblewrap' if use_bwrap else 'process-group'}: skipped ({e})")
            continue
        iso = res.pop("_isolation")["name"]  # type: ignore[index]
        if not box and use_bwrap:
            iso += ", per command"
        for name in ("serial", f"{args.concurrency} at once"):
            row(f"{iso}, {name}", res[name])
        for op in ("create", "delete"):
            print(f"{iso}, {op:<28}{res[op]['p50'] * 1e3:>9.2f}{res[op]['p90'] * 1e3:>9.2f}")
        cpu = res.pop("_box_cpu")
        if box and use_bwrap:
            print(f"{iso}: CPU per command inside the boxes (all passes): box {cpu['box_ms']:.2f} ms, "
                  f"commands {cpu['commands_ms']:.2f} ms")


if __name__ == "__main__":
    main()
