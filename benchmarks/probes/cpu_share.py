"""How much of the machine a forward call gets: wall-clock GFLOP/s beside CPU seconds per call.

Shape legend: B batch, h heads, T sequence length (Tq = Tk), d head dim; fp32, contiguous
(B, h, T, d) inputs. For each shape, calls on one and on two threads alternate in one process;
per thread count it prints the wall-clock GFLOP/s (median, min, max over the samples), the
process's CPU seconds per wall second (2.0: both threads ran the whole call; 1.0: one core's
worth), and GFLOP per CPU second (per-thread work: equal on one and two threads when the
threads cost nothing extra). A wall-clock figure that moves while GFLOP per CPU second does not
moved with the CPU the machine gave the process, not with the kernel. Run it with
``OMP_WAIT_POLICY=PASSIVE``: an OpenMP worker left spinning after a call reaches ``getrusage``
late (a 1x4x512x64 call then read 316 GFLOP per CPU second on two threads, above the FMA peak).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_WAIT_POLICY=PASSIVE \\
        .venv/bin/python benchmarks/probes/cpu_share.py \\
        --shapes 4,16,2048,64,causal 1,8,4096,64,dense
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

from mha.ops import flash


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process, user + system
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["4,16,2048,64,causal", "1,8,4096,64,dense"],
                    help="B,h,T,d,{causal,dense}")
    ap.add_argument("--samples", type=int, default=15)
    args = ap.parse_args()
    for spec in args.shapes:
        *dims, kind = spec.split(",")
        B, h, T, d = map(int, dims)
        causal = kind == "causal"
        q, k, v = (torch.randn(B, h, T, d) for _ in range(3))  # (B, h, T, d)
        flop = 4.0 * B * h * T * T * d * (0.5 if causal else 1.0)
        samples: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
        for threads in samples:  # warm-up (and the native build)
            torch.set_num_threads(threads)
            flash.flash_attention(q, k, v, causal=causal)
        for _ in range(args.samples):
            for threads, rows in samples.items():
                torch.set_num_threads(threads)
                c0, t0 = _cpu_seconds(), time.perf_counter()
                flash.flash_attention(q, k, v, causal=causal)
                rows.append((time.perf_counter() - t0, _cpu_seconds() - c0))
        for threads, rows in samples.items():
            walls = [w for w, _ in rows]
            share = statistics.median(c / w for w, c in rows)
            per_cpu = flop / statistics.median(c for _, c in rows) / 1e9
            wall = flop / statistics.median(walls) / 1e9
            print(f"{spec} threads={threads}: wall {wall:.0f} GFLOP/s "
                  f"(min {flop / max(walls) / 1e9:.0f}, max {flop / min(walls) / 1e9:.0f}), "
                  f"CPU s per wall s {share:.2f}, {per_cpu:.0f} GFLOP per CPU s, "
                  f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
