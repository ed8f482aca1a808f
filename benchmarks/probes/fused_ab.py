"""A/B timing of the module's fused forward op (linear/self_attention.cpp) from several source
trees in one process: each variant is compiled with ops under ``torch.ops.mha_ab_<name>``
(flash_ab.py's build), loaded side by side and timed round-robin on the same inputs.

Shape legend: B batch, T sequence length, D model width (= N_out), h heads. Per shape and
variant: ``self_attention_f32`` / ``_bf16`` on random x, W_qkv, b_qkv, W_O, b_O, the weights
packed per call (``--frozen``: packed once by the variant's own ``pack_panels_*``). ``causal``
in a shape is passed only to variants whose schema has it (an older tree has not: its column
is left out). The ratio column is each variant's time over the first's (< 1: faster); the
outputs are compared bitwise with the first variant's.

    git -C . archive $OLD src/mha/csrc | tar -x -C /tmp/base   # the old tree (a commit)
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src .venv/bin/python \\
        benchmarks/probes/fused_ab.py --variant old=/tmp/base/src/mha/csrc \\
        --variant new=src/mha/csrc --threads 1 --clock cpu --repeats 9
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import add_variant_argument  # noqa: E402
from flash_ab import _interleaved, build_variants  # noqa: E402

SHAPES = ["32,20,512,8,dense", "8,64,512,8,dense", "32,20,512,8,causal", "8,64,512,8,causal"]


def _takes_causal(op) -> bool:
    return any(a.name == "causal" for a in op.default._schema.arguments)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_variant_argument(ap)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="B,T,D,h,{dense|causal}")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), action="append",
                    help="only these dtypes (default: both)")
    ap.add_argument("--frozen", action="store_true", help="the weights packed once")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--min-time", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = build_variants(args.variant, "linear/self_attention.cpp")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"threads={torch.get_num_threads()} clock={args.clock} frozen={args.frozen} "
          f"load={os.getloadavg()[0]:.2f}")
    for dname in args.dtype or ("fp32", "bf16"):
        dtype = torch.bfloat16 if dname == "bf16" else torch.float32
        suffix = "bf16" if dname == "bf16" else "f32"
        for spec in args.shapes:
            B, T, D, h, mode = spec.split(",")
            B, T, D, h = int(B), int(T), int(D), int(h)
            causal = mode == "causal"
            g = torch.Generator().manual_seed(0)
            x = torch.randn(B, T, D, generator=g).to(dtype)  # (B, T, D)
            w_qkv = (torch.randn(3 * D, D, generator=g) * D ** -0.5).to(dtype)  # (3 h d, D)
            w_o = (torch.randn(D, D, generator=g) * D ** -0.5).to(dtype)  # (N_out, h d)
            b_qkv, b_o = (torch.randn(n, generator=g).to(dtype) * 0.1 for n in (3 * D, D))
            fns = {}
            for n in names:
                ops = getattr(torch.ops, f"mha_ab_{n}")
                op = getattr(ops, f"self_attention_{suffix}")
                if causal and not _takes_causal(op):
                    continue
                pack = getattr(ops, f"pack_panels_{suffix}")
                panels = (pack(w_qkv), pack(w_o)) if args.frozen else (None, None)
                extra = (causal,) if _takes_causal(op) else ()
                args_n = (x, w_qkv, b_qkv, w_o, b_o, h, (D // h) ** -0.5, *panels, *extra)
                fns[n] = lambda op=op, args_n=args_n: op(*args_n)
            if not fns:
                continue
            first = next(iter(fns))
            ref = fns[first]()
            same = {n: torch.equal(fn(), ref) for n, fn in fns.items()}
            with torch.no_grad():
                secs = _interleaved(fns, args.repeats, args.min_time, clock)
            base = secs[first]
            row = "  ".join(f"{n} {s * 1e3:7.3f} ms ({s / base:.3f}{'' if same[n] else ', differs'})"
                            for n, s in secs.items())
            print(f"{dname} {spec:>20}  {row}  load={os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
