"""Paged prefill: the paged flash forward vs a gathered copy vs contiguous K/V, in one process.

Run (under the timing lock, see docs/kernel.md):
    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        .venv/bin/python benchmarks/probes/paged_prefill.py [--rounds 7] [--page 16 17]
        [--threads 1]

Each case is a batch of prefill chunks of sequences whose prefix is cached (SmolLM2's
attention shape: h 9, h_kv 3, d 64), one layer of a :class:`mha.PagedKVCache`:

* ``native``: ``attend_varlen`` on the paged flash forward, one call for every chunk, K/V
  packed from the pages through the block table;
* ``gathered``: each chunk on its sequence's K/V gathered from the pages (``gather``, a copy)
  then ``mha.attention`` (the path before the paged forward, and the int8 fallback);
* ``contiguous``: each chunk through ``mha.attention`` on K/V already contiguous (what a dense
  per-sequence cache would run: the same kernel, no copy, one call per chunk).

Prints the median ms per call (interleaved rounds) and the ratios to ``native``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import mha
from mha.paged import PagedKVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved  # noqa: E402

H, H_KV, D = 9, 3, 64
CASES = {  # name: (cached lengths after the chunk, chunk lengths)
    "1 x 512 of 2048": ([2048], [512]),
    "4 chunks of 256, ctx 300-2048": ([300, 700, 1024, 2048], [256, 256, 256, 256]),
    "16 prompts 3-40 (serving)": ([3 + (i * 37) // 15 for i in range(16)],
                                  [3 + (i * 37) // 15 for i in range(16)]),
    "8 chunks of 64, ctx 8000": ([8000] * 8, [64] * 8),
}


def _setup(lengths, counts, page, dtype):
    g = torch.Generator().manual_seed(0)
    pages = sum(-(-L // page) for L in lengths)
    cache = PagedKVCache(pages, page, H_KV, D, max_seqs=len(lengths), max_len=max(lengths),
                         dtype=dtype)
    ids = []
    for L in lengths:
        s = cache.add_sequence()
        cache.append([s], torch.randn(L, H_KV, D, generator=g).to(dtype),
                     torch.randn(L, H_KV, D, generator=g).to(dtype), cu_seqlens=[0, L])
        ids.append(s)
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], H, D, generator=g).to(dtype)  # (N, h, d)
    dense = [cache.gather(0, s) for s in ids]  # (1, h_kv, L, d) each
    qs = [q[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(cu[:-1], cu[1:], strict=True)]

    def native():
        return cache.attend_varlen(0, q, ids, cu)

    def gathered():
        return [cache._attend_gathered(0, x, s, {}) for x, s in zip(qs, ids, strict=True)]

    def contiguous():
        return [mha.attention(x, k, v, causal=True) for x, (k, v) in zip(qs, dense, strict=True)]

    return {"native": native, "gathered": gathered, "contiguous": contiguous}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--page", type=int, nargs="+", default=[16])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"h {H}, h_kv {H_KV}, d {D}, {torch.get_num_threads()} threads; median ms per call, "
          f"ratio = time / native")
    print(f"{'case':>30} {'dtype':>8} {'page':>4} {'native':>8} {'gathered':>15} "
          f"{'contiguous':>15}")
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for page in a.page:
                for name, (lengths, counts) in CASES.items():
                    t = interleaved(_setup(lengths, counts, page, dtype), a.rounds, min_time=0.05)
                    n = t["native"]
                    cells = " ".join(f"{t[k] * 1e3:7.2f} ({t[k] / n:4.2f}x)"
                                     for k in ("gathered", "contiguous"))
                    print(f"{name:>30} {str(dtype)[6:]:>8} {page:>4} {n * 1e3:8.2f} {cells}")


if __name__ == "__main__":
    main()
