"""How long does one command take through the sandbox service, against running it directly?

Three ways to run the same command, measured in the same run, one call at a time:

    raw       subprocess.run(["bash", "-c", CMD]) in this process                      the baseline
    bwrap     the same inside a bare `bwrap --unshare-all` (no agent, no limits)        isolation's floor
    backend   LocalBackend.exec(...) in this process: the sandbox (bubblewrap) and      where the sandbox's
              exec agent, no orchestrator, no HTTP; commands run by the sandbox's box   own cost shows
    per-cmd   the same with a fresh bubblewrap per command (LocalBackend(box=False))    what the box saves
    service   SandboxClient.exec(CMD) against the embedded service (orchestrator +      what a user pays
              REST API + SQLite + LocalBackend) running as a child process on loopback

The service's share is (service − backend). Orchard Env reports a 0.280 s mean exec round trip on Kubernetes;
our target is service p50 ≤ 2.5 × raw p50.

    python benchmarks/env_latency.py                    # 60 calls each of `echo hi`
    python benchmarks/env_latency.py --n 200 --command "python3 -c 'print(1)'"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def machine() -> dict[str, str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return {"machine": f"{cpu}, {os.cpu_count()} cpus, load avg {load}", "python": platform.python_version(),
            "commit": commit}


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]

    return {"p50": q(0.5), "p90": q(0.9), "mean": statistics.fmean(ordered), "n": len(ordered)}


def timed(fn: Callable[[], object], n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def measure_backend(command: str, n: int, warmup: int, root: str, box: bool = True) -> tuple[list[float], str]:
    from orchard.env.backends.base import ExecRequest, SandboxSpec
    from orchard.env.backends.local import LocalBackend

    async def run() -> tuple[list[float], str]:
        backend = LocalBackend(os.path.join(root, "direct" if box else "direct-per-command"), box=box)
        await backend.create("bench", SandboxSpec())
        request = ExecRequest(command=["bash", "-c", command])
        for _ in range(warmup):
            await backend.exec("bench", request)
        out = []
        for _ in range(n):
            start = time.perf_counter()
            result = await backend.exec("bench", request)
            out.append(time.perf_counter() - start)
            assert result.exit_code == 0, result
        await backend.delete("bench")
        await backend.close()
        return out, backend.isolation

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=60, help="measured calls per way")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--command", default="echo hi")
    parser.add_argument("--backend", default="local", choices=["local", "local-per-command"],
                        help="the service's backend: a box per sandbox (default) or a bubblewrap per command")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.n < 1:
        raise SystemExit(f"--n must be >= 1, got {args.n}")

    from orchard.env import SandboxClient
    from orchard.env.embedded import serve

    root = tempfile.mkdtemp(prefix="orchard-env-bench-")
    os.chmod(root, 0o711)
    raw = timed(lambda: subprocess.run(["bash", "-c", args.command], capture_output=True, check=True),
                args.n, args.warmup)
    rows_extra = {}
    if shutil.which("bwrap"):
        bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
                 "--dev", "/dev", "bash", "-c", args.command]
        rows_extra["bwrap"] = percentiles(timed(lambda: subprocess.run(bwrap, capture_output=True, check=True),
                                                args.n, args.warmup))
    backend, isolation = measure_backend(args.command, args.n, args.warmup, root)
    per_command, _ = measure_backend(args.command, args.n, args.warmup, root, box=False)
    with serve(os.path.join(root, "svc"), in_process=False, backend=args.backend) as (url, key), \
            SandboxClient(url, key) as client, client.create() as sb:
        def one() -> None:
            result = sb.exec(args.command)
            assert result.ok, result

        service = timed(one, args.n, args.warmup)

    rows = {"raw": percentiles(raw), **rows_extra, "backend": percentiles(backend),
            "per-cmd": percentiles(per_command), "service": percentiles(service)}
    info = machine()
    print(f"# env_latency: `{args.command}`, {args.n} calls each after {args.warmup} warm-up")
    print(f"# machine: {info['machine']}; python {info['python']}; commit {info['commit']}; "
          f"isolation {isolation}; service backend {args.backend}")
    print(f"{'way':<9} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8} {'p50 / raw':>10}")
    for name, row in rows.items():
        print(f"{name:<9} {row['p50'] * 1e3:8.2f} {row['p90'] * 1e3:8.2f} {row['mean'] * 1e3:8.2f} "
              f"{row['p50'] / rows['raw']['p50']:10.2f}")
    overhead = rows["service"]["p50"] - rows["backend"]["p50"]
    ratio = rows["service"]["p50"] / rows["raw"]["p50"]
    print(f"service overhead over the backend (p50): {overhead * 1e3:.2f} ms; "
          f"target service p50 <= 2.5 x raw: {'met' if ratio <= 2.5 else 'MISSED'} ({ratio:.2f} x); "
          f"Orchard Env on Kubernetes: 280 ms mean")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": args.command, "isolation": isolation, **info,
                                               **rows}, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
