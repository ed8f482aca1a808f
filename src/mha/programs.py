"""Programs of ``torch.export`` that hold mha's native ops: saving them, and loading them
without unpickling anything.

Shape legend: B batch, T sequence length, d_model model width.

``torch.export.export(module, (x,), dynamic_shapes=...)`` of a :class:`mha.MultiHeadAttention`
(or a model built from it) traces every attention call to the native op
``torch.ops.mha.flash_attention_fwd`` over the whole declared range of B and T (dispatch
settles no size threshold a dynamic range straddles: :func:`mha.symbolic.size_below`), and
the projections to ``torch.ops.mha.linear`` where mha's tiles were measured faster here.
Such a program runs where mha is installed: its ops are looked up by name when the program is
loaded, so :func:`load` loads mha's native ops first.

``torch.export.load`` unpickles parts of an archive (sample inputs that ``weights_only``
refuses, tensors or objects stored as pickles), so a crafted file could run code. :func:`load`
reads the archive into memory, refuses every entry it does not know to be inert (JSON, raw
tensor bytes, sample inputs that ``torch.load(weights_only=True)`` reads), and only then hands
the checked bytes to ``torch.export.load``. A ``byteorder`` other than this machine's is
refused: ``torch.export.load`` ignores it and reads the raw tensor bytes in native order. The
zip's directory is checked first: a name
present twice (zipfile reads the last copy, torch's reader the first, ignoring case) or sizes
it cannot honestly hold (compressed bytes past the file's end, an entry or all entries
together inflating more than :data:`MAX_RATIO` times the file: a zip bomb) refuse the file
before any entry is inflated.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

import torch

from mha.checks import check_path

#: the mha op families a program may hold, and the loader of each (module, function)
_OP_LOADERS = {"flash_attention_": ("mha.ops.flash", "unavailable"),
               "flash_decode": ("mha.ops.decode", "unavailable"),
               "linear": ("mha.ops.linear", "load")}
_OP_NAME = re.compile(r'"torch\.ops\.mha\.([A-Za-z0-9_]+)\.[A-Za-z0-9_]+"')
_INERT_TOP = ("archive_format", "archive_version", "byteorder", ".data/")
#: the most an entry may inflate (declared size / compressed size) once above 1 MiB;
#: torch.export.save stores entries uncompressed (ratio 1), JSON deflates ~5-20x
MAX_RATIO = 100
_SMALL = 1 << 20
#: what a damaged zip raises while an entry is read (a bad CRC, a cut deflate stream, ...)
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError)
#: what torch.export.load raises on an archive that passed the checks but cannot be read
_LOAD_ERRORS = (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError,
                EOFError, zipfile.BadZipFile)


def save(program: torch.export.ExportedProgram, path) -> Path:
    """Write ``program`` with ``torch.export.save`` to ``path`` and return it; the file
    appears complete or not at all (written aside, then renamed)."""
    if not isinstance(program, torch.export.ExportedProgram):
        raise TypeError(f"program must be a torch.export.ExportedProgram, got "
                        f"{type(program).__name__}")
    path = check_path("path", path)
    if path.is_dir():
        raise ValueError(f"path: {path} is a directory; give the name of the file to write")
    if not path.parent.is_dir():
        raise ValueError(f"path: the directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp.pt2",
                                dir=path.parent)  # torch.export.save wants .pt2
    os.close(fd)
    try:
        torch.export.save(program, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(path) -> torch.export.ExportedProgram:
    """The program saved at ``path`` (by :func:`save` or ``torch.export.save``), with mha's
    native ops loaded first. Raises ValueError naming the file and the entry for an archive
    that would make ``torch.export.load`` unpickle anything (nothing of the file is run or
    unpickled then), whose zip directory is crafted or damaged, or that torch cannot read, and
    RuntimeError when an mha op the program holds cannot be loaded here (its build failed)."""
    path = check_path("path", path)
    if not path.is_file():
        raise ValueError(f"path: {path} is not a file")
    with open(path, "rb") as f:
        try:  # the zip's end record and directory first: a big file of another kind, or a
            # crafted directory, is refused before the file is read into memory
            with zipfile.ZipFile(f) as archive:
                _check_directory(path, archive, os.fstat(f.fileno()).st_size)
        except zipfile.BadZipFile:
            raise ValueError(f"path: {path} is not a torch.export archive (not a zip "
                             f"file)") from None
        f.seek(0)
        data = f.read()  # checked again and loaded from the same bytes
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise ValueError(f"path: {path} is not a torch.export archive (not a zip file)") from None
    with archive:
        _check_directory(path, archive, len(data))
        try:
            ops = _check_archive(path, archive)
        except _ZIP_ERRORS as e:
            raise ValueError(f"path: {path} is a damaged zip archive ({e})") from None
    _load_ops(ops)
    with _logged_errors() as logged:
        try:
            return torch.export.load(io.BytesIO(data))
        except _LOAD_ERRORS as e:
            # torch.export.load logs the error it met (with its traceback) as a warning, then
            # raises "check the warnings above": the logged error is the cause
            cause = logged[-1] if logged else e
            why = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise ValueError(f"path: {path}: torch.export.load cannot read it "
                             f"({type(cause).__name__}: {why})") from e


@contextlib.contextmanager
def _logged_errors():
    """The exceptions ``torch.export`` logs while the block runs, kept instead of printed with
    their tracebacks (its other messages pass as usual)."""
    caught: list[BaseException] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            caught.append(record.exc_info[1])
            return False
        return True

    logger = logging.getLogger("torch.export")
    logger.addFilter(keep)
    try:
        yield caught
    finally:
        logger.removeFilter(keep)


def _check_directory(path: Path, archive: zipfile.ZipFile, size: int) -> None:
    """The zip's directory, before any entry is inflated: each name once (ignoring case, as
    torch's reader looks names up), compressed sizes within the file, no entry and not the
    entries together inflating more than :data:`MAX_RATIO` times."""
    seen: dict[str, str] = {}
    compressed = inflated = 0
    for info in archive.infolist():
        key = info.filename.lower()
        if key in seen:
            raise ValueError(f"path: {path} holds {info.filename} more than once (as "
                             f"{seen[key]}): the checks would read one copy and "
                             f"torch.export.load another: not loaded")
        seen[key] = info.filename
        compressed += info.compress_size
        inflated += info.file_size
        if info.file_size > max(_SMALL, MAX_RATIO * info.compress_size):
            raise ValueError(f"path: {path}: entry {info.filename} declares "
                             f"{info.file_size:,} bytes from {info.compress_size:,} compressed "
                             f"(more than {MAX_RATIO}x: a zip bomb?): not loaded")
    if compressed > size:
        raise ValueError(f"path: {path}: its entries declare {compressed:,} compressed bytes, "
                         f"more than the file's {size:,} (a damaged or crafted zip directory): "
                         f"not loaded")
    if inflated > max(_SMALL, MAX_RATIO * size):  # many entries, each within its own bound
        raise ValueError(f"path: {path}: its entries declare {inflated:,} bytes in all from "
                         f"the file's {size:,} (more than {MAX_RATIO}x: a zip bomb?): not "
                         f"loaded")


def _check_archive(path: Path, archive: zipfile.ZipFile) -> set[str]:
    """Refuse anything ``torch.export.load`` would unpickle; return the mha op names the
    program's graphs call."""
    names = archive.namelist()
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or f"{next(iter(roots))}/archive_format" not in names:
        raise ValueError(f"path: {path} is not a torch.export .pt2 archive (no archive_format)")
    root = next(iter(roots)) + "/"
    if archive.read(root + "archive_format").decode(errors="replace").strip() != "pt2":
        raise ValueError(f"path: {path} is not a torch.export .pt2 archive")
    if root + "byteorder" in names:
        mark = archive.read(root + "byteorder").decode(errors="replace").strip()
        if mark != sys.byteorder:
            raise ValueError(f"path: {path} declares byteorder {mark[:20]!r}, and this machine "
                             f"is {sys.byteorder}-endian: torch.export.load reads the tensors' "
                             f"raw bytes in this machine's order whatever the mark says, so "
                             f"their values would be wrong: not loaded")
    inert: set[str] = set()  # raw tensor bytes listed by a config with use_pickle false
    ops: set[str] = set()
    for name in names:
        rel = name[len(root):]
        if name.endswith("/"):
            continue
        if rel.startswith(("data/weights/", "data/constants/")) and rel.endswith("_config.json"):
            inert |= _raw_tensors(path, rel, archive.read(name))
    for name in names:
        rel = name[len(root):]
        if name.endswith("/") or rel.startswith(_INERT_TOP) or rel in inert:
            continue
        if rel.startswith(("data/weights/", "data/constants/")) and rel.endswith("_config.json"):
            continue
        if rel.startswith("models/") and rel.endswith(".json"):
            ops |= set(_OP_NAME.findall(archive.read(name).decode("utf-8", errors="replace")))
            continue
        if rel.startswith("extra/"):
            continue  # read as text
        if rel.startswith("data/sample_inputs/") and rel.endswith(".pt"):
            _check_weights_only(path, rel, archive.read(name))
            continue
        raise ValueError(f"path: {path} holds {rel}, which torch.export.load would unpickle or "
                         f"run (a pickled tensor, a custom object or compiled code): not loaded")
    return ops


def _raw_tensors(path: Path, rel: str, text: bytes) -> set[str]:
    """The files a weights / constants config lists as raw tensor bytes (ValueError for an
    entry stored as a pickle)."""
    try:
        config = json.loads(text)["config"]
        entries = config.items()
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"path: {path} holds an unreadable {rel}") from None
    folder = rel.rsplit("/", 1)[0] + "/"
    files = set()
    for fqn, entry in entries:
        if not isinstance(entry, dict) or entry.get("use_pickle") is not False \
                or not isinstance(entry.get("path_name"), str):
            raise ValueError(f"path: {path} stores {fqn!r} ({rel}) as a pickle, which "
                             f"torch.export.load would unpickle: not loaded")
        files.add(folder + entry["path_name"])
    return files


def _check_weights_only(path: Path, rel: str, payload: bytes) -> None:
    """Sample inputs must load with ``weights_only=True``: where that fails,
    ``torch.export.load`` retries with full unpickling."""
    try:
        torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # any refusal of the restricted unpickler
        raise ValueError(f"path: {path} holds {rel}, which torch.load(weights_only=True) "
                         f"refuses ({type(e).__name__}); torch.export.load would unpickle it "
                         f"fully: not loaded") from None


def _load_ops(ops: set[str]) -> None:
    """Load the native extension of every mha op the program calls (RuntimeError naming the
    op and why when it cannot be)."""
    import importlib

    for op in sorted(ops):
        family = next((f for f in _OP_LOADERS if op.startswith(f)), None)
        if family is None:
            raise RuntimeError(f"the program calls torch.ops.mha.{op}, which this version of mha "
                               f"does not load for exported programs")
        module, fn = _OP_LOADERS[family]
        reason = getattr(importlib.import_module(module), fn)()
        if reason is not None:
            raise RuntimeError(f"the program calls torch.ops.mha.{op}: {reason}")
