"""orchard._cli.run_main: a user's mistake is one line on stderr and exit status 2; a bug keeps its traceback.

Each case runs a tiny script in a real subprocess, as a user would run a recipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    '''
    import argparse
    import sys
    from dataclasses import dataclass, field

    from orchard._cli import run_main
    from orchard.train.config import load_config
    from orchard.train.model import load_causal_lm


    @dataclass
    class Stage:
        steps: int = 2
        """Steps."""

        def validate(self):
            if self.steps < 1:
                raise ValueError(f"steps must be an int >= 1, got {self.steps}")


    @dataclass
    class Config:
        model_path: str | None = None
        """A checkpoint."""
        rl: Stage = field(default_factory=Stage)
        """RL."""


    def main(argv):
        parser = argparse.ArgumentParser(prog="tiny")
        parser.add_argument("--config")
        parser.add_argument("--bug", action="store_true")
        parser.add_argument("overrides", nargs="*")
        args = parser.parse_args(argv)
        cfg = load_config(Config, args.config, args.overrides, derived={"seed": "rl.steps"})
        if args.bug:
            {}["a key nobody set"]
        if cfg.model_path is not None:
            load_causal_lm(cfg.model_path)
        if cfg.rl.steps == 99:
            open("/nonexistent-dir-of-a-bug/file")
        print("ran", cfg.rl.steps)
        return 0


    sys.exit(run_main(main))
    '''
)


def run_script(tmp_path: Path, *args: str, debug_env: bool = False) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "ORCHARD_DEBUG"}
    if debug_env:
        env["ORCHARD_DEBUG"] = "1"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def stderr_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    # Libraries may warn on import (not ours to silence here); the runner's own output is the "error:" line.
    return [ln for ln in proc.stderr.splitlines() if "Warning" not in ln and ln.strip()]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["rl.stpes=3"], "error: rl.stpes is not a config key; did you mean 'rl.steps'?"),
        (["rl.steps=-3"], "error: rl.steps must be an int >= 1, got -3"),
        (["seed=1"], "error: seed is derived from rl.steps; set that instead"),
        (["--config", "nope.yaml"], "error: config file 'nope.yaml' does not exist or is not a file"),
        (["--frobnicate"], "error: unrecognized arguments: --frobnicate (see tiny --help)"),
        (["--config"], "error: argument --config: expected one argument (see tiny --help)"),
        (["model_path=missing_model"],
         "error: source must be a local checkpoint directory or a config; no such directory: 'missing_model'"),
    ],
)
def test_user_mistakes_are_one_line_and_status_2(tmp_path: Path, args: list[str], line: str) -> None:
    proc = run_script(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert stderr_lines(proc) == [line]
    assert proc.stdout == ""


def test_a_correct_run_and_a_bug(tmp_path: Path) -> None:
    ok = run_script(tmp_path, "rl.steps=5")
    assert ok.returncode == 0 and ok.stdout == "ran 5\n"
    # A bug (a KeyError, or a FileNotFoundError of a path the user never wrote) keeps its traceback, status 1.
    for args, last in ((["--bug"], "KeyError: 'a key nobody set'"), (["rl.steps=99"], "FileNotFoundError:")):
        proc = run_script(tmp_path, *args)
        assert proc.returncode == 1
        assert "Traceback (most recent call last)" in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(last)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_of_a_mistake(tmp_path: Path, how: str) -> None:
    args = ["rl.steps=-3", "--debug"] if how == "flag" else ["rl.steps=-3"]
    proc = run_script(tmp_path, *args, debug_env=how == "env")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "orchard.train.config.ConfigError: rl.steps must be an int >= 1, got -3"
    )
    ok = run_script(tmp_path, "--debug", "rl.steps=4")  # --debug never reaches main's parser
    assert ok.returncode == 0 and ok.stdout == "ran 4\n"


def test_run_main_restores_argparse_and_rejects_a_non_callable() -> None:
    import argparse

    from orchard._cli import run_main

    before = argparse.ArgumentParser.error
    assert run_main(lambda argv: len(argv), ["a", "b"]) == 2
    assert argparse.ArgumentParser.error is before
    with pytest.raises(ValueError, match="main must be callable"):
        run_main("main", [])  # type: ignore[arg-type]

