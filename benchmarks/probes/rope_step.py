"""Developer probe: what RoPE costs one ``MultiHeadAttention`` layer in a decode step, split
into the angles and the rotation, at SmolLM2-135M's attention shape (d_model 576, 9 query /
3 K/V heads of 64, ``Rotary(64, theta=100000)``), fp32, random weights, one row.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src \\
        python benchmarks/probes/rope_step.py [--cached 128] [--rounds 9]

With ``--cached`` tokens in a :class:`mha.KVCache`, times per call (thread CPU time, one
thread, round-robin medians of ``--rounds``): ``angles``, the module's positions-from-the-cache
plus :meth:`mha.rope.Rotary.angles` (``MultiHeadAttention._rope_angles``); ``rotate``, the
rotation of one token's Q ``(1, 1, 9, 64)`` and K ``(1, 1, 3, 64)`` by them
(:meth:`mha.rope.Rotary.rotate_tokens`, twice); ``rotate QK``, the same rotation as the module
runs it on the QKV GEMM's output, Q's and K's columns in one call on 12 heads
(``MultiHeadAttention._rotate_qk``). A model of L layers spends L times each per step;
:class:`mha.models.Llama` computes the angles once per step (:meth:`Llama.rope_angles`), which
saves ``(L - 1) x angles``.
"""

from __future__ import annotations

import argparse
import time

import torch

import mha
from _timing import interleaved
from mha.rope import Rotary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(576, 9, num_kv_heads=3, head_dim=64, bias=False,
                               rope=Rotary(64, theta=100000.0)).eval()
    cache = m.new_cache(1, args.cached + 1)
    query = torch.randn(1, 1, 576)  # (B, Tn, d_model): one new token
    with torch.no_grad():
        m(torch.randn(1, args.cached, 576), cache=cache)  # (B, T, d_model) prefill
        angles = m._rope_angles(query, None, cache, None)  # (1, 1, 64) x 2
        q, k = torch.randn(1, 1, 9, 64), torch.randn(1, 1, 3, 64)  # (B, Tn, h / h_kv, d)
        qkv = torch.randn(1, 1, 15 * 64)  # (B, Tn, (h + 2 h_kv) d): the QKV GEMM's output
        q_cols, k_cols, _ = qkv.split((9 * 64, 3 * 64, 3 * 64), dim=-1)

        def rotate():
            m.rope.rotate_tokens(q, *angles)
            m.rope.rotate_tokens(k, *angles)

        med = interleaved({"angles": lambda: m._rope_angles(query, None, cache, None),
                           "rotate": rotate,
                           "rotate QK": lambda: m._rotate_qk(q_cols, k_cols, angles)},
                          args.rounds, min_time=0.05,
                          clock=time.thread_time)
    for name, s in med.items():
        print(f"{name:9s} {s * 1e6:7.1f} us per layer and step  (x30 layers: "
              f"{s * 30e3:.2f} ms)")


if __name__ == "__main__":
    main()
