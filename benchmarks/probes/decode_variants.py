"""The score variants in the decode kernel: one decode step with softcap / sinks / ALiBi / bias
vs the plain step, side by side in one process (round-robin medians, ``_timing.interleaved``).

Run (under the timing lock, see docs/kernel.md):
    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        .venv/bin/python benchmarks/probes/decode_variants.py --dtype float32

Shapes (B, h, Tq, Tk, d): (1, 32, 1, 8192, 128) MHA and (1, 9, 1, 8000, 64) GQA with h_kv = 3.
Prints the median ms of each call (``mha.ops.decode.flash_decode``, the op mha's dispatch
picks for these calls) and its cost over the plain step. ``--clock cpu`` times the process's
CPU seconds per call (all threads) instead of the wall clock: on a shared, oversubscribed
machine the wall clock mostly measures the neighbours.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mha
from _timing import interleaved
from mha.ops.decode import flash_decode

SHAPES = [(1, 32, 32, 1, 8192, 128), (1, 9, 3, 1, 8000, 64)]  # (B, h, h_kv, Tq, Tk, d)


def _cpu_interleaved(fns, rounds: int, calls: int = 3) -> dict[str, float]:
    """Median CPU seconds (``time.process_time``, every thread) per call, round-robin."""
    for fn in fns.values():
        fn()  # warm-up (and the native build)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            samples[name].append((time.process_time() - t0) / calls)
    return {name: statistics.median(v) for name, v in samples.items()}


def _step(q, k, v, kw):
    def fn():
        with torch.no_grad():
            flash_decode(q, k, v, **kw)
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    for B, h, h_kv, Tq, Tk, d in SHAPES:
        q = torch.randn(B, h, Tq, d).to(dtype)  # (B, h, Tq, d)
        k, v = (torch.randn(B, h_kv, Tk, d).to(dtype) for _ in range(2))  # (B, h_kv, Tk, d)
        kinds = {"plain": {}, "softcap": {"softcap": 30.0}, "sinks": {"sinks": torch.randn(h)},
                 "alibi": {"alibi_slopes": mha.alibi_slopes(h)},
                 "bias (h, 1, Tk)": {"bias": torch.randn(h, 1, Tk)},
                 "all four": {"softcap": 30.0, "sinks": torch.randn(h),
                              "alibi_slopes": mha.alibi_slopes(h),
                              "bias": torch.randn(h, 1, Tk)}}
        for kw in kinds.values():
            assert mha.explain(q, k, v, **kw).chosen == "flash_decode"

        steps = {name: _step(q, k, v, kw) for name, kw in kinds.items()}
        t = (_cpu_interleaved(steps, a.rounds) if a.clock == "cpu"
             else interleaved(steps, a.rounds, min_time=0.05))
        print(f"(B, h, Tq, Tk, d) = ({B}, {h}, {Tq}, {Tk}, {d}), h_kv = {h_kv}, {a.dtype}, "
              f"{torch.get_num_threads()} threads, {a.clock} clock")
        for name, sec in t.items():
            print(f"  {name:16s} {sec * 1e3:8.3f} ms  {sec / t['plain'] - 1:+7.1%} over plain")


if __name__ == "__main__":
    main()
