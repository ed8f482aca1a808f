"""``mha.PagedKVCache``: pages, block table, refcounts, copy-on-write fork, free and reuse,
the refusals that leave it unchanged, and attention through it.

Shape legend: N packed tokens, h / h_kv query / K/V heads, d head dim, p page size.

The model of the cache is a dict ``seq -> list of (k, v) rows``: after any sequence of
operations, every live sequence's gathered K/V equals its list (hypothesis drives the
operations), pages are shared exactly as the refcounts say, and none leaks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mha
from mha.ops import decode
from mha.paged import PagePoolExhausted, pool_bytes

H_KV, D = 2, 8


def _cache(num_pages=12, page_size=4, *, max_seqs=4, max_len=24, kv_dtype=None, layers=1):
    return mha.PagedKVCache(num_pages, page_size, H_KV, D, max_seqs=max_seqs, max_len=max_len,
                            num_layers=layers, dtype=torch.float32, kv_dtype=kv_dtype)


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H_KV, D, generator=g), torch.randn(n, H_KV, D, generator=g)


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name


def _check_invariants(c: mha.PagedKVCache) -> None:
    """Refcounts are the number of live block-table entries naming each page; free pages are
    exactly those with refcount 0."""
    count = torch.zeros(c.num_pages, dtype=torch.int32)
    for s in c.sequences:
        for page in c.block_table[s, :c.pages_for(int(c.lengths[s]))].tolist():
            count[page] += 1
    assert torch.equal(count, c.refcount)
    assert sorted(c._free) == [i for i in range(c.num_pages) if int(count[i]) == 0]


# ------------------------------------------------------------------ the model-based property
OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free"]),
                         st.integers(0, 10), st.integers(0, 9)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, page_size=st.sampled_from([1, 3, 4]))
def test_random_operations_match_a_list_model(ops, page_size):
    c = _cache(num_pages=14, page_size=page_size, max_seqs=5, max_len=18)
    model: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for n_op, (op, a, b) in enumerate(ops):
            live = c.sequences
            before = c.state()
            try:
                if op == "add":
                    model[c.add_sequence()] = []
                elif op == "free" and live:
                    s = live[a % len(live)]
                    c.free(s)
                    del model[s]
                elif op == "fork" and live:
                    s = live[a % len(live)]
                    model[c.fork(s)] = list(model[s])
                elif op == "append" and live:
                    seqs = live[:1 + a % len(live)]
                    counts = [(b + i) % 4 for i in range(len(seqs))]
                    cu = [0]
                    for n in counts:
                        cu.append(cu[-1] + n)
                    k, v = _rows(cu[-1], n_op)
                    c.append(seqs, k, v, cu_seqlens=cu)
                    for i, s in enumerate(seqs):
                        model[s] += [torch.stack([k[j], v[j]]) for j in range(cu[i], cu[i + 1])]
            except (PagePoolExhausted, ValueError) as e:
                _same_state(before, c.state())  # a refusal changes nothing
                assert "page pool exhausted" in str(e) or "max_len" in str(e) or "slots" in str(e)
            _check_invariants(c)
            for s, rows in model.items():
                k, v = c.gather(0, s)  # (1, h_kv, n, d)
                want = torch.stack(rows) if rows else torch.zeros(0, 2, H_KV, D)  # (n, 2, h_kv, d)
                assert torch.equal(k[0].transpose(0, 1), want[:, 0])
                assert torch.equal(v[0].transpose(0, 1), want[:, 1])


# ------------------------------------------------------------------ fork, copy-on-write, free
def test_fork_shares_pages_and_copies_a_shared_last_page_on_write():
    c = _cache(page_size=4)
    with torch.no_grad():
        a = c.add_sequence()
        c.append([a], *_rows(6, 0), cu_seqlens=[0, 6])  # pages: one full, one with 2 of 4
        full, tail = c.block_table[a, :2].tolist()
        b = c.fork(a)
        assert c.block_table[b, :2].tolist() == [full, tail]
        assert c.refcount[full] == 2 and c.refcount[tail] == 2
        free = c.free_pages
        c.append([b], *_rows(1, 1))  # b writes into the shared tail: b gets a copy first
        assert c.block_table[b, 0] == full and c.block_table[b, 1] != tail
        assert c.refcount[full] == 2 and c.refcount[tail] == 1 and c.free_pages == free - 1
        ka, _ = c.gather(0, a)
        kb, _ = c.gather(0, b)
        assert ka.shape[2] == 6 and kb.shape[2] == 7 and torch.equal(ka, kb[:, :, :6])
        c.append([a], *_rows(1, 2))  # a's tail is its own again: written in place
        assert c.block_table[a, 1] == tail and c.free_pages == free - 1
        _check_invariants(c)


def test_a_sequence_and_its_fork_extended_in_one_call_leak_no_page():
    c = _cache(num_pages=4, page_size=3)
    with torch.no_grad():
        a = c.add_sequence()
        c.append([a], *_rows(1, 0))
        b = c.fork(a)  # a and b share a's half-full page
        c.append([a, b], *_rows(3, 1), cu_seqlens=[0, 1, 3])  # both write into it
    _check_invariants(c)
    assert c.free_pages == c.num_pages - 2  # one copy: the last writer keeps the page
    c.free(a)
    c.free(b)
    assert c.free_pages == c.num_pages


def test_fork_at_a_page_boundary_copies_nothing():
    c = _cache(page_size=4)
    with torch.no_grad():
        a = c.add_sequence()
        c.append([a], *_rows(8, 0), cu_seqlens=[0, 8])
        b = c.fork(a)
        free = c.free_pages
        c.append([a, b], *_rows(2, 1))  # each starts a new page; the full ones stay shared
        assert c.free_pages == free - 2
        assert c.block_table[a, :2].tolist() == c.block_table[b, :2].tolist()
        _check_invariants(c)


def test_free_returns_pages_only_when_no_sequence_holds_them():
    c = _cache(page_size=4)
    with torch.no_grad():
        a = c.add_sequence()
        c.append([a], *_rows(5, 0), cu_seqlens=[0, 5])
        b = c.fork(a)
        c.free(a)
        assert c.free_pages == c.num_pages - 2  # b still holds both pages
        c.free(b)
        assert c.free_pages == c.num_pages and not c.sequences
        s = c.add_sequence()  # ids and pages are reused
        assert s == a
        c.append([s], *_rows(1, 1))
        _check_invariants(c)


# ------------------------------------------------------------------ refusals, cache unchanged
def _busy_cache(kv_dtype=None):
    c = _cache(num_pages=5, page_size=4, kv_dtype=kv_dtype)
    with torch.no_grad():
        a, b = c.add_sequence(), c.add_sequence()
        c.append([a, b], *_rows(9, 0), cu_seqlens=[0, 5, 9])
        c.fork(a)
    return c, a, b


BAD = [
    ("pool exhausted", lambda c, a, b: c.append([a], *_rows(12, 1), cu_seqlens=[0, 12]),
     PagePoolExhausted, r"needs 4 page\(s\), 2 free"),  # 3 new + a copy of the shared tail
    ("past max_len", lambda c, a, b: c.append([b], *_rows(21, 1), cu_seqlens=[0, 21]),
     ValueError, "exceed max_len=24"),
    ("freed id", lambda c, a, b: (c.free(b), c.append([b], *_rows(1, 1))),
     ValueError, "seq_ids=1 is not a live sequence"),
    ("unknown id", lambda c, a, b: c.append([3], *_rows(1, 1)),
     ValueError, "seq_ids=3 is not a live sequence"),
    ("duplicate id", lambda c, a, b: c.append([a, a], *_rows(2, 1)),
     ValueError, "must not repeat"),
    ("wrong dtype", lambda c, a, b: c.append([a], *(t.double() for t in _rows(1, 1))),
     TypeError, "k must be torch.float32"),
    ("wrong shape", lambda c, a, b: c.append([a], *_rows(2, 1)),
     ValueError, r"k \(N, h_kv, d_k\) = \(1, 2, 8\)"),
    ("bad cu_seqlens", lambda c, a, b: c.append([a], *_rows(2, 1), cu_seqlens=[1, 2]),
     ValueError, "cu_seqlens"),
    ("layer", lambda c, a, b: c.write(1, [a], *_rows(1, 1)),
     ValueError, r"layer must lie in \[0, 1\)"),
    ("free twice", lambda c, a, b: (c.free(b), c.free(b)),
     ValueError, "seq_id=1 is not a live sequence"),
]


@pytest.mark.parametrize("what,call,err,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_and_the_cache_unchanged(what, call, err, words):
    c, a, b = _busy_cache()
    before = c.state()
    with torch.no_grad(), pytest.raises(err, match=words):
        call(c, a, b)
    after = c.state()
    if what in ("freed id", "free twice"):  # the first free did happen; compare from there
        c2, a2, b2 = _busy_cache()
        c2.free(b2)
        before = c2.state()
    _same_state(before, after)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_batch_of_no_sequences_changes_nothing(kv_dtype):
    c, a, b = _busy_cache(kv_dtype)
    before = c.state()
    k, v = _rows(0, 1)  # (0, h_kv, d): no tokens
    with torch.no_grad():
        c.append([], k, v)
        c.append([], k, v, cu_seqlens=[0])
        c.write(0, [], k, v)
        c.extend([], [])
    _same_state(before, c.state())


def test_int8_refuses_non_finite_rows_unchanged():
    c, a, b = _busy_cache("int8")
    before = c.state()
    k, v = _rows(1, 3)
    v[0, 1, 2] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError, match="v holds NaN or Inf"):
        c.append([a], k, v)
    _same_state(before, c.state())


@pytest.mark.parametrize("kv_dtype", ["fp8", torch.float16, 8, "int4"])
def test_wrong_kv_dtype_names_the_choices(kv_dtype):
    with pytest.raises(ValueError, match="kv_dtype must be None .* 'int8'"):
        _cache(kv_dtype=kv_dtype)


def test_bad_sizes_name_the_argument():
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        mha.PagedKVCache(4, 0, 2, 8, max_seqs=1, max_len=8)
    with pytest.raises(TypeError, match="max_len must be a positive int"):
        mha.PagedKVCache(4, 4, 2, 8, max_seqs=1, max_len=8.0)


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.float32, "bf16"), (torch.float32, "int8"),
                                             (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("d_v", [None, 12])
def test_pool_bytes_are_the_bytes_the_cache_allocates(dtype, kv_dtype, d_v):
    args = (5, 4, 3, 8, d_v)
    c = mha.PagedKVCache(*args, max_seqs=2, max_len=16, num_layers=2, dtype=dtype,
                         kv_dtype=kv_dtype)
    held = sum(t.nbytes for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None)
    assert c.nbytes == held
    assert pool_bytes(*args, num_layers=2, dtype=dtype, kv_dtype=kv_dtype) == held


def test_pool_bytes_refuses_what_the_cache_refuses():
    with pytest.raises(ValueError, match="num_pages must be a positive int, got 0"):
        pool_bytes(0, 4, 2, 8)
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        pool_bytes(4, 4, 2, 8, kv_dtype="int4")


def test_append_on_a_multi_layer_cache_says_to_extend_then_write():
    c = _cache(layers=2)
    s = c.add_sequence()
    with torch.no_grad(), pytest.raises(ValueError, match="call extend once, then write"):
        c.append([s], *_rows(1, 0))


# ------------------------------------------------------------------ attention through pages
def _fill(kv_dtype, seed=0, lengths=(9, 1, 14)):
    c = _cache(num_pages=16, page_size=4, max_len=16, kv_dtype=kv_dtype)
    seqs = [c.add_sequence() for _ in lengths]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    with torch.no_grad():
        c.append(seqs, *_rows(cu[-1], seed), cu_seqlens=cu)
    return c, seqs


@pytest.mark.skipif(decode.unavailable() is not None, reason="decode kernel unavailable")
@pytest.mark.parametrize("kv_dtype,tol", [(None, 1e-6), ("bfloat16", 2e-2), ("int8", 5e-2)])
def test_attend_equals_attention_on_the_gathered_keys(kv_dtype, tol):
    c, seqs = _fill(kv_dtype)
    q = torch.randn(len(seqs), 3 * H_KV, 1, D)  # (S, h, 1, d)
    with torch.no_grad():
        got = c.attend(0, q, seqs)  # (S, h, 1, d)
        for i, s in enumerate(seqs):
            k, v = c.gather(0, s)
            want = mha.reference.attention(q[i:i + 1], k, v, upcast=True)[0]
            assert (got[i:i + 1].double() - want).abs().max() <= tol
    exact, _ = _fill(None)
    if kv_dtype is not None:  # and near the full-precision cache (storage error only)
        with torch.no_grad():
            assert (got - exact.attend(0, q, seqs)).abs().max() <= tol


@pytest.mark.skipif(decode.unavailable() is not None, reason="decode kernel unavailable")
def test_attend_varlen_mixes_prefill_chunks_and_decode_rows():
    """One call: a 5-token chunk, two decode rows, a 3-token chunk; each sequence causal to
    its own keys (bottom-right), against the fp64 oracle per sequence."""
    c, seqs = _fill(None, lengths=(9, 1, 14))
    s4 = c.add_sequence()
    counts = [5, 1, 1, 3]
    order = [seqs[0], seqs[1], seqs[2], s4]
    with torch.no_grad():
        c.extend(order, counts)
        cu = [0, 5, 6, 7, 10]
        k, v = _rows(10, 5)
        c.write(0, order, k, v, cu)
        q = torch.randn(10, 2 * H_KV, D)  # (N, h, d)
        got = c.attend_varlen(0, q, order, cu)  # (N, h, d)
    for i, s in enumerate(order):
        kk, vv = c.gather(0, s)  # (1, h_kv, n, d)
        qs = q[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0)  # (1, h, n_q, d)
        n_q, n_k = qs.shape[2], kk.shape[2]
        allowed = torch.arange(n_k).view(1, -1) <= torch.arange(n_q).view(-1, 1) + n_k - n_q
        want = mha.reference.attention(qs, kk, vv, allowed=allowed, upcast=True)[0]
        assert (got[cu[i]:cu[i + 1]].transpose(0, 1).double() - want[0]).abs().max() <= 1e-5


def test_attend_refuses_queries_of_another_dtype():
    c, seqs = _fill(None)
    with torch.no_grad(), pytest.raises(TypeError, match="q must be torch.float32"):
        c.attend(0, torch.randn(3, 4, 1, D, dtype=torch.float64), seqs)


def test_attend_without_the_kernel_runs_on_gathered_keys(monkeypatch):
    c, seqs = _fill(None)
    q = torch.randn(len(seqs), 2 * H_KV, 1, D)  # (S, h, 1, d)
    with torch.no_grad():
        native = c.attend(0, q, seqs) if decode.unavailable() is None else None
        monkeypatch.setattr(decode, "unavailable", lambda: "no compiler (test)")
        with mha.use_backend("math"):  # dispatch must not pick the (unpatched) decode backend
            got = c.attend(0, q, seqs)  # (S, h, 1, d)
        for i, s in enumerate(seqs):
            k, v = c.gather(0, s)
            want = mha.reference.attention(q[i:i + 1], k, v, upcast=True)[0]
            assert (got[i:i + 1].double() - want).abs().max() <= 1e-6
    if native is not None:
        assert (got - native).abs().max() <= 1e-6


def test_attend_refuses_keywords_the_cache_sets_by_name():
    c, seqs = _fill(None)
    q = torch.randn(len(seqs), 2 * H_KV, 1, D)  # (S, h, 1, d)
    before = c.state()
    with torch.no_grad():
        with pytest.raises(TypeError, match="attend: causal is set by the cache"):
            c.attend(0, q, seqs, causal=True)
        with pytest.raises(TypeError, match="attend got an unexpected keyword 'window'"):
            c.attend(0, q, seqs, window=4)
        qv = torch.randn(len(seqs), 2 * H_KV, D)  # (N, h, d): one query per sequence
        with pytest.raises(TypeError, match="attend_varlen: key_lengths is set by the cache"):
            c.attend_varlen(0, qv, seqs, list(range(len(seqs) + 1)), key_lengths=None)
    _same_state(before, c.state())
