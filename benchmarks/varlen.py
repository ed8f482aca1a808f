"""Packed sequences: mha.varlen_attention's two strategies vs one padded mha.attention call.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/varlen.py
Prints the median ms of each, side by side in one process, and what "auto" picked.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

import mha
from mha.varlen import _choose


def timed(fns: dict, rounds: int = 7) -> dict:
    """Median ms of each function, measured round-robin (one call of each per round) so that
    a noisy neighbour slows all of them alike."""
    for fn in fns.values():
        fn()
    runs = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t)
    return {name: statistics.median(r) * 1e3 for name, r in runs.items()}


def main() -> None:
    torch.manual_seed(0)
    h, d = 8, 64
    for name, lengths in [("even 16x256", [256] * 16), ("skewed 2048 + 32x64", [2048] + [64] * 32),
                          ("mixed 64..1024", [64, 128, 256, 512, 1024] * 3)]:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        N, S, T = sum(lengths), len(lengths), max(lengths)
        q, k, v = (torch.randn(N, h, d) for _ in range(3))  # (N, h, d)
        padded = [torch.randn(S, h, T, d) for _ in range(3)]  # (S, h, T, d)
        kl = torch.tensor(lengths)
        fns = {s: functools.partial(mha.varlen_attention, q, k, v, cu, causal=True, strategy=s)
               for s in ("pad", "loop")}
        fns["padded batch + key_lengths"] = functools.partial(mha.attention, *padded,
                                                              causal=True, key_lengths=kl)
        with torch.no_grad():
            row = timed(fns)
        auto = _choose(lengths, lengths, h * 2 * d)
        cells = ", ".join(f"{k} {v:.1f} ms" for k, v in row.items())
        print(f"{name:<22} {cells}; auto picks {auto}")


if __name__ == "__main__":
    main()
