"""Prefill chunks through the block table: ``PagedKVCache.attend_varlen`` on the paged flash
forward (``mha.ops.flash.flash_attention_paged``), no gathered copy.

Shape legend: S sequences, N packed queries, h / h_kv query / K/V heads, p page size, L_s the
tokens sequence s holds, n_s its queries in the call (its last n_s tokens), d head dim.

Judged against the float64 oracle row by row (each sequence's K/V gathered, causal aligned
bottom-right to its own length), bitwise against the dense flash kernel on the same K/V where
both run the same key blocks, and against the gathered path the cache falls back to.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mha import paged
from mha.ops import decode, flash
from mha.paged import PagedKVCache

from oracle import assert_within_budget

pytestmark = pytest.mark.skipif(
    flash.unavailable() is not None or decode.unavailable() is not None,
    reason=f"native kernels unavailable: {flash.unavailable() or decode.unavailable()}")


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The cache warns once per process and reason: a test that expects the warning starts
    from a process that has not given it yet, whatever ran before it."""
    monkeypatch.setattr(paged, "_warned", set())


def _filled(lengths, *, p, h_kv=2, d=32, dtype=torch.float32, kv_dtype=None, seed=0,
            extra_pages=3):
    """A one-layer cache holding sequences of these lengths (random K/V); free pages are NaN,
    so a read outside a sequence's own pages would show."""
    g = torch.Generator().manual_seed(seed)
    pages = sum(-(-L // p) for L in lengths) + extra_pages
    cache = PagedKVCache(pages, p, h_kv, d, max_seqs=len(lengths) + 2,
                         max_len=max(lengths) + 2 * p, dtype=dtype, kv_dtype=kv_dtype)
    if cache.kv_dtype != torch.int8:
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
    ids = []
    for L in lengths:
        s = cache.add_sequence()
        k = torch.randn(L, h_kv, d, generator=g).to(dtype)  # (L, h_kv, d)
        v = torch.randn(L, h_kv, d, generator=g).to(dtype)  # (L, h_kv, d)
        cache.append([s], k, v, cu_seqlens=[0, L])
        ids.append(s)
    return cache, ids, g


def _cu(counts):
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    return cu


def _causal(n, L):
    """(n, L) True = may attend: query i (position L - n + i) sees keys j <= i + L - n."""
    return torch.arange(L)[None, :] <= torch.arange(n)[:, None] + (L - n)


def _check_rows(cache, ids, q, cu, out, *, dtype):
    """Each row within the tolerance rule of the float64 oracle on its gathered K/V."""
    h_kv = cache.k.shape[2]
    g = q.shape[1] // h_kv
    for i, s in enumerate(ids):
        k, v = cache.gather(0, s)  # (1, h_kv, L, d)
        n, L = cu[i + 1] - cu[i], k.shape[2]
        qs = q[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0).to(dtype)  # (1, h, n, d)
        k, v = (t.repeat_interleave(g, dim=1).to(dtype) for t in (k, v))  # (1, h, L, d)
        got = out[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0).to(dtype)  # (1, h, n, d)
        assert_within_budget(got, qs, k, v, _causal(n, L), what=f"row {i} (n={n}, L={L})")


@settings(max_examples=30, deadline=None)
@given(p=st.sampled_from([1, 3, 16, 17, 33, 64]), g=st.sampled_from([1, 3]),
       h_kv=st.integers(1, 2), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       rows=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), min_size=1,
                     max_size=4),
       seed=st.integers(0, 2**16))
def test_ragged_chunks_match_oracle(p, g, h_kv, dtype, rows, seed):
    lengths = [L for L, _ in rows]
    counts = [max(1, min(n, L)) for L, n in rows]  # 1 <= n <= L: decode rows mix in
    cache, ids, gen = _filled(lengths, p=p, h_kv=h_kv, dtype=dtype, seed=seed)
    q = torch.randn(sum(counts), g * h_kv, 32, generator=gen).to(dtype)  # (N, h, d)
    cu = _cu(counts)
    with torch.no_grad():
        out = cache.attend_varlen(0, q, ids, cu)  # (N, h, d)
    assert out.shape == (sum(counts), g * h_kv, 32) and out.dtype == dtype
    _check_rows(cache, ids, q, cu, out, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [16, 48, 7])
def test_bitwise_equal_to_dense_kernel(dtype, p):
    # rows of >= 128 keys: the paged and the dense forward walk the same 128-key blocks, so
    # packing from pages must give the very same bits as packing contiguous K/V
    lengths, counts = [300, 129, 200], [100, 129, 57]
    cache, ids, gen = _filled(lengths, p=p, h_kv=2, d=64, dtype=dtype)
    q = torch.randn(sum(counts), 6, 64, generator=gen).to(dtype)  # (N, h, d)
    cu = _cu(counts)
    kernel = flash.kernels()["bfloat16" if dtype == torch.bfloat16 else "float32"]
    with torch.no_grad():
        out = cache.attend_varlen(0, q, ids, cu)  # (N, h, d)
        for i, s in enumerate(ids):
            k, v = cache.gather(0, s)  # (1, h_kv, L, d)
            qs = q[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0)  # (1, h, n, d)
            want, _ = torch.ops.mha._flash_attention_fwd_kernel(
                qs, k, v, None, None, True, 64 ** -0.5, kernel)  # (1, h, n, d)
            assert torch.equal(out[cu[i]:cu[i + 1]], want[0].transpose(0, 1)), f"row {i}"


def test_native_path_agrees_with_gathered_and_makes_no_copy(monkeypatch):
    lengths, counts = [90, 40, 5], [30, 1, 5]
    cache, ids, gen = _filled(lengths, p=16)
    q = torch.randn(sum(counts), 4, 32, generator=gen)  # (N, h, d)
    cu = _cu(counts)
    calls = []
    monkeypatch.setattr(cache, "gather", lambda *a: calls.append(a))
    with torch.no_grad():
        out = cache.attend_varlen(0, q, ids, cu)
    assert calls == []  # the native path never gathers
    monkeypatch.undo()
    with torch.no_grad():
        for i in (0, 2):
            qs = q[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0)  # (1, h, n, d)
            ref = cache._attend_gathered(0, qs, ids[i], {})[0].transpose(0, 1)  # (n, h, d)
            torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, atol=2e-6, rtol=1e-5)


def test_cow_forked_sequences_share_pages():
    p = 8
    cache, (parent,), gen = _filled([37], p=p, extra_pages=12)
    child = cache.fork(parent)
    for s in (parent, child):  # each grows differently; the shared partial page is copied
        k = torch.randn(11, 2, 32, generator=gen)  # (11, h_kv, d)
        cache.append([s], k, torch.randn(11, 2, 32, generator=gen), cu_seqlens=[0, 11])
    shared = 37 // p  # full pages written before the fork
    assert torch.equal(cache.block_table[parent, :shared], cache.block_table[child, :shared])
    assert int(cache.refcount[cache.block_table[parent, 0]]) == 2
    counts = [20, 11]
    q = torch.randn(sum(counts), 2, 32, generator=gen)  # (N, h, d)
    cu = _cu(counts)
    with torch.no_grad():
        out = cache.attend_varlen(0, q, [parent, child], cu)
    _check_rows(cache, [parent, child], q, cu, out, dtype=torch.float32)


def test_rows_that_see_no_key_and_the_lse():
    # the op with fewer keys than queries: causal bottom-right leaves the first rows empty
    g = torch.Generator().manual_seed(3)
    k = torch.randn(6, 1, 4, 16, generator=g)  # (P, h_kv, p, d)
    v = torch.randn(6, 1, 4, 16, generator=g)
    bt = torch.tensor([[2, 0, 5], [1, 3, 4]], dtype=torch.int32)  # (B, M)
    q = torch.randn(9, 2, 16, generator=g)  # (N, h, d): rows of 5 and 4 queries
    cu, lengths = torch.tensor([0, 5, 9]), torch.tensor([3, 0])
    with torch.no_grad():
        out, lse = flash.flash_attention_paged(q, k, v, bt, cu, lengths)
    assert torch.equal(out[:2], torch.zeros(2, 2, 16)) and torch.equal(out[5:], torch.zeros(4, 2, 16))
    assert torch.isinf(lse[:, :2]).all() and torch.isinf(lse[:, 5:]).all()
    dense_k = k[bt[0].long()].transpose(0, 1).reshape(1, 1, 12, 16)[:, :, :3]  # (1, h_kv, 3, d)
    dense_v = v[bt[0].long()].transpose(0, 1).reshape(1, 1, 12, 16)[:, :, :3]
    qs = q[2:5].transpose(0, 1).unsqueeze(0)  # (1, h, 3, d): queries that see keys
    assert_within_budget(out[2:5].transpose(0, 1).unsqueeze(0), qs, dense_k.expand(1, 2, 3, 16),
                         dense_v.expand(1, 2, 3, 16), _causal(3, 3))
    ref = torch.logsumexp((qs.double() @ dense_k.double().transpose(-1, -2)) * 16 ** -0.5
                          + torch.where(_causal(3, 3), 0.0, float("-inf")), -1)  # (1, h, 3)
    torch.testing.assert_close(lse[:, 2:5].double(), ref[0], atol=1e-5, rtol=1e-5)


def test_nan_reaches_only_the_rows_that_see_it():
    cache, (s,), gen = _filled([40], p=16)
    k = torch.randn(1, 2, 32, generator=gen)
    k[0, 0, 0] = float("nan")  # token 40's K, head 0: seen only by the last query
    cache.append([s], k, torch.randn(1, 2, 32, generator=gen), cu_seqlens=[0, 1])
    q = torch.randn(8, 4, 32, generator=gen)  # (N, h, d): the last 8 of 41 tokens
    with torch.no_grad():
        out = cache.attend_varlen(0, q, [s], [0, 8])
    assert torch.isnan(out[7, :2]).all()  # query heads of K/V head 0 see the NaN key
    assert torch.isfinite(out[7, 2:]).all() and torch.isfinite(out[:7]).all()
    q[3, 1, 5] = float("nan")
    with torch.no_grad():
        out = cache.attend_varlen(0, q, [s], [0, 8])
    assert torch.isnan(out[3, 1]).all() and torch.isfinite(out[3, 0]).all()


def test_bf16_pages_with_fp32_queries_run_native():
    cache, ids, gen = _filled([70, 33], p=16, dtype=torch.float32, kv_dtype="bfloat16")
    q = torch.randn(50, 4, 32, generator=gen)  # (N, h, d)
    cu = [0, 30, 50]
    assert cache.explain(q).startswith("prefill chunks: native")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = cache.attend_varlen(0, q, ids, cu)
    assert out.dtype == torch.float32
    # the queries are cast to the pages' bf16 and run the bf16 tiles: bf16's error budget
    _check_rows(cache, ids, q, cu, out, dtype=torch.bfloat16)


def test_int8_pages_fall_back_with_the_reason(fresh_warnings):
    cache, ids, gen = _filled([50, 20], p=16, kv_dtype="int8")
    q = torch.randn(30, 4, 32, generator=gen)  # (N, h, d)
    cu = [0, 20, 30]
    assert "int8 pages" in cache.explain(q)
    with pytest.warns(UserWarning, match="int8 pages"):
        with torch.no_grad():
            out = cache.attend_varlen(0, q, ids, cu)
    _check_rows(cache, ids, q, cu, out, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process and reason
        with torch.no_grad():
            again = cache.attend_varlen(0, q, ids, cu)
    assert torch.equal(again, out)


def test_position_variants_fall_back_and_softcap_sinks_run_native():
    cache, ids, gen = _filled([60], p=16)
    q = torch.randn(12, 4, 32, generator=gen)  # (N, h, d)
    sinks = torch.randn(4, generator=gen)
    assert "alibi_slopes" in cache.explain(q, alibi_slopes=torch.ones(4))
    assert cache.explain(q, softcap=5.0, sinks=sinks).startswith("prefill chunks: native")
    with torch.no_grad():
        got = cache.attend_varlen(0, q, ids, [0, 12], softcap=5.0, sinks=sinks)
        qs = q.transpose(0, 1).unsqueeze(0)  # (1, h, 12, d)
        ref = cache._attend_gathered(0, qs, ids[0], dict(softcap=5.0, sinks=sinks))
    torch.testing.assert_close(got, ref[0].transpose(0, 1), atol=2e-6, rtol=1e-5)


def test_grad_is_refused_by_the_op_and_served_by_the_gathered_path(fresh_warnings):
    cache, ids, gen = _filled([30], p=16)
    q = torch.randn(10, 4, 32, generator=gen, requires_grad=True)  # (N, h, d)
    bt, cu, lengths = cache.block_table[:1], torch.tensor([0, 10]), cache.lengths[:1]
    with pytest.raises(RuntimeError, match="forward only"):
        flash.flash_attention_paged(q, cache.k[0], cache.v[0], bt, cu, lengths)
    assert "requires grad" in cache.explain(q)
    with pytest.warns(UserWarning, match="requires grad"):
        out = cache.attend_varlen(0, q, ids, [0, 10])
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_bad_block_table_is_refused_by_the_op():
    k = torch.zeros(4, 1, 8, 16)  # (P, h_kv, p, d)
    q = torch.zeros(3, 1, 16)  # (N, h, d)
    bt = torch.tensor([[0, 9]], dtype=torch.int32)  # page 9 of a 4-page pool
    with torch.no_grad(), pytest.raises(RuntimeError, match="not a page of the pool"):
        flash.flash_attention_paged(q, k, k, bt, torch.tensor([0, 3]), torch.tensor([12]))
    with torch.no_grad(), pytest.raises(RuntimeError, match="key_lengths"):
        flash.flash_attention_paged(q, k, k, bt, torch.tensor([0, 3]), torch.tensor([17]))


def test_queries_beyond_the_cached_tokens_are_refused_unchanged():
    cache, ids, gen = _filled([5], p=4)
    before = cache.state()
    with pytest.raises(ValueError, match="fewer than its 6 queries"):
        cache.attend_varlen(0, torch.randn(6, 2, 32), ids, [0, 6])
    after = cache.state()
    for name in ("k", "v", "block_table", "lengths"):
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, equal_nan=True)


def test_opcheck():
    cache, ids, gen = _filled([20, 9], p=4)
    q = torch.randn(12, 2, 32, generator=gen)  # (N, h, d)
    args = (q, cache.k[0], cache.v[0], cache.block_table[:2], torch.tensor([0, 9, 12]),
            cache.lengths[:2], True, 0.2)
    torch.library.opcheck(torch.ops.mha.flash_attention_paged_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
