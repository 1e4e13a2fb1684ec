"""Run a script's ``main(argv)`` so that a mistake on its command line costs one line, and a bug keeps its traceback.

A recipe ends with::

    if __name__ == "__main__":
        sys.exit(run_main(main))

What counts as the user's mistake, printed as ``error: <message>`` on stderr with exit status 2:

- a ``ConfigError`` (an unknown, derived or mistyped config key, a failed ``validate()``, a missing config file);
- a usage error (unknown option, missing argument) of a `UsageErrorParser`, the parser such a ``main`` builds,
  with a pointer to ``--help``;
- a ``FileNotFoundError`` whose file name the user wrote in an argument (``--config x.yaml``, ``model.path=/m``).

Anything else is a bug and propagates with its traceback. ``--debug`` anywhere in ``argv`` (removed before
``main`` sees it) or ``ORCHARD_DEBUG=1`` lets every exception propagate, the user's mistakes included.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from orchard.train.config import ConfigError

__all__ = ["UsageError", "UsageErrorParser", "run_main"]

EXIT_USAGE = 2
"""The exit status of a usage error (argparse's and the shells' convention)."""


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
    try:
        return int(main(args) or 0)
    except (ConfigError, UsageError) as exc:
        return _one_line(str(exc))
    except FileNotFoundError as exc:
        if exc.filename is None or not any(str(exc.filename) in a for a in args):
            raise
        return _one_line(f"{exc.strerror or 'no such file'}: {str(exc.filename)!r}")


def _one_line(message: str) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_USAGE
