"""SWE sandboxes: the repository at its base commit before the episode (`prepare_sandbox`), and the reward after
it (`score_sandbox`), through the async sandbox client (``orchard.env.AsyncSandboxClient``'s sandboxes).

Before the episode: the instance's repository (its ``files``, or its ``repo_dir`` without ``.git``) is unpacked
in the sandbox's workspace (its working directory, ``/workspace`` under bubblewrap), git is initialised with one
commit (so ``git diff`` against it is the agent's patch), and ``python3 -m pytest`` works: where the image's
python has no pytest (the host image here: the development virtualenv's interpreter lies under a home the
sandbox's uid cannot enter), pytest and its dependencies, copied from this process's environment (pure Python),
are unpacked in the sandbox user's site directory. The sandbox is created by the caller, with the network
blocked (the client's default); nothing here needs the network.

After the episode (`score_sandbox`), as SWE-bench's harness does, only the agent's patch counts:

1. the patch is the workspace's diff from the base commit (``git add -A; git diff --cached --binary``, so new
   files count; ``__pycache__`` and ``.pytest_cache`` are excluded);
2. the workspace is emptied and the base unpacked again, and the patch applied to it (so a rewritten history,
   hooks or files outside the diff change nothing);
3. the test files ``test_patch`` touches are reset to their base version (a patch that edited the tests loses
   those edits), then ``test_patch`` is applied;
4. ``FAIL_TO_PASS`` + ``PASS_TO_PASS`` run with one pytest under a timeout, with the user site directory off
   (pytest comes from the image or from a fresh copy in the command's own ``/tmp``, never from where the agent
   could write): resolved iff every one passes.

A patch that does not apply, or a run that times out or crashes, is the policy's failure (not resolved, reward
-1). A sandbox that fails (the client's errors, or a set-up command that should succeed and did not:
`orchard.rollout.harness.EnvironmentFailure`) raises: the caller marks the episode ``env_error``, never 0.
"""

from __future__ import annotations

import base64
import functools
import importlib.metadata
import io
import re
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.testrun import PYTEST_ENV, parse_test_results, pytest_argv
from orchard.rollout.harness import EnvironmentFailure

PYTHON = "python3"
"""The interpreter inside the sandbox (as the Claw domain: the image's ``python3`` on PATH)."""

GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "orchard",
           "GIT_AUTHOR_EMAIL": "orchard@localhost", "GIT_COMMITTER_NAME": "orchard",
           "GIT_COMMITTER_EMAIL": "orchard@localhost", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
"""Our git commands read no configuration the agent could have written (``~/.gitconfig``: aliases, hooks), and
the base commit's identity and date are fixed, so its hash depends on the files only."""

EXCLUDE = "__pycache__/\n*.pyc\n.pytest_cache/\n"
"""Never part of the agent's patch (``.git/info/exclude``, not a file of the repository)."""

MAX_PATCH_BYTES = 16 << 20
"""A larger diff is not scored (not resolved): no repository fix is 16 MiB."""

_UNPACK = "base64 -d | tar -xzf - --no-same-owner -C ."
_GIT_BASE = ("git init -q . && printf %s " + shlex.quote(EXCLUDE) + " > .git/info/exclude && git add -A && "
             "git -c commit.gpgsign=false commit -q --no-verify --allow-empty -m base && git rev-parse HEAD")
_DIFF = ("base=$(git rev-list --max-parents=0 HEAD | tail -n 1) && git add -A && "
         "git diff --cached --binary --no-color --no-ext-diff \"$base\"")


@dataclass(frozen=True)
class SWEVerdict:
    """The outcome of one episode: the agent's patch and how the decisive tests did with it."""

    resolved: bool
    """Every ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` test passed."""
    fail_to_pass: dict[str, bool]
    """Per ``FAIL_TO_PASS`` test: passed."""
    pass_to_pass: dict[str, bool]
    """Per ``PASS_TO_PASS`` test: passed."""
    patch: str
    """The agent's diff from the base commit ('' when it changed nothing)."""
    patch_applied: bool
    """The patch applied to a clean base (False for a patch too large or not applicable; empty applies)."""
    details: dict[str, Any] = field(default_factory=dict)
    """The test run's exit code and whether it timed out, and the tail of its output."""

    @property
    def tests(self) -> dict[str, bool]:
        """Every decisive test: passed."""
        return {**self.fail_to_pass, **self.pass_to_pass}

    @property
    def reward(self) -> float:
        """The RL reward: +1 when resolved, -1 otherwise (the outcome reward, as in the Claw domain)."""
        return 1.0 if self.resolved else -1.0

    @property
    def components(self) -> dict[str, float]:
        """Named parts, as floats (a trajectory's ``reward_components``): ``resolved``, the fractions of
        ``fail_to_pass`` and ``pass_to_pass`` tests that passed (1 when a set is empty), ``patch_applied`` and
        ``empty_patch``."""
        def fraction(results: dict[str, bool]) -> float:
            return sum(results.values()) / len(results) if results else 1.0

        return {"resolved": float(self.resolved), "fail_to_pass": fraction(self.fail_to_pass),
                "pass_to_pass": fraction(self.pass_to_pass), "patch_applied": float(self.patch_applied),
                "empty_patch": float(not self.patch.strip())}


def repository_archive(instance: SWEInstance) -> bytes:
    """The repository at the base commit as a gzipped tar (sorted, fixed times; a ``repo_dir``'s ``.git`` left
    out, symlinks kept as links)."""
    if not isinstance(instance, SWEInstance):
        raise ValueError(f"instance must be a SWEInstance, got {type(instance).__name__}")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        if instance.files is not None:
            for path in sorted(instance.files):
                data = instance.files[path].encode()
                info = tarfile.TarInfo(path)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        else:
            root = Path(instance.repo_dir or "")
            if not root.is_dir():
                raise ValueError(f"instance.repo_dir {instance.repo_dir!r} is not a directory")
            for path in sorted(root.rglob("*")):
                rel = path.relative_to(root)
                if rel.parts[0] == ".git" or not (path.is_file() or path.is_symlink()):
                    continue
                info = tar.gettarinfo(str(path), rel.as_posix())
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if info.isreg():
                    with path.open("rb") as handle:
                        tar.addfile(info, handle)
                else:
                    tar.addfile(info)
    return buffer.getvalue()


@functools.cache
def pytest_bundle() -> bytes:
    """pytest and the distributions it requires (markers aside, those installed here), as a gzipped tar of
    their site-packages files without bytecode: unpacked on a sandbox's ``sys.path``, ``import pytest`` works."""
    names, queue = set(), ["pytest"]
    while queue:
        name = queue.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a platform-only requirement (colorama on Windows) that this machine lacks
        key = dist.metadata["Name"].lower()
        if key in names:
            continue
        names.add(key)
        for requirement in dist.requires or []:
            if "extra ==" not in requirement:
                queue.append(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for name in sorted(names):
            dist = importlib.metadata.distribution(name)
            for entry in sorted(dist.files or [], key=str):
                parts = Path(str(entry)).parts
                if ".." in parts or "__pycache__" in parts or str(entry).endswith(".pyc"):
                    continue
                source = Path(str(entry.locate()))
                if source.is_file():
                    info = tar.gettarinfo(str(source), Path(str(entry)).as_posix())
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    with source.open("rb") as handle:
                        tar.addfile(info, handle)
    return buffer.getvalue()


async def _run(sandbox: Any, command: list[str] | str, what: str, *, timeout: float, stdin: str | None = None,
               env: dict[str, str] | None = None, max_output_bytes: int | None = None) -> Any:
    result = await sandbox.exec(command, timeout=timeout, stdin=stdin, env=env, max_output_bytes=max_output_bytes)
    if result.exit_code != 0:
        raise EnvironmentFailure(f"{what} failed (exit {result.exit_code}): {(result.stderr or result.stdout)[-500:]}")
    return result


async def _unpack_base(sandbox: Any, instance: SWEInstance, timeout: float) -> str:
    archive = base64.b64encode(repository_archive(instance)).decode("ascii")
    await _run(sandbox, ["bash", "-c", _UNPACK], "unpacking the repository", timeout=timeout, stdin=archive)
    result = await _run(sandbox, ["bash", "-c", _GIT_BASE], "the base commit", timeout=timeout, env=GIT_ENV)
    return result.stdout.strip()


async def _has_pytest(sandbox: Any, python: str, timeout: float, *, user_site: bool) -> bool:
    env = None if user_site else {"PYTHONNOUSERSITE": "1"}
    result = await sandbox.exec([python, "-c", "import pytest"], timeout=timeout, env=env)
    if result.exit_code == 127:
        raise EnvironmentFailure(f"the sandbox has no {python}: {result.stderr[-300:]}")
    return result.exit_code == 0


async def prepare_sandbox(sandbox: Any, instance: SWEInstance, *, timeout: float = 60.0,
                          python: str = PYTHON) -> str:
    """Put ``instance``'s repository at its base commit in the sandbox's workspace, with git and pytest.

    Returns the base commit's hash in the sandbox (not ``instance.base_commit``: the history is one commit).

    Args:
        sandbox: a fresh sandbox (``AsyncSandbox``) with an empty workspace.
        instance: the task.
        timeout: per set-up command, seconds. Default 60.
        python: the sandbox's interpreter. Default "python3".

    Raises:
        EnvironmentFailure: a set-up command failed (no git, tar or python in the image; pytest unusable).
    """
    if not isinstance(instance, SWEInstance):
        raise ValueError(f"instance must be a SWEInstance, got {type(instance).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    base = await _unpack_base(sandbox, instance, timeout)
    if not await _has_pytest(sandbox, python, timeout, user_site=True):
        bundle = base64.b64encode(pytest_bundle()).decode("ascii")
        site = f'"$({shlex.quote(python)} -c "import site; print(site.getusersitepackages())")"'
        script = f"d={site} && mkdir -p \"$d\" && base64 -d | tar -xzf - --no-same-owner -C \"$d\""
        await _run(sandbox, ["bash", "-c", script], "installing pytest", timeout=timeout, stdin=bundle)
        if not await _has_pytest(sandbox, python, timeout, user_site=True):
            raise EnvironmentFailure(f"pytest does not import in the sandbox's {python} after installing it")
    return base


def patched_paths(test_patch: str) -> list[str]:
    """The paths a ``git diff`` touches (old and new names), in order of appearance."""
    paths: list[str] = []
    for line in test_patch.splitlines():
        match = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
        if match:
            paths += [p for p in match.groups() if p not in paths]
    return paths


async def score_sandbox(sandbox: Any, instance: SWEInstance, timeout_s: float = 300.0, *,
                        setup_timeout_s: float = 60.0, python: str = PYTHON) -> SWEVerdict:
    """Score the finished episode in its sandbox: the agent's patch against the hidden tests (see the module).

    Args:
        sandbox: the episode's sandbox, prepared by `prepare_sandbox`.
        instance: the task.
        timeout_s: the test run's limit, seconds. Default 300.
        setup_timeout_s: per command that extracts the patch or rebuilds the base. Default 60.
        python: the sandbox's interpreter. Default "python3".

    Raises:
        EnvironmentFailure: a command that should succeed did not (unpacking, the base commit, ``test_patch``
            not applying to the base), or the test run could not start.
    """
    if not isinstance(instance, SWEInstance):
        raise ValueError(f"instance must be a SWEInstance, got {type(instance).__name__}")
    for name, value in (("timeout_s", timeout_s), ("setup_timeout_s", setup_timeout_s)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    tests = instance.tests
    diff = await sandbox.exec(["bash", "-c", _DIFF], timeout=setup_timeout_s, env=GIT_ENV,
                              max_output_bytes=MAX_PATCH_BYTES)
    # A repository the agent broke (.git removed) gives no patch: its failure, not the sandbox's.
    patch = diff.stdout if diff.exit_code == 0 and not diff.stdout_truncated else ""
    patch_ok = diff.exit_code == 0 and not diff.stdout_truncated

    # Steps 2-3: a clean base, the agent's patch, the test files reset, the hidden tests.
    await _run(sandbox, ["bash", "-c", "chmod -R u+rwX . 2>/dev/null; find . -mindepth 1 -delete"],
               "emptying the workspace", timeout=setup_timeout_s)
    await _unpack_base(sandbox, instance, setup_timeout_s)
    if patch_ok and patch.strip():
        applied = await sandbox.exec(["git", "apply", "--binary", "-"], timeout=setup_timeout_s, env=GIT_ENV,
                                     stdin=patch)
        patch_ok = applied.exit_code == 0
    if not patch_ok:
        return SWEVerdict(False, dict.fromkeys(instance.FAIL_TO_PASS, False),
                          dict.fromkeys(instance.PASS_TO_PASS, False), patch, False,
                          {"reason": "the patch could not be taken or applied"})
    reset = " ".join(shlex.quote(p) for p in patched_paths(instance.test_patch))
    if reset:
        script = (f"for f in {reset}; do if git cat-file -e HEAD:\"$f\" 2>/dev/null; then "
                  "git checkout -q HEAD -- \"$f\"; else rm -rf -- \"$f\"; fi; done")
        await _run(sandbox, ["bash", "-c", script], "resetting the test files", timeout=setup_timeout_s, env=GIT_ENV)
    if instance.test_patch.strip():
        await _run(sandbox, ["git", "apply", "--binary", "-"], "applying test_patch", timeout=setup_timeout_s,
                   env=GIT_ENV, stdin=instance.test_patch)

    # Step 4: the decisive tests, with nothing from the agent's home on the path.
    env = {**PYTEST_ENV, "PYTHONNOUSERSITE": "1"}
    argv = pytest_argv(python, tests)
    stdin = None
    if not await _has_pytest(sandbox, python, setup_timeout_s, user_site=False):
        stdin = base64.b64encode(pytest_bundle()).decode("ascii")
        argv = ["bash", "-c", 'd=$(mktemp -d) && base64 -d | tar -xzf - --no-same-owner -C "$d" && '
                'PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}" exec "$@"', "bash", *argv]
    run = await sandbox.exec(argv, timeout=timeout_s, env=env, stdin=stdin)
    if run.exit_code in (126, 127):
        raise EnvironmentFailure(f"the test run could not start (exit {run.exit_code}): {run.stderr[-300:]}")
    results = parse_test_results(run.stdout, tests)
    fail_to_pass = {t: results[t] for t in instance.FAIL_TO_PASS}
    pass_to_pass = {t: results[t] for t in instance.PASS_TO_PASS}
    return SWEVerdict(all(results.values()), fail_to_pass, pass_to_pass, patch, True,
                      {"exit_code": run.exit_code, "timed_out": bool(run.timed_out),
                       "output_tail": run.stdout[-2000:]})
