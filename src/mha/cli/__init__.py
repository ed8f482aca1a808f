"""The ``mha`` command. Thin: each subcommand lives in its own module here and calls the
library's public functions. A subcommand module defines ``add_parser(subparsers)`` which
registers its parser and sets ``func`` (called with the parsed args; returns an exit code).

Errors (see :func:`main`): a user's mistake is one line on stderr, never a traceback —
exit 2 for the command line (argparse's code: a bad value, a wrong combination of options),
1 for a failure while running (a file that cannot be written, memory that cannot be had, a
missing optional dependency, with its ``pip install`` hint, a forcing variable such as
``MHA_FLASH_BF16`` naming a kernel that cannot run here: :mod:`mha.ops.forcing`), 130 for
Ctrl-C. Any other
exception is a bug in mha and keeps its traceback. ``mha --debug ...`` prints the traceback
of every error too.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import traceback

from mha.cli.options import UsageError, install_hint

# Subcommand modules, in the order `mha --help` lists them.
SUBCOMMANDS = ("demo", "shapes", "build", "bench", "encode", "generate", "chat", "serve", "viz",
               "experiment")

__all__ = ["SUBCOMMANDS", "UsageError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a :class:`UsageError` (one line, printed by
    :func:`main`) instead of usage text and ``SystemExit``."""

    def error(self, message: str):
        # "argument --batch/-B: must be ..." -> "--batch must be ..."
        m = re.match(r"argument ([^/:\s]+)[^:]*: (.*)", message, flags=re.S)
        if m:
            name, rest = m.groups()
            message = f"{name} {rest}" if rest.startswith("must ") else f"{name}: {rest}"
        raise UsageError(f"{message} (see {self.prog} --help)", prog=self.prog)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mha", description="multi-head attention: run, measure and look "
                     "inside", epilog="A mistake in the command prints one line and exits 2; "
                     "a failure while running exits 1; --debug shows the traceback.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of any error (before the subcommand)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"mha.cli.{name}").add_parser(sub)
    _name_commands(parser)
    return parser


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Give every leaf (sub)command parser a ``prog`` default, so errors raised while it runs
    are prefixed with its name (``mha experiment heads: ...``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if child.get_default("func") is not None:
                    child.set_defaults(prog=child.prog)
                _name_commands(child)


def _debug_requested(argv: list[str]) -> bool:
    """``--debug`` among the options before the subcommand (also when parsing fails)."""
    for token in argv:
        if not token.startswith("-"):
            return False
        if token == "--debug":
            return True
    return False


def _fail(prog: str, message: str, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"{prog}: {' '.join(str(message).split())}", file=sys.stderr)  # exactly one line
    return code


def _allocation_failure(e: RuntimeError) -> bool:
    """torch reports a failed CPU allocation (or a size past what it can address) as a
    RuntimeError: those are "out of memory", not bugs."""
    text = str(e)
    return any(s in text for s in ("can't allocate memory", "Storage size calculation overflowed",
                                   "not enough memory"))


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"cannot use {str(e.filename)!r}: {e.strerror}"
    return str(e) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the ``mha`` command; returns the exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug, prog = _debug_requested(argv), "mha"
    try:
        args, extra = build_parser().parse_known_args(argv)
        debug, prog = args.debug, getattr(args, "prog", prog)
        if extra:  # named after the (sub)command they were given to
            where = prog if argv.index(extra[0]) > argv.index(args.command) else "mha"
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see {where} --help)",
                             prog=where)
        return int(args.func(args) or 0)
    except UsageError as e:
        return _fail(e.prog or prog, str(e), 2, debug)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130, debug)
    except ImportError as e:
        hint = install_hint(e)
        if hint is None:
            raise  # mha's own import failed: a bug
        return _fail(prog, hint, 1, debug)
    except BrokenPipeError:  # `mha shapes --json | head`: the reader left, nothing to say
        _silence_stdout()
        return 1
    except OSError as e:
        return _fail(prog, _os_message(e), 1, debug)
    except MemoryError as e:
        return _fail(prog, f"out of memory: {e}" if str(e) else "out of memory", 1, debug)
    except (RuntimeError, ValueError) as e:
        from mha.ops import forcing

        if forcing.is_refusal(e):  # MHA_FLASH_BF16 & co. naming what cannot run here
            return _fail(prog, str(e).strip().splitlines()[0], 1, debug)
        if not isinstance(e, RuntimeError) or not _allocation_failure(e):
            raise
        return _fail(prog, f"out of memory: {str(e).splitlines()[0]}", 1, debug)


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush does
    not raise again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
