"""Few query rows: the decode kernel (flash_decode) against the tile kernel (flash_cpu), the
two ops mha's dispatch chooses between for inference calls with Tq <= 16, side by side in one
process (round-robin, fastest batch, ``_timing.interleaved``).

Run:
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python \
        benchmarks/probes/decode_or_tiles.py --threads 1 --clock cpu

Prints, per (dtype, B, h, h_kv, mask) and (Tq, Tk), the tile kernel's time over the decode
kernel's (< 1: the tile kernel is faster) and the query rows per K/V head, g * Tq, that
``mha.backends.flash_decode.DEFER_ROWS`` compares with its threshold.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from _timing import interleaved
from mha.ops import decode, flash

HEADS = ((2, 8, 8), (1, 9, 3), (8, 16, 16))  # (B, h, h_kv)
TQ = (1, 4, 8, 16)
TK = (16, 64, 256, 1024)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                    help="cpu: the calling thread's CPU time (with --threads 1)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), nargs="*", default=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    scale = args.d ** -0.5
    print(f"threads={args.threads} clock={args.clock} d={args.d} load={os.getloadavg()[0]:.1f}; "
          "tile / decode time, (g*Tq rows)")
    for name in args.dtype:
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        for B, h, h_kv in HEADS:
            for causal in (False, True):
                cells = []
                for Tq in TQ:
                    for Tk in TK:
                        if Tk < Tq:
                            continue
                        g = torch.Generator().manual_seed(0)
                        q = torch.randn(B, h, Tq, args.d, generator=g).to(dtype)  # (B, h, Tq, d)
                        k, v = (torch.randn(B, h_kv, Tk, args.d, generator=g).to(dtype)
                                for _ in range(2))  # (B, h_kv, Tk, d)
                        fns = {
                            "decode": lambda q=q, k=k, v=v, causal=causal: decode.call_op(
                                q, k, v, key_lengths=None, mask=None, scale=scale,
                                causal=causal),
                            "tiles": lambda q=q, k=k, v=v, causal=causal: flash.flash_attention(
                                q, k, v, causal=causal, scale=scale),
                        }
                        with torch.no_grad():
                            t = interleaved(fns, args.rounds, min_time=0.02, clock=clock, stat=min)
                        cells.append(f"{Tq}/{Tk}:{t['tiles'] / t['decode']:.2f}"
                                     f"({h // h_kv * Tq})")
                print(f"{name} {B}x{h}/{h_kv} {'causal' if causal else 'dense '} "
                      + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
