"""The software tile unit (csrc/amx/amx_emulate.h) models the instructions it stands for.

A small C++ program, compiled here with the kernels' flags, runs the kernels' own tile
intrinsics (``_tile_loadconfig``, ``_tile_loadd``, ``_tile_dpbf16ps``, ``_tile_stored``,
``_tile_zero``, ``_tile_release``, which the header turns into calls to the model) on inputs
written by this test, and writes back what was stored and the eight registers. Checked against
the Intel SDM's definitions (palette 1), computed here in numpy float32:

* a tile holds ``rows`` rows of ``colsb`` bytes of its configuration: a load reads exactly
  those (row r at base + r * stride), the rest of the register is zero; a store writes exactly
  those; a configuration and a release zero every register;
* TDPBF16PS: for m < rows[C], n < colsb[C] / 4, k < colsb[A] / 4, in that order,
  ``c[m][n] += a[m][2k] b[k][2n]`` then ``c[m][n] += a[m][2k+1] b[k][2n+1]``, each add rounded
  to fp32, and the bytes of C past colsb[C] zero (the inputs are chosen so that another order
  of the adds gives other bits: the test can tell);
* a tile used against its configuration (shapes that do not agree, no configuration) aborts.

Not modelled, so not tested: the hardware's flush of denormal inputs and results to zero.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from mha.ops import build

M, K, N = 5, 7, 9  # C rows, A pairs (colsb[A] = 4K), C fp32 columns (colsb[C] = 4N)
STRIDE = 80  # bytes between source rows: wider than a tile row, garbage past colsb
PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include "amx/amx_tiles.h"  // TileConfig, load_tile_config; the model under MHA_AMX_EMULATE

int main(int argc, char** argv) {
  using mha_amx::TileConfig;
  static unsigned char a[16 * 80], b[16 * 80], c[16 * 80], out[16 * 80];
  FILE* f = std::fopen(argv[1], "rb");
  if (!f) return 2;
  for (unsigned char* buf : {a, b, c, out})
    if (std::fread(buf, 1, 16 * 80, f) != 16 * 80) return 2;
  std::fclose(f);
  const char* mode = argc > 2 ? argv[2] : "run";
  if (!std::strcmp(mode, "unconfigured")) { _tile_zero(0); return 0; }  // must abort
  TileConfig cfg{};
  cfg.palette = 1;
  cfg.rows[0] = M_, cfg.colsb[0] = 4 * N_;  // C
  cfg.rows[1] = M_, cfg.colsb[1] = 4 * K_;  // A
  cfg.rows[2] = K_, cfg.colsb[2] = 4 * N_;  // B
  cfg.rows[3] = 16, cfg.colsb[3] = 64;      // a full tile, to see the zeroing by a load
  if (!std::strcmp(mode, "mismatch")) cfg.rows[2] = K_ + 1;  // B rows != A pairs: must abort
  mha_amx::load_tile_config(cfg);
  _tile_loadd(3, c, 80);  // a full tile, zeroed by the configuration below
  mha_amx::load_tile_config(cfg);
  _tile_loadd(0, c, 80);
  _tile_loadd(1, a, 80);
  _tile_loadd(2, b, 80);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, out, 80);
  FILE* o = std::fopen(argv[1], "wb");
  std::fwrite(out, 1, sizeof out, o);
  std::fwrite(mha_amx_emu::registers().data, 1, sizeof mha_amx_emu::registers().data, o);
  _tile_release();
  std::fwrite(mha_amx_emu::registers().data, 1, sizeof mha_amx_emu::registers().data, o);
  std::fclose(o);
  return 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """The compiled program's path (the kernels' flags, MHA_AMX_EMULATE, an AVX512_BF16
    target so that amx_tiles.h takes the model whatever this CPU is)."""
    cxx = build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler found (install g++, or set MHA_CXX/CXX to one)")
    where = tmp_path_factory.mktemp("amx_emulate")
    src = where / "check.cpp"
    src.write_text(PROGRAM.replace("M_", str(M)).replace("K_", str(K)).replace("N_", str(N)))
    flags = [f for f in build.FLAGS if f not in ("-march=native", "-fopenmp")]
    cmd = [cxx, *flags, "-march=cooperlake", "-DMHA_AMX_EMULATE", f"-I{build.CSRC}", str(src),
           "-o", str(where / "check")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("unrecognized command-line option" in r.stderr
                              or "bad value" in r.stderr):
        pytest.skip(f"the compiler does not know -march=cooperlake: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return where / "check"


def _bf16(rng, shape) -> np.ndarray:
    """bf16 bit patterns of +-2^e (1 + m / 128), e in [-12, 12]: wide enough that the order of
    fp32 adds shows in the bits, never denormal or infinite in a product or a sum here."""
    e = rng.integers(-12, 13, shape)
    m = rng.integers(0, 128, shape)
    s = rng.integers(0, 2, shape)
    return ((s << 15) | ((e + 127) << 7) | m).astype(np.uint16)


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _inputs(seed):
    """Source buffers (16 rows of STRIDE bytes, garbage everywhere) and the logical operands."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 256, (16, STRIDE), dtype=np.uint8)  # garbage past the tile
    b = rng.integers(1, 256, (16, STRIDE), dtype=np.uint8)
    c = rng.integers(1, 256, (16, STRIDE), dtype=np.uint8)
    a_bf = _bf16(rng, (M, 2 * K))  # A: M rows of K pairs
    b_bf = _bf16(rng, (K, 2 * N))  # B: K rows of N pairs
    c_f = (_f32(_bf16(rng, (M, N))) * np.float32(3)).astype(np.float32)
    a[:M, :4 * K] = a_bf.view(np.uint8).reshape(M, 4 * K)
    b[:K, :4 * N] = b_bf.view(np.uint8).reshape(K, 4 * N)
    c[:M, :4 * N] = c_f.view(np.uint8).reshape(M, 4 * N)
    return a, b, c, _f32(a_bf), _f32(b_bf), c_f


def _sdm_order(a, b, c):
    """TDPBF16PS as the SDM writes it: pairs in order, every add rounded to fp32."""
    out = c.copy()
    for m in range(M):
        for k in range(K):
            for n in range(N):
                out[m, n] = np.float32(out[m, n] + a[m, 2 * k] * b[k, 2 * n])
                out[m, n] = np.float32(out[m, n] + a[m, 2 * k + 1] * b[k, 2 * n + 1])
    return out


def _pair_first(a, b, c):
    """Another order (each pair's two products added first): what the test must tell apart."""
    out = c.copy()
    for m in range(M):
        for k in range(K):
            for n in range(N):
                pair = np.float32(a[m, 2 * k] * b[k, 2 * n] + a[m, 2 * k + 1] * b[k, 2 * n + 1])
                out[m, n] = np.float32(out[m, n] + pair)
    return out


def _run(program, tmp_path, seed, mode=None):
    a, b, c, af, bf, cf = _inputs(seed)
    sentinel = np.full((16, STRIDE), 0xA5, dtype=np.uint8)
    io = tmp_path / f"io{seed}.bin"
    io.write_bytes(a.tobytes() + b.tobytes() + c.tobytes() + sentinel.tobytes())
    r = subprocess.run([str(program), str(io), *([mode] if mode else [])], capture_output=True,
                       timeout=60)
    return r, io, (a, b), (af, bf, cf)


@pytest.mark.parametrize("seed", [0, 1])
def test_tdpbf16ps_loads_and_stores_follow_the_configuration(program, tmp_path, seed):
    r, io, (a, b), (af, bf, cf) = _run(program, tmp_path, seed)
    assert r.returncode == 0, r.stderr
    raw = np.frombuffer(io.read_bytes(), dtype=np.uint8)
    out = raw[:16 * STRIDE].reshape(16, STRIDE)
    regs = raw[16 * STRIDE:16 * STRIDE + 8 * 1024].reshape(8, 16, 64)
    after_release = raw[16 * STRIDE + 8 * 1024:]
    # the store wrote M rows of 4N bytes, nothing else
    assert (out[M:] == 0xA5).all() and (out[:M, 4 * N:] == 0xA5).all()
    got = out[:M, :4 * N].copy().view(np.float32)
    want = _sdm_order(af, bf, cf)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (got, want)
    # the inputs discriminate the order of the adds
    assert not np.array_equal(_pair_first(af, bf, cf).view(np.uint32), want.view(np.uint32))
    # registers: configured bytes only, zeros past rows / colsb (C after the product too)
    for t, rows, colsb in ((0, M, 4 * N), (1, M, 4 * K), (2, K, 4 * N)):
        assert (regs[t, rows:] == 0).all() and (regs[t, :, colsb:] == 0).all(), f"tile {t}"
    assert np.array_equal(regs[1, :M, :4 * K], a[:M, :4 * K])  # row r from base + r * stride
    assert np.array_equal(regs[2, :K, :4 * N], b[:K, :4 * N])
    assert (regs[3] == 0).all(), "a configuration leaves tile 3's earlier load"
    assert (regs[4:] == 0).all()
    assert (after_release == 0).all(), "a release leaves data in the registers"


@pytest.mark.parametrize("mode", ["mismatch", "unconfigured"])
def test_a_tile_used_against_its_configuration_aborts(program, tmp_path, mode):
    r = _run(program, tmp_path, 0, mode)[0]
    assert r.returncode == -6, (r.returncode, r.stderr)  # SIGABRT
