"""What rotary position embeddings cost in the module: MultiHeadAttention(rope=True) against the
same module without rope (same weights), inference forward, causal (``--bidirectional``: not
causal). At T <= 64 both take the fused short-sequence forward (which turns Q and K itself);
there the module with rope is also timed step by step (the fused forward switched off in the
probe).

Run (one thread, load average printed):
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/rope_cost.py \
        [--dtype float32] [--rounds 15] [--bidirectional]

Shapes: d_model 512, 8 heads (d_k 64), (B, T) = (1, 512) and (32, 20). Per shape prints the
median ms of each module and of the rotation alone (``Rotary.apply_rotary`` on Q and K), timed
side by side in one process (round-robin, thread CPU time), and the ratio with / without rope
(and, where fused, step by step / fused with rope).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

import mha
import mha.module
from _timing import interleaved

SHAPES = ((1, 512), (32, 20))


def _unfused(m, x, causal):
    """``m(x)`` with the fused forward off (the module's gate answers with a reason)."""
    gate = mha.module.why_not_fused
    mha.module.why_not_fused = lambda *a, **k: "off in the probe"
    try:
        return m(x, causal=causal)
    finally:
        mha.module.why_not_fused = gate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--bidirectional", action="store_true", help="causal=False")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    plain = mha.MultiHeadAttention(512, 8).to(dtype).eval()
    rope = mha.MultiHeadAttention(512, 8, rope=True).to(dtype).eval()
    rope.load_state_dict(plain.state_dict())
    causal = not a.bidirectional
    print(f"{a.dtype}, d_model 512, h 8, causal={causal} forward, "
          f"threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.2f}")
    for B, T in SHAPES:
        x = torch.randn(B, T, 512, dtype=dtype)
        q = torch.randn(B, T, 8, 64, dtype=dtype).transpose(1, 2)  # (B, h, T, d): the module's view
        with torch.no_grad():
            path = plain.explain(x, causal=causal).splitlines()[-1]
            print(f"  B {B} T {T} without rope: {path[:60]}")
        fns = {"without rope": functools.partial(plain, x, causal=causal),
               "with rope": functools.partial(rope, x, causal=causal),
               "rotation of Q and K": lambda q=q: (rope.rope.apply_rotary(q),
                                                   rope.rope.apply_rotary(q))}
        if T <= 64:
            fns["with rope, step by step"] = functools.partial(_unfused, rope, x, causal)
        with torch.no_grad():
            ms = {n: t * 1e3 for n, t in interleaved(fns, a.rounds, min_time=0.05,
                                                       clock=time.thread_time).items()}
        base = ms["without rope"]
        unfused = "with rope, step by step"
        print(f"  B {B:>2} T {T:>3}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items())
              + f"; with / without {ms['with rope'] / base:.3f}x"
              + (f"; step by step / fused, with rope {ms[unfused] / ms['with rope']:.3f}x"
                 if unfused in ms else ""))
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
