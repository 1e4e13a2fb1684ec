"""SWE sandboxes: the repository at its base commit before the episode (`prepare_sandbox`), and the reward after
it (`score_sandbox`), through the async sandbox client (``orchard.env.AsyncSandboxClient``'s sandboxes).

Before the episode: the instance's repository (its ``files``, or its ``repo_dir`` without ``.git``) is put in the
sandbox's workspace (its working directory, ``/workspace`` under bubblewrap) with its git repository of one
commit (so ``git diff`` against it is the agent's patch) already built: `base_tree` runs ``git init`` and the
commit on this host once per snapshot (cached under a key that reads none of the repository's files, see
`orchard.domains.swe.trees`), and the service's archive upload unpacks it through its file layer, so no process
starts in the sandbox for it. The base is remembered for the sandbox, and its scoring uses it again.
And ``python3 -m pytest`` works: where the image's python has no pytest (the host image here: the development
virtualenv's interpreter lies under a home the sandbox's uid cannot enter), pytest and its dependencies (pure
Python) come as one zip with their bytecode (`pytest_bundle`), put on the sandbox user's path by a ``.pth`` file
in its site directory. The zip is read where every sandbox of the service sees it, read-only, when the service
shares a folder named ``orchard-pytest`` holding it (`write_pytest_bundle`; ``serve(shared={"orchard-pytest":
folder})``, on Kubernetes an image layer or volume at the same path); else it is sent with the command into the
user site. The ``.pth`` takes a command (the user site is outside the workspace, where the file API does not
reach), unless the sandbox was created with `pytest_env` (the shared zip on every command's ``PYTHONPATH``):
then the set-up runs no command at all. Whether the image has pytest, where its user site lies and what the
shared folder holds is asked once per service, image and python and remembered by this process. The sandbox is
created by the caller, with the network blocked (the client's default); nothing here needs the network.

After the episode (`score_sandbox`), as SWE-bench's harness does, only the agent's patch counts:

1. the patch is the workspace's diff from the base commit (``git add -A; git diff --cached --binary``, so new
   files count; ``__pycache__`` and ``.pytest_cache`` are excluded), and the workspace is emptied;
2. on this host (`scored_archive`), the base the sandbox was prepared with, with the patch applied (so a
   rewritten history, hooks or files outside the diff change nothing);
3. the test files ``test_patch`` touches are reset to their base version (a patch that edited the tests loses
   those edits), then ``test_patch`` is applied, and the tree goes into the emptied workspace by the archive
   upload (the base's archive as it was built, followed by the files the patches touch: only those are
   unpacked and patched here);
4. ``FAIL_TO_PASS`` + ``PASS_TO_PASS`` run with one pytest under a timeout, with the user site directory off
   (pytest comes from the image, or from the service's read-only shared folder, or from a copy of the zip in the
   command's own ``/tmp`` whose SHA-256 matches this process's bundle, else from a fresh copy sent with the
   command: never from where the agent could have written): resolved iff every one passes, as
   `orchard.domains.swe.testrun.parse_test_results` reads the run's summary and exit status (a failed subtest, a
   teardown error, or a failed exit status that the summary does not explain is no pass).

Step 1 is one command and step 4 another. A patch that does not apply, or may write more than
`MAX_PATCH_WRITE_BYTES` (read from its headers before anything is unpacked here), a tree the archive upload
refuses for its size, or a run that times out or crashes, is the policy's failure (not resolved, reward -1). A sandbox that fails (the client's errors, or a set-up step that
should succeed and did not: `orchard.rollout.harness.EnvironmentFailure`, a step 1 that runs out of time
among them, since no patch was taken) raises: the caller marks the episode ``env_error``, never 0. Every set-up step is done before the agent's code runs again (in step 4), so a test
that exits with a chosen status cannot pass itself off as a set-up failure.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import importlib.metadata
import importlib.util
import io
import marshal
import os
import re
import sys
import tarfile
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchard.domains.swe.instances import SWEInstance
from orchard.domains.swe.patches import patch_write_bound, patched_paths
from orchard.domains.swe.testrun import PYTEST_ENV, parse_test_results, pytest_argv
from orchard.domains.swe.trees import (
    BASE_CACHE_BYTES,
    EXCLUDE,
    GIT_ENV,
    MAX_PATCH_WRITE_BYTES,
    RECENT_CHANGE_S,
    BaseTree,
    PatchTooLargeError,
    base_archive,
    base_tree,
    repository_archive,
    scored_archive,
    scored_tree,
)
from orchard.env.backends.base import SHARED_MOUNT
from orchard.env.errors import BadRequestError, PathError
from orchard.rollout.harness import EnvironmentFailure

__all__ = [
    "BASE_CACHE_BYTES", "EXCLUDE", "GIT_ENV", "MAX_PATCH_BYTES", "MAX_PATCH_WRITE_BYTES", "PYTHON", "RECENT_CHANGE_S",
    "SHARED_PYTEST", "WORKSPACE", "BaseTree", "PatchTooLargeError", "SWEVerdict", "base_archive", "base_tree",
    "patch_write_bound", "patched_paths", "prepare_sandbox", "pytest_bundle", "pytest_env", "repository_archive",
    "sandbox_options", "score_sandbox", "scored_archive", "scored_tree", "shared_folders", "write_pytest_bundle",
]

WORKSPACE = "/workspace"
"""The sandbox's workspace as the file API names it (its working directory: the repository's root)."""

PYTHON = "python3"
"""The interpreter inside the sandbox (as the Claw domain: the image's ``python3`` on PATH)."""


MAX_PATCH_BYTES = 16 << 20
"""A larger diff is not scored (not resolved): no repository fix is 16 MiB."""

_BUNDLE = "orchard-pytest"
"""The zip in the sandbox user's site directory, and the ``.pth`` file there that puts it on ``sys.path``."""

SHARED_PYTEST = "orchard-pytest"
"""The name of the service's shared folder that holds `pytest_bundle` (see `write_pytest_bundle`)."""

_INPUTS = """set -o pipefail
t=$(mktemp -d) || exit 1
trap 'rm -rf "$t"' EXIT
base64 -d | tar -xf - -C "$t" || { echo "unpacking the command's inputs failed" >&2; exit 1; }
"""
"""The command's standard input, a base64 tar of its inputs, unpacked in a fresh temporary directory ``$t``."""

_PREPARE = _INPUTS + f"""if [ -f "$t/tree.tar.gz" ]; then tar -xzf "$t/tree.tar.gz" --no-same-owner -C . >&2 || exit 1; fi
if [ -f "$t/pytest.zip" ]; then
  {{ mkdir -p "$ORCHARD_SITE" && mv "$t/pytest.zip" "$ORCHARD_SITE/{_BUNDLE}.zip" &&
    printf '%s\\n' "$ORCHARD_SITE/{_BUNDLE}.zip" > "$ORCHARD_SITE/{_BUNDLE}.pth"; }} >&2 || exit 1
elif [ -n "${{ORCHARD_PYTEST:-}}" ]; then
  {{ mkdir -p "$ORCHARD_SITE" && printf '%s\\n' "$ORCHARD_PYTEST" > "$ORCHARD_SITE/{_BUNDLE}.pth"; }} >&2 || exit 1
fi
if [ -n "${{ORCHARD_CHECK:-}}" ]; then "$ORCHARD_PYTHON" -c "import pytest" >&2 || exit 1; fi
"""
"""The set-up command, when one is needed: a tree the archive upload refused (``$t/tree.tar.gz``, unpacked by
tar); pytest in the user site ``$ORCHARD_SITE`` when it was sent, or a ``.pth`` there naming the shared copy
``$ORCHARD_PYTEST``; the import checked when ``$ORCHARD_CHECK`` is set."""

_EMPTY_FAILED = 2
_TAKE_PATCH = f"""base=$(git rev-list --max-parents=0 HEAD) && base=${{base##*$'\\n'}} && git add -A &&
  git diff --cached --binary --no-color --no-ext-diff "$base" || exit 1
{{ chmod -R u+rwX . 2>/dev/null; find . -mindepth 1 -delete; }} >&2 || exit {_EMPTY_FAILED}
"""
"""`score_sandbox`'s first command (steps 1 and 2's emptying): the diff from the first root commit on standard
output (exit 1 when git fails: the agent broke its repository), then the workspace emptied (exit
`_EMPTY_FAILED` when that fails: the sandbox's failure)."""

_TESTS, _PYTEST_MISSING = "orchard: tests", "orchard: pytest-missing"
"""`_BUNDLE_TESTS`'s first output line: the step it reached (absent: a set-up step failed)."""

_BUNDLE_TESTS = f"""set -o pipefail
t=$(mktemp -d) || exit 1
trap 'rm -rf "$t"' EXIT
if [ -n "${{ORCHARD_SEND:-}}" ]; then
  base64 -d > "$t/pytest.zip" || exit 1
else
  cp -- "$ORCHARD_SITE/{_BUNDLE}.zip" "$t/pytest.zip" 2>/dev/null || {{ echo "{_PYTEST_MISSING}"; exit 0; }}
  [ "$(sha256sum < "$t/pytest.zip" 2>/dev/null | cut -c1-64)" = "$ORCHARD_SHA" ] || {{ echo "{_PYTEST_MISSING}"; exit 0; }}
fi
export PYTHONPATH="$t/pytest.zip${{PYTHONPATH:+:$PYTHONPATH}}"
echo "{_TESTS}"
"$@"
"""
"""`score_sandbox`'s test run when neither the image nor the service's shared folder has pytest: the bundle
from the user site, used only when its SHA-256 is ``$ORCHARD_SHA`` (the agent could have replaced it), copied
into the command's own ``/tmp``; else (``$ORCHARD_SEND`` set) a fresh copy from standard input."""


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
    """The test run's exit code and whether it timed out, and the tail of its output; for a patch not scored,
    the ``reason``."""

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


def _pytest_distributions() -> list[importlib.metadata.Distribution]:
    """pytest and the distributions it requires (markers aside, those installed here), sorted by name."""
    found: dict[str, importlib.metadata.Distribution] = {}
    queue = ["pytest"]
    while queue:
        name = queue.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a platform-only requirement (colorama on Windows) that this machine lacks
        key = dist.metadata["Name"].lower()
        if key in found:
            continue
        found[key] = dist
        for requirement in dist.requires or []:
            if "extra ==" not in requirement:
                queue.append(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])
    return [found[key] for key in sorted(found)]


@functools.cache
def pytest_bundle() -> bytes:
    """pytest and the distributions it requires, as a zip of their site-packages files: on a sandbox's
    ``sys.path`` (zipimport), ``import pytest`` works.

    Each module's bytecode for this interpreter sits beside its source (``mod.pyc``, where zipimport looks),
    unchecked-hash, so a sandbox python of the same minor version imports pytest without compiling it (seconds
    under load, paid again by every run from a read-only copy); another version ignores it and compiles the
    source. Of pygments (1.2 MB of source, mostly lexers) only the modules pytest imports on every run get
    bytecode: the rest is imported only to colour other languages.
    """
    from orchard._extras import requires_extra

    with requires_extra("swe"):
        import _pytest._io.terminalwriter  # noqa: F401  (what it imports of pygments is what every run imports)

    loaded = {Path(m.__file__).resolve() for name, m in list(sys.modules.items())
              if name.partition(".")[0] == "pygments" and getattr(m, "__file__", None)}
    buffer = io.BytesIO()
    # PEP 552: bit 0 hash-based, bit 1 check the source; 0b01 is never checked (0b11 had every import decompress
    # and hash its module's source)
    flags = (0b01).to_bytes(4, "little")
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for dist in _pytest_distributions():
            for entry in sorted(dist.files or [], key=str):
                name = Path(str(entry)).as_posix()
                parts = Path(name).parts
                if ".." in parts or "__pycache__" in parts or name.endswith(".pyc"):
                    continue
                source = Path(str(entry.locate()))
                if not source.is_file():
                    continue
                data = source.read_bytes()
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # the same bytes every time
                info.compress_type = zipfile.ZIP_DEFLATED
                bundle.writestr(info, data)
                if name.endswith(".py") and (parts[0] != "pygments" or source.resolve() in loaded):
                    code = compile(data, name, "exec", dont_inherit=True)
                    pyc = importlib.util.MAGIC_NUMBER + flags + importlib.util.source_hash(data) + marshal.dumps(code)
                    info = zipfile.ZipInfo(name[:-3] + ".pyc", date_time=(1980, 1, 1, 0, 0, 0))
                    info.compress_type = zipfile.ZIP_DEFLATED
                    bundle.writestr(info, pyc)
    return buffer.getvalue()


@functools.cache
def _bundle_sha256() -> str:
    return hashlib.sha256(pytest_bundle()).hexdigest()


def _shared_bundle_name() -> str:
    return f"pytest-{_bundle_sha256()[:16]}.zip"


def write_pytest_bundle(directory: str | os.PathLike[str]) -> str:
    """Write `pytest_bundle` into ``directory`` (made if missing, world-readable) under a name that carries its
    hash, and return the file's path. Share ``directory`` with the sandboxes as ``SHARED_PYTEST``
    (``serve(shared={SHARED_PYTEST: directory})``): `prepare_sandbox` then sends no pytest, and every sandbox
    reads this one read-only copy. A bundle of another environment (another hash) beside it is ignored.
    """
    if not isinstance(directory, str | os.PathLike):
        raise ValueError(f"directory must be a path, got {type(directory).__name__}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    target = folder / _shared_bundle_name()
    if not target.is_file():
        tmp = folder / f".{target.name}.{os.getpid()}"
        tmp.write_bytes(pytest_bundle())
        tmp.chmod(0o644)
        tmp.replace(target)
    return str(target)


@dataclass(frozen=True)
class _ImageFacts:
    has_pytest: bool
    """The image's python imports pytest with the user site off."""
    user_site: str
    """The sandbox user's site directory, where the bundle goes when the image lacks pytest."""
    shared: tuple[str, ...] = ()
    """The file names in the service's shared ``SHARED_PYTEST`` folder (empty: no such folder)."""

    @property
    def shared_pytest(self) -> str:
        """The path in the sandbox of this process's bundle in the shared folder ('' when it is not there)."""
        if self.has_pytest or _shared_bundle_name() not in self.shared:
            return ""
        return f"{SHARED_MOUNT}/{SHARED_PYTEST}/{_shared_bundle_name()}"


_FACTS: dict[tuple[str, str, str], _ImageFacts] = {}
"""What the first sandbox of a (service, image, python) told; the image is read-only, so every later one agrees."""
_CHECKED: set[tuple[str, str, str]] = set()
"""Keys whose bundle was seen to import after it was installed."""


def _facts_key(sandbox: Any, python: str) -> tuple[str, str, str]:
    info = getattr(sandbox, "info", None) or {}
    return (str(getattr(getattr(sandbox, "client", None), "base_url", "")), str(info.get("image", "")), python)


async def _image_facts(sandbox: Any, python: str, timeout: float) -> _ImageFacts:
    key = _facts_key(sandbox, python)
    if key in _FACTS:
        return _FACTS[key]
    folder = f"{SHARED_MOUNT}/{SHARED_PYTEST}"
    probe = ("import os, site; print(site.getusersitepackages()); "
             f"print(*sorted(os.listdir({folder!r})) if os.path.isdir({folder!r}) else [], flush=True); import pytest")
    # -I: neither the user site nor the working directory (the agent's) on the path
    result = await sandbox.exec([python, "-I", "-c", probe], timeout=timeout)
    if result.exit_code == 127:
        raise EnvironmentFailure(f"the sandbox has no {python}: {result.stderr[-300:]}")
    site, _, shared = result.stdout.partition("\n")
    if not site.startswith("/"):
        raise EnvironmentFailure(f"{python} in the sandbox names no user site directory (exit "
                                 f"{result.exit_code}): {(result.stderr or result.stdout)[-300:]}")
    _FACTS[key] = _ImageFacts(result.exit_code == 0, site.strip(), tuple(shared.split()))
    return _FACTS[key]


def pytest_env() -> dict[str, str]:
    """The sandbox environment (``client.create(env=pytest_env())``, or a pool's ``env``) that puts the service's
    shared pytest (`write_pytest_bundle`) on the path of every command: `prepare_sandbox` then writes no ``.pth``
    and runs no command at all. For images without pytest (it would come before the image's own); a path that
    is not there (the service shares no such folder) is ignored by Python, and `prepare_sandbox` writes the
    ``.pth`` as without it."""
    return {"PYTHONPATH": f"{SHARED_MOUNT}/{SHARED_PYTEST}/{_shared_bundle_name()}"}


def shared_folders() -> dict[str, Callable[[Path], object]]:
    """The folders a sandbox service started for SWE episodes shares with every sandbox, name -> the function that
    fills one (``orchard.stages.sandbox_service(url, shared=shared_folders())``): the pytest bundle, so no episode
    sends its own."""
    return {SHARED_PYTEST: write_pytest_bundle}


def sandbox_options() -> dict[str, Any]:
    """What every SWE episode creates its sandbox with (``client.create(**sandbox_options())``, and the recipe's
    warm pools, whose sandboxes only serve requests with the same options): the host image and `pytest_env`, so
    that `prepare_sandbox` runs no command where the service shares pytest."""
    return {"image": "host", "env": pytest_env()}


def _pytest_on_path(sandbox: Any, shared: str) -> bool:
    """Whether every command of ``sandbox`` has ``shared`` on its ``PYTHONPATH`` (the sandbox's own env)."""
    env = (getattr(sandbox, "info", None) or {}).get("env") or {}
    return bool(shared) and shared in str(env.get("PYTHONPATH", "")).split(":")


def _inputs(**members: bytes | str) -> str:
    """A base64 tar of named files: the standard input of `_PREPARE`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(raw), 0o600
            tar.addfile(info, io.BytesIO(raw))
    return base64.b64encode(buffer.getvalue()).decode("ascii")


async def _run(sandbox: Any, command: list[str] | str, what: str, *, timeout: float, stdin: str | None = None,
               env: dict[str, str] | None = None, max_output_bytes: int | None = None) -> Any:
    result = await sandbox.exec(command, timeout=timeout, stdin=stdin, env=env, max_output_bytes=max_output_bytes)
    if result.exit_code != 0:
        raise EnvironmentFailure(f"{what} failed (exit {result.exit_code}): {(result.stderr or result.stdout)[-500:]}")
    return result


_UPLOAD_TOO_LARGE = "unpacks to more than max_bytes"
"""The archive upload's refusal of a tree beyond its cap (1 GiB), a ``BadRequestError``."""

_PREPARED: OrderedDict[tuple[str, str], tuple[str, BaseTree]] = OrderedDict()
"""(service, sandbox id) -> (instance id, the base `prepare_sandbox` put there), taken by `score_sandbox`: the
scoring applies the patch to the very base the agent started from, and looks nothing up again. The most recent
`_PREPARED_MAX` (a sandbox that is never scored leaves its entry until then)."""
_PREPARED_MAX = 256
_PREPARED_LOCK = threading.Lock()  # episodes may run on the event loops of several threads


def _sandbox_key(sandbox: Any) -> tuple[str, str] | None:
    ident = getattr(sandbox, "sandbox_id", None)
    if not isinstance(ident, str):
        return None
    return str(getattr(getattr(sandbox, "client", None), "base_url", "")), ident


def _remember_base(sandbox: Any, instance: SWEInstance, base: BaseTree) -> None:
    key = _sandbox_key(sandbox)
    if key is not None:
        with _PREPARED_LOCK:
            _PREPARED[key] = (instance.instance_id, base)
            _PREPARED.move_to_end(key)
            while len(_PREPARED) > _PREPARED_MAX:
                _PREPARED.popitem(last=False)


async def _prepared_base(sandbox: Any, instance: SWEInstance) -> BaseTree:
    """The base `prepare_sandbox` put in ``sandbox`` for ``instance``; built (or looked up) again when this
    process did not prepare it."""
    key = _sandbox_key(sandbox)
    with _PREPARED_LOCK:
        entry = _PREPARED.pop(key, None) if key is not None else None
    if entry is not None and entry[0] == instance.instance_id:
        return entry[1]
    return await asyncio.to_thread(base_tree, instance)


async def _upload_tree(sandbox: Any, tree: bytes) -> bool:
    """Unpack ``tree`` (a gzipped tar) in the workspace through the archive upload, no process in the sandbox;
    False when the service refused a member (a link that leaves the tree: `_PREPARE` unpacks it with tar)."""
    try:
        await sandbox.upload_archive(WORKSPACE, tree)
    except PathError:
        return False
    return True


async def prepare_sandbox(sandbox: Any, instance: SWEInstance, *, timeout: float = 60.0,
                          python: str = PYTHON) -> str:
    """Put ``instance``'s repository at its base commit in the sandbox's workspace, with git and pytest.

    The repository (`base_tree`: the files and their ``.git``, built on this host once per snapshot) goes in
    through the service's archive upload, which starts no process in the sandbox. No command follows when the
    image has pytest, or when the service shares it and the sandbox was created with `pytest_env`; else one
    (a ``.pth`` in the user site naming the shared copy, or pytest itself on its standard input when the image
    lacks it and the service shares none). A repository with a link the upload refuses (one leaving the tree)
    is unpacked by that command instead. Before the first sandbox of a service, image and python in this
    process: one probe of the image.

    Returns the base commit's hash (not ``instance.base_commit``: the history is one commit).

    Args:
        sandbox: a fresh sandbox (``AsyncSandbox``) with an empty workspace.
        instance: the task.
        timeout: per set-up command, seconds. Default 60.
        python: the sandbox's interpreter. Default "python3".

    Raises:
        EnvironmentFailure: a set-up command failed (no tar or python in the image; pytest unusable).
    """
    if not isinstance(instance, SWEInstance):
        raise ValueError(f"instance must be a SWEInstance, got {type(instance).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    facts = await _image_facts(sandbox, python, timeout)
    key = _facts_key(sandbox, python)
    base = await asyncio.to_thread(base_tree, instance)  # git on this host the first time
    archive = base.archive
    members: dict[str, bytes] = {} if await _upload_tree(sandbox, archive) else {"tree.tar.gz": archive}
    env = {**GIT_ENV, "ORCHARD_SITE": facts.user_site, "ORCHARD_PYTHON": python}
    if facts.has_pytest or _pytest_on_path(sandbox, facts.shared_pytest):
        pass
    elif facts.shared_pytest:
        env["ORCHARD_PYTEST"] = facts.shared_pytest
    else:
        members["pytest.zip"] = await asyncio.to_thread(pytest_bundle)  # built once, seconds: off the loop
    if not members and "ORCHARD_PYTEST" not in env:
        _remember_base(sandbox, instance, base)
        return base.commit
    if not facts.has_pytest and key not in _CHECKED:
        env["ORCHARD_CHECK"] = "1"
    await _run(sandbox, ["bash", "-c", _PREPARE], "preparing the repository and pytest", timeout=timeout,
               stdin=_inputs(**members), env=env)
    if "ORCHARD_CHECK" in env:
        _CHECKED.add(key)
    _remember_base(sandbox, instance, base)
    return base.commit


async def score_sandbox(sandbox: Any, instance: SWEInstance, timeout_s: float = 300.0, *,
                        setup_timeout_s: float = 60.0, python: str = PYTHON) -> SWEVerdict:
    """Score the finished episode in its sandbox: the agent's patch against the hidden tests (see the module).

    Two commands and an upload: the diff, taken with the workspace emptied in the same command; the patched
    tree (`scored_archive`: the base this process prepared the sandbox with, or else `base_tree` of the
    instance, and the touched files patched on this host) through the archive upload; the tests, whose limit is
    ``timeout_s + setup_timeout_s`` (our reading of "the tests run with a timeout": a slow start never eats
    the tests' time). A tree the upload refuses (a link the agent made that leaves the repository) is unpacked
    by a third command with tar. When pytest is neither in the image nor shared, the test command takes the
    user site's copy after checking its hash, and runs once more with a fresh copy when that was altered. A
    patch that may write more than `MAX_PATCH_WRITE_BYTES`, or a tree the upload refuses for its size, is not
    resolved (``patch_applied`` False, the reason in ``details``), never an environment failure.

    Args:
        sandbox: the episode's sandbox, prepared by `prepare_sandbox`.
        instance: the task.
        timeout_s: the test run's limit, seconds. Default 300.
        setup_timeout_s: the first command's limit, and the set-up's share of the test command's. Default 60.
        python: the sandbox's interpreter. Default "python3".

    Raises:
        ValueError: ``instance`` has no ``FAIL_TO_PASS`` test (every verdict would be resolved) or an empty test id,
            or a timeout is not a number > 0; checked before the sandbox is touched.
        EnvironmentFailure: a step before the tests that should succeed did not (taking the patch within
            ``setup_timeout_s``, emptying the workspace, unpacking, ``test_patch`` not applying to the base), or the
            image's pytest is gone. Once the tests
            started, any exit status is theirs: the probe found the python, so a 126 or 127 comes from the
            agent's code (a conftest that exits so), the policy's failure rather than an ``env_error`` it could
            hide behind.
    """
    if not isinstance(instance, SWEInstance):
        raise ValueError(f"instance must be a SWEInstance, got {type(instance).__name__}")
    # With no test to decide it every verdict would be vacuously resolved (and pytest, given no id, runs them all)
    if not instance.FAIL_TO_PASS:
        raise ValueError(f"instance.FAIL_TO_PASS must name at least one test, got {instance.FAIL_TO_PASS!r}")
    for name, ids in (("FAIL_TO_PASS", instance.FAIL_TO_PASS), ("PASS_TO_PASS", instance.PASS_TO_PASS)):
        if isinstance(ids, str) or not all(isinstance(t, str) and t.strip() for t in ids):
            raise ValueError(f"instance.{name} must be a list of non-empty test ids, got {ids!r:.120}")
    for name, value in (("timeout_s", timeout_s), ("setup_timeout_s", setup_timeout_s)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    tests = instance.tests
    taken = await sandbox.exec(["bash", "-c", _TAKE_PATCH], timeout=setup_timeout_s, env=GIT_ENV,
                               max_output_bytes=MAX_PATCH_BYTES)
    if taken.timed_out:
        # No patch was taken, so there is nothing to score: the episode has no verdict (env_error), not a -1.
        raise EnvironmentFailure(f"taking the patch timed out after {setup_timeout_s:g} s: {taken.stderr[-300:]}")
    if taken.exit_code == _EMPTY_FAILED:
        raise EnvironmentFailure(f"emptying the workspace failed: {taken.stderr[-500:]}")
    # A repository the agent broke (.git removed) gives no patch: its failure, not the sandbox's.
    patch_ok = taken.exit_code == 0 and not taken.stdout_truncated
    patch = taken.stdout if patch_ok else ""
    facts = await _image_facts(sandbox, python, setup_timeout_s)
    base = await _prepared_base(sandbox, instance)

    def unscored(reason: str) -> SWEVerdict:
        return SWEVerdict(False, dict.fromkeys(instance.FAIL_TO_PASS, False),
                          dict.fromkeys(instance.PASS_TO_PASS, False), patch, False, {"reason": reason})

    try:
        tree = await asyncio.to_thread(scored_archive, base, patch, instance.test_patch) if patch_ok else None
    except PatchTooLargeError as exc:
        return unscored(str(exc))
    if tree is None:
        return unscored("the patch could not be taken or applied")
    try:
        uploaded = await _upload_tree(sandbox, tree)
    except BadRequestError as exc:
        # the tree is the base, test_patch and the agent's patch: past the upload's cap, the patch made it so
        if _UPLOAD_TOO_LARGE not in str(exc):
            raise
        return unscored(f"the patched tree is larger than the archive upload takes: {exc}")
    if not uploaded:
        await _run(sandbox, ["bash", "-c", _PREPARE], "unpacking the scored tree", timeout=setup_timeout_s,
                   stdin=_inputs(**{"tree.tar.gz": tree}))
    # The tests' environment: nothing from the agent's home on the path.
    env = {**PYTEST_ENV, "PYTHONNOUSERSITE": "1"}
    argv = pytest_argv(python, tests)
    limit = timeout_s + setup_timeout_s
    if facts.has_pytest or facts.shared_pytest:
        if facts.shared_pytest:
            env["PYTHONPATH"] = facts.shared_pytest  # read-only for the agent: no copy, no hash to check
        run = await sandbox.exec(argv, timeout=limit, env=env)
        output = run.stdout
    else:
        env.update(ORCHARD_SITE=facts.user_site, ORCHARD_SHA=await asyncio.to_thread(_bundle_sha256))
        bundle_argv = ["bash", "-c", _BUNDLE_TESTS, "bash", *argv]
        run = await sandbox.exec(bundle_argv, timeout=limit, env=env)
        if run.stdout.startswith(_PYTEST_MISSING + "\n"):
            fresh = base64.b64encode(await asyncio.to_thread(pytest_bundle)).decode("ascii")
            run = await sandbox.exec(bundle_argv, timeout=limit, env={**env, "ORCHARD_SEND": "1"}, stdin=fresh)
        step, _, output = run.stdout.partition("\n")
        if step != _TESTS:
            raise EnvironmentFailure(f"setting up the test run failed (exit {run.exit_code}"
                                     f"{', timed out' if run.timed_out else ''}): {(run.stderr or run.stdout)[-500:]}")
    if facts.has_pytest and run.exit_code == 1 and "No module named pytest" in run.stderr:
        # The image's pytest gone (an image replaced under its name while this process remembered it), or a
        # conftest that says so: the image, which the agent cannot touch, tells which.
        _FACTS.pop(_facts_key(sandbox, python), None)
        if not (await _image_facts(sandbox, python, setup_timeout_s)).has_pytest:
            raise EnvironmentFailure(f"the image's {python} no longer has pytest: {run.stderr[-300:]}")
    results = parse_test_results(output, tests, exit_code=run.exit_code)
    fail_to_pass = {t: results[t] for t in instance.FAIL_TO_PASS}
    pass_to_pass = {t: results[t] for t in instance.PASS_TO_PASS}
    return SWEVerdict(all(results.values()), fail_to_pass, pass_to_pass, patch, True,
                      {"exit_code": run.exit_code, "timed_out": bool(run.timed_out),
                       "output_tail": output[-2000:]})
