"""Child-process runs: DeepSpeed ZeRO-2 / ZeRO-3 on 2 CPU ranks (gloo) against the plain-torch path, and runs
killed with SIGKILL and resumed, plain and under both ZeRO stages, against the steps they replay (bit-identical on
CPU).

Every run is 3 optimizer steps with a checkpoint at step 2; a killed run dies after logging step 3, so its resume
drops the orphaned step-3 row and replays step 3. Each launch starts torch and DeepSpeed anew (~10-30 s on a busy
2-core machine), which is what a test here costs; the steps themselves take well under a second.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from orchard.train.metrics import read_jsonl_metrics

HERE = Path(__file__).parent
REPO = HERE.parent.parent
WORKER = HERE / "train_worker.py"
STEPS = 3
KILL_AFTER = 3
LAUNCH_TIMEOUT_S = 200
"""One child run's limit; a test holds at most two runs and the plain fixture inside its own timeout."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # DeepSpeed JIT-compiles its CPU shared-memory comm op on first use; keep it cached across runs.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: list[str], timeout: float = LAUNCH_TIMEOUT_S) -> None:
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _plain(out: Path, micro: int = 2) -> None:
    _run([sys.executable, str(WORKER), str(out), "plain", "2", str(STEPS), str(micro)])


def _deepspeed_args(out: Path, stage: int) -> list[str]:
    torchrun = Path(sys.executable).parent / "torchrun"
    return [str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
            str(_free_port()), str(WORKER), str(out), "deepspeed", str(stage), str(STEPS), "2"]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc): torchrun may start its ranks in sessions of their own, which
    a kill of its process group misses."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)


def _run_until_killed(args: list[str], out: Path) -> None:
    """Start ``args`` in its own process group, wait for the worker's kill point, SIGKILL it and every process it
    started (the ranks too, whatever session they are in)."""
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not (out / "killme").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "worker never reached the kill point"
            time.sleep(0.2)
        time.sleep(0.5)  # let every rank reach its sleep
        _kill_tree(proc)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _without_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plain")
    _plain(out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_two_ranks_resume_exactly_and_match_plain_torch(plain_run: Path, tmp_path: Path,
                                                                   stage: int) -> None:
    """A ZeRO run killed after step 3 resumes from its step-2 DeepSpeed checkpoint and replays step 3 exactly
    (``torch.equal`` weights, equal metric rows: the same ranks, partitions and reduction order on CPU); the whole
    run matches the plain-torch path within a tolerance (different summation order, see below)."""
    _run_until_killed([*_deepspeed_args(tmp_path, stage), str(KILL_AFTER)], tmp_path)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    killed_rows = _without_perf(read_jsonl_metrics(tmp_path / "metrics.jsonl"))
    killed = torch.load(tmp_path / "killed.pt")["full"]
    assert [r["step"] for r in killed_rows] == [1, 2, 3]
    _run(_deepspeed_args(tmp_path, stage))
    got = read_jsonl_metrics(tmp_path / "metrics.jsonl")
    assert _without_perf(got) == killed_rows
    b = torch.load(tmp_path / "final.pt")
    assert b["full"].keys() == killed.keys()
    for name, value in b["full"].items():
        assert torch.equal(value, killed[name]), (stage, name)

    ref = read_jsonl_metrics(plain_run / "metrics.jsonl")
    for r, g in zip(ref, got, strict=True):
        for key in ("loss/total", "loss/policy", "loss/sft", "loss/k3_opd", "grad_norm", "lr", "clip/low_frac",
                    "tokens/action"):
            assert g[key] == pytest.approx(r[key], rel=2e-5, abs=1e-7), (stage, r["step"], key)
    a = torch.load(plain_run / "final.pt")
    assert a["full"].keys() == b["full"].keys()
    for name in a["full"]:
        # Adam normalises each coordinate, so float summation-order noise in tiny gradients shows as ~1e-7 of
        # lr=1e-3 updates; a real mismatch (a lost micro-batch, a missed rank) moves weights by ~lr.
        torch.testing.assert_close(b["full"][name], a["full"][name], rtol=0, atol=2e-5, msg=name)
    # The weights handed to the rollout callback after the last step are the full (gathered) weights.
    for name, value in b["full"].items():
        assert torch.equal(b["handed_last"][name], value), name
        assert b["handed_last"][name].shape == a["full"][name].shape


@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60)
def test_sigkilled_run_resumes_bit_identically(plain_run: Path, tmp_path: Path) -> None:
    # The worker checkpoints every 2 steps; killed after logging step 3, it must resume from step 2, drop the
    # orphaned step-3 row, and replay step 3 exactly (data noise comes from the restored global RNG).
    args = [sys.executable, str(WORKER), str(tmp_path), "plain", "2", str(STEPS), "2"]
    _run_until_killed([*args, str(KILL_AFTER)], tmp_path)
    assert [r["step"] for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    _run(args)
    ref = _without_perf(read_jsonl_metrics(plain_run / "metrics.jsonl"))
    got = _without_perf(read_jsonl_metrics(tmp_path / "metrics.jsonl"))
    assert got == ref
    a = torch.load(plain_run / "final.pt")["full"]
    b = torch.load(tmp_path / "final.pt")["full"]
    for name in a:
        assert torch.equal(a[name], b[name]), name
