"""A ``torch.export`` program of the module against the eager module, side by side.

Shape legend: B batch, T sequence length, d_model model width, h heads.

The module (``mha.MultiHeadAttention(d_model, h)``, eval, causal) is exported once under
``torch.no_grad()`` with B in [1, 64] and T in [1, 4096] dynamic, then ``ep.module()`` and the
eager module are timed round-robin in one process (medians) at each (B, T), inference, so the
ratio ``program / eager`` is the cost of running the exported program instead of the module:
what the program holds (``mha.flash_attention_fwd`` for every T, ``mha.linear`` or torch's
GEMM for the projections) against what eager dispatch picks per size (the decode kernel for
T <= 16, the fused forward for T <= 64, ...), plus the program's per-call input checks.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src .venv/bin/python \
        benchmarks/probes/export_program.py --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.export import Dim, export

import mha
from _timing import interleaved

SIZES = ((1, 1), (1, 8), (32, 20), (4, 128), (1, 1024))  # (B, T)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the calling thread's CPU time (one thread, shared machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(args.d_model, args.heads).eval()
    B, T = Dim("B", min=1, max=64), Dim("T", min=1, max=4096)
    with torch.no_grad():
        ep = export(m, (torch.randn(2, 33, args.d_model),), kwargs={"causal": True},
                    dynamic_shapes=({0: B, 1: T}, None))
    program = ep.module()
    ops = sorted({str(n.target) for n in ep.graph.nodes if str(n.target).startswith("mha.")})
    print(f"program holds {', '.join(ops)}; load {os.getloadavg()[0]:.2f}, "
          f"{args.threads} thread(s), clock {args.clock}")
    for b, t in SIZES:
        x = torch.randn(b, t, args.d_model)  # (B, T, d_model)
        with torch.no_grad():
            got = interleaved({"eager": lambda x=x: m(x, causal=True),
                               "program": lambda x=x: program(x, causal=True)},
                              args.rounds, min_time=0.02, clock=clock)
        e, g = got["eager"], got["program"]
        print(f"B={b:<3} T={t:<5} eager {e * 1e6:9.1f} us  program {g * 1e6:9.1f} us  "
              f"program / eager {g / e:5.2f}")
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
