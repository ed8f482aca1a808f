"""This machine's limits, measured in the same run as the benchmarks.

* ``fp32`` — theoretical fp32 peak as a native loop reaches it: every thread runs 16
  independent chains of 512-bit ``vfmadd231ps`` (16 lanes × 2 FLOPs per instruction), so
  nothing but FMA issue rate limits it. AVX2 machines run the same loop on 256-bit registers.
* ``bf16_avx512`` — the same with ``vdpbf16ps`` (per 512-bit instruction 32 bf16 products
  summed into 16 fp32 lanes: 64 FLOPs), where the CPU has AVX512_BF16.
* ``bf16_amx`` — an AMX ``tdpbf16ps`` loop on 4 accumulator tiles (16 x 16 fp32 each, fed by
  16 x 32 bf16 tiles: 16384 FLOPs per instruction), where the CPU and kernel allow AMX.
* ``bf16`` — the larger of the two: the bf16 peak "% of peak" is taken against.
* ``mm_fp32`` / ``mm_bf16`` — what ``torch.mm`` reaches on a large square product (n³·2 FLOPs):
  the achievable GEMM rate, not a peak.
* ``mem_read`` — GB/s of ``torch.sum`` over a 512 MiB fp32 tensor (a read-bandwidth proxy).

The loops are a ~80-line C file compiled here with the system C compiler (``cc``) into a
cache directory and called through ctypes, run on the benchmark's thread count. The FMA peaks
divide each thread's FLOPs by **that thread's own CPU time** (``CLOCK_THREAD_CPUTIME_ID``) and
add the threads up: this is the rate the cores deliver while running, which other processes
sharing the machine do not lower (the wall-clock figure is kept in ``how``). The benchmarks
themselves are timed by the wall clock, so on a busy machine "% of peak" reads low, never high.
The GEMM and memory figures are wall-clock bests of several runs. When no compiler is available the FMA peaks are missing
(their reason says why) and "% of peak" is not shown for them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mha.ops.forcing import cpu_flags


@dataclass
class Peak:
    key: str
    label: str
    value: float | None  # GFLOP/s (or GB/s for mem_read)
    unit: str = "GFLOP/s"
    how: str = ""

    @property
    def gflops(self) -> float | None:
        return self.value if self.unit == "GFLOP/s" else None


_SRC = r"""
#include <immintrin.h>
#include <pthread.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { long iters; float out; double cpu; } job_t;
static double cpu_now(void) {
  struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define CHAINS16(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) \
                     OP(8) OP(9) OP(10) OP(11) OP(12) OP(13) OP(14) OP(15)

__attribute__((target("avx512f"))) static void* f32_512(void* p) {
  job_t* j = (job_t*)p;
  double c0 = cpu_now();
  __m512 x = _mm512_set1_ps(1.0000001f + (float)j->out), y = _mm512_set1_ps(0.9999999f);
#define DECL(i) __m512 a##i = _mm512_set1_ps((float)i);
#define STEP(i) a##i = _mm512_fmadd_ps(x, y, a##i);
#define SUM(i) s = _mm512_add_ps(s, a##i);
  CHAINS16(DECL)
  for (long i = 0; i < j->iters; ++i) { CHAINS16(STEP) }
  __m512 s = _mm512_setzero_ps(); CHAINS16(SUM)
  j->out = _mm512_reduce_add_ps(s);
  j->cpu = cpu_now() - c0;
  return 0;
}
#undef DECL
#undef STEP
#undef SUM

__attribute__((target("avx512f,avx512bf16"))) static void* bf16_512(void* p) {
  job_t* j = (job_t*)p;
  double c0 = cpu_now();
  __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3f80);
#define DECL(i) __m512 a##i = _mm512_set1_ps((float)i + j->out);
#define STEP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
#define SUM(i) s = _mm512_add_ps(s, a##i);
  CHAINS16(DECL)
  for (long i = 0; i < j->iters; ++i) { CHAINS16(STEP) }
  __m512 s = _mm512_setzero_ps(); CHAINS16(SUM)
  j->out = _mm512_reduce_add_ps(s);
  j->cpu = cpu_now() - c0;
  return 0;
}
#undef DECL
#undef STEP
#undef SUM

__attribute__((target("avx2,fma"))) static void* f32_256(void* p) {
  job_t* j = (job_t*)p;
  double c0 = cpu_now();
  __m256 x = _mm256_set1_ps(1.0000001f + (float)j->out), y = _mm256_set1_ps(0.9999999f);
#define DECL(i) __m256 a##i = _mm256_set1_ps((float)i);
#define STEP(i) a##i = _mm256_fmadd_ps(x, y, a##i);
#define SUM(i) s = _mm256_add_ps(s, a##i);
  CHAINS16(DECL)
  for (long i = 0; i < j->iters; ++i) { CHAINS16(STEP) }
  __m256 s = _mm256_setzero_ps(); CHAINS16(SUM)
  float o[8]; _mm256_storeu_ps(o, s);
  j->out = o[0] + o[7];
  j->cpu = cpu_now() - c0;
  return 0;
}

typedef struct { unsigned char palette_id, start_row, reserved[14]; unsigned short colsb[16];
                 unsigned char rows[16]; } tilecfg_t;
/* AMX: 4 accumulator tiles (16x16 fp32) fed by 4 input tiles (16 rows x 32 bf16). */
__attribute__((target("amx-tile,amx-bf16"))) static void* bf16_amx(void* p) {
  job_t* j = (job_t*)p;
  double c0 = cpu_now();
  unsigned short a[16 * 32] __attribute__((aligned(64)));
  float c[16 * 16] __attribute__((aligned(64)));
  for (int i = 0; i < 16 * 32; ++i) a[i] = 0x3c00;
  tilecfg_t cfg = {0};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  _tile_loadconfig(&cfg);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a, 64); _tile_loadd(5, a, 64); _tile_loadd(6, a, 64); _tile_loadd(7, a, 64);
  for (long i = 0; i < j->iters; ++i) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  j->out = c[0];
  j->cpu = cpu_now() - c0;
  return 0;
}

/* Linux asks a process to request the AMX tile state first (ARCH_REQ_XCOMP_PERM, XTILEDATA). */
int amx_permit(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

/* kind 0: fp32 avx512, 1: bf16 avx512, 2: fp32 avx2. Returns the sum over threads of
   iterations per second of that thread's own CPU time; *wall gets the wall seconds. */
double run(int kind, int threads, long iters, double* wall) {
  void* (*f)(void*) = kind == 0 ? f32_512 : kind == 1 ? bf16_512 : kind == 2 ? f32_256 : bf16_amx;
  pthread_t t[64]; job_t jobs[64];
  if (threads > 64) threads = 64;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int i = 0; i < threads; ++i) { jobs[i].iters = iters; jobs[i].out = 0; pthread_create(&t[i], 0, f, &jobs[i]); }
  for (int i = 0; i < threads; ++i) pthread_join(t[i], 0);
  clock_gettime(CLOCK_MONOTONIC, &b);
  *wall = (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
  double rate = 0;
  for (int i = 0; i < threads; ++i) rate += iters / jobs[i].cpu;
  return rate;
}
"""

# FLOPs per loop iteration per thread: 16 chains x (lanes x 2) for FMA; x 64 for vdpbf16ps;
# AMX: 4 tdpbf16ps x (16 x 16 outputs x 32 products x 2).
_FLOPS_PER_ITER = {0: 16 * 32, 1: 16 * 64, 2: 16 * 16, 3: 4 * 16 * 16 * 32 * 2}


def _load_lib() -> tuple[ctypes.CDLL | None, str]:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc/gcc) found to build the FMA loop"
    tag = hashlib.sha256((_SRC + cc).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mha" / "bench"
    so = root / f"peak-{tag}.so"
    if not so.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
            src.write_text(_SRC)
            res = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", str(src), "-o",
                                  str(out)], capture_output=True, text=True)
            if res.returncode != 0:
                return None, f"compiling the FMA loop failed: {res.stderr.strip()[-300:]}"
            shutil.move(str(out), so)
    lib = ctypes.CDLL(str(so))
    lib.run.restype = ctypes.c_double
    lib.amx_permit.restype = ctypes.c_int
    lib.run.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.POINTER(ctypes.c_double))
    return lib, ""


def _loop_peak(lib, kind: int, threads: int, budget: float) -> tuple[float, float]:
    """GFLOP/s of the FMA loop ``kind``: ``(per CPU-second x threads, wall clock)``, each the
    best of several runs of ~0.05 s within ~``budget`` seconds."""
    wall = ctypes.c_double()
    iters = 100_000
    while True:  # calibrate to ~0.05 s per run
        lib.run(kind, threads, iters, ctypes.byref(wall))
        if wall.value > 0.01:
            break
        iters *= 4
    iters = max(1, int(iters * 0.05 / wall.value))
    best_cpu, best_wall, spent = 0.0, 0.0, 0.0
    while spent < budget or best_cpu == 0.0:
        rate = lib.run(kind, threads, iters, ctypes.byref(wall))
        spent += wall.value
        best_cpu = max(best_cpu, _FLOPS_PER_ITER[kind] * rate / 1e9)
        best_wall = max(best_wall, _FLOPS_PER_ITER[kind] * iters * threads / wall.value / 1e9)
    return best_cpu, best_wall


def _mm_peak(dtype, n: int, budget: float, longest: float = 4.0) -> tuple[float, int]:
    """The best GFLOP/s of ``torch.mm`` on ``(m, m)`` operands and ``m``: ``m = n`` unless one
    product of that size would take longer than ``longest`` seconds at the rate of a 256-cube
    probe (e.g. bf16 on a CPU without bf16 arithmetic, where a 4096-cube product takes
    minutes); then the largest power of two below that."""
    import torch

    def best_rate(m: int, budget: float) -> float:
        a = torch.randn(m, m).to(dtype)
        b = torch.randn(m, m).to(dtype)
        torch.mm(a, b)  # warm-up
        best, spent = 0.0, 0.0
        while spent < budget or best == 0.0:
            t0 = time.perf_counter()
            torch.mm(a, b)  # (m, m) @ (m, m) -> (m, m)
            dt = time.perf_counter() - t0
            spent += dt
            best = max(best, 2 * m**3 / dt / 1e9)
        return best

    m = min(n, 256)
    probe = best_rate(m, 0.0)  # one timed product
    while m < n and 2 * (2 * m) ** 3 / (probe * 1e9) <= longest:
        m *= 2
    return best_rate(m, budget), m


def _mem_read(budget: float) -> float:
    import torch

    x = torch.ones(2**27)  # 512 MiB fp32
    x.sum()
    best, spent = 0.0, 0.0
    while spent < budget or best == 0.0:
        t0 = time.perf_counter()
        x.sum()
        dt = time.perf_counter() - t0
        spent += dt
        best = max(best, x.numel() * 4 / dt / 1e9)
    return best


def measure_peaks(threads: int, quick: bool = False) -> dict[str, Peak]:
    """Measure every peak (about 3 s; ~1 s when ``quick``)."""
    import torch

    budget = 0.3 if quick else 0.8
    flags = cpu_flags()
    lib, why = _load_lib()
    peaks: dict[str, Peak] = {}
    if lib is None:
        peaks["fp32"] = Peak("fp32", "fp32 FMA peak", None, how=why)
        peaks["bf16"] = Peak("bf16", "bf16 dot peak", None, how=why)
    else:
        wide = "avx512f" in flags
        kind = 0 if wide else 2
        cpu, wall = _loop_peak(lib, kind, threads, budget)
        peaks["fp32"] = Peak("fp32", "fp32 FMA peak", cpu,
                             how=f"{'AVX-512' if wide else 'AVX2'} vfmadd231ps loop, 16 chains: "
                                 f"rate per thread CPU-second x {threads} threads "
                                 f"(wall clock now: {wall:.0f})")
        if wide and "avx512_bf16" in flags:
            cpu, wall = _loop_peak(lib, 1, threads, budget)
            peaks["bf16_avx512"] = Peak(
                "bf16_avx512", "bf16 AVX-512 dot peak", cpu,
                how=f"vdpbf16ps loop (64 FLOPs/instr), 16 chains: rate per thread CPU-second x "
                    f"{threads} threads (wall clock now: {wall:.0f})")
        if {"amx_bf16", "amx_tile"} <= flags and lib.amx_permit() == 0:
            cpu, wall = _loop_peak(lib, 3, threads, budget)
            peaks["bf16_amx"] = Peak(
                "bf16_amx", "bf16 AMX peak", cpu,
                how=f"AMX tdpbf16ps loop (4 tiles, 16384 FLOPs/instr): rate per thread "
                    f"CPU-second x {threads} threads (wall clock now: {wall:.0f})")
        best = max((p for k, p in peaks.items() if k.startswith("bf16_")),
                   key=lambda p: p.value or 0.0, default=None)
        peaks["bf16"] = (Peak("bf16", f"bf16 peak ({best.label})", best.value, how=best.how)
                         if best else Peak("bf16", "bf16 peak", None,
                                           how="CPU has neither AVX512_BF16 nor AMX-BF16"))
    n = 2048 if quick else 4096
    for key, dtype, name in (("mm_fp32", torch.float32, "fp32"),
                             ("mm_bf16", torch.bfloat16, "bf16")):
        rate, m = _mm_peak(dtype, n, budget)
        peaks[key] = Peak(key, f"torch mm {name}", rate,
                          how=f"torch.mm {m}x{m}x{m} {name}, best run")
    peaks["mem_read"] = Peak("mem_read", "memory read", _mem_read(budget / 2), unit="GB/s",
                             how="torch.sum over 512 MiB fp32, best run")
    return peaks
