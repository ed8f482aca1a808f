"""mha.linear against F.linear, and the module's training step against nn.MultiheadAttention.

Shape legend: M rows (B * T), K input features, N output features; the module is the seeds'
(B = 32, T = 20, d_model = 512, h = 8). One process, calls interleaved round-robin, medians.
GFLOP/s count 2 M N K for the forward and 3x that for forward + backward.

    OPENBLAS_CORETYPE= OPENBLAS_L2_SIZE= .venv/bin/python benchmarks/linear.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import mha
from _timing import interleaved
from mha import linear

SHAPES = ((640, 512, 1536), (640, 512, 512), (2048, 512, 1536), (2048, 2048, 2048))


def _shape(M: int, K: int, N: int, rounds: int) -> str:
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    b = torch.randn(N, requires_grad=True)
    gy = torch.randn(M, N)

    def fwd(f):
        def run():
            with torch.no_grad():
                f(x, w, b)
        return run

    def train(f):
        return lambda: torch.autograd.grad(f(x, w, b), (x, w, b), gy)

    t = interleaved({"mha fwd": fwd(linear.linear), "torch fwd": fwd(F.linear),
                     "mha fwd+bwd": train(linear.linear), "torch fwd+bwd": train(F.linear)},
                    rounds, min_time=0.05)
    fl = 2.0 * M * N * K
    return (f"{M}x{K}x{N}: forward {fl / t['mha fwd'] / 1e9:.0f} vs "
            f"{fl / t['torch fwd'] / 1e9:.0f} GFLOP/s ({t['torch fwd'] / t['mha fwd']:.2f}x); "
            f"forward + backward {3 * fl / t['mha fwd+bwd'] / 1e9:.0f} vs "
            f"{3 * fl / t['torch fwd+bwd'] / 1e9:.0f} "
            f"({t['torch fwd+bwd'] / t['mha fwd+bwd']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; native: {linear.load() or 'yes'}")
    for M, K, N in SHAPES:
        print(_shape(M, K, N, args.rounds))
    m = mha.MultiHeadAttention(512, 8)
    tm = m.to_torch()
    x = torch.randn(32, 20, 512)
    opts = {n: torch.optim.SGD(mod.parameters(), lr=1e-4) for n, mod in (("mha", m), ("torch", tm))}

    def step(name):
        mod, opt = (m, opts["mha"]) if name == "mha" else (tm, opts["torch"])
        call = (lambda: mod(x)) if name == "mha" else (lambda: mod(x, x, x, need_weights=False)[0])

        def run():
            opt.zero_grad()
            call().square().mean().backward()
            opt.step()  # the weights change: mha repacks them at the next forward
        return run

    t = interleaved({"mha": step("mha"), "torch": step("torch")}, args.rounds, min_time=0.1)
    print(f"module training step (B32 T20 d_model 512 h8, SGD): mha {t['mha'] * 1e3:.2f} ms, "
          f"nn.MultiheadAttention {t['torch'] * 1e3:.2f} ms ({t['torch'] / t['mha']:.2f}x)")


if __name__ == "__main__":
    main()
