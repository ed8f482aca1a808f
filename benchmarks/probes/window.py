"""Sliding-window attention: the native kernel (mha's pick) vs SDPA with the materialized mask.

Run (one shape and dtype per command, under the timing lock):
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/window.py \
        --T 8192 --window 1024 --dtype float32

Shape (1, 8, T, 64), causal with the window. Prints the median ms of each, measured side by side
in one process (round-robin), and each one's ratio to mha's pick:
  * mha window       mha.attention(causal=True, window=w), no backend named (flash_cpu);
  * mha via sdpa     the same call forced to the sdpa backend (the
                     (Tq, Tk) window mask materialized, all key blocks computed);
  * torch sdpa mask  F.scaled_dot_product_attention with a precomputed bool mask;
  * mha causal       mha.attention(causal=True) without a window (the work a window saves).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

import mha
from _timing import interleaved
from mha.masks import causal_mask, window_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, a.T, 64).to(dtype) for _ in range(3))  # (B, h, T, d)
    allowed = causal_mask(a.T, a.T) & window_mask(a.T, a.T, a.window)  # (T, T)
    chosen = mha.explain(q, k, v, causal=True, window=a.window).chosen
    fns = {
        "mha window": functools.partial(mha.attention, q, k, v, causal=True, window=a.window),
        "mha via sdpa": functools.partial(mha.attention, q, k, v, causal=True, window=a.window,
                                          backend="sdpa"),
        "torch sdpa mask": functools.partial(F.scaled_dot_product_attention, q, k, v,
                                             attn_mask=allowed),
        "mha causal": functools.partial(mha.attention, q, k, v, causal=True),
    }
    with torch.no_grad():
        ref = fns["torch sdpa mask"]().float()
        err = (fns["mha window"]().float() - ref).abs().max().item()
        ms = {k: v * 1e3 for k, v in interleaved(fns, a.rounds).items()}
    base = ms["mha window"]
    print(f"(1, 8, {a.T}, 64) {a.dtype} causal window {a.window}: mha picks {chosen}; "
          f"max |mha - torch sdpa| = {err:.1e}; threads {torch.get_num_threads()}")
    for name, t in ms.items():
        print(f"  {name:<16} {t:9.1f} ms  {t / base:6.2f}x")


if __name__ == "__main__":
    main()
