"""Building the native extensions in ``mha/csrc`` once, and caching them across runs.

:func:`load_extension` is what the op modules call: it loads, registers the op's Python side
once and answers None or the reason the op is unavailable. Underneath,
``load(name, sources)`` compiles the C++ files with ``torch.utils.cpp_extension`` (ninja from
PyPI, the machine's g++) and ``-O3 -march=native -fopenmp`` (OpenMP so that
``at::parallel_for`` really runs in parallel), then loads the shared library, whose
``TORCH_LIBRARY`` blocks register ops under ``torch.ops.mha``. The cache entry is keyed by
the sources' contents, the headers, the flags, torch's version, Python's and the CPU's
identity, so an unchanged build is a ``dlopen`` and a changed source rebuilds. ``MHA_CXX`` (or
``CXX``) names the compiler; it is only needed when something has to be built.

Where the cache lives: ``MHA_BUILD_DIR`` when set (if it cannot be created or written, that is
an error — it is never silently replaced); otherwise ``~/.cache/mha/build``, and when that
cannot be written, a private ``<tempdir>/mha-build-<uid>`` (owned by the user, mode 0700),
named in one warning.

What the cache guarantees:

- The final entry ``<root>/<key>/<name>.so`` only ever holds a complete library: each build
  runs in a private temporary directory inside the root and the finished library is moved in
  with ``os.replace``, followed by ``<name>.manifest.json`` (its size and sha256). No file is
  ever rewritten in place, so a process that already mapped the library is never cut short.
- Builds are serialized across processes by an exclusive ``flock`` on ``<root>/<key>.lock``
  (threads of one process by a ``threading.Lock``): processes that start together wait for
  the first one's build and load it. Temporary directories left by a killed build are removed
  by the next lock holder.
- A library is loaded only after it matches its manifest. A mismatch (truncated or corrupted
  file), a missing manifest, or a library that fails to load is discarded (under the lock) and
  rebuilt once; if that fails too, :class:`BuildError`.

Failures — a missing compiler, a compiler error, a cache directory that cannot be used —
raise :class:`BuildError` with the reason; callers turn that into one warning and a backend
rejection reason, never a wrong result and never a crash. A cache directory that cannot be
used concerns every extension: this module warns about it once (``BuildError.warned``) and
callers do not repeat it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from mha.ops import forcing

try:
    import fcntl
except ImportError:  # not a POSIX system: builds stay atomic, concurrent ones may duplicate work
    fcntl = None

CSRC = Path(__file__).parent.parent / "csrc"  # src/mha/csrc
# -fno-trapping-math: the kernels never trap on floating-point exceptions, and without it GCC
# will not turn the selects of the score variants' tanh / exp2 (common/score_mods.h) into
# vector blends (it keeps a possibly trapping float->int conversion under a branch). NaN and
# Inf arithmetic is unchanged (no -ffast-math).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-DNDEBUG", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)
# MHA_AMX_EMULATE=1 at build time: on a CPU without AMX (but with AVX512_BF16) the AMX tile
# kernels are compiled against software tiles (csrc/amx/amx_emulate.h), so their logic runs
# and is tested there; slow, for tests only. Part of the cache key like every flag.
EMULATE_AMX = ("-DMHA_AMX_EMULATE",)


def flags() -> tuple[str, ...]:
    """The compiler flags of a build in this process: :data:`FLAGS` and their ``-march`` as
    ``MHA_MARCH`` (the kernels' words for an instruction set the build lacks name it:
    ``csrc/common/isa_words.h``), plus :data:`EMULATE_AMX` when ``MHA_AMX_EMULATE=1``. Raises
    :class:`BuildError` (the words of :mod:`mha.ops.forcing`) for another value, or for ``1``
    on a CPU the software tiles cannot run on."""
    try:
        emulate = forcing.amx_emulate(os.environ.get("MHA_AMX_EMULATE"))
    except ValueError as e:
        raise BuildError(str(e)) from None
    march = tuple(f"-DMHA_MARCH={f.partition('=')[2]}" for f in FLAGS if f.startswith("-march="))
    return FLAGS + march + (EMULATE_AMX if emulate else ())

_FIX = "set MHA_BUILD_DIR to a writable directory"
_lock = threading.Lock()
_loaded: dict[tuple[str, tuple[Path, ...]], Path] = {}


class BuildError(RuntimeError):
    """The native extension could not be built or loaded; the message says why.

    ``warned`` is True when this module already warned the user about the cause (a cache
    directory that cannot be used, shared by every extension): callers then stay silent."""

    warned: bool = False


def cache_root() -> Path:
    """The cache directory in use, created and checked writable (see the module docstring).
    Raises :class:`BuildError` naming the directory and the fix when there is none."""
    explicit = os.environ.get("MHA_BUILD_DIR")
    if explicit:
        path, error = _explicit_root(os.path.abspath(explicit))
    else:
        path, error = _default_root(os.path.expanduser("~"), tempfile.gettempdir())
    if error is not None:
        raise error
    return path


@functools.cache
def _explicit_root(where: str) -> tuple[Path | None, BuildError | None]:
    try:
        _prepare(Path(where))
    except OSError as e:
        return None, _warned(BuildError(f"MHA_BUILD_DIR={where} cannot be used as the build "
                                        f"cache ({_why(e)}); {_FIX}"))
    return Path(where), None


@functools.cache
def _default_root(home: str, tmp: str) -> tuple[Path | None, BuildError | None]:
    default = Path(home) / ".cache" / "mha" / "build"
    try:
        if home == "~":
            raise FileNotFoundError("the home directory is unknown")
        _prepare(default)
        return default, None
    except OSError as e:
        first = f"{default} cannot be written ({_why(e)})"
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    fallback = Path(tmp) / f"mha-build-{uid}"
    try:
        _prepare(fallback, private=True)
    except OSError as e:
        return None, _warned(BuildError(f"no usable build cache: {first}, and neither can "
                                        f"{fallback} ({_why(e)}); {_FIX}"))
    warnings.warn(f"mha: the build cache {first}; using {fallback} instead ({_FIX} to choose "
                  "the place)", RuntimeWarning, stacklevel=4)
    return fallback, None


def _prepare(root: Path, private: bool = False) -> None:
    """Create ``root`` and check that a file can be created in it (the only test that holds
    for root on read-only or pseudo filesystems). ``private``: a directory in a shared temp
    dir must be ours and closed to others, since its libraries are loaded into the process."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o777)
    if private:
        st, uid = os.lstat(root), os.getuid() if hasattr(os, "getuid") else None
        if not stat.S_ISDIR(st.st_mode) or uid not in (None, st.st_uid) or st.st_mode & 0o022:
            raise PermissionError(f"{root} is not a directory of this user closed to others")
    fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
    os.close(fd)
    os.unlink(probe)


def _why(e: OSError) -> str:
    return f"{type(e).__name__}: {e.strerror or e}"


def _warned(error: BuildError) -> BuildError:
    warnings.warn(f"mha: native kernels disabled, falling back to other backends: {error}",
                  RuntimeWarning, stacklevel=5)
    error.warned = True
    return error


def compiler() -> str | None:
    """The C++ compiler to use, or None when there is none."""
    cxx = os.environ.get("MHA_CXX") or os.environ.get("CXX") or "c++"
    return shutil.which(cxx)


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _key(name: str, sources: list[Path], csrc: Path) -> str:
    """The cache key: the sources and every header under ``csrc`` (subfolders too, each with
    its path: a header may be included from any of them), the flags and the toolchain."""
    h = hashlib.sha256()
    for s in sorted(sources):
        h.update(_relative(s, csrc).encode())
        h.update(s.read_bytes())
    for header in sorted(csrc.rglob("*.h")):
        h.update(_relative(header, csrc).encode())
        h.update(header.read_bytes())
    h.update(" ".join(flags() + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(_cpu_identity().encode())  # -march=native: a build is only valid on its CPU kind
    return f"{name}-{h.hexdigest()[:16]}"


def _relative(path: Path, csrc: Path) -> str:
    try:
        return path.relative_to(csrc).as_posix()
    except ValueError:
        return path.name


def load(name: str, sources: tuple[str, ...], verbose: bool = False, *,
         csrc: Path = CSRC) -> Path:
    """Build (or reuse) the extension ``name`` from ``sources`` (paths inside ``csrc``: the
    package's ``mha/csrc``; tests pass a directory of their own) and load it into this
    process, once. Returns the path of the loaded library; raises :class:`BuildError` with
    the reason when it cannot."""
    paths = [csrc / s for s in sources]
    with _lock:
        if (name, tuple(paths)) not in _loaded:
            missing = [str(p) for p in paths if not p.exists()]
            if missing:
                raise BuildError(f"native sources missing: {', '.join(missing)}")
            _loaded[name, tuple(paths)] = _load_unlocked(name, paths, csrc, verbose)
        return _loaded[name, tuple(paths)]



def prebuild(items, *, jobs: int | None = None, csrc: Path = CSRC) -> dict[str, float]:
    """Build the extensions ``items`` (``(name, sources)`` pairs, as :func:`load` takes them)
    that the cache lacks, several at a time: each in a child process of its own (the cache's
    lock keeps them apart from any other build), at most ``jobs`` at once (default: the CPUs
    this process may use). A build is one compiler process per source, so building one
    extension uses one CPU however many there are; ``mha build`` and the tests that need a
    build of their own start them together. Nothing is loaded here: :func:`load` then finds
    them built. Best effort: an extension whose child failed is left to :func:`load`, which
    builds it again and says why it fails. ``csrc`` as for :func:`load`. Returns each
    extension built here -> its seconds."""
    import subprocess
    import time
    from concurrent.futures import ThreadPoolExecutor

    try:
        root = cache_root()
    except BuildError:
        return {}  # load() says why
    missing = []
    for name, sources in items:
        paths = [csrc / s for s in sources]
        if not all(p.exists() for p in paths):
            continue  # load() says which are missing
        entry = root / _key(name, paths, csrc)
        if not _matches_manifest(entry / f"{name}.so", entry / f"{name}.manifest.json"):
            missing.append((name, tuple(sources)))
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    if len(missing) < 2 or jobs < 2:
        return {}  # nothing to overlap: load() builds it in this process
    package = str(Path(__file__).resolve().parent.parent.parent)  # the folder holding mha/
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")]))}
    child = ("import sys; from pathlib import Path; from mha.ops import build; "
             "build.load(sys.argv[1], tuple(sys.argv[3:]), csrc=Path(sys.argv[2]))")

    def run(item: tuple[str, tuple[str, ...]]) -> tuple[str, float | None]:
        name, sources = item
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", child, name, str(csrc), *sources], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, check=False)
        return name, (time.perf_counter() - start if done.returncode == 0 else None)

    with ThreadPoolExecutor(max_workers=min(jobs, len(missing))) as pool:
        return {name: secs for name, secs in pool.map(run, missing) if secs is not None}


_ready: dict[str, str | None] = {}  # extension name -> None (loaded, registered) or the reason
_registered: set[str] = set()  # extensions whose Python side is registered (once per process)


def load_extension(name: str, sources: tuple[str, ...], *, register=None,
                   instead: str | None = None) -> str | None:
    """The one loader of mha's native ops: build (or reuse) and load the extension ``name``,
    then run ``register()`` (the op's Python side: fake twins, autograd) once per process.

    Returns None when the ops are ready, or the reason they are unavailable, e.g.
    ``"mha_decode unavailable (no C++ compiler found ...)"``. ``instead`` says what the caller
    does without them (``"falling back to other backends"``): the reason is then warned once
    (never twice: a cache directory that cannot be used was already warned by
    :func:`cache_root`). ``instead=None`` stays silent (the caller's fallback is exact and
    cheap, e.g. ``F.linear``). The answer is kept: later calls cost a dict lookup.
    """
    if name in _ready:
        return _ready[name]
    try:
        load(name, sources)
    except BuildError as e:
        reason = f"{name} unavailable ({e})"
        if instead is not None and not e.warned:
            warnings.warn(f"mha: {reason}; {instead}", RuntimeWarning, stacklevel=3)
        _ready[name] = reason
        return reason
    with _lock:
        if name not in _registered:
            if register is not None:
                register()
            _registered.add(name)
        _ready[name] = None
    return None


def ask(op):
    """``op()`` for a question about the loaded build or the CPU (its instruction sets, the
    kernel it chose, which GEMM was measured faster), run eagerly on real tensors even while a
    graph is traced: non-strict ``torch.export`` records every op it sees (on fake tensors),
    and such an answer is a fact of the process, not a step of the exported program."""
    from torch.utils._python_dispatch import _disable_current_modes

    # both kinds of mode: the tracer's dispatch modes (fake tensors, graph recording) and its
    # torch-function mode (which would put Python into every op of a measurement)
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return op()


def forget(name: str) -> None:
    """Drop the kept answer of :func:`load_extension` for ``name`` (tests that simulate a
    failed build); the next call asks again."""
    _ready.pop(name, None)


def _load_unlocked(name: str, paths: list[Path], csrc: Path, verbose: bool) -> Path:
    root = cache_root()
    key = _key(name, paths, csrc)
    entry = root / key
    lib, manifest = entry / f"{name}.so", entry / f"{name}.manifest.json"
    tried = _matches_manifest(lib, manifest)
    if tried and _dlopen(lib) is None:  # the common case: built before, no lock needed
        return lib
    with _exclusive(root / f"{key}.lock") as locked:
        if locked:
            _remove_stale(root, key)
        if not tried and _matches_manifest(lib, manifest) and _dlopen(lib) is None:
            return lib  # another process finished it while this one waited
        _discard(entry, lib, manifest)
        work, built = _compile(name, paths, csrc, root, key, verbose)  # cpp_extension loaded it
        try:
            _install(built, lib, manifest)
        except OSError as e:  # the library works here; the next process builds again
            warnings.warn(f"mha: {name} built and loaded, but it could not be stored in "
                          f"{entry} ({_why(e)}); {_FIX} to keep builds", RuntimeWarning,
                          stacklevel=4)
            return built
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return lib


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold an exclusive lock on ``path`` across processes; yields whether it is held (False
    where the filesystem has no locks: installs stay atomic, builds may then run twice)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise BuildError(f"cannot create the lock file {path} ({_why(e)}); {_FIX}") from e
    try:
        locked = False
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                locked = True
            except OSError:
                pass
        yield locked
    finally:
        os.close(fd)  # releases the lock


def _remove_stale(root: Path, key: str) -> None:
    """Temporary build directories of this key that a killed process left (the lock holder is
    the only one that creates them, so any found now are abandoned)."""
    for d in root.glob(f".build-{key}-*"):
        shutil.rmtree(d, ignore_errors=True)


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return path.stat().st_size, h.hexdigest()


def _matches_manifest(lib: Path, manifest: Path) -> bool:
    """Whether ``lib`` is exactly the library its manifest describes (size and sha256)."""
    try:
        want = json.loads(manifest.read_text())
        size = lib.stat().st_size
        if not isinstance(want, dict) or want.get("size") != size:
            return False
        return _digest(lib) == (size, want.get("sha256"))
    except (OSError, ValueError):
        return False


def _dlopen(lib: Path) -> str | None:
    """Load a verified library; the reason when that fails, else None."""
    try:
        torch.ops.load_library(str(lib))
    except Exception as e:  # OSError from dlopen: undefined symbols, a foreign ELF
        return f"{type(e).__name__}: {e}"
    return None


def _discard(entry: Path, lib: Path, manifest: Path) -> None:
    """Remove a cache entry (the manifest first: a library without one is never loaded)."""
    try:
        for f in (manifest, lib):
            f.unlink(missing_ok=True)
        if entry.exists():
            shutil.rmtree(entry)
    except OSError as e:
        raise BuildError(f"cannot replace the cache entry {entry} ({_why(e)}); {_FIX}") from e


def _compile(name: str, paths: list[Path], csrc: Path, root: Path, key: str,
             verbose: bool) -> tuple[Path, Path]:
    """Build into a private temporary directory inside ``root`` (cpp_extension also loads the
    library; ``csrc`` is the include root, as in ``#include "common/finite.h"``). Returns that
    directory and the library in it."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++, or set MHA_CXX/CXX to one)")
    try:
        work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=root))
    except OSError as e:
        raise BuildError(f"cannot create a build directory in {root} ({_why(e)}); "
                         f"{_FIX}") from e
    from torch.utils import cpp_extension

    env_cxx = os.environ.get("CXX")
    os.environ["CXX"] = cxx
    try:
        built = cpp_extension.load(name=name, sources=[str(p) for p in paths],
                                   extra_cflags=list(flags()), extra_ldflags=list(LDFLAGS),
                                   extra_include_paths=[str(csrc)],
                                   build_directory=str(work), verbose=verbose,
                                   is_python_module=False)
    except Exception as e:  # compiler errors, missing ninja, link errors, a full disk
        shutil.rmtree(work, ignore_errors=True)
        raise BuildError(f"building {name} failed: {type(e).__name__}: "
                         f"{str(e).strip()[-2000:]}") from e
    finally:
        if env_cxx is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = env_cxx
    return work, Path(built)


def _install(built: Path, lib: Path, manifest: Path) -> None:
    """Move the finished library into place, then write its manifest (both atomically)."""
    size, sha = _digest(built)
    lib.parent.mkdir(parents=True, exist_ok=True)
    os.replace(built, lib)
    part = manifest.with_name(manifest.name + ".part")
    part.write_text(json.dumps({"library": lib.name, "size": size, "sha256": sha}))
    os.replace(part, manifest)
