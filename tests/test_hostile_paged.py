"""``mha.PagedKVCache``'s Python API used carelessly: a freed sequence used again, more tokens
than the pool holds, K/V of the wrong shape or dtype, a layer out of range, a token count that
is not one. Each is refused naming the argument, and the cache (pools, block table, lengths,
refcounts, free list) is exactly as it was.

Shape legend: N packed tokens, h_kv K/V heads, d head dim, S' sequences of a call, Tq queries.
"""

from __future__ import annotations

import pytest
import torch

import mha


def _cache():
    c = mha.PagedKVCache(3, 4, 2, 8, max_seqs=3, max_len=16, num_layers=2)  # 12 tokens
    s = c.add_sequence()
    c.extend([s], [5])
    with torch.no_grad():
        for layer in range(2):
            c.write(layer, [s], torch.randn(5, 2, 8), torch.randn(5, 2, 8), cu_seqlens=[0, 5])
    freed = c.add_sequence()
    c.extend([freed], [2])
    c.free(freed)
    return c, s, freed


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


KV = (torch.randn(5, 2, 8), torch.randn(5, 2, 8))  # (N, h_kv, d) x 2

CALLS = [  # (what, call(cache, live, freed), exception, words)
    ("free twice", lambda c, s, f: c.free(f), ValueError, "seq_id=1 is not a live sequence"),
    ("fork a freed one", lambda c, s, f: c.fork(f), ValueError, "parent=1 is not a live"),
    ("gather a freed one", lambda c, s, f: c.gather(0, f), ValueError, "seq_id=1 is not a live"),
    ("extend past the pool", lambda c, s, f: c.extend([s], [8]), mha.PagePoolExhausted,
     r"needs 2 page\(s\), 1 free"),
    ("extend past max_len", lambda c, s, f: c.extend([s], [12]), ValueError, "max_len=16"),
    ("extend a freed one", lambda c, s, f: c.extend([s, f], [1, 1]), ValueError, "seq_ids=1"),
    ("k of another d", lambda c, s, f: c.write(0, [s], KV[0][..., :7], KV[1], cu_seqlens=[0, 5]),
     ValueError, "expected k"),
    ("k of another dtype", lambda c, s, f: c.write(0, [s], KV[0].double(), KV[1],
                                                   cu_seqlens=[0, 5]), TypeError, "k must be"),
    ("layer past the last", lambda c, s, f: c.write(2, [s], *KV, cu_seqlens=[0, 5]), ValueError,
     r"layer must lie in \[0, 2\)"),
    ("negative layer", lambda c, s, f: c.attend(-1, torch.randn(1, 2, 1, 8), [s]), ValueError,
     "layer"),
    ("more written than extended", lambda c, s, f: c.write(0, [s], torch.randn(6, 2, 8),
                                                           torch.randn(6, 2, 8),
                                                           cu_seqlens=[0, 6]),
     ValueError, "fewer than the 6 written"),
    ("pages_for a negative count", lambda c, s, f: c.pages_for(-5), ValueError, "n_tokens"),
    ("pages_for a float", lambda c, s, f: c.pages_for(2.5), TypeError, "n_tokens"),
]


@pytest.mark.parametrize("what, call, exc, words", CALLS, ids=[c[0] for c in CALLS])
def test_refusals_name_the_argument_and_change_nothing(what, call, exc, words):
    c, s, freed = _cache()
    before = c.state()
    with pytest.raises(exc, match=words):
        call(c, s, freed)
    assert _same(c.state(), before)
