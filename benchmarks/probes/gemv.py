"""Developer probe: the packed weight-stationary projections (mha.ops.gemv) against torch's
GEMM and a plain streaming read of the same bytes, on SmolLM2-135M's projection shapes.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src \
        python benchmarks/probes/gemv.py [--rows 1] [--layers 30] [--threads 2]

One "step" runs every projection of ``--layers`` decoder layers once (q 576x576, k/v 192x576,
o 576x576, gate/up 1536x576, down 576x1536) plus lm_head (49152x576), each layer with weights
of its own, so the weights do not fit in the caches and are read from memory, as in decoding
(``--no-head``: lm_head left out; with prefill-sized ``--rows`` the packed rows run torch's
bf16 GEMM on the kept bf16 copy, beside F.linear in fp32 and bf16).
Impls: F.linear on fp32 weights, F.linear on bf16 weights and activations, the packed bf16 and
int8 kernels, and the native read loop (csrc/bench/stream_read.cpp) over the packed bf16 and
int8 bytes. Prints ms per step and GB/s of weights read; the packed rows also as % of the
read loop's rate, timed round-robin in this process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved  # noqa: E402
from mha.ops import build, gemv  # noqa: E402

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
          (576, 1536)]  # (N, K) of q, k, v, o, gate, up, down
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1, help="M, the rows of x (tokens)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--no-head", action="store_true",
                    help="leave lm_head out (the layers' projections only: prefill-sized --rows)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.05 for _ in range(args.layers) for n, k in SHAPES]
    if not args.no_head:
        ws.append(torch.randn(*HEAD, generator=g) * 0.05)
    w16 = [w.bfloat16() for w in ws]
    pb = [gemv.pack(w, "bf16") for w in ws]
    pq = [gemv.pack(w, "int8") for w in ws]
    gemv.load()
    x32 = {k: torch.randn(args.rows, k, generator=g) for k in (576, 1536)}
    x16 = {k: v.bfloat16() for k, v in x32.items()}
    build.load("mha_stream_read", ("bench/stream_read.cpp",))
    read = torch.ops.mha.stream_read
    flat_b = torch.cat([p.data.view(-1).view(torch.float32) for p in pb])  # same bytes, fp32 view
    flat_q = torch.cat([p.data.view(-1).view(torch.float32) for p in pq])
    bytes_b = sum(p.nbytes for p in pb)
    bytes_q = sum(p.nbytes for p in pq)
    bytes_f = sum(w.numel() * 4 for w in ws)
    fns = {
        "F.linear fp32": (lambda: [F.linear(x32[w.shape[1]], w) for w in ws], bytes_f),
        "F.linear bf16": (lambda: [F.linear(x16[w.shape[1]], w) for w in w16], bytes_f // 2),
        "packed bf16": (lambda: [gemv.gemv(x32[p.k], p) for p in pb], bytes_b),
        "packed int8": (lambda: [gemv.gemv(x32[p.k], p) for p in pq], bytes_q),
        "read loop (bf16 bytes)": (lambda: read(flat_b), bytes_b),
        "read loop (int8 bytes)": (lambda: read(flat_q), bytes_q),
    }
    with torch.inference_mode():
        t = interleaved({k: f for k, (f, _) in fns.items()}, args.rounds)
    head = "" if args.no_head else " + lm_head"
    print(f"{args.layers} layers{head}, M={args.rows}, {torch.get_num_threads()} threads")
    for name, (_, nbytes) in fns.items():
        rate = nbytes / t[name] / 1e9
        rel = ""
        if name.startswith("packed"):
            ref = "read loop (bf16 bytes)" if "bf16" in name else "read loop (int8 bytes)"
            rel = f"  {100 * t[ref] / t[name]:5.1f} % of the read loop"
        print(f"  {name:24s} {1e3 * t[name]:8.2f} ms  {rate:6.1f} GB/s{rel}")


if __name__ == "__main__":
    main()
