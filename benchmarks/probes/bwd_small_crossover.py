"""Crossover of the backward's small-problem path (flash/bwd_small.h) with the block driver.

Shape legend: B batch, h heads (h_kv = h), Tq/Tk query/key lengths, d = d_k = d_v. Both paths
of one build, in one process, timed round-robin: ``_flash_attention_bwd_fused_math(...,
"small")`` against ``"fp32"`` (the block driver's fp32 products; for bf16 inputs below one
64 x 64 block the driver runs those too). Prints time(small) / time(block): < 1, the small path
is faster. out and lse come from the package's forward, grad_out contiguous.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python \\
        benchmarks/probes/bwd_small_crossover.py --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from _timing import interleaved
from mha.ops import flash

GRID = ("8,8,20,20,64", "8,8,32,32,64", "8,8,48,48,64", "8,8,64,64,64", "8,8,128,64,64",
        "8,8,256,64,64", "8,8,20,20,128", "8,8,64,64,128", "8,8,20,20,256", "8,8,64,64,256",
        "32,8,20,20,64", "32,8,64,64,64")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(GRID), help="B,h,Tq,Tk,d")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert flash.unavailable() is None and flash.load_backward() is None
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"threads={torch.get_num_threads()} clock={args.clock} dtype={args.dtype} "
          f"causal={args.causal} load={os.getloadavg()[0]:.2f}")
    for spec in args.shapes:
        B, h, Tq, Tk, d = (int(x) for x in spec.split(","))
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, h, Tq, d, generator=g).to(dtype)  # (B, h, Tq, d)
        k, v = (torch.randn(B, h, Tk, d, generator=g).to(dtype) for _ in range(2))  # (B, h, Tk, d)
        go = torch.randn(B, h, Tq, d, generator=g).to(dtype)  # (B, h, Tq, d)
        out, lse = flash.flash_attention(q, k, v, causal=args.causal, scale=d ** -0.5)
        inputs = (go, None, q, k, v, out, lse, None, None, args.causal, d ** -0.5)
        fns = {m: (lambda m=m, inputs=inputs: torch.ops.mha._flash_attention_bwd_fused_math(
            *inputs, m)) for m in ("fp32", "small")}
        secs = interleaved(fns, args.repeats, min_time=0.2, clock=clock)
        print(f"{spec:>16}  block {secs['fp32'] * 1e3:8.3f} ms  small {secs['small'] * 1e3:8.3f} ms"
              f"  small/block {secs['small'] / secs['fp32']:.3f}  load={os.getloadavg()[0]:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
