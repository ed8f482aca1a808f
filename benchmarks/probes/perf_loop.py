"""Call one native kernel in a loop for ``--seconds``, for a profiler to sample (``perf``).

Shape legend: B batch, h heads, T sequence length (Tq = Tk), d head dim. Inputs are the
module's layout, (B, T, h, d) viewed as (B, h, T, d), or with ``--contiguous`` (B, h, T, d)
tensors (the layout ``mha bench`` and ``flash_ab.py`` time: fp32 V is then read in place).
Prints ms per call and GFLOP/s (4 B h T^2 d, half when causal; the backward's five products
count 2.5x that) to stderr.

    OPENBLAS_CORETYPE= perf record -F 4000 -o fwd.data -- \\
        .venv/bin/python benchmarks/probes/perf_loop.py --shape 1,8,4096,64 --dtype fp32 --threads 1
    perf report -i fwd.data --no-children --stdio | grep %
    .venv/bin/python benchmarks/probes/perf_loop.py --shape 1,8,2048,64 --dtype bf16 --causal --backward
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from mha.ops import flash


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,8,4096,64", help="B,h,T,d")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true", help="loop the fused backward instead")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--contiguous", action="store_true", help="(B, h, T, d) inputs, not views")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, h, T, d = map(int, args.shape.split(","))
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    if args.contiguous:
        q, k, v = (torch.randn(B, h, T, d).to(dtype) for _ in range(3))
    else:  # the module's (B, T, h, d) views
        q, k, v = (torch.randn(B, T, h, d).to(dtype).transpose(1, 2) for _ in range(3))
    flops = 4.0 * B * h * T * T * d * (0.5 if args.causal else 1.0)
    if args.backward:
        if flash.load_backward() is not None:
            sys.exit("the fused backward is unavailable here")
        out, lse = flash.flash_attention(q, k, v, causal=args.causal)
        bargs = (torch.randn_like(out), None, q, k, v, out, lse, None, None, args.causal, d**-0.5)
        call = lambda: torch.ops.mha.flash_attention_bwd_fused(*bargs)  # noqa: E731
        flops *= 2.5
    else:
        call = lambda: flash.flash_attention(q, k, v, causal=args.causal)  # noqa: E731
    call()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        call()
        n += 1
    dt = (time.perf_counter() - t0) / n
    print(f"{dt * 1e3:.2f} ms per call, {flops / dt / 1e9:.1f} GFLOP/s ({n} calls)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
