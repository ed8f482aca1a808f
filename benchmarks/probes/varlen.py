"""Packed sequences: mha.varlen_attention's two strategies vs one padded mha.attention call.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/probes/varlen.py
Prints the median ms of each, side by side in one process, and what "auto" picked.
"""

from __future__ import annotations

import functools

import torch

import mha
from _timing import interleaved
from mha.varlen import _choose


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
            row = {k: v * 1e3 for k, v in interleaved(fns, 7).items()}
        auto = _choose(lengths, lengths, h * 2 * d)
        cells = ", ".join(f"{k} {v:.1f} ms" for k, v in row.items())
        print(f"{name:<22} {cells}; auto picks {auto}")


if __name__ == "__main__":
    main()
