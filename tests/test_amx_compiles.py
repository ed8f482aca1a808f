"""The Intel AMX paths of the native kernels still compile on a machine without AMX.

The machines this project runs on (AMD Zen 5) have no AMX, so the AMX forward (``flash_attn.cpp``,
``AmxBf16``) and the AMX decode q.k (``flash_decode.cpp``) are never built by ``mha build`` here
and their numerical tests skip. This compiles both translation units the way ``mha build`` does,
with the AMX target switched on (``-mamx-tile -mamx-bf16``), syntax and templates only
(``-fsyntax-only``: nothing runs), and checks that the AMX code was really seen.
"""

from __future__ import annotations

import subprocess
import sysconfig

import pytest

from mha import _build


def _compile(source: str, required_macro: str, tmp_path) -> subprocess.CompletedProcess:
    from torch.utils.cpp_extension import include_paths

    cxx = _build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler found (install g++, or set MHA_CXX/CXX to one)")
    wrapper = tmp_path / f"amx_{source}"
    wrapper.write_text(f'#include "{source}"\n#ifndef {required_macro}\n'
                       f'#error "{required_macro} is not defined: the AMX code was not compiled"\n'
                       "#endif\n")
    incs = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"], _build.CSRC)]
    cmd = [cxx, "-fsyntax-only", *_build.FLAGS, "-mamx-tile", "-mamx-bf16", *incs, str(wrapper)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("source,macro", [("flash_attn.cpp", "MHA_FLASH_AMX"),
                                          ("flash_decode.cpp", "MHA_DECODE_AMX")])
def test_amx_code_compiles(source, macro, tmp_path):
    r = _compile(source, macro, tmp_path)
    if r.returncode != 0 and "unrecognized command-line option" in r.stderr:
        pytest.skip(f"the compiler does not target AMX: {r.stderr.strip()[:200]}")
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert r.returncode == 0, "\n".join(errors[:20]) or r.stderr[-2000:]
