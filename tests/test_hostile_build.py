"""The native build cache under hostile conditions: a cache directory that cannot be written,
a half-written or corrupted library in the cache, several processes building at once.

Every case runs in a subprocess with a cache directory of its own, so the libraries the test
process has loaded are untouched. The cache tests build a tiny test-only source (a plain C
function, no torch headers: seconds instead of minutes) through the same ``build.load`` as the
kernels, with a compiler wrapper that logs each invocation so builds can be counted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mha.ops import build

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent
NAME = "mha_probe"
PROBE_CPP = """
extern "C" double mha_probe_dot(const double* a, const double* b, long n) {
  double s = 0.0;
  for (long i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
"""
A, B = (1.5, -2.0, 3.25, 4.0, 0.5), (2.0, 7.0, -1.0, 0.25, 10.0)

# Loads the probe (argv: sources dir, then optionally a barrier dir and an index: announce
# readiness there and start when the file "go" appears) and prints what happened as JSON.
# ``mha/ops/build.py`` depends on torch only; it is imported on its own, without the package's
# other modules, to keep each process's start short.
PROBE = textwrap.dedent("""
    import ctypes, importlib.util, json, os, sys, time, warnings
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("_build", @BUILD_PY@)
    _build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_build)
    if len(sys.argv) > 2:
        barrier = Path(sys.argv[2])
        (barrier / f"ready-{sys.argv[3]}").touch()
        while not (barrier / "go").exists():
            time.sleep(0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            lib, error = _build.load("mha_probe", ("probe.cpp",), csrc=Path(sys.argv[1])), None
        except _build.BuildError as e:
            lib, error = None, str(e)
    dot = None
    if lib is not None:
        f = ctypes.CDLL(str(lib)).mha_probe_dot
        f.restype = ctypes.c_double
        f.argtypes = [ctypes.POINTER(ctypes.c_double)] * 2 + [ctypes.c_long]
        a, b = (ctypes.c_double * 5)(*@A@), (ctypes.c_double * 5)(*@B@)
        dot = f(a, b, 5)
    print(json.dumps({"lib": lib and str(lib), "error": error, "dot": dot,
                      "warnings": [str(w.message) for w in caught]}))
""").replace("@BUILD_PY@", repr(str(SRC / "mha" / "ops" / "build.py"))).replace(
    "@A@", repr(A)).replace("@B@", repr(B))

# The first mha.attention call of a process, judged against the fp64 oracle.
ATTENTION = textwrap.dedent("""
    import json, sys, warnings
    import torch
    sys.path.insert(0, @TESTS@)
    import mha
    from oracle import assert_within_budget
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 24, 32), torch.randn(1, 2, 24, 32), torch.randn(1, 2, 24, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = mha.attention(q, k, v, causal=True)
        mha.attention(q, k, v)
    assert_within_budget(out, q, k, v, allowed=mha.causal_mask(24, 24))
    print(json.dumps({"chosen": mha.explain(q, k, v).chosen,
                      "warnings": [str(w.message) for w in caught]}))
""").replace("@TESTS@", repr(str(TESTS)))


def _env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("MHA_BUILD_DIR", None)
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _run(script: str, env: dict[str, str], *args: str) -> dict:
    res = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    """The probe's sources and a compiler wrapper that logs every invocation."""
    real = build.compiler()
    if real is None:
        pytest.skip("no C++ compiler found (install g++, or set MHA_CXX/CXX to one)")
    root = tmp_path_factory.mktemp("toolchain")
    (root / "csrc").mkdir()
    (root / "csrc" / "probe.cpp").write_text(PROBE_CPP)
    (root / "bin").mkdir()
    wrapper = root / "bin" / "g++"  # a name cpp_extension accepts without probing
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> "$MHA_TEST_CXX_LOG"\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return root


def _probe_env(toolchain: Path, log: Path, **changes: str | None) -> dict[str, str]:
    return _env(MHA_CXX=str(toolchain / "bin" / "g++"), MHA_TEST_CXX_LOG=str(log), **changes)


def _compiles(log: Path) -> int:
    """How many translation units were compiled (one per build of the probe)."""
    if not log.exists():
        return 0
    return sum(" -c " in f" {line} " for line in log.read_text().splitlines())


def _entry(cache: Path) -> Path:
    (entry,) = [d for d in cache.iterdir() if d.is_dir() and d.name.startswith(NAME)]
    return entry


def _assert_complete(cache: Path) -> None:
    """One entry whose library matches its manifest; no temporary build directory left."""
    entry = _entry(cache)
    manifest = json.loads((entry / f"{NAME}.manifest.json").read_text())
    assert build._digest(entry / f"{NAME}.so") == (manifest["size"], manifest["sha256"])
    assert not [d for d in cache.iterdir() if d.name.startswith(".build-")]


DOT = sum(x * y for x, y in zip(A, B, strict=True))


@pytest.fixture(scope="module")
def built(toolchain, tmp_path_factory):
    """A cache holding one complete build of the probe (copied by each test that damages it)."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    log = cache.parent / "cxx.log"
    got = _run(PROBE, _probe_env(toolchain, log, MHA_BUILD_DIR=str(cache)),
               str(toolchain / "csrc"))
    assert got["dot"] == pytest.approx(DOT) and got["error"] is None
    assert _compiles(log) == 1
    _assert_complete(cache)
    return cache


# --- a cache directory that cannot be written -------------------------------------------

def _under_a_file(tmp: Path) -> Path:
    (tmp / "plain").write_text("not a directory")
    return tmp / "plain" / "cache"


UNUSABLE = {
    "under a regular file": _under_a_file,
    "in /proc": lambda tmp: Path("/proc/mha-build-test"),
    "/proc itself (exists, refuses new files)": lambda tmp: Path("/proc"),
}


@pytest.mark.parametrize("where", sorted(UNUSABLE))
def test_unusable_build_dir_is_one_warning_and_a_fallback(where, tmp_path):
    bad = UNUSABLE[where](tmp_path)
    got = _run(ATTENTION, _env(MHA_BUILD_DIR=str(bad)))
    assert len(got["warnings"]) == 1, got["warnings"]
    assert f"MHA_BUILD_DIR={bad}" in got["warnings"][0]
    assert "set MHA_BUILD_DIR to a writable directory" in got["warnings"][0]
    assert got["chosen"] not in ("flash_cpu", "flash_decode")


def test_immutable_build_dir_is_one_warning_and_a_fallback(tmp_path):
    """A directory that exists but refuses new files even to root (``chattr +i``)."""
    bad = tmp_path / "immutable"
    bad.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(bad)],
                                                        capture_output=True).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        got = _run(ATTENTION, _env(MHA_BUILD_DIR=str(bad)))
    finally:
        subprocess.run(["chattr", "-i", str(bad)], check=True)
    assert len(got["warnings"]) == 1, got["warnings"]
    assert f"MHA_BUILD_DIR={bad}" in got["warnings"][0]
    assert got["chosen"] not in ("flash_cpu", "flash_decode")


def test_cli_build_with_unusable_build_dir_says_one_line(tmp_path):
    bad = _under_a_file(tmp_path)
    script = "import sys; from mha.cli import main; sys.exit(main(['build']))"
    res = subprocess.run([sys.executable, "-c", script], env=_env(MHA_BUILD_DIR=str(bad)),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and res.stderr.strip() == "", res.stderr
    failed = [ln for ln in res.stdout.splitlines() if str(bad) in ln]
    assert len(failed) == 1 and "set MHA_BUILD_DIR to a writable directory" in failed[0]


@pytest.mark.parametrize(("value", "flags", "words"), [
    ("yes", {"avx512f", "avx512_bf16"},
     "MHA_AMX_EMULATE=yes is not a choice: expected one of 1, 0 (this build can run: 1, 0;"),
    ("1", {"avx2", "avx512f"},
     "MHA_AMX_EMULATE=1 cannot run here: software AMX tiles need avx512f and avx512_bf16; the "
     "CPU lacks avx512_bf16 (choices this build can run: 0;"),
])
def test_amx_emulate_that_cannot_run_is_refused(monkeypatch, value, flags, words):
    """An unknown MHA_AMX_EMULATE, or 1 where the software tiles cannot run, is a build error
    in mha.ops.forcing's words (warned once, the fallback backends), never ignored."""
    from mha.ops import forcing

    with pytest.raises(ValueError) as e:
        forcing.amx_emulate(value, frozenset(flags))
    assert str(e.value).startswith(words), str(e.value)
    assert forcing.amx_emulate("1", frozenset({"avx512f", "avx512_bf16"}))
    assert not forcing.amx_emulate("0") and not forcing.amx_emulate(None)
    monkeypatch.setenv("MHA_AMX_EMULATE", "yes")
    with pytest.raises(build.BuildError, match="MHA_AMX_EMULATE=yes is not a choice"):
        build.flags()


@pytest.mark.parametrize(("env", "words"), [
    ({"MHA_FLASH_BF16": "avx512"}, "refused: MHA_FLASH_BF16=avx512 is not a choice"),
    ({"MHA_DECODE_BF16": "fp16"}, "refused: MHA_DECODE_BF16=fp16 is not a choice"),
])
def test_cli_build_with_a_forcing_that_cannot_run(env, words):
    """``mha build`` says which forcing cannot run (one line each, no traceback), exit 1."""
    script = "import sys; from mha.cli import main; sys.exit(main(['build']))"
    res = subprocess.run([sys.executable, "-c", script],
                         env=_env(MHA_BUILD_DIR=os.environ.get("MHA_BUILD_DIR"), **env),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert any(words in line for line in res.stdout.splitlines()), res.stdout


def test_unwritable_home_falls_back_to_a_private_temp_dir(toolchain, tmp_path):
    """No MHA_BUILD_DIR and ~/.cache unusable: build in <tempdir>/mha-build-<uid>, say so once."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    log = tmp_path / "cxx.log"
    got = _run(PROBE, _probe_env(toolchain, log, HOME=str(_under_a_file(tmp_path)),
                                 TMPDIR=str(tmpdir)), str(toolchain / "csrc"))
    fallback = tmpdir / f"mha-build-{os.getuid()}"
    assert got["dot"] == pytest.approx(DOT)
    assert len(got["warnings"]) == 1 and str(fallback) in got["warnings"][0], got["warnings"]
    assert got["lib"].startswith(str(fallback))
    assert (fallback.stat().st_mode & 0o777) == 0o700
    _assert_complete(fallback)


def test_unwritable_home_and_unusable_fallback_is_one_warning(tmp_path):
    """The temp fallback is refused when it is not a private directory of this user (its
    libraries would be loaded into the process): here, one open to every user."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    fallback = tmpdir / f"mha-build-{os.getuid()}"
    fallback.mkdir()
    fallback.chmod(0o777)
    got = _run(ATTENTION, _env(HOME=str(_under_a_file(tmp_path)), TMPDIR=str(tmpdir)))
    assert len(got["warnings"]) == 1, got["warnings"]
    assert str(fallback) in got["warnings"][0]
    assert "set MHA_BUILD_DIR to a writable directory" in got["warnings"][0]
    assert got["chosen"] not in ("flash_cpu", "flash_decode")


# --- a damaged library in the cache ------------------------------------------------------

def _truncate(entry: Path) -> None:
    lib = entry / f"{NAME}.so"
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])


def _corrupt_same_size(entry: Path) -> None:
    lib = entry / f"{NAME}.so"
    data = bytearray(lib.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(b ^ 0xFF for b in data[middle: middle + 64])
    lib.write_bytes(bytes(data))


def _delete_manifest(entry: Path) -> None:
    (entry / f"{NAME}.manifest.json").unlink()


def _not_a_library_with_its_manifest(entry: Path) -> None:
    """Matches its manifest, but dlopen refuses it: the load failure path."""
    lib = entry / f"{NAME}.so"
    lib.write_bytes(b"not an ELF file\n" * 64)
    size, sha = build._digest(lib)
    (entry / f"{NAME}.manifest.json").write_text(json.dumps({"size": size, "sha256": sha}))


DAMAGE = {"truncated to half": _truncate, "bytes flipped, same size": _corrupt_same_size,
          "manifest deleted": _delete_manifest,
          "not a library, manifest matching": _not_a_library_with_its_manifest}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_library_is_rebuilt_never_loaded(damage, built, toolchain, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    DAMAGE[damage](_entry(cache))
    log = tmp_path / "cxx.log"
    got = _run(PROBE, _probe_env(toolchain, log, MHA_BUILD_DIR=str(cache)),
               str(toolchain / "csrc"))
    assert got["error"] is None and got["dot"] == pytest.approx(DOT)
    assert got["warnings"] == []
    assert _compiles(log) == 1
    _assert_complete(cache)


def test_damaged_library_that_cannot_be_rebuilt_is_a_build_error(built, toolchain, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    _truncate(_entry(cache))
    got = _run(PROBE, _env(MHA_BUILD_DIR=str(cache), MHA_CXX="/nonexistent/c++", CXX=None),
               str(toolchain / "csrc"))
    assert got["dot"] is None and "no C++ compiler" in got["error"]
    assert not [d for d in cache.iterdir() if d.is_dir()]  # the damaged entry is gone


def test_intact_cache_loads_without_building(built, toolchain, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    log = tmp_path / "cxx.log"
    got = _run(PROBE, _probe_env(toolchain, log, MHA_BUILD_DIR=str(cache)),
               str(toolchain / "csrc"))
    assert got["dot"] == pytest.approx(DOT) and got["warnings"] == []
    assert _compiles(log) == 0


# --- several processes building at once --------------------------------------------------

def test_concurrent_processes_build_once(toolchain, tmp_path):
    cache, barrier, log = tmp_path / "cache", tmp_path / "barrier", tmp_path / "cxx.log"
    barrier.mkdir()
    env = _probe_env(toolchain, log, MHA_BUILD_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, str(toolchain / "csrc"),
                               str(barrier), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    try:
        deadline = time.monotonic() + 120
        while len(list(barrier.glob("ready-*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        (barrier / "go").touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"exit {p.returncode}\n{err[-3000:]}"
        got = json.loads(out.strip().splitlines()[-1])
        assert got["error"] is None and got["dot"] == pytest.approx(DOT)
    assert _compiles(log) == 1
    _assert_complete(cache)


def test_cache_key_covers_headers_in_subfolders(tmp_path):
    """Editing a header in any subfolder of the sources' root gives another cache key (else an
    edited header would not rebuild); so does moving a header to another folder."""
    (tmp_path / "common").mkdir()
    (tmp_path / "other").mkdir()
    src = tmp_path / "unit.cpp"
    src.write_text('#include "common/x.h"\n')
    header = tmp_path / "common" / "x.h"
    header.write_text("int x = 1;\n")
    before = build._key("probe", [src], tmp_path)
    header.write_text("int x = 2;\n")
    edited = build._key("probe", [src], tmp_path)
    header.rename(tmp_path / "other" / "x.h")
    moved = build._key("probe", [src], tmp_path)
    assert len({before, edited, moved}) == 3


# --- several extensions built at once (mha build) ----------------------------------------

def _overlap_toolchain(toolchain: Path, tmp: Path) -> Path:
    """A compiler wrapper whose compiles each wait (up to 60 s) until another compile has
    started, and log "together" or "alone": compiles that run one after the other say alone."""
    wrapper = tmp / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in *" -c "*)
          touch "$MHA_TEST_BARRIER/started-$$"
          n=0; seen=alone
          while [ $n -lt 600 ]; do
            if [ $(ls "$MHA_TEST_BARRIER" | wc -l) -ge 2 ]; then seen=together; break; fi
            sleep 0.1; n=$((n + 1))
          done
          echo "$seen" >> "$MHA_TEST_BARRIER.seen";;
        esac
        echo "$*" >> "$MHA_TEST_CXX_LOG"
        exec {build.compiler()} "$@"
    """))
    wrapper.chmod(0o755)
    csrc = tmp / "csrc"
    csrc.mkdir()
    (csrc / "probe.cpp").write_text(PROBE_CPP)
    (csrc / "probe2.cpp").write_text(PROBE_CPP.replace("mha_probe_dot", "mha_probe2_dot"))
    (csrc / "broken.cpp").write_text("this is not C++\n")
    return csrc


def test_prebuild_builds_missing_extensions_at_once(toolchain, tmp_path, monkeypatch):
    csrc = _overlap_toolchain(toolchain, tmp_path)
    cache, barrier, log = tmp_path / "cache", tmp_path / "barrier", tmp_path / "cxx.log"
    barrier.mkdir()
    for k, v in _env(MHA_CXX=str(tmp_path / "bin" / "g++"), MHA_TEST_CXX_LOG=str(log),
                     MHA_TEST_BARRIER=str(barrier), MHA_BUILD_DIR=str(cache)).items():
        monkeypatch.setenv(k, v)
    items = [(NAME, ("probe.cpp",)), ("mha_probe2", ("probe2.cpp",)),
             ("mha_broken", ("broken.cpp",))]
    built = build.prebuild(items, jobs=3, csrc=csrc)
    assert sorted(built) == [NAME, "mha_probe2"]  # the broken one is left to load()
    assert all(secs > 0 for secs in built.values())
    assert (tmp_path / "barrier.seen").read_text().split() == ["together"] * 3
    assert _compiles(log) == 3
    entries = sorted(d.name.split("-")[0] for d in cache.iterdir() if d.is_dir()
                     and not d.name.startswith("."))
    assert entries == [NAME, "mha_probe2"]
    assert not [d for d in cache.iterdir() if d.name.startswith(".build-")]
    for name, sources in items[:2]:  # complete: load() takes them without compiling
        entry = cache / build._key(name, [csrc / s for s in sources], csrc)
        manifest = json.loads((entry / f"{name}.manifest.json").read_text())
        assert build._digest(entry / f"{name}.so") == (manifest["size"], manifest["sha256"])
    # built already: nothing to do; one missing or one CPU: nothing to overlap (load() builds)
    assert build.prebuild(items[:2], jobs=3, csrc=csrc) == {}
    assert build.prebuild(items, jobs=3, csrc=csrc) == {}  # only the broken one is missing
    assert build.prebuild([("mha_probe3", ("probe.cpp",)), *items], jobs=1, csrc=csrc) == {}
    assert _compiles(log) == 3
    with pytest.raises(build.BuildError, match="building mha_broken failed"):
        build.load("mha_broken", ("broken.cpp",), csrc=csrc)
