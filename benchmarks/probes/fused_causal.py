"""The module's inference forward, causal and not, fused (one native call,
:mod:`mha.ops.self_attention`) against step by step (projections, attention and W_O as separate
calls), for short sequences.

Shape legend: B batch, T sequence length, d_model model width, h heads.

For each dtype and shape, four calls of one module (same weights, same input), timed side by side
in one process (round-robin, medians; ``--clock cpu``: the calling thread's CPU time):
``m(x)`` and ``m(x, causal=True)`` as the module runs them (the line ``causal: ...`` says which
way the causal call runs), and each again with the fused forward switched off in the probe.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src .venv/bin/python \\
        benchmarks/probes/fused_causal.py --threads 1 --clock cpu --rounds 9
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import mha
import mha.module
from _timing import interleaved

SHAPES = ((32, 20, 512, 8), (8, 64, 512, 8))  # (B, T, d_model, h)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _unfused(fn):
    """``fn`` with the fused forward off (the module's gate answers with a reason)."""
    def run():
        gate = mha.module.why_not_fused
        mha.module.why_not_fused = lambda *a, **k: "off in the probe"
        try:
            return fn()
        finally:
            mha.module.why_not_fused = gate
    return run


def case(B: int, T: int, D: int, h: int, dname: str, rounds: int, clock) -> None:
    dtype = DTYPES[dname]
    m = mha.MultiHeadAttention(D, h).to(dtype).eval()
    x = torch.randn(B, T, D).to(dtype)  # (B, T, d_model)
    fns = {"not causal": lambda: m(x),
           "not causal, step by step": _unfused(lambda: m(x)),
           "causal": lambda: m(x, causal=True),
           "causal, step by step": _unfused(lambda: m(x, causal=True))}
    with torch.no_grad():
        t = interleaved(fns, rounds, min_time=0.05, clock=clock)
        plain = m.explain(x).splitlines()[-1]
        causal = m.explain(x, causal=True).splitlines()[-1]
    print(f"B{B} T{T} d_model{D} h{h} {dname}:")
    print(f"    not causal: {plain[:70]}")
    print(f"    causal:     {causal[:70]}")
    for name, sec in t.items():
        print(f"    {name:26s} {sec * 1e3:8.3f} ms")
    print(f"    causal / not causal {t['causal'] / t['not causal']:.3f}; causal step by step / "
          f"causal {t['causal, step by step'] / t['causal']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dtype", choices=tuple(DTYPES), action="append",
                    help="only these dtypes (default: all)")
    ap.add_argument("--shape", action="append", metavar="B,T,D,h",
                    help="these shapes instead (batch, length, d_model, heads); repeatable")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (time.thread_time; needs --threads 1)")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, clock {args.clock}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    torch.manual_seed(0)
    shapes = ([tuple(int(v) for v in sh.split(",")) for sh in args.shape] if args.shape
              else SHAPES)
    for B, T, D, h in shapes:
        for dname in args.dtype or DTYPES:
            case(B, T, D, h, dname, args.rounds, clock)
    print(f"load average after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
