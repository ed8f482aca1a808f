"""Quick side-by-side timing of the flash_cpu kernel vs torch SDPA and naive torch (one process).

Shape legend: B batch, h heads, T sequence length (Tq = Tk), d head dim.
GFLOP/s counts 4 B h Tq Tk d FLOPs (QK^T and PV), half of that for causal. Medians of
``--repeats`` round-robin timed runs after a warm-up; the ratio columns are what to compare across runs.

    OPENBLAS_CORETYPE= OPENBLAS_L2_SIZE= .venv/bin/python benchmarks/kernel_profile.py
    .venv/bin/python benchmarks/kernel_profile.py --shapes 1,8,4096,64 --cases fp32-causal
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _timing import interleaved
from mha.ops import flash

SHAPES = ((1, 8, 4096, 64), (1, 32, 2048, 128), (4, 16, 2048, 64), (32, 8, 20, 64))
CASES = ("fp32-dense", "fp32-causal", "bf16-dense", "bf16-causal")


def _contenders(q, k, v, causal: bool, naive: bool) -> dict:
    runs = {
        "flash": lambda: flash.flash_attention(q, k, v, causal=causal),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    if naive:
        runs["naive"] = lambda: _naive(q, k, v, causal)
    return runs


def _naive(q, k, v, causal):
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, h, T, T)
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v  # (B, h, T, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES])
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    ap.add_argument("--no-naive", action="store_true", help="skip naive torch (memory heavy)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert flash.unavailable() is None, flash.unavailable()
    print(f"threads={torch.get_num_threads()} isa={flash.isa()}")
    print(f"{'shape':>18} {'case':>12} {'flash':>8} {'sdpa':>8} {'naive':>8} "
          f"{'x sdpa':>7} {'x naive':>7}   (GFLOP/s)")
    for spec in args.shapes:
        B, h, T, d = map(int, spec.split(","))
        for case in args.cases:
            dtype = torch.float32 if case.startswith("fp32") else torch.bfloat16
            causal = case.endswith("causal")
            # the module's layout: (B, T, h, d) viewed as (B, h, T, d)
            q, k, v = (torch.randn(B, T, h, d).to(dtype).transpose(1, 2) for _ in range(3))
            flops = 4.0 * B * h * T * T * d * (0.5 if causal else 1.0)
            naive = not args.no_naive and B * h * T * T * 4 < 2**31
            with torch.no_grad():
                secs = interleaved(_contenders(q, k, v, causal, naive), args.repeats, min_time=0.1)
            g = {n: flops / t / 1e9 for n, t in secs.items()}
            na = g.get("naive", float("nan"))
            print(f"{spec:>18} {case:>12} {g['flash']:8.1f} {g['sdpa']:8.1f} {na:8.1f} "
                  f"{g['flash'] / g['sdpa']:7.2f} {g['flash'] / na:7.2f}", flush=True)


if __name__ == "__main__":
    main()
