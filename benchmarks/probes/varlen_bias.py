"""Packed sequences with a per-sequence score bias: mha.varlen_attention's two strategies, and
what "auto" picks (its cost model counts the padded bias the pad strategy builds).

Run: PYTHONPATH=src .venv/bin/python benchmarks/probes/varlen_bias.py
Prints the median ms of "pad" and "loop" (interleaved in one process) for a full
``(h, n_q[s], n_k[s])`` bias and a ``(h, 1, 1)`` one, and the strategy "auto" chooses.
"""

from __future__ import annotations

import functools

import torch

import mha
from _timing import interleaved
from mha.varlen import _choose, _numel, _padded_bias_shape


def main() -> None:
    torch.manual_seed(0)
    h, d = 8, 64
    for name, lengths in [("even 8x256", [256] * 8), ("skewed 1024 + 16x64", [1024] + [64] * 16),
                          ("mixed 64..512", [64, 128, 256, 512] * 2)]:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        N = sum(lengths)
        q, k, v = (torch.randn(N, h, d) for _ in range(3))  # (N, h, d)
        for kind, shape in (("full bias", lambda n: (h, n, n)), ("(h,1,1) bias", lambda n: (h, 1, 1))):
            biases = [torch.randn(*shape(n)) for n in lengths]
            fns = {s: functools.partial(mha.varlen_attention, q, k, v, cu, causal=True,
                                        strategy=s, bias=biases) for s in ("pad", "loop")}
            with torch.no_grad():
                row = {s: t * 1e3 for s, t in interleaved(fns, 5).items()}
            auto = _choose(lengths, lengths, h * 2 * d,
                           _numel(_padded_bias_shape([b.view(-1, *b.shape[-2:]) for b in biases],
                                                     lengths, lengths)))
            cells = ", ".join(f"{s} {t:.1f} ms" for s, t in row.items())
            print(f"{name:<20} {kind:<13} {cells}; auto picks {auto}")


if __name__ == "__main__":
    main()
