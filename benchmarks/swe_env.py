"""How fast is the SWE environment on one machine? Three questions, each against a baseline measured in this run:

    ready     a sandbox with the instance's repository ready (create + `prepare_sandbox`: unpacked, git, pytest)
              against the same repository written to a local directory and committed with git; twice: a
              sandbox created on the spot, and one from a warm pool (`AsyncSandboxPool`, size 2, refilled
              between samples). The git objects are built on the host once per instance before timing (their
              build is reported apart), pytest is read from the service's shared folder (never sent), on the
              path of every command by the sandbox's env (`pytest_env`): the repository goes in through the
              archive upload and no command runs
              target: <= 50 ms (a container start is ~0.6 s, a pooled cluster sandbox ~2.6 s)
    reward    one reward through the service (`score_sandbox` of the gold patch: the diff, the patched tree built
              on the host and uploaded, FAIL_TO_PASS + PASS_TO_PASS under pytest) against the same in a directory
              (copy the base, `git apply` both patches, the same pytest command)          target: <= 1.2 x
    episodes  the scripted teacher's careful episodes through the harness program (bash and tool conventions,
              through the recording proxy and the embedded service, scored): episodes per minute

    python benchmarks/swe_env.py [--n 10] [--episodes 8] [--concurrency 4] [--json out.json]

The embedded service (local backend, SQLite) runs as a child process on loopback; the toy instances are the
generator's (level 1, templates in turn).
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIT = ["git", "-c", "user.name=orchard", "-c", "user.email=orchard@localhost", "-c", "commit.gpgsign=false"]


def machine() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()} {os.cpu_count()} cpus (load avg {load}), python {platform.python_version()}, "
            f"commit {commit.stdout.strip()}")


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def direct_ready(instance: Any, root: Path) -> Path:
    """The repository in a local directory at one git commit: the direct analogue of `prepare_sandbox`."""
    repo = Path(tempfile.mkdtemp(dir=root))
    for path, text in instance.files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-q", "-m", "base"], cwd=repo, check=True)
    return repo


def direct_reward(instance: Any, base: Path, root: Path) -> bool:
    """The gold patch's reward in a directory: a copy of the base, both patches, the decisive tests."""
    from orchard.domains.swe.testrun import PYTEST_ENV, parse_test_results, pytest_argv

    repo = Path(tempfile.mkdtemp(dir=root)) / "repo"
    shutil.copytree(base, repo)
    for patch in (instance.patch, instance.test_patch):
        subprocess.run(["git", "apply", "-"], cwd=repo, input=patch, text=True, check=True)
    # Plugins off: the sandbox's pytest is a bare copy, while this environment's may load many by entry point.
    run = subprocess.run(pytest_argv(sys.executable, instance.tests), cwd=repo, capture_output=True, text=True,
                         env={**os.environ, **PYTEST_ENV, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return all(parse_test_results(run.stdout, instance.tests, exit_code=run.returncode).values())


async def service_side(instances: list[Any], args: Any, url: str, key: str) -> dict[str, Any]:
    from orchard.data.tokenizer import build_chat_tokenizer
    from orchard.domains.swe.sandbox import GIT_ENV, base_archive, prepare_sandbox, pytest_env, score_sandbox
    from orchard.domains.swe.teacher import SWETeacherEngine, teacher_trajectories
    from orchard.domains.swe.tool_rollout import SWEBashRollouts, SWEToolRollouts
    from orchard.env import AsyncSandboxClient, AsyncSandboxPool

    out: dict[str, Any] = {"ready": [], "ready_create": [], "ready_pool": [], "reward": [], "host_build": []}
    for instance in instances[:args.n]:  # what an image build is to a container: once per instance, ahead
        start = time.perf_counter()
        base_archive(instance)
        out["host_build"].append(time.perf_counter() - start)
    async with AsyncSandboxClient(url, key) as client:
        env = pytest_env()
        warm = await client.create(env=env)
        await prepare_sandbox(warm, instances[0])  # the image probe, the pytest bundle and the service's caches: once
        await warm.delete()
        async with AsyncSandboxPool(client, 2, env=env) as pool:
            for i in range(args.n):
                await pool.wait_filled()  # a pool that keeps up: the refill happens between requests
                start = time.perf_counter()
                sandbox = await pool.acquire()
                await prepare_sandbox(sandbox, instances[i % len(instances)])
                out["ready_pool"].append(time.perf_counter() - start)
                await sandbox.delete()
        for i in range(args.n):
            instance = instances[i % len(instances)]
            start = time.perf_counter()
            sandbox = await client.create(env=env)
            created = time.perf_counter()
            await prepare_sandbox(sandbox, instance)
            out["ready"].append(time.perf_counter() - start)
            out["ready_create"].append(created - start)
            applied = await sandbox.exec(["git", "apply", "-"], env=GIT_ENV, stdin=instance.patch)
            assert applied.exit_code == 0, applied
            start = time.perf_counter()
            verdict = await score_sandbox(sandbox, instance)
            out["reward"].append(time.perf_counter() - start)
            assert verdict.resolved, verdict.details
            await sandbox.delete()

        # The scripted teacher needs a chat tokenizer only to speak through the proxy: the recipe's offline one.
        tokenizer = build_chat_tokenizer([t for i in instances for t in (i.problem_statement, *i.files.values())],
                                         vocab_size=2048, split_words=False)
        teacher = SWETeacherEngine(tokenizer, instances, failure_rate=0.0, seed=0)
        program = {"concurrency": args.concurrency, "max_steps": 12, "max_tokens": 256, "max_time_s": 300.0}
        pool = instances[:args.episodes]
        out["episodes"] = {}
        for name, rollouts in (("bash", SWEBashRollouts(client, tokenizer, **program)),
                               ("tool", SWEToolRollouts(client, tokenizer, **program))):
            start = time.perf_counter()
            trajectories = await teacher_trajectories(rollouts, teacher, pool, attempts=1)
            wall = time.perf_counter() - start
            out["episodes"][name] = {"episodes": len(trajectories), "wall_s": wall,
                                     "per_min": 60 * len(trajectories) / wall,
                                     "resolved": sum((t.reward or 0) > 0 for t in trajectories),
                                     "env_errors": sum(not t.valid for t in trajectories)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10, help="sandboxes readied and rewards computed, each way")
    parser.add_argument("--episodes", type=int, default=8, help="teacher episodes per convention")
    parser.add_argument("--concurrency", type=int, default=4, help="episodes in flight at once")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    for name in ("n", "episodes", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")

    from orchard.domains.swe.generator import TEMPLATES, make_instance
    from orchard.domains.swe.sandbox import SHARED_PYTEST, write_pytest_bundle
    from orchard.env.embedded import serve

    templates = sorted(TEMPLATES)
    count = max(args.n, args.episodes)
    instances = [make_instance(templates[i % len(templates)], i // len(templates), level=1) for i in range(count)]
    root = Path(tempfile.mkdtemp(prefix="orchard-swe-bench-"))
    os.chmod(root, 0o711)  # the service's sandboxes run as other uids and must reach their root below it
    direct_reward(instances[0], direct_ready(instances[0], root), root)  # warm the page cache and pytest's imports
    ready, reward = [], []
    for i in range(args.n):
        instance = instances[i % len(instances)]
        start = time.perf_counter()
        base = direct_ready(instance, root)
        ready.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert direct_reward(instance, base, root)
        reward.append(time.perf_counter() - start)
    write_pytest_bundle(root / "shared")
    shared = {SHARED_PYTEST: str(root / "shared")}
    with serve(str(root / "svc"), in_process=False, shared=shared) as service:
        svc = asyncio.run(service_side(instances, args, service.url, service.api_key))
    shutil.rmtree(root, ignore_errors=True)

    rows = {"ready": (p50(ready), p50(svc["ready"])), "reward": (p50(reward), p50(svc["reward"])),
            "ready_pool": (p50(ready), p50(svc["ready_pool"]))}
    print(f"# swe_env: {args.n} sandboxes / rewards each way, {args.episodes} teacher episodes per convention at "
          f"concurrency {args.concurrency}")
    print(f"# machine: {machine()}")
    print("| question | direct p50 ms | service p50 ms | service / direct | target |")
    print("|---|---|---|---|---|")
    reward_ratio = rows["reward"][1] / rows["reward"][0]
    for name, label in (("ready", "repository ready, created on the spot"), ("ready_pool", "repository ready, pooled")):
        ok = rows[name][1] <= 0.050
        print(f"| {label} | {rows[name][0] * 1e3:.1f} | {rows[name][1] * 1e3:.1f} | "
              f"{rows[name][1] / rows[name][0]:.2f} | <= 50 ms: {'met' if ok else 'MISSED'} |")
    print(f"| one reward | {rows['reward'][0] * 1e3:.1f} | {rows['reward'][1] * 1e3:.1f} | {reward_ratio:.2f} | "
          f"<= 1.2 x: {'met' if reward_ratio <= 1.2 else 'MISSED'} |")
    print(f"of ready on the spot, the create: p50 {p50(svc['ready_create']) * 1e3:.1f} ms (the rest: prepare_sandbox)")
    print(f"git objects built on the host, once per instance (before timing): p50 {p50(svc['host_build']) * 1e3:.1f} ms")
    for name, row in svc["episodes"].items():
        print(f"teacher episodes, {name}: {row['episodes']} in {row['wall_s']:.1f} s = {row['per_min']:.1f} per "
              f"minute ({row['resolved']} resolved, {row['env_errors']} env errors)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "direct": {"ready": ready, "reward": reward},
                                               "service": svc}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
