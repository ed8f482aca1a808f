"""The fused backward alone, once per arithmetic of its five products, side by side.

Shape legend: B batch, h heads, T sequence length (Tq = Tk), d head dim.
For bf16 inputs the products run on AMX tiles (``amx``: tdpbf16ps, csrc/amx/flash_amx_bwd.h),
on ``vdpbf16ps`` (``bf16``) or in fp32 (``fp32``); the process picks one by default
(``mha build`` says which), and ``torch.ops.mha._flash_attention_bwd_fused_math`` runs a named
one, so all of them are timed here in one process, round-robin, with the same inputs, out and
lse (from the default forward). Prints ms per call, GFLOP/s (the backward's 5 products: 10 B h
Tq Tk d, half for causal) and each arithmetic's speed against fp32. An arithmetic this build
lacks is listed as unavailable (``amx``: a CPU with AMX; a software-tile build,
MHA_AMX_EMULATE=1, runs it but its times mean nothing).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
        .venv/bin/python benchmarks/probes/bwd_products.py --cases 1,8,2048,64,causal --threads 2
"""

from __future__ import annotations

import argparse

import torch

from _timing import interleaved
from mha.ops import flash

CASES = ("1,8,2048,64,causal", "1,8,4096,64,dense", "1,32,2048,128,dense")
MATHS = ("amx", "bf16", "fp32")


def _case(spec: str):
    B, h, T, d, mask = spec.split(",")
    B, h, T, d = int(B), int(h), int(T), int(d)
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(B, h, T, d, generator=g).bfloat16() for _ in range(4))
    causal = mask == "causal"
    out, lse = flash.flash_attention(q, k, v, causal=causal)  # (B, h, T, d), (B, h, T)
    flops = 10.0 * B * h * T * T * d * (0.5 if causal else 1.0)
    return (go, None, q, k, v, out, lse, None, None, causal, d ** -0.5), flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), help="B,h,T,d,causal|dense")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert flash.load_backward() is None, flash.load_backward()
    default = torch.ops.mha.flash_attention_bwd_bf16_math()
    print(f"threads {args.threads}; isa {flash.isa()}; default bf16 arithmetic: {default}")
    for spec in args.cases:
        call, flops = _case(spec)
        fns, missing = {}, []
        for math in MATHS:
            try:
                torch.ops.mha._flash_attention_bwd_fused_math(*call, math)
            except RuntimeError as e:
                missing.append(f"{math} unavailable ({str(e).splitlines()[0]})")
                continue
            fns[math] = (lambda m=math, c=call: torch.ops.mha._flash_attention_bwd_fused_math(*c, m))
        times = interleaved(fns, args.rounds, min_time=0.2)
        print(f"{spec}:")
        for math, t in times.items():
            vs = times["fp32"] / t if "fp32" in times else float("nan")
            print(f"  {math:<5} {t * 1e3:8.2f} ms  {flops / t / 1e9:7.0f} GFLOP/s  "
                  f"{vs:5.2f}x fp32")
        for line in missing:
            print(f"  {line}")


if __name__ == "__main__":
    main()
