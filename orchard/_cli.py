"""Run a script's ``main(argv)`` so that a mistake on its command line costs one line, and a bug keeps its traceback.

A recipe ends with::

    if __name__ == "__main__":
        sys.exit(run_main(main))

What counts as the user's mistake, printed as ``error: <message>`` on stderr with exit status 2:

- a ``ConfigError`` (an unknown, derived or mistyped config key, a failed ``validate()``, a missing config file);
- a usage error (unknown option, missing argument) of a `UsageErrorParser`, the parser such a ``main`` builds,
  with a pointer to ``--help``;
- a ``FileNotFoundError`` whose file name the user wrote in an argument (``--config x.yaml``, ``model.path=/m``).

Two ends that are no one's mistake are quiet too:

- Ctrl-C (``KeyboardInterrupt``) prints ``interrupted`` and exits 130 (128 + SIGINT, the shells' convention);
- a reader that closed the pipe early (``--show-config | head``) ends the run with exit status 141 (128 + SIGPIPE,
  what a program killed by that signal reports) and nothing on stderr.

Anything else is a bug and propagates with its traceback. ``--debug`` anywhere in ``argv`` (removed before
``main`` sees it) or ``ORCHARD_DEBUG=1`` lets every exception propagate, the user's mistakes included.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from orchard.train.config import ConfigError

__all__ = ["UsageError", "UsageErrorParser", "run_main"]

EXIT_USAGE = 2
"""The exit status of a usage error (argparse's and the shells' convention)."""
EXIT_INTERRUPTED = 128 + signal.SIGINT
"""The exit status after Ctrl-C: 130."""
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
"""The exit status after the reader of stdout went away: 141."""


class UsageError(Exception):
    """A usage error of a `UsageErrorParser`, raised instead of argparse's two-line message and exit."""


class UsageErrorParser(argparse.ArgumentParser):
    """The parser of a script whose ``main`` runs under `run_main`: a usage error raises `UsageError` (which
    `run_main` prints as one line) instead of printing the usage and exiting; its subparsers are of this class too.

    Only parsers of this class change: any other ``argparse.ArgumentParser`` in the process keeps argparse's own
    behaviour, inside ``main`` or not.
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def run_main(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)`` and return its exit status; a user's mistake becomes one line on stderr and status 2.

    Args:
        main: the script's entry point; it receives the argument list (without ``--debug``) and returns an exit
            status or None (0).
        argv: the arguments; default ``sys.argv[1:]``.
    """
    if not callable(main):
        raise ValueError(f"main must be callable, got {main!r}")
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("ORCHARD_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    if debug:
        return int(main(args) or 0)
    said: list[bool] = []
    previous = _quiet_interrupts(said)
    try:
        return int(main(args) or 0)
    except KeyboardInterrupt:
        if not said:  # raised by the code, or signals could not be handled here (not the main thread)
            print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Python flushes stdout once more at exit: into the closed pipe that would be a second BrokenPipeError and
        # an "Exception ignored" message (the Python docs' recipe).
        _to_devnull(sys.stdout)
        return EXIT_BROKEN_PIPE
    except (ConfigError, UsageError) as exc:
        return _one_line(str(exc))
    except FileNotFoundError as exc:
        if exc.filename is None or not any(str(exc.filename) in a for a in args):
            raise
        return _one_line(f"{exc.strerror or 'no such file'}: {str(exc.filename)!r}")
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _quiet_interrupts(said: list[bool]) -> Any:
    """On SIGINT, say ``interrupted`` (and append to ``said``) and stop writing to stderr, then raise
    ``KeyboardInterrupt`` as Python does: the run unwinds (servers stop, files close), but the cancelled requests
    and tasks it ends may log tracebacks that are no one's error. Returns the handler it replaced (None where
    signals cannot be set: not the main thread)."""

    def interrupted(signum: int, frame: Any) -> None:
        if not said:
            print("interrupted", file=sys.stderr, flush=True)
            said.append(True)
            _to_devnull(sys.stderr)
        signal.default_int_handler(signum, frame)

    try:
        return signal.signal(signal.SIGINT, interrupted)
    except ValueError:
        return None


def _one_line(message: str) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_USAGE


def _to_devnull(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null (a stream without one, a test's capture, is left alone)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
