"""The `orchard` command's edges, run as real commands: --version, defaults in --help, one-line errors."""

import argparse
import socket
import subprocess
import sys

import pytest

import orchard
from orchard.cli import DefaultsHelpFormatter, build_parser, main


def orchard_cmd(*argv: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport sys\nfrom orchard.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)


def test_version_prints_the_package_version():
    out = subprocess.run([sys.executable, "-m", "orchard", "--version"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"orchard {orchard.__version__}\n"


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["serve-model"], ["(default: 8001)", "(default: 127.0.0.1)", "(default: float32)", "(default: 512)"]),
        (["serve-proxy"], ["(default: 8002)", "(default: info)"]),
        # a subcommand registered by another module inherits the parser class: an option without help shows it too
        (["env", "serve"], ["(default: 64)", "(default: warning)"]),
    ],
)
def test_help_shows_defaults(argv, shown):
    out = subprocess.run([sys.executable, "-m", "orchard", *argv, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())  # help lines wrap at the terminal width
    for text in shown:
        assert text in flat


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def test_every_option_with_a_value_documents_its_default():
    # The property behind the examples above, over every parser the command has: an option that takes a value
    # and has a default other than None says "default" in its help (from the formatter, or in its own words).
    checked = 0
    for parser in _subparsers(build_parser()):
        assert parser.formatter_class is DefaultsHelpFormatter
        options = " ".join(parser.format_help().split()).split(" options: ", 1)[1]
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
                checked += 1
                after = options.split(f" {action.option_strings[-1]} ", 1)[1]
                next_option = after.find(" --")
                assert "default" in after[: None if next_option < 0 else next_option], action.option_strings
    assert checked >= 15


def test_a_model_path_that_is_no_directory_is_one_line():
    out = orchard_cmd("serve-model", "--model", "/no/such/dir")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "'/no/such/dir'" in out.stderr and "'tiny'" in out.stderr and "local" in out.stderr


def test_debug_shows_the_traceback():
    # main in process (a subprocess per spelling paid the model loader's torch import): with --debug, before or
    # after the subcommand, the error propagates, and the interpreter prints its traceback with status 1
    for argv in (["--debug", "serve-model", "--model", "/no/such/dir"],
                 ["serve-model", "--model", "/no/such/dir", "--debug"]):
        with pytest.raises(ValueError, match="/no/such/dir"):
            main(argv)


def test_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = orchard_cmd("serve-proxy", "--upstream", "http://127.0.0.1:9", "--port", str(port))
    assert out.returncode == 1
    assert out.stderr == f"orchard serve-proxy: error: [Errno 98] cannot listen on 127.0.0.1:{port}: " \
                         "Address already in use\n"


def test_an_unreachable_redis_store_is_one_line(capsys):
    # Before, the service started and its start-up failed in a 40-line traceback of the Redis client and uvicorn.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    assert main(["env", "serve", "--store", f"redis://127.0.0.1:{port}/0", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err == f"orchard env: error: cannot reach the Redis store (--store): Error 111 connecting to " \
                  f"127.0.0.1:{port}. Connection refused.\n"


def test_a_missing_extra_keeps_the_command_listed_and_names_the_extra():
    # Without httpx (the env extra), `orchard.env.cli` cannot be imported: `orchard --help` still works and
    # `orchard env serve` says what to install, in one line.
    prelude = "import sys\nsys.modules['httpx'] = None"
    listed = orchard_cmd("--help", prelude=prelude)
    assert listed.returncode == 0, listed.stderr
    assert "env" in listed.stdout and "serve-model" in listed.stdout
    out = orchard_cmd("env", "serve", "--port", "0", prelude=prelude)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "pip install 'orchard-rl[env]'" in out.stderr


def test_an_unexpected_error_is_one_line_with_the_way_to_the_traceback(monkeypatch, capsys):
    import orchard.rollout.cli

    def broken(args):
        raise KeyError("bug")

    monkeypatch.setattr(orchard.rollout.cli, "_serve_proxy", broken)
    assert main(["serve-proxy", "--upstream", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err == "orchard serve-proxy: unexpected error: KeyError: 'bug' (rerun with --debug for the traceback)\n"
    with pytest.raises(KeyError):
        main(["--debug", "serve-proxy", "--upstream", "http://127.0.0.1:9"])


@pytest.mark.parametrize(("flag", "compiled"), [([], False), (["--compile-decode"], True)])
def test_serve_model_passes_compile_decode_to_the_engine(monkeypatch, flag, compiled):
    # The engine and the server are replaced: what is checked is the flag's way from the command line to HFEngine.
    from orchard.rollout import cli as rollout_cli
    from orchard.rollout import hf_engine, server

    built = {}

    def engine(model, **kwargs):
        built.update(kwargs)
        return "engine"

    monkeypatch.setattr(hf_engine, "HFEngine", engine)
    monkeypatch.setattr(server, "build_app", lambda engine, tokenizer, **kwargs: "app")
    monkeypatch.setattr(rollout_cli, "load_model_and_tokenizer",
                        lambda name, **kwargs: ("model", argparse.Namespace(pad_token_id=0)))
    monkeypatch.setattr(rollout_cli, "run_app", lambda app, host, port, log_level: None)
    assert main(["serve-model", "--model", "tiny", *flag]) == 0
    assert built["compile_decode"] is compiled
