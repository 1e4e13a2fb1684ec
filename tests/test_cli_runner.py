"""orchard._cli.run_main: a user's mistake is one line on stderr and exit status 2; a bug keeps its traceback.

A tiny script's ``main`` is called under ``run_main`` in process, what the script's ``__main__`` line does (a
subprocess per case paid the torch and transformers imports each); one mistake and one bug run the script in a real
subprocess, as a user would run a recipe, and prove the exit status and what reaches stderr end to end.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    '''
    import sys
    from dataclasses import dataclass, field

    from orchard._cli import UsageErrorParser, run_main
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
        parser = UsageErrorParser(prog="tiny")
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


    if __name__ == "__main__":
        sys.exit(run_main(main))
    '''
)


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "ORCHARD_DEBUG"}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def stderr_lines(stderr: str) -> list[str]:
    # Libraries may warn on import (not ours to silence here); the runner's own output is the "error:" line.
    return [ln for ln in stderr.splitlines() if "Warning" not in ln and ln.strip()]


@pytest.fixture(scope="module")
def tiny_main(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("script") / "tiny.py"
    path.write_text(SCRIPT)
    spec = importlib.util.spec_from_file_location("cli_runner_tiny", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module.main
    del sys.modules[spec.name]


@pytest.fixture
def in_process(tiny_main, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """``in_process(*args)`` -> (exit status, stdout, stderr) of the tiny script's ``run_main(main, args)``, run in
    ``tmp_path`` (as the subprocess is) without ``ORCHARD_DEBUG``."""
    from orchard._cli import run_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ORCHARD_DEBUG", raising=False)

    def call(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = run_main(tiny_main, list(args))
        out, err = capsys.readouterr()
        return status, out, err

    return call


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
def test_user_mistakes_are_one_line_and_status_2(in_process, args: list[str], line: str) -> None:
    status, out, err = in_process(*args)
    assert status == 2, err
    assert stderr_lines(err) == [line]
    assert out == ""


def test_a_mistake_from_the_command_line(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "rl.steps=-3")
    assert proc.returncode == 2, proc.stderr
    assert stderr_lines(proc.stderr) == ["error: rl.steps must be an int >= 1, got -3"]
    assert proc.stdout == ""


def test_a_correct_run_and_a_bug(in_process) -> None:
    assert in_process("rl.steps=5") == (0, "ran 5\n", "")
    # A bug (a KeyError, or a FileNotFoundError of a path the user never wrote) propagates: its traceback stays.
    with pytest.raises(KeyError, match="a key nobody set"):
        in_process("--bug")
    with pytest.raises(FileNotFoundError, match="nonexistent-dir-of-a-bug"):
        in_process("rl.steps=99")


def test_a_bug_from_the_command_line_keeps_its_traceback_and_status_1(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "--bug")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("KeyError: 'a key nobody set'")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_of_a_mistake(in_process, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    from orchard.train.config import ConfigError

    args = ["rl.steps=-3", "--debug"] if how == "flag" else ["rl.steps=-3"]
    if how == "env":
        monkeypatch.setenv("ORCHARD_DEBUG", "1")
    with pytest.raises(ConfigError) as raised:  # propagates: the interpreter prints its traceback, status 1
        in_process(*args)
    # the traceback's last line, as the interpreter writes it
    assert f"{type(raised.value).__module__}.{type(raised.value).__qualname__}: {raised.value}" == (
        "orchard.train.config.ConfigError: rl.steps must be an int >= 1, got -3"
    )
    assert in_process("--debug", "rl.steps=4") == (0, "ran 4\n", "")  # --debug never reaches main's parser


def test_run_main_restores_argparse_and_rejects_a_non_callable() -> None:
    import argparse

    from orchard._cli import run_main

    before = argparse.ArgumentParser.error
    assert run_main(lambda argv: len(argv), ["a", "b"]) == 2
    assert argparse.ArgumentParser.error is before
    with pytest.raises(ValueError, match="main must be callable"):
        run_main("main", [])  # type: ignore[arg-type]



def test_only_the_projects_parser_changes(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from orchard._cli import UsageError, UsageErrorParser, run_main

    seen = []

    def main(argv: list[str]) -> int:
        # No process-wide patch while main runs: a plain parser keeps argparse's usage lines and exit.
        seen.append(argparse.ArgumentParser.error)
        argparse.ArgumentParser(prog="plain").parse_args(argv)
        return 0

    with pytest.raises(SystemExit) as exited:
        run_main(main, ["--frobnicate"])
    assert exited.value.code == 2
    assert seen == [argparse.ArgumentParser.error]
    assert capsys.readouterr().err.splitlines() == ["usage: plain [-h]", "plain: error: unrecognized arguments: --frobnicate"]

    # The project's parser raises, outside run_main too, and so do its subcommands' parsers.
    parser = UsageErrorParser(prog="tool")
    parser.add_subparsers(dest="command", required=True).add_parser("go").add_argument("--n", type=int)
    with pytest.raises(UsageError, match=r"^argument --n: invalid int value: 'x' \(see tool go --help\)$"):
        parser.parse_args(["go", "--n", "x"])

    def sub_main(argv: list[str]) -> int:
        parser.parse_args(argv)
        return 0

    assert run_main(sub_main, ["go", "--n", "3"]) == 0
    assert run_main(sub_main, []) == 2
    assert capsys.readouterr().err == "error: the following arguments are required: command (see tool --help)\n"


def test_an_interrupt_and_a_closed_pipe_end_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    from orchard._cli import run_main

    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    def piped(argv: list[str]) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    handler = signal.getsignal(signal.SIGINT)
    # 130 = 128 + SIGINT and 141 = 128 + SIGPIPE, the statuses a shell reports for a process those signals end
    assert (run_main(interrupted, []), capsys.readouterr()) == (130, ("", "interrupted\n"))
    assert (run_main(piped, []), capsys.readouterr()) == (141, ("", ""))
    assert signal.getsignal(signal.SIGINT) is handler  # run_main's own SIGINT handler is gone after it
    # --debug: both propagate, with their tracebacks
    with pytest.raises(KeyboardInterrupt):
        run_main(interrupted, ["--debug"])
    with pytest.raises(BrokenPipeError):
        run_main(piped, ["--debug"])
