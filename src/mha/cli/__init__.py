"""The ``mha`` command. Thin: each subcommand lives in its own module here and calls the
library's public functions. A subcommand module defines ``add_parser(subparsers)`` which
registers its parser and sets ``func`` (called with the parsed args; returns an exit code)."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `mha --help` lists them.
SUBCOMMANDS = ("demo", "shapes", "build", "bench", "encode", "viz", "experiment")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mha", description="multi-head attention: run, "
                                     "measure and look inside")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"mha.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
