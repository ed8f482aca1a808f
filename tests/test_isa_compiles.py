"""Every instruction-set path of the native kernels compiles, whatever CPU runs the tests.

``mha build`` compiles with ``-march=native``, so a machine builds (and the numerical tests run)
only the paths its CPU has: an AVX2-only CPU runs the portable loops, AMD Zen 5 the AVX-512 and
``vdpbf16ps`` paths, an Intel Xeon with AMX all of them. This compiles each translation unit the
way ``mha build`` does but for a named target CPU — Cooper Lake (AVX-512 with BF16, no AMX) and
Sapphire Rapids (AVX-512 with AMX), and Haswell (AVX2 only) for the packed projections' portable
loop; and the AMX kernels on software tiles (Cooper Lake with ``-DMHA_AMX_EMULATE``, what a
``MHA_AMX_EMULATE=1`` build compiles) — nothing runs — and checks that the path's code was
really seen (its feature macro is defined).
A target lacking an instruction set some source uses (all but Sapphire Rapids) must also
generate code: GCC reports an intrinsic outside its feature's guard (``_mm512_dpbf16_ps`` under
``__AVX512F__`` alone, for Skylake-AVX512) only when it inlines the intrinsic, which
``-fsyntax-only`` never does. Unoptimised GIMPLE for link-time optimisation is the cheapest
compile that inlines them (``CODEGEN``); Sapphire Rapids, having every instruction set the
sources use, is checked for syntax and templates only.
Each compile is one single-threaded compiler process: the cases run once, as many at a time as
this process may use CPUs (the ``compiled`` fixture), and each test reads its own result.
Torch's headers are most of each compile (6 of its 8 CPU-s), and every translation unit begins
with the same three (``PRELUDE``): a target shared by several cases parses them once, into a GCC
precompiled header that those cases' compiles load before their source (where the source
includes them again, a no-op) — the same text in the same order, parsed once.
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mha.ops import build

AVX512_BF16 = "-march=cooperlake"
AMX = "-march=sapphirerapids"
AVX2 = "-march=haswell"  # no AVX-512: the portable loops
AVX512F = "-march=skylake-avx512"  # AVX-512 without AVX512_BF16
EMULATED = "-march=cooperlake -DMHA_AMX_EMULATE"  # the AMX kernels on software tiles
CASES = [  # (source, target, macros the source defines when the path is compiled in)
    ("flash/flash_attn.cpp", AVX512_BF16, ("MHA_FLASH_LAZY_SOFTMAX", "MHA_FLASH_BF16_TILES",
                                           "MHA_FLASH_SMALL")),
    ("flash/flash_attn.cpp", AMX, ("MHA_FLASH_AMX",)),
    ("decode/flash_decode.cpp", AVX512_BF16, ("__AVX512BF16__",)),
    ("decode/flash_decode.cpp", AMX, ("MHA_DECODE_AMX",)),
    ("flash/flash_attn.cpp", EMULATED, ("MHA_FLASH_AMX", "MHA_AMX_EMULATED")),
    ("decode/flash_decode.cpp", EMULATED, ("MHA_DECODE_AMX", "MHA_AMX_EMULATED")),
    ("flash/flash_attn_bwd.cpp", AVX512_BF16, ("MHA_GEMM_BF16",)),
    ("flash/flash_attn_bwd.cpp", AMX, ("MHA_BWD_AMX",)),
    ("linear/linear.cpp", AVX512_BF16, ("__AVX512F__",)),
    ("linear/gemv.cpp", AVX512_BF16, ("__AVX512F__",)),
    ("linear/self_attention.cpp", AVX512_BF16, ("MHA_GEMM_BF16",)),
    ("linear/self_attention.cpp", AVX512F, ("__AVX512F__",)),  # fp32 only: no bf16 tiles
    ("linear/self_attention.cpp", AVX2, ("__AVX2__",)),  # the ops refuse: no AVX-512 tiles
    ("linear/gemv.cpp", AVX2, ("__AVX2__",)),
    ("bench/stream_read.cpp", AVX512_BF16, ("__AVX512F__",)),
    ("bench/flash_breakdown.cpp", AMX, ("MHA_FLASH_AMX",)),
    # a header that must compile on its own, given its includes
    ("flash/flash_small.h", AVX512_BF16, ("MHA_FLASH_SMALL",)),
]


# The first lines of every translation unit (csrc/**/*.cpp); a source that does not begin with
# them is compiled without the precompiled header
PRELUDE = ("#include <ATen/ATen.h>", "#include <ATen/Parallel.h>", "#include <torch/library.h>")
PCH_MIN_CASES = 4  # a precompiled header costs about two plain compiles (18 CPU-s, 400 MB)
SYNTAX_ONLY = ("-fsyntax-only",)
# Code generation as far as the always-inline intrinsics' target check, without optimisation or
# machine code: -O0 replaces the build's -O3, and the output is GIMPLE for link-time
# optimisation only (-fno-fat-lto-objects), discarded
CODEGEN = ("-O0", "-flto", "-fno-fat-lto-objects")
CODEGEN_OUT = ("-c", "-o", os.devnull)
COMPLETE = {AMX}  # targets with every instruction set the sources use: syntax only


def _mode(target: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The flags that replace the build's ``-O3`` for ``target`` (a precompiled header must be
    made with the same) and those that name a translation unit's output."""
    if target.split()[0] in COMPLETE:
        return SYNTAX_ONLY, ()
    return CODEGEN, CODEGEN_OUT


def _command(target: str) -> list[str]:
    """The compiler, the build's flags but ``-march=native`` and ``-O3`` (``_mode`` gives
    what replaces it), ``target`` and the include paths."""
    from torch.utils.cpp_extension import include_paths

    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler found (install g++, or set MHA_CXX/CXX to one)")
    incs = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"], build.CSRC)]
    flags = [f for f in build.FLAGS if f not in ("-march=native", "-O3")]
    return [cxx, *flags, *target.split(), *incs]


def _begins_with_prelude(source: str) -> bool:
    code = [ln.strip() for ln in (build.CSRC / source).read_text().splitlines()
            if ln.strip().startswith("#")]
    return tuple(code[:len(PRELUDE)]) == PRELUDE


def _precompile(target: str, tmp_path) -> Path | None:
    """``PRELUDE`` precompiled for ``target`` into ``tmp_path``: the header to pass to
    ``-include`` (GCC loads the ``.gch`` beside it), or None when the compiler cannot."""
    header = tmp_path / "prelude.h"
    header.write_text("".join(f"{ln}\n" for ln in PRELUDE))
    opt, _ = _mode(target)
    cmd = [*_command(target), *opt, "-x", "c++-header", str(header), "-o", f"{header}.gch"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return header if r.returncode == 0 else None


def _compile(source: str, target: str, macros, tmp_path,
             prelude: Path | None = None) -> subprocess.CompletedProcess:
    """``source`` compiled for ``target`` (``_mode``), with its path's macros checked;
    ``prelude``: a precompiled ``PRELUDE`` for the same target, loaded first (a header GCC
    cannot use is a warning, ``-Winvalid-pch``, that the test turns into a failure)."""
    cmd = _command(target)
    wrapper = tmp_path / f"isa_{source.replace('/', '_')}.cpp"  # a .h would make a header
    checks = "".join(f'#ifndef {m}\n#error "{m} is not defined: the {target} path was not '
                     'compiled"\n#endif\n' for m in macros)
    wrapper.write_text(f'#include "{source}"\n{checks}')
    pch = ["-include", str(prelude), "-Winvalid-pch"] if prelude is not None else []
    opt, out = _mode(target)
    cmd = [cmd[0], *opt, *out, *pch, *cmd[1:], str(wrapper)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Every case of ``CASES`` compiled once, one compiler per usable CPU at a time:
    ``(source, target) -> CompletedProcess``."""
    root = tmp_path_factory.mktemp("isa")
    march = {i: CASES[i][1].split()[0] for i in range(len(CASES))}  # -D macros share the header
    shared = [i for i in range(len(CASES)) if _begins_with_prelude(CASES[i][0])]
    targets = sorted({march[i] for i in shared if sum(march[j] == march[i] for j in shared)
                      >= PCH_MIN_CASES})
    workers = max(1, min(len(CASES), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        headers = {}  # -march -> future of its precompiled prelude

        def precompiled(t: str):
            (root / t[len("-march="):]).mkdir()
            return _precompile(t, root / t[len("-march="):])

        for t in targets:
            headers[t] = pool.submit(precompiled, t)

        def one(i: int):
            source, target, macros = CASES[i]
            (root / str(i)).mkdir()
            header = headers[march[i]].result() if i in shared and march[i] in headers else None
            return (source, target), _compile(source, target, macros, root / str(i), header)

        # the cases without a precompiled header first, while the headers are being made
        order = sorted(range(len(CASES)), key=lambda i: march[i] in headers and i in shared)
        results = dict(pool.map(one, order))
    for t in targets:  # 400 MB each: not kept in pytest's temporary directories
        for gch in (root / t[len("-march="):]).glob("*.gch"):
            gch.unlink()
    return results


@pytest.mark.parametrize("source,target,macros", CASES,
                         ids=[f"{s}-{t.split()[0].split('=')[1]}"
                              + ("-emulated" if "EMULATE" in t else "") for s, t, _ in CASES])
def test_isa_path_compiles(source, target, macros, compiled):
    r = compiled[source, target]
    if r.returncode != 0 and ("unrecognized command-line option" in r.stderr
                              or "bad value" in r.stderr):
        pytest.skip(f"the compiler does not know {target}: {r.stderr.strip()[:200]}")
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert r.returncode == 0, "\n".join(errors[:20]) or r.stderr[-2000:]
    assert "Winvalid-pch" not in r.stderr, r.stderr[-2000:]  # the precompiled header was used


def test_every_translation_unit_is_compiled_here():
    """A new ``.cpp`` under ``csrc`` (any subfolder) must join ``CASES``."""
    sources = {p.relative_to(build.CSRC).as_posix() for p in build.CSRC.rglob("*.cpp")}
    assert sources == {s for s, _, _ in CASES if s.endswith(".cpp")}


WORDS = r"""#include <cstdio>
#include "common/isa_words.h"
int main() {
  std::printf("%s\n", mha_common::build_lacks("avx512bf16", "AVX512_BF16",
                                               mha_common::cpu_has_avx512_bf16()).c_str());
}
"""


@pytest.mark.parametrize("march, macro, cpu_has_it", [
    ("-march=skylake-avx512", "skylake-avx512",
     "the CPU has AVX512_BF16, but the build's flags (-march=skylake-avx512) do not target it"),
    ("-march=skylake-avx512", None, "the CPU has AVX512_BF16, but the build's flags do not "
     "target it"),
    ("-march=native", "native",
     "the CPU has AVX512_BF16, but the compiler did not target it under -march=native"),
], ids=["named-march", "no-macro", "native"])
def test_words_for_an_instruction_set_the_build_lacks(march, macro, cpu_has_it, tmp_path):
    """``this build lacks avx512bf16 (...)`` says whether the CPU or the build's flags lack it
    (csrc/common/isa_words.h): compiled for a CPU without AVX512_BF16 and run on this one."""
    from mha.ops.forcing import cpu_flags

    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler found (install g++, or set MHA_CXX/CXX to one)")
    src = tmp_path / "words.cpp"
    src.write_text(WORDS)
    exe = tmp_path / "words"
    defines = [f"-DMHA_MARCH={macro}"] if macro else []
    r = subprocess.run([cxx, "-O1", "-std=c++17", march, *defines, f"-I{build.CSRC}", str(src),
                        "-o", str(exe)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("unrecognized command-line option" in r.stderr
                              or "bad value" in r.stderr):
        pytest.skip(f"the compiler does not know {march}: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr[-2000:]
    words = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.strip()
    if "avx512_bf16" in cpu_flags():
        assert words == f"this build lacks avx512bf16 ({cpu_has_it})", words
    else:
        assert words == "this build lacks avx512bf16 (the CPU has no AVX512_BF16)", words
