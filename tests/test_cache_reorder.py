"""``KVCache.reorder``: beam search's gather of cache rows, in place.

Shape legend: B rows (beams), T tokens, T_max capacity, h_kv heads, d head dim, d_model width.
"""

from __future__ import annotations

import pytest
import torch

import mha


def _module(seed=0, d_model=64, num_heads=4, num_kv_heads=2):
    torch.manual_seed(seed)
    return mha.MultiHeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads).eval()


def _filled_cache(B=3, T_max=12, lengths=(7, 5, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = mha.KVCache(B, 2, T_max, 8, 4)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))  # (B, h_kv, T_max, d_k)
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))  # (B, h_kv, T_max, d_v)
    cache.lengths.copy_(torch.tensor(lengths))
    cache.starts.copy_(torch.tensor([0, 1, 2][:B]))
    return cache


def test_beam_search_with_reorder_equals_recomputing_each_beam():
    """Decode B beams, reorder them between steps (duplicates, ragged rows): every step's output
    equals the full causal pass over that beam's own token history, recomputed from scratch."""
    m = _module()
    g = torch.Generator().manual_seed(1)
    B, P, d_model = 3, 5, 64
    prompt = torch.randn(1, P, d_model, generator=g).expand(B, P, d_model)  # (B, P, d_model)
    with torch.no_grad():
        cache = m.new_cache(B, 16)
        m(prompt.contiguous(), cache=cache)
        cache.truncate(torch.tensor([5, 4, 3]))  # ragged beams (e.g. different prompt lengths)
        hist = [prompt[b, :L] for b, L in enumerate((5, 4, 3))]  # (L_b, d_model) each
        for index in ([2, 0, 0], [1, 1, 2], [0, 2, 1], [2, 2, 2]):
            cache.reorder(torch.tensor(index))
            hist = [hist[i] for i in index]
            assert cache.lengths.tolist() == [h.shape[0] for h in hist]
            x = torch.randn(B, 1, d_model, generator=g)  # (B, 1, d_model) the next tokens
            y = m(x, cache=cache)  # (B, 1, d_model)
            hist = [torch.cat([h, x[b]]) for b, h in enumerate(hist)]
            for b in range(B):
                full = m(hist[b].unsqueeze(0), causal=True)  # (1, T_b, d_model), no cache
                torch.testing.assert_close(y[b, 0], full[0, -1], rtol=1e-5, atol=1e-5)


def test_duplicates_copy_rows_lengths_and_starts_and_only_the_valid_part():
    cache = _filled_cache()
    k0, v0 = cache.k.clone(), cache.v.clone()
    ptrs = (cache.k.data_ptr(), cache.v.data_ptr())
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.lengths.tolist() == [6, 6, 7] and cache.starts.tolist() == [2, 2, 0]
    Tk = 7  # the longest row kept: positions past it are never copied
    for b, src in enumerate([2, 2, 0]):
        assert torch.equal(cache.k[b, :, :Tk], k0[src, :, :Tk])
        assert torch.equal(cache.v[b, :, :Tk], v0[src, :, :Tk])
        assert torch.equal(cache.k[b, :, Tk:], k0[b, :, Tk:])  # untouched beyond Tk
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == ptrs
    same = cache.k.clone()
    cache.reorder(torch.arange(3, dtype=torch.int32))  # identity (any integer dtype): no-op
    assert torch.equal(cache.k, same) and cache.lengths.tolist() == [6, 6, 7]


@pytest.mark.parametrize("index, error, match", [
    (torch.tensor([0.0, 1.0, 2.0]), TypeError, "integer tensor"),
    (torch.tensor([True, False, True]), TypeError, "integer tensor"),
    ([0, 1, 2], TypeError, "integer tensor"),
    (torch.tensor([0, 1]), ValueError, r"shape \(B,\) = \(3,\)"),
    (torch.tensor([[0, 1, 2]]), ValueError, r"shape \(B,\) = \(3,\)"),
    (torch.tensor([0, 3, 1]), ValueError, r"\[0, 3\)"),
    (torch.tensor([-1, 0, 1]), ValueError, r"\[0, 3\)"),
    (torch.tensor([0, 1, 2], device="meta"), ValueError, "device"),
])
def test_refusal_names_the_problem_and_leaves_the_cache_intact(index, error, match):
    cache = _filled_cache()
    before = [t.clone() for t in (cache.k, cache.v, cache.lengths, cache.starts)]
    with pytest.raises(error, match=match):
        cache.reorder(index)
    after = (cache.k, cache.v, cache.lengths, cache.starts)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
