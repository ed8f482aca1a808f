"""Developer probe: what choosing the next token costs per decode step, greedy vs sampled
(:func:`mha.sampling.next_tokens`), at SmolLM2's vocabulary (V = 49152), fp32 logits.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src \\
        python benchmarks/probes/sampling_step.py [--rows 1 8] [--rounds 15]

For R rows of logits ``(R, V)`` (random normal x 4, a peaked distribution like a model's), times
per call, thread CPU time, one thread, round-robin medians of ``--rounds``: ``greedy``
(``logits.argmax(-1)``, the greedy paths' call), ``temperature`` (0.8 alone), ``top_k`` (0.8,
k = 50), ``top_p`` (0.8, p = 0.95: a full sort of the row), ``all`` (0.8, k = 50, p = 0.95,
min_p = 0.05). Each sampled row draws one uniform from its own generator.
"""

from __future__ import annotations

import argparse
import time

import torch

from _timing import interleaved
from mha.sampling import SamplingParams, next_tokens

V = 49152
SETTINGS = {"temperature": SamplingParams(temperature=0.8, seed=0),
            "top_k": SamplingParams(temperature=0.8, top_k=50, seed=0),
            "top_p": SamplingParams(temperature=0.8, top_p=0.95, seed=0),
            "all": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, seed=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for R in args.rows:
        logits = torch.randn(R, V, generator=torch.Generator().manual_seed(0)) * 4  # (R, V)
        fns = {"greedy": lambda x=logits: x.argmax(-1)}
        for name, p in SETTINGS.items():
            gens = [p.generator(i) for i in range(R)]
            fns[name] = lambda x=logits, p=p, g=gens: next_tokens(x, [p] * len(g), g)
        t = interleaved(fns, args.rounds, min_time=0.05, clock=time.thread_time)
        print(f"R={R}, V={V}, 1 thread, CPU time per step (median of {args.rounds}):")
        for name, s in t.items():
            print(f"  {name:12s} {s * 1e3:8.3f} ms   {s / t['greedy']:7.1f}x greedy")


if __name__ == "__main__":
    main()
