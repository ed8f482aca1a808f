"""Developer probe: what :meth:`mha.models.Llama.forward_paged`'s check of ``positions``
against the extended cache (:func:`mha.paged.check_step`, after ``check_positions``) costs per
step, against the decode step it guards.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src \\
        python benchmarks/probes/paged_positions_check.py [--seqs 1 8 32] [--rounds 15]

A Llama of SmolLM2-135M's shape (30 layers, d_model 576, 9 / 3 heads, V = 49152; random fp32
weights, nothing downloaded) holds S sequences of 40 tokens in a :class:`mha.PagedKVCache`;
one decode step feeds one token of each (N = S, the logits of the S rows). Timed round-robin,
thread CPU time, one thread: ``check`` (the two checks alone) and ``step`` (the whole
forward_paged, which runs them once). A step writes its K/V at the positions it was extended
to, so repeating it leaves the cache as it was.
"""

from __future__ import annotations

import argparse
import time

import torch

from _timing import interleaved
from mha.models import Llama
from mha.paged import PagedKVCache, check_step
from mha.rope import check_positions

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True,
               rms_norm_eps=1e-5)
PROMPT = 40


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama.from_config(SMOLLM2).eval()
    s = model.settings
    for S in args.seqs:
        cache = PagedKVCache(S * 4, 16, s.num_kv_heads, s.head_dim, max_seqs=S, max_len=64,
                             num_layers=s.num_layers)
        seqs = [cache.add_sequence() for _ in range(S)]
        cache.extend(seqs, [PROMPT + 1] * S)  # a prompt of 40, then the step's token
        ids = torch.randint(3, s.vocab_size, (1, S))  # (1, N)
        positions = torch.full((S,), PROMPT)  # (N,)
        cu = list(range(S + 1))
        rows = torch.arange(S)

        def check(positions=positions, cache=cache, seqs=seqs, cu=cu, S=S):
            check_step(cache, S, check_positions(positions, 1, S, positions.device), seqs, cu)

        def step(ids=ids, positions=positions, cache=cache, seqs=seqs, cu=cu, rows=rows):
            model.forward_paged(ids, positions, cache, seqs, cu, rows=rows)

        t = interleaved({"check": check, "step": step}, args.rounds, min_time=0.05,
                        clock=time.thread_time)
        print(f"S={S} sequences (N={S} tokens), 1 thread, CPU time per step (median of "
              f"{args.rounds}): check {t['check'] * 1e6:.1f} us, step {t['step'] * 1e3:.2f} ms, "
              f"check / step {t['check'] / t['step']:.2%}")


if __name__ == "__main__":
    main()
