"""The flash kernels' bf16 choice, checked over shapes: the forward on ``avx512bf16``
(vdpbf16ps) against ``avx512f`` (widened to fp32), and the fused backward's products on
``bf16`` against ``fp32``, all side by side in one process, round-robin medians.

Shape legend: B batch, h heads, T length (Tq = Tk), d head dim.
The process measures one forward problem (``mha.ops.flash_choice.SHAPE``, one thread, its CPU
clock) and the backward follows that choice; this probe says whether the forward's ordering
holds at other shapes and whether the backward's agrees. Prints ms per call and each pair's
ratio (``avx512f / avx512bf16``, ``fp32 / bf16``: > 1 means the vdpbf16ps side is faster) and
the process's own choice (``mha.ops.flash.bf16_said``).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python \\
        benchmarks/probes/bf16_choice.py --threads 1 --rounds 7
"""

from __future__ import annotations

import argparse
import time

import torch

from _timing import interleaved
from mha.ops import flash

CASES = ("1,8,512,64,dense", "1,4,256,64,dense", "1,8,1024,64,causal", "1,4,512,128,dense",
         "2,16,2048,64,causal")


def _calls(spec: str) -> dict:
    """The four calls of one case ``B,h,T,d,causal|dense`` on the same bf16 inputs."""
    B, h, T, d, mask = spec.split(",")
    B, h, T, d, causal = int(B), int(h), int(T), int(d), mask == "causal"
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(B, h, T, d, generator=g).bfloat16() for _ in range(4))
    scale = d ** -0.5
    out, lse = torch.ops.mha.flash_attention_fwd(q, k, v, None, None, causal, scale)
    fwd = torch.ops.mha._flash_attention_fwd_kernel
    bwd = torch.ops.mha._flash_attention_bwd_fused_math
    fns = {f"fwd {kn}": (lambda kn=kn: fwd(q, k, v, None, None, causal, scale, kn))
           for kn in ("avx512bf16", "avx512f")}
    fns.update({f"bwd {m}": (lambda m=m: bwd(go, None, q, k, v, out, lse, None, None, causal,
                                             scale, m, 0)) for m in ("bf16", "fp32")})
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), help="B,h,T,d,causal|dense")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    assert flash.unavailable() is None, flash.unavailable()
    assert flash.load_backward() is None, flash.load_backward()
    print(f"isa {flash.isa()}; this process: bf16 -> {flash.kernels()['bfloat16']}: "
          f"{flash.bf16_said()}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"threads {args.threads}, clock {clock.__name__}, {args.rounds} rounds")
    for spec in args.cases:
        t = interleaved(_calls(spec), args.rounds, min_time=0.02, clock=clock)
        f, b = t["fwd avx512f"] / t["fwd avx512bf16"], t["bwd fp32"] / t["bwd bf16"]
        times = "  ".join(f"{n} {s * 1e3:.2f} ms" for n, s in t.items())
        agree = "agree" if (f > 1) == (b > 1) else "DISAGREE"
        print(f"{spec:<20} {times}  fwd {f:.2f}x  bwd {b:.2f}x  ({agree})")


if __name__ == "__main__":
    main()
