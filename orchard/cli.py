"""The `orchard` command. Each subcommand lives beside the code it runs and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that expose `register(subparsers)`; imported lazily so `orchard --help` stays fast.
SUBCOMMAND_MODULES = (
    "orchard.env.cli",
    "orchard.rollout.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchard", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
