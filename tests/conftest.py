"""Set-up shared by test modules in different folders: the embedded sandbox service and the ids of the sandboxes it
holds, the tiny vision-language model and the screenshots it looks at, DeepSpeed's CPU op built once per session,
a scripted `Rollouts` for the task filter's tests, asyncio's timeouts as Python 3.10 has them, a harness
program's episode against a sandbox that never answers, and a real SWE-bench-format instance (a public fix) built as
a local git clone at its base commit.

On CI (the `CI` environment variable set) a skipped test fails, unless it skipped because the machine has no CUDA
device: a CI run that skipped, say, the isolation tests for want of bubblewrap would pass without testing what it
promises. CPU CI lacks only CUDA; the GPU checks (benchmarks/gpu_check.sh) run those tests."""

import asyncio
import base64
import fcntl
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The one reason a test may skip on CI: it needs a CUDA device ("needs a CUDA device", "CUDA is not available").
_ALLOWED_ON_CI = re.compile(r"\bCUDA\b", re.IGNORECASE)


def _fail_skip_on_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turns a skip (not an expected failure, whose report says skipped too) into a failure when `CI` is set."""
    if not os.environ.get("CI") or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if _ALLOWED_ON_CI.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = f"{reason}\n(on CI only a test that needs a CUDA device may skip: see tests/conftest.py)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    _fail_skip_on_ci(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    """A module that skips as a whole (``pytest.importorskip`` at its top) fails on CI too."""
    report = yield
    _fail_skip_on_ci(report)
    return report


@pytest.fixture(scope="module")
def embedded_service():
    """The embedded sandbox service with `orchard.env.embedded.serve`'s defaults (local backend, SQLite state, a
    temporary root), a fresh one per test module: a module's tests that check no sandbox is left see only their
    own module's."""
    from orchard.env.embedded import serve

    with serve() as service:
        yield service


@pytest.fixture(scope="session")
def sandbox_ids() -> Callable:
    """``await sandbox_ids(client)``: the ids of the sandboxes an `AsyncSandboxClient`'s service holds now."""

    async def ids(client) -> set[str]:
        return {s["sandbox_id"] for s in await client.list_sandboxes()}

    return ids


@pytest.fixture(scope="module")
def tiny_vl():
    """``(model, tokenizer, image_processor)`` of `orchard.models.tiny.tiny_vl_chat_model` (seed 0): a fresh one
    per test module, as tests put it in eval mode or leave gradients on it."""
    from orchard.models.tiny import tiny_vl_chat_model

    return tiny_vl_chat_model(seed=0)


@pytest.fixture(scope="session")
def screenshot() -> Callable[[int, int, int], dict]:
    """``screenshot(width, height, seed)``: an ``image_url`` content part holding a PNG of seeded random pixels as
    a data URL; the same arguments give the same part."""
    from PIL import Image

    def part(width: int, height: int, seed: int) -> dict:
        pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        return {"type": "image_url", "image_url": {"url": url}}

    return part


@pytest.fixture(scope="session")
def deepspeed_cpu_comm_op() -> None:
    """DeepSpeed's CPU shared-memory op, loaded (JIT-built if it is not yet) in one process before a test starts two
    ranks: two ranks building it into an empty build directory at once can abort one of them (seen in CI on a fresh
    clone). Built where the ranks look: ``TORCH_EXTENSIONS_DIR``, by default the checkout's build/torch_extensions.
    Once per session: each test that starts ranks used to pay this process's DeepSpeed import itself."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))
    # pytest-xdist workers each run this session fixture: one builds while the others wait on the lock, then load
    Path(env["TORCH_EXTENSIONS_DIR"]).mkdir(parents=True, exist_ok=True)
    with open(Path(env["TORCH_EXTENSIONS_DIR"]) / ".orchard-test-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu.comm import "
                               "ShareMemCommBuilder; ShareMemCommBuilder().load()"], env=env, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


class ScriptedRollouts:
    """A `Rollouts` whose i-th episode of a task has the i-th outcome of ``outcomes[task]`` (cycled): True passed
    (+1), False failed (-1), None a dead sandbox (env_error, unscored). Records each call's group size."""

    def __init__(self, outcomes):
        self.outcomes, self.calls, self.seen = outcomes, [], {}

    async def __call__(self, engine, tasks, *, group_size, temperature, max_tokens=None, seed=None):
        from orchard.data import Trajectory

        self.calls.append((list(tasks), group_size))
        out = []
        for task in tasks:
            for _ in range(group_size):
                i = self.seen.get(task, 0)
                self.seen[task] = i + 1
                o = self.outcomes[task][i % len(self.outcomes[task])]
                out.append(Trajectory(task_id=task, reward=None if o is None else (1.0 if o else -1.0),
                                      termination_reason="env_error" if o is None else "done"))
        return out


@pytest.fixture(scope="session")
def scripted_rollouts() -> type:
    """`ScriptedRollouts`: a `Rollouts` whose outcomes per task are fixed in advance (the task filter's tests)."""
    return ScriptedRollouts


class RecordingLog:
    """A `RunLog` stand-in that keeps what it is given: ``rows`` as ``(metrics, step)`` and the console ``lines``."""

    def __init__(self):
        self.rows, self.lines = [], []

    def log(self, metrics, step):
        self.rows.append((dict(metrics), step))

    def print(self, line):
        self.lines.append(line)


@pytest.fixture(scope="session")
def recording_log() -> type:
    """`RecordingLog`: a stage's log whose rows and console lines a test reads."""
    return RecordingLog


class _Py310TimeoutError(Exception):
    """`asyncio.TimeoutError` as Python 3.10 has it (setup.cfg allows 3.10): not the builtin `TimeoutError`,
    which it is only from 3.11."""


@pytest.fixture
def python_310_timeouts(monkeypatch):
    """`asyncio.wait_for` and `asyncio.TimeoutError` as on Python 3.10, on the 3.11+ that runs the tests. It reaches
    an ``except asyncio.TimeoutError`` (looked up when it runs), not a tuple of exceptions built at import, which
    keeps the class of the Python that imported it."""
    wait_for = asyncio.wait_for

    async def wait_for_310(awaitable, timeout):
        try:
            return await wait_for(awaitable, timeout)
        except TimeoutError:
            raise _Py310TimeoutError from None

    monkeypatch.setattr(asyncio, "TimeoutError", _Py310TimeoutError)
    monkeypatch.setattr(asyncio, "wait_for", wait_for_310)


class _HangingSandbox:
    """A sandbox whose commands never end: only the harness's own wait can end the call."""

    async def exec(self, command, *, timeout):
        await asyncio.sleep(3600)


class _HangingEnv:
    async def sandbox(self, sandbox_id):
        return _HangingSandbox()


@pytest.fixture
def episode_against_a_hanging_sandbox() -> Callable:
    """``run(harness_module, settings, episode, reply)``: the harness program's ``run_episode`` against a sandbox
    whose commands never end, the model answering every turn with ``reply`` (an OpenAI chat completion)."""

    def run(harness: Any, settings: Any, episode: dict, reply: dict) -> dict:
        import httpx

        async def main() -> dict:
            transport = httpx.MockTransport(lambda request: httpx.Response(200, json=reply))
            async with httpx.AsyncClient(transport=transport) as http:
                return await harness.run_episode(http, _HangingEnv(), settings, episode)

        return asyncio.run(main())

    return run


REAL_SWE = ROOT / "tests/domains/swe/cachetools_130"
"""A real fix in the SWE-bench format: its files, gold patch, hidden test and row (see its README)."""

# A fixed identity and date: the base commit's hash depends on the files alone, the same on every machine.
_FIXTURE_GIT_ENV = {"GIT_AUTHOR_NAME": "orchard fixture", "GIT_AUTHOR_EMAIL": "fixture@orchard.invalid",
                    "GIT_AUTHOR_DATE": "2019-05-17T16:00:00+00:00", "GIT_COMMITTER_NAME": "orchard fixture",
                    "GIT_COMMITTER_EMAIL": "fixture@orchard.invalid",
                    "GIT_COMMITTER_DATE": "2019-05-17T16:00:00+00:00", "GIT_CONFIG_NOSYSTEM": "1"}


def _fixture_git(repo: Path, *args: str) -> str:
    """``git args`` in ``repo`` with the fixture's identity and date, nothing of this process's git settings."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo.parent), **_FIXTURE_GIT_ENV}
    run = subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=repo, env=env, capture_output=True,
                         text=True, check=True)
    return run.stdout


def _build_real_swe(root: Path) -> SimpleNamespace:
    row = json.loads((REAL_SWE / "instance.json").read_text())
    repo_root = root / "repos"
    repo = repo_root / row["instance_id"]
    for stored in sorted((REAL_SWE / "repo").rglob("*.txt")):
        target = repo / stored.relative_to(REAL_SWE / "repo").with_suffix("")  # keys.py.txt -> keys.py
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(stored.read_bytes())
    _fixture_git(repo, "init", "-q", "--template=", ".")
    _fixture_git(repo, "add", "-A")
    _fixture_git(repo, "commit", "-q", "--no-verify", "-m", "cachetools 3e5fe02: the files of the fixture")
    base_commit = _fixture_git(repo, "rev-parse", "HEAD").strip()
    row.update(base_commit=base_commit, patch=(REAL_SWE / "patch.diff").read_text(),
               test_patch=(REAL_SWE / "test_patch.diff").read_text())
    path = root / "instances.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return SimpleNamespace(path=path, repo_root=repo_root, repo=repo, base_commit=base_commit, row=row)


@pytest.fixture(scope="session")
def build_real_swe() -> Callable[[Path], SimpleNamespace]:
    """``build_real_swe(root)``: the real instance (cachetools issue #130) under ``root``: ``repos/<instance_id>``
    a git repository of one commit holding the fix's base files, ``instances.jsonl`` its SWE-bench row with that
    commit as ``base_commit``. Returns ``path`` (the JSONL), ``repo_root``, ``repo``, ``base_commit`` and ``row``."""
    return _build_real_swe


@pytest.fixture(scope="session")
def fixture_git() -> Callable[..., str]:
    """``fixture_git(repo, *args)``: ``git args`` in ``repo`` with the real fixture's fixed identity and date."""
    return _fixture_git
