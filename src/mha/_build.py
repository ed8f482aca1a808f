"""Building the native extensions in ``mha/csrc`` once, and caching them across runs.

``load(name, sources)`` compiles the C++ files with ``torch.utils.cpp_extension`` (ninja from
PyPI, the machine's g++) and ``-O3 -march=native -fopenmp`` (OpenMP so that
``at::parallel_for`` really runs in parallel), then loads the shared library, whose
``TORCH_LIBRARY`` blocks register ops under ``torch.ops.mha``. The cache directory is keyed by
the sources' contents, the flags, torch's version and Python's, so an unchanged build is a
``dlopen`` and a changed source rebuilds. ``MHA_BUILD_DIR`` moves the cache (default
``~/.cache/mha/build``); ``MHA_CXX`` (or ``CXX``) names the compiler.

Failures raise :class:`BuildError` with the reason; callers turn that into one warning and a
backend rejection reason — never a wrong result.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-DNDEBUG")
LDFLAGS = ("-fopenmp",)
_lock = threading.Lock()


class BuildError(RuntimeError):
    """The native extension could not be built or loaded; the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("MHA_BUILD_DIR", Path.home() / ".cache" / "mha" / "build"))


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


def _key(name: str, sources: list[Path]) -> str:
    h = hashlib.sha256()
    for s in sorted(sources):
        h.update(s.name.encode())
        h.update(s.read_bytes())
    for header in sorted(CSRC.glob("*.h")):
        h.update(header.read_bytes())
    h.update(" ".join(FLAGS + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(_cpu_identity().encode())  # -march=native: a build is only valid on its CPU kind
    return f"{name}-{h.hexdigest()[:16]}"


@functools.cache
def load(name: str, sources: tuple[str, ...], verbose: bool = False) -> Path:
    """Build (or reuse) the extension ``name`` from ``sources`` (file names in ``mha/csrc``)
    and load it into this process. Returns the path of the loaded library."""
    paths = [CSRC / s for s in sources]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise BuildError(f"native sources missing: {', '.join(missing)}")
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (install g++, or set MHA_CXX/CXX to one)")
    key = _key(name, paths)
    build_dir = cache_root() / key
    lib = build_dir / f"{name}.so"
    with _lock:
        if not lib.exists():
            build_dir.mkdir(parents=True, exist_ok=True)
            from torch.utils import cpp_extension

            env_cxx = os.environ.get("CXX")
            os.environ["CXX"] = cxx
            try:
                cpp_extension.load(name=name, sources=[str(p) for p in paths],
                                   extra_cflags=list(FLAGS), extra_ldflags=list(LDFLAGS),
                                   build_directory=str(build_dir), verbose=verbose,
                                   is_python_module=False)
                return lib  # cpp_extension.load already loaded it
            except Exception as e:  # compiler errors, missing ninja, link errors
                raise BuildError(f"building {name} failed: {type(e).__name__}: "
                                 f"{str(e).strip()[-2000:]}") from e
            finally:
                if env_cxx is None:
                    os.environ.pop("CXX", None)
                else:
                    os.environ["CXX"] = env_cxx
        try:
            torch.ops.load_library(str(lib))
        except Exception as e:
            raise BuildError(f"loading {lib} failed: {e}") from e
    return lib
