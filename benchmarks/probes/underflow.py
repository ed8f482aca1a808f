"""Inputs whose softmax underflows: the bf16 kernel against itself on random inputs, and SDPA.

Each query sees one key ~135 log2-units above all others, so every other 2^(t - m) lands in
fp32's denormal range; without flush-to-zero in the kernel's workers, each of those exp2's
vscalefps takes a microcode assist on Intel cores (~15x slower, measured on a Xeon with AMX). The
"peaky / random" ratio should stay near 1. Round-robin medians in one process.

    OPENBLAS_CORETYPE= OPENBLAS_L2_SIZE= .venv/bin/python benchmarks/probes/underflow.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _timing import interleaved
from mha.ops import flash


def inputs(B: int, h: int, T: int, d: int, peaky: bool, seed: int = 0):
    """(B, h, T, d) bf16 q, k, v; peaky: key 0 scores ~94 (x log2 e ~ 135) above the rest."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    q = torch.randn(B, h, T, d, generator=g)  # (B, h, T, d)
    k = torch.randn(B, h, T, d, generator=g)
    if peaky:
        q = u * 9.7 + 0.1 * q  # every query ~ along u, |q| ~ 9.7
        k = 0.1 * k
        k[:, :, 0] = u * 9.7  # key 0 scores ~ 94 with scale 1
    v = torch.randn(B, h, T, d, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,4,2048,64", help="B,h,T,d")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    B, h, T, d = map(int, args.shape.split(","))
    assert flash.unavailable() is None, flash.unavailable()
    print(f"threads={torch.get_num_threads()} isa={flash.isa()} shape={args.shape} scale=1")
    runs = {}
    for kind in ("random", "peaky"):
        q, k, v = inputs(B, h, T, d, kind == "peaky")
        runs[f"flash {kind}"] = lambda q=q, k=k, v=v: flash.flash_attention(q, k, v, scale=1.0)
        runs[f"sdpa {kind}"] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, scale=1.0)
    with torch.no_grad():
        secs = interleaved(runs, args.repeats, min_time=0.1)
    for name, t in secs.items():
        print(f"{name:>14}: {t * 1e3:8.2f} ms")
    print(f"flash peaky / random: {secs['flash peaky'] / secs['flash random']:.2f}  "
          f"sdpa peaky / random: {secs['sdpa peaky'] / secs['sdpa random']:.2f}")


if __name__ == "__main__":
    main()
