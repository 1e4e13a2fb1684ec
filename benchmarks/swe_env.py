"""How fast is the SWE environment on one machine? Four questions, each against a baseline measured in this run:

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
    real      one reward on a real repository of a few MB (`real_repository`: networkx's source as installed, a
              dependency of torch, committed into a fresh git clone when the benchmark starts, with a bug we put
              in and the project's own test of it; nothing downloaded, nothing of it kept in this repository):
              `score_sandbox` against the same in a directory (copy the clone, `git apply` both patches, the same
              pytest command), both with the interpreter the sandbox runs and the same pytest bundle, samples
              interleaved; the base built on the host once before timing          target: <= 1.2 x
    episodes  the scripted teacher's careful episodes through the harness program (bash and tool conventions,
              through the recording proxy and the embedded service, scored): episodes per minute

    python benchmarks/swe_env.py [--n 10] [--episodes 8] [--concurrency 4] [--real 5] [--only-real] [--json out.json]

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


REAL_TEST_FILE = "networkx/utils/tests/test_misc.py"
REAL_F2P = [f"{REAL_TEST_FILE}::test_pairwise"]
REAL_P2P = [f"{REAL_TEST_FILE}::{name}" for name in (
    "test_make_list_of_ints", "test_groups", "test_edges_equal_data", "test_edges_equal_multigraph_data",
    "test_edges_equal_directed", "test_edges_equal_directed_data")]
REAL_FIX = ("    return zip(a, chain(b, (first,)))\n", "    return zip(a, b)\n")
"""The bug put in the real repository: ``pairwise(..., cyclic=True)`` loses the pair that closes the cycle."""
REAL_TEST = ("    assert list(pairwise(nodes, cyclic=True)) == node_pairs_cycle\n",
             "    assert list(pairwise(nodes, cyclic=True)) == node_pairs_cycle\n"
             "    assert list(pairwise(iter(nodes), cyclic=True)) == node_pairs_cycle\n")
"""The hidden test: one more assertion in the project's own test of the function."""


def real_repository(root: Path) -> Any:
    """A real repository of a few MB, built here from what is installed (no network): networkx's source as the
    environment has it (a dependency of torch, so every orchard install has it), with its license, committed into
    a fresh git repository. The task in it is ours: the bug `REAL_FIX` injected at the base commit (the gold patch
    removes it), the hidden test `REAL_TEST` added by ``test_patch``; ``FAIL_TO_PASS`` is the project's own
    ``test_pairwise``, ``PASS_TO_PASS`` six other tests of the same file. Returns the `SWEInstance` (its
    ``repo_dir`` the clone), its size in bytes and its file count."""
    import importlib.metadata

    from orchard.domains.swe.instances import SWEInstance

    dist = importlib.metadata.distribution("networkx")
    repo = root / "networkx"
    size = count = 0
    for entry in dist.files or []:
        parts = Path(str(entry)).parts
        top = parts[0].endswith(".dist-info") and parts[1:2] == ("licenses",)
        if not (parts[0] == "networkx" or top) or "__pycache__" in parts or str(entry).endswith(".pyc"):
            continue
        target = repo / (Path(*parts[2:]) if top else Path(*parts))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(entry.locate(), target)
        size, count = size + target.stat().st_size, count + 1

    def edit(path: str, old: str, new: str) -> None:
        text = (repo / path).read_text()
        if old not in text:
            raise SystemExit(f"networkx {dist.version}: {path} no longer holds {old.strip()!r}; update REAL_FIX / "
                             "REAL_TEST in benchmarks/swe_env.py")
        (repo / path).write_text(text.replace(old, new, 1))

    def git(*args: str) -> str:
        return subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    edit("networkx/utils/misc.py", *REAL_FIX)
    git("add", "-A")
    git("commit", "-q", "-m", f"networkx {dist.version}, pairwise(cyclic=True) broken")
    git("repack", "-a", "-d", "-q")  # as a clone has it: one pack
    diffs = []
    for path, (old, new) in (("networkx/utils/misc.py", REAL_FIX[::-1]), (REAL_TEST_FILE, REAL_TEST)):
        edit(path, old, new)
        diffs.append(git("diff"))
        git("checkout", "-q", "--", path)
    return SWEInstance(
        instance_id="networkx__pairwise-cyclic", repo="networkx/networkx", base_commit=git("rev-parse", "HEAD").strip(),
        problem_statement="nx.utils.pairwise(nodes, cyclic=True) leaves out the pair from the last node back to "
                          "the first.", patch=diffs[0], test_patch=diffs[1], FAIL_TO_PASS=REAL_F2P,
        PASS_TO_PASS=REAL_P2P, repo_dir=str(repo)), size, count


def direct_real_reward(instance: Any, root: Path, python: str, bundle: str) -> bool:
    """The real repository's reward in a directory, with the sandbox's own interpreter and pytest bundle: a copy
    of the clone (its ``.git`` included), both patches, the decisive tests."""
    from orchard.domains.swe.testrun import PYTEST_ENV, parse_test_results, pytest_argv

    repo = Path(tempfile.mkdtemp(dir=root)) / "repo"
    shutil.copytree(instance.repo_dir, repo, symlinks=True)
    for patch in (instance.patch, instance.test_patch):
        subprocess.run(["git", "apply", "-"], cwd=repo, input=patch, text=True, check=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root), **PYTEST_ENV,
           "PYTHONNOUSERSITE": "1", "PYTHONPATH": bundle}
    run = subprocess.run(pytest_argv(python, instance.tests), cwd=repo, capture_output=True, text=True, env=env)
    shutil.rmtree(repo.parent, ignore_errors=True)
    return all(parse_test_results(run.stdout, instance.tests, exit_code=run.returncode).values())


async def real_side(instance: Any, args: Any, url: str, key: str, root: Path, bundle: str) -> dict[str, Any]:
    """The real repository's reward both ways, interleaved (a direct sample, then a service one: load that
    drifts during the run falls on both); the base built once on the host before timing."""
    from orchard.domains.swe.sandbox import GIT_ENV, base_archive, prepare_sandbox, pytest_env, score_sandbox
    from orchard.env import AsyncSandboxClient

    out: dict[str, Any] = {"direct": [], "service": [], "ready": []}
    start = time.perf_counter()
    base_archive(instance)
    out["host_build"] = time.perf_counter() - start
    async with AsyncSandboxClient(url, key) as client:
        env = pytest_env()
        async with await client.create(env=env) as probe:
            # the direct run uses the interpreter the sandbox runs, found the way the sandbox finds it
            found = await probe.exec(["python3", "-c", "import os, sys; print(os.path.realpath(sys.executable))"])
            python = found.stdout.strip()
            if found.exit_code != 0 or not Path(python).is_file():
                raise SystemExit(f"the sandbox's python3 ({python or found.stderr[-200:]}) is not on this host")
            await prepare_sandbox(probe, instance)  # the service's caches, as for the toy rows
        out["python"] = python
        assert direct_real_reward(instance, root, python, bundle)  # warm the page cache
        for _ in range(args.real):
            start = time.perf_counter()
            assert direct_real_reward(instance, root, python, bundle)
            out["direct"].append(time.perf_counter() - start)
            async with await client.create(env=env) as sandbox:
                start = time.perf_counter()
                await prepare_sandbox(sandbox, instance)
                out["ready"].append(time.perf_counter() - start)
                applied = await sandbox.exec(["git", "apply", "-"], env=GIT_ENV, stdin=instance.patch)
                assert applied.exit_code == 0, applied
                start = time.perf_counter()
                verdict = await score_sandbox(sandbox, instance)
                out["service"].append(time.perf_counter() - start)
                assert verdict.resolved, verdict.details
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10, help="sandboxes readied and rewards computed, each way")
    parser.add_argument("--episodes", type=int, default=8, help="teacher episodes per convention")
    parser.add_argument("--concurrency", type=int, default=4, help="episodes in flight at once")
    parser.add_argument("--real", type=int, default=5, help="rewards on the real repository, each way (0: none)")
    parser.add_argument("--only-real", action="store_true", help="only the real repository's row")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    for name in ("n", "episodes", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.real < (1 if args.only_real else 0):
        raise SystemExit(f"--real must be >= {1 if args.only_real else 0}, got {args.real}")

    from orchard.domains.swe.generator import TEMPLATES, make_instance
    from orchard.domains.swe.sandbox import RECENT_CHANGE_S, SHARED_PYTEST, write_pytest_bundle
    from orchard.env.embedded import serve

    root = Path(tempfile.mkdtemp(prefix="orchard-swe-bench-"))
    os.chmod(root, 0o711)  # the service's sandboxes run as other uids and must reach their root below it
    real = real_repository(root) if args.real else None
    real_svc: dict[str, Any] = {}
    written = time.monotonic()
    templates = sorted(TEMPLATES)
    count = max(args.n, args.episodes)
    instances = [make_instance(templates[i % len(templates)], i // len(templates), level=1) for i in range(count)]
    ready: list[float] = []
    reward: list[float] = []
    if not args.only_real:
        direct_reward(instances[0], direct_ready(instances[0], root), root)  # warm the page cache, pytest's imports
        for i in range(args.n):
            instance = instances[i % len(instances)]
            start = time.perf_counter()
            base = direct_ready(instance, root)
            ready.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert direct_reward(instance, base, root)
            reward.append(time.perf_counter() - start)
    bundle = write_pytest_bundle(root / "shared")
    shared = {SHARED_PYTEST: str(root / "shared")}
    with serve(str(root / "svc"), in_process=False, shared=shared) as service:
        svc = None if args.only_real else asyncio.run(service_side(instances, args, service.url, service.api_key))
        if real is not None:
            # a snapshot whose files changed within RECENT_CHANGE_S is not cached yet: the repository just built
            time.sleep(max(0.0, RECENT_CHANGE_S - (time.monotonic() - written)))
            real_svc = asyncio.run(real_side(real[0], args, service.url, service.api_key, root, bundle))
    shutil.rmtree(root, ignore_errors=True)

    print(f"# swe_env: {0 if args.only_real else args.n} sandboxes / rewards each way, "
          f"{0 if args.only_real else args.episodes} teacher episodes per convention at concurrency "
          f"{args.concurrency}, {args.real} rewards each way on a real repository")
    print(f"# machine: {machine()}")
    print("| question | direct p50 ms | service p50 ms | service / direct | target |")
    print("|---|---|---|---|---|")
    if svc is not None:
        rows = {"ready": (p50(ready), p50(svc["ready"])), "reward": (p50(reward), p50(svc["reward"])),
                "ready_pool": (p50(ready), p50(svc["ready_pool"]))}
        reward_ratio = rows["reward"][1] / rows["reward"][0]
        for name, label in (("ready", "repository ready, created on the spot"),
                            ("ready_pool", "repository ready, pooled")):
            ok = rows[name][1] <= 0.050
            print(f"| {label} | {rows[name][0] * 1e3:.1f} | {rows[name][1] * 1e3:.1f} | "
                  f"{rows[name][1] / rows[name][0]:.2f} | <= 50 ms: {'met' if ok else 'MISSED'} |")
        print(f"| one reward | {rows['reward'][0] * 1e3:.1f} | {rows['reward'][1] * 1e3:.1f} | {reward_ratio:.2f} | "
              f"<= 1.2 x: {'met' if reward_ratio <= 1.2 else 'MISSED'} |")
    if real is not None:
        instance, size, files = real
        direct_ms, service_ms = p50(real_svc["direct"]) * 1e3, p50(real_svc["service"]) * 1e3
        ratio = service_ms / direct_ms
        print(f"| one reward, real repository ({files} files, {size / 1e6:.1f} MB) | {direct_ms:.1f} | "
              f"{service_ms:.1f} | {ratio:.2f} | <= 1.2 x: {'met' if ratio <= 1.2 else 'MISSED'} |")
    if svc is not None:
        print(f"of ready on the spot, the create: p50 {p50(svc['ready_create']) * 1e3:.1f} ms "
              "(the rest: prepare_sandbox)")
        print(f"git objects built on the host, once per instance (before timing): "
              f"p50 {p50(svc['host_build']) * 1e3:.1f} ms")
        for name, row in svc["episodes"].items():
            print(f"teacher episodes, {name}: {row['episodes']} in {row['wall_s']:.1f} s = {row['per_min']:.1f} per "
                  f"minute ({row['resolved']} resolved, {row['env_errors']} env errors)")
    if real is not None:
        samples = ", ".join(f"{d * 1e3:.0f}/{s * 1e3:.0f}" for d, s in zip(real_svc["direct"], real_svc["service"],
                                                                          strict=True))
        print(f"real repository: networkx's installed source in a git clone at its base commit; "
              f"both ways with the sandbox's {real_svc['python']} and the same pytest bundle; samples direct/service "
              f"ms: {samples}; repository ready (prepare_sandbox) p50 {p50(real_svc['ready']) * 1e3:.1f} ms; its "
              f"base built on the host once (before timing) in {real_svc['host_build'] * 1e3:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "direct": {"ready": ready, "reward": reward},
                                               "service": svc, "real": real_svc or None},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
