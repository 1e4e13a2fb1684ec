"""The value-training command line as a real process: help, one-line usage errors, tracebacks only on --debug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "orchard.value.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_help_prints_usage_with_defaults() -> None:
    res = _cli("--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: python -m orchard.value.cli")
    assert "steps: int = 200" in res.stdout and "gamma: float = 0.98" in res.stdout
    assert "max_len: int = 4096" in res.stdout and res.stderr == ""


@pytest.fixture()
def dirs(tmp_path: Path) -> list[str]:
    (tmp_path / "tok").mkdir()
    (tmp_path / "lm").mkdir()
    return [f"tokenizer={tmp_path / 'tok'}", f"model={tmp_path / 'lm'}", f"output_dir={tmp_path / 'out'}"]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "error: config key 'data' is required"),
        (["data=missing.jsonl"], "error: data=missing.jsonl is not a file"),
        (["data=" + __file__, "gamma=1.5"], "error: gamma must be in [0, 1], got 1.5"),
        (["data=missing.jsonl", "steps=many"], "error: steps expects int, got 'many'"),
        (["data=missing.jsonl", "--no-such-flag"], "error: unrecognized arguments: --no-such-flag"),
    ],
)
def test_usage_errors_print_one_line_and_exit_2(dirs: list[str], args: list[str], message: str) -> None:
    res = _cli(*dirs, *args)
    assert res.returncode == 2
    assert res.stderr.startswith(message) and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.stderr and not (Path(dirs[2].split("=", 1)[1])).exists()


def test_debug_shows_the_traceback(dirs: list[str]) -> None:
    res = _cli(*dirs, "data=missing.jsonl", "--debug")
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "ValueError: data=missing.jsonl is not a file" in res.stderr
