"""Side-by-side timing at the seeds' tiny shape (issue 3): mha vs torch SDPA and naive torch.

Shape legend: B batch, h heads, T sequence length (Tq = Tk), d head dim.
Times, in one process and round-robin (so load drifts hit every implementation), microseconds
per call of: the raw op ``torch.ops.mha.flash_attention_fwd``, ``mha.attention`` (auto
dispatch) and with ``backend="flash_cpu"``, torch SDPA, and naive torch
``softmax(q k^T * scale) v``. Medians of ``--repeats`` samples; the ratio columns are what to
compare across runs. Run under the timing lock (see docs/kernel.md):

    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        .venv/bin/python benchmarks/probes/tiny_shape.py --threads 2 --repeats 15
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import mha
from _timing import interleaved
from mha.ops import flash

CASES = ("fp32-dense", "fp32-causal", "bf16-dense", "bf16-causal")


def _naive(q, k, v, causal: bool):
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, h, Tq, Tk)
    if causal:
        Tq, Tk = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool).triu(Tk - Tq + 1), float("-inf"))
    return torch.softmax(s, -1) @ v  # (B, h, Tq, d)


def _contenders(q, k, v, causal: bool) -> dict:
    scale = q.shape[-1] ** -0.5
    return {
        "raw": lambda: torch.ops.mha.flash_attention_fwd(q, k, v, None, None, causal, scale),
        "auto": lambda: mha.attention(q, k, v, causal=causal),
        "flash_cpu": lambda: mha.attention(q, k, v, causal=causal, backend="flash_cpu"),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "naive": lambda: _naive(q, k, v, causal),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="32,8,20,64", help="B,h,T,d")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    B, h, T, d = (int(x) for x in args.shape.split(","))
    assert flash.unavailable() is None, flash.unavailable()
    print(f"shape (B, h, T, d) = ({B}, {h}, {T}, {d}), threads {torch.get_num_threads()}, "
          f"microseconds per call (median of {args.repeats})")
    print(f"{'case':<12} {'raw op':>8} {'auto':>8} {'flash_cpu':>9} {'sdpa':>8} {'naive':>8}"
          f"  {'auto/best':>9} {'raw/best':>8}")
    for case in args.cases.split(","):
        dt, kind = case.split("-")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
        causal = kind == "causal"
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, h, T, d, generator=g).to(dtype) for _ in range(3))  # (B, h, T, d)
        secs = interleaved(_contenders(q, k, v, causal), args.repeats, min_time=0.02, warmup=3)
        t = {n: s * 1e6 for n, s in secs.items()}
        best = min(t["sdpa"], t["naive"])
        print(f"{case:<12} {t['raw']:8.1f} {t['auto']:8.1f} {t['flash_cpu']:9.1f} "
              f"{t['sdpa']:8.1f} {t['naive']:8.1f}  {t['auto'] / best:9.2f} {t['raw'] / best:8.2f}")


if __name__ == "__main__":
    main()
