"""The value-training command line: help, one-line usage errors, tracebacks only on --debug. ``main(argv)`` is
called in process (a subprocess per case paid the torch and transformers imports each); one usage error runs
``python -m orchard.value.cli`` as a real process, for the exit status and stderr end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchard.value.cli import main


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "orchard.value.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_help_prints_usage_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's --help exits; `python -m` turns it into the status
        main(["--help"])
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m orchard.value.cli")
    assert "steps: int = 200" in out and "gamma: float = 0.98" in out
    assert "max_len: int = 4096" in out and err == ""


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
def test_usage_errors_print_one_line_and_exit_2(dirs: list[str], args: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*dirs, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert "Traceback" not in err and not (Path(dirs[2].split("=", 1)[1])).exists()


def test_a_usage_error_from_the_command_line(dirs: list[str]) -> None:
    res = _cli(*dirs, "data=missing.jsonl")
    assert res.returncode == 2
    assert res.stderr == "error: data=missing.jsonl is not a file\n", res.stderr
    assert not (Path(dirs[2].split("=", 1)[1])).exists()


def test_debug_shows_the_traceback(dirs: list[str]) -> None:
    # propagates: the interpreter prints its traceback and exits with status 1
    with pytest.raises(ValueError, match=r"^data=missing\.jsonl is not a file$"):
        main([*dirs, "data=missing.jsonl", "--debug"])
