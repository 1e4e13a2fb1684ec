"""The `orchard` command. Each subcommand lives beside the code it runs and registers itself here.

Errors of configuration and use (a bad flag value, a missing path, a port in use, a missing extra) print one line
and exit non-zero; ``orchard --debug ...`` (or ``--debug`` after the subcommand) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from typing import Any

from orchard import __version__

# Modules that expose `register(subparsers)`, with the subcommands they add (for a placeholder that names the
# missing extra when a module cannot be imported); imported lazily so `orchard --help` stays fast.
SUBCOMMAND_MODULES = {
    "orchard.env.cli": ("env",),
    "orchard.rollout.cli": ("serve-model", "serve-proxy"),
    "orchard.models.cli": ("models",),
}

# Exit statuses: argparse's 2 for usage and configuration errors; 1 for anything else that went wrong.
EXIT_USAGE = 2
EXIT_FAILURE = 1


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for every option with a value, also one without help text, unless its help already
    says its default (``(default ...``), the default is ``None`` (the help says what happens then) or the option
    is a flag."""

    def _shows_default(self, action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "(default" in help_text or not self._shows_default(action):
            return help_text
        return f"{help_text} (default: %(default)s)"


class OrchardParser(argparse.ArgumentParser):
    """Every parser of the command (subcommands inherit the class): defaults in ``--help`` and a ``--debug``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        if self.add_help:
            # SUPPRESS: a subcommand that was not given --debug leaves the top level's value alone.
            self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                              help="show the traceback of an error instead of one line")


def _unavailable(error: ModuleNotFoundError) -> Any:
    def fail(args: argparse.Namespace) -> int:
        raise error

    return fail


def build_parser() -> argparse.ArgumentParser:
    parser = OrchardParser(prog="orchard", description=__doc__.splitlines()[0])
    parser.set_defaults(debug=False)
    parser.add_argument("--version", action="version", version=f"orchard {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, commands in SUBCOMMAND_MODULES.items():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.partition(".")[0] == "orchard":
                raise
            # A missing extra: the commands still show, and running one prints which extra to install.
            for command in commands:
                placeholder = subparsers.add_parser(command, help=f"unavailable: {exc}", add_help=False)
                placeholder.add_argument("rest", nargs=argparse.REMAINDER)
                placeholder.set_defaults(func=_unavailable(exc))
            continue
        module.register(subparsers)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        prog = f"orchard {args.command}"
        if isinstance(exc, (ValueError, OSError, ImportError)):
            # Configuration and environment: a bad value, a path, a port, a missing extra.
            print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE
        print(f"{prog}: unexpected error: {type(exc).__name__}: {_one_line(exc)} "
              f"(rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
