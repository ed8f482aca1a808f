"""Do two threads make each other's forward work dearer? Per-query-block CPU time, alone and at once.

Shape legend: B batch, h heads, T length (Tq = Tk), d head dim; fp32, contiguous (B, h, T, d)
inputs, causal. Builds the forward with ``-DMHA_FLASH_TRACE`` (``src/mha/csrc/flash/trace.h``:
each K/V packing and each 48-row query block records its wall interval and its thread's CPU
time) and calls it on one and on two threads, alternating. Every block of a two-thread call
that ran without a pause (thread CPU / wall >= 0.95) is binned by how much of its interval the
other thread was running blocks without a pause: "alone" (< 5 %: the other thread was off the
CPU, or idle) or "at once" (>= 95 %: both cores ran this forward). Each block's CPU time is
divided by the median of the same block (head, rows) over the one-thread calls; a cost that
comes from sharing the machine (L3, memory, the output's pages) shows as "at once" above
"alone". Per call it also prints the process's CPU time (``getrusage``: both threads, user and
system, OpenMP's waits included) against the CPU time inside the traced parts. On a shared
machine the "at once" bin fills only in the minutes the other core is free; its count is
printed. ``--broadcast``: q, k, v of batch row 0 repeated over B (stride 0; 1/B of the input
bytes, the same work). ``--by-rows``: the query blocks also by their first row (a head's first
rows are where its Q and V rows are first read and its output rows first written).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/block_trace.py \\
        --shapes 4,16,2048,64 1,8,4096,64 --calls 30
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_ab import _build  # noqa: E402

CONTINUOUS = 0.95  # thread CPU / wall of a block that ran without a pause


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return r.ru_utime + r.ru_stime


def _read(path: Path) -> list[tuple[int, int, int, float, float, float]]:
    """(thread, head, first row or -1 for packing, wall start, wall end, CPU s); clears the file."""
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    path.unlink()
    return [(int(t), int(hd), int(r), float(w0), float(w1), float(c)) for t, hd, r, w0, w1, c in rows]


def _with_overlap(records):
    """(head, row, CPU s, share of the record's wall interval the other thread ran continuous
    records) for every continuous record."""
    cont = [r for r in records if r[5] >= CONTINUOUS * max(r[4] - r[3], 1e-9)]
    by_thread = defaultdict(list)
    for r in cont:
        by_thread[r[0]].append(r)
    out = []
    for t, head, row, w0, w1, c in cont:
        covered = sum(min(w1, o[4]) - max(w0, o[3]) for t2, rs in by_thread.items() if t2 != t
                      for o in rs if o[4] > w0 and o[3] < w1)
        out.append((head, row, c, covered / (w1 - w0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["4,16,2048,64", "1,8,4096,64"], help="B,h,T,d")
    ap.add_argument("--calls", type=int, default=30, help="calls per thread count")
    ap.add_argument("--broadcast", action="store_true",
                    help="q, k, v of batch row 0 repeated over B (stride 0)")
    ap.add_argument("--by-rows", action="store_true",
                    help="also split the query blocks by their first row: 0, 48-479, >= 480")
    ap.add_argument("--csrc", default=str(Path(__file__).resolve().parents[2] / "src/mha/csrc"))
    args = ap.parse_args()
    _build("trace", Path(args.csrc).resolve(), ["-DMHA_FLASH_TRACE"], "flash/flash_attn.cpp")
    trace = Path(f"/tmp/mha_flash_trace_{os.getpid()}.txt")  # where flash/trace.h writes
    op = torch.ops.mha_ab_trace._flash_attention_fwd_kernel
    for spec in args.shapes:
        B, h, T, d = map(int, spec.split(","))
        g = torch.Generator().manual_seed(0)
        shape = (1 if args.broadcast else B, h, T, d)
        q, k, v = (torch.randn(*shape, generator=g).expand(B, h, T, d) for _ in range(3))
        blocks: dict[int, list] = {1: [], 2: []}
        calls: dict[int, list] = {1: [], 2: []}
        for threads in blocks:  # warm-up
            torch.set_num_threads(threads)
            op(q, k, v, None, None, True, d ** -0.5, "auto")
        _read(trace)
        for _ in range(args.calls):
            for threads in blocks:
                torch.set_num_threads(threads)
                c0, t0 = _cpu_seconds(), time.perf_counter()
                op(q, k, v, None, None, True, d ** -0.5, "auto")
                wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
                records = _read(trace)
                calls[threads].append((wall, cpu, sum(r[5] for r in records)))
                blocks[threads] += _with_overlap(records)
        print(f"{spec} causal{' broadcast' if args.broadcast else ''}, {args.calls} calls per "
              f"thread count, load {os.getloadavg()[0]:.2f}")
        for threads, rows in calls.items():
            med = [statistics.median(x[i] for x in rows) * 1e3 for i in range(3)]
            outside = statistics.median(x[1] - x[2] for x in rows) * 1e3
            print(f"  threads={threads} per call: wall {med[0]:.1f} ms, process CPU {med[1]:.1f} ms, "
                  f"in the traced parts {med[2]:.1f} ms, outside them {outside:.1f} ms")
        base: dict = defaultdict(list)
        for head, row, c, _ in blocks[1]:
            base[(head, row)].append(c)
        base = {key: statistics.median(v) for key, v in base.items()}
        parts = [("query blocks", lambda r: r >= 0), ("packing", lambda r: r < 0)]
        if args.by_rows:  # a head's first rows read Q and V, and write the output, first
            parts += [("row 0", lambda r: r == 0), ("rows 48-479", lambda r: 0 < r < 480),
                      ("rows >= 480", lambda r: r >= 480)]
        for threads in blocks:
            for part, is_part in parts:
                for label, lo, hi in (("alone", 0.0, 0.05), ("at once", 0.95, 1.01)):
                    sel = [(c, base[(hd, r)]) for hd, r, c, f in blocks[threads]
                           if lo <= f < hi and is_part(r) and (hd, r) in base]
                    if threads == 1 and label != "alone" or not sel:
                        continue
                    ratios = [c / b for c, b in sel]
                    print(f"  threads={threads} {part:12s} {label:7s} n={len(sel):6d}: CPU / the "
                          f"one-thread median: median {statistics.median(ratios):.3f}, total "
                          f"{sum(c for c, _ in sel) / sum(b for _, b in sel):.3f}")


if __name__ == "__main__":
    main()
