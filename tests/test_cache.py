"""``mha.KVCache`` and ``MultiHeadAttention(x_new, cache=...)``: incremental decoding equals the
full causal pass (seed 002), for every backend that can serve, with ragged rows, GQA, refusal
without damage, and cheap rollback.

Shape legend: B batch, T tokens, T_max capacity, h / h_kv heads, d_model width.
The tolerance rule is the project's: error vs an fp64 oracle <= 2x the error of the naive
low-precision computation (the full pass through the reference loop) + a small floor.
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha.backends import all_backends
from mha.cache import ConcatKVCache

from oracle import FLOOR, max_err

DTYPES = (torch.float32, torch.bfloat16)


def _module(dtype, num_kv_heads=None, seed=0, d_model=128, num_heads=8):
    torch.manual_seed(seed)
    return mha.MultiHeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads).to(dtype).eval()


def _x(B, T, dtype, seed=1, d_model=128):
    return torch.randn(B, T, d_model, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_budget(got, m, x, what=""):
    """``got`` (B, T, d_model) vs the fp64 full causal pass; budget from the naive low-precision
    full pass (the seeds' per-head loop in x's dtype)."""
    ref = m.double()(x.double(), causal=True, backend="reference")
    m.to(x.dtype)
    naive = m(x, causal=True, backend="reference")
    budget = 2 * max_err(naive, ref) + FLOOR[x.dtype]
    err = max_err(got, ref)
    assert err <= budget, f"{what}: error {err:.3e} > budget {budget:.3e}"


def _decode(m, x, chunks, cache=None, backend=None):
    """Feed x (B, T, d_model) through the cache in chunks of the given sizes; concat outputs."""
    cache = m.new_cache(x.shape[0], x.shape[1]) if cache is None else cache
    outs, t = [], 0
    for n in chunks:
        outs.append(m(x[:, t:t + n], cache=cache, backend=backend))  # (B, n, d_model)
        t += n
    assert t == x.shape[1]
    return torch.cat(outs, dim=1), cache


def _rejections(backend, dtype, B, h, h_kv, d, chunks):
    """The backend's reasons (from the capability table) against the calls decoding makes:
    each chunk's queries against the keys cached so far."""
    reasons, t = [], 0
    for n in chunks:
        t += n
        q, kv = torch.zeros(B, h, n, d, dtype=dtype), torch.zeros(B, h_kv, t, d, dtype=dtype)
        verdict = {v.backend: v for v in mha.explain(q, kv, kv, causal=n > 1)}[backend]
        reasons += [r for r in verdict.reasons if r not in reasons]
    return reasons


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", [None, *[b.name for b in all_backends()]])
def test_prefill_then_steps_equals_the_full_causal_pass(backend, dtype):
    # chunked prefill (<= 16 tokens: every backend, incl. flash_decode, serves each chunk)
    chunks = [12, 3, 1, 1, 4] + [1] * 3
    if backend is not None:
        reasons = _rejections(backend, dtype, 2, 8, 4, 16, chunks)
        if reasons:
            pytest.skip(f"{backend} cannot serve these calls: {'; '.join(reasons)}")
    m, x = _module(dtype, num_kv_heads=4), _x(2, 24, dtype)
    with torch.no_grad():
        got, cache = _decode(m, x, chunks, backend=backend)
        _assert_budget(got, m, x, f"backend={backend}")
    assert cache.lengths.tolist() == [24, 24]


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_long_prefill_and_gqa_decoding(num_kv_heads, dtype):
    m, x = _module(dtype, num_kv_heads=num_kv_heads), _x(3, 40, dtype)
    with torch.no_grad():
        got, cache = _decode(m, x, [30] + [1] * 10)
        _assert_budget(got, m, x, f"h_kv={num_kv_heads}")
    assert cache.k.shape == (3, num_kv_heads, 40, 16)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_ragged_rows_right_padding(dtype):
    """Prompts of lengths 5, 9, 7 padded to 9: prefill, truncate per row, then decode steps
    of 1 and 3 tokens (Tq > 1 with ragged rows goes through the cache's per-row mask)."""
    m = _module(dtype, num_kv_heads=2)
    lengths = [5, 9, 7]
    rows = [_x(1, L + 5, dtype, seed=10 + i) for i, L in enumerate(lengths)]
    with torch.no_grad():
        prompt = torch.zeros(3, 9, 128, dtype=dtype)
        for i, L in enumerate(lengths):
            prompt[i, :L] = rows[i][0, :L]
        cache = m.new_cache(3, 20)
        y_prompt = m(prompt, cache=cache)
        cache.truncate(torch.tensor(lengths))
        steps = [m(torch.stack([r[0, L:L + 1] for r, L in zip(rows, lengths, strict=True)]),
                   cache=cache)]
        steps.append(m(torch.stack([r[0, L + 1:L + 4] for r, L in zip(rows, lengths,
                                                                       strict=True)]), cache=cache))
        steps.append(m(torch.stack([r[0, L + 4:L + 5] for r, L in zip(rows, lengths,
                                                                       strict=True)]), cache=cache))
        assert cache.lengths.tolist() == [L + 5 for L in lengths]
        for i, L in enumerate(lengths):
            got = torch.cat([y_prompt[i:i + 1, :L]] + [s[i:i + 1] for s in steps], dim=1)
            _assert_budget(got, m, rows[i], f"row {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_ragged_rows_left_padding(dtype):
    m = _module(dtype)
    lengths = [4, 8]
    rows = [_x(1, L + 4, dtype, seed=20 + i) for i, L in enumerate(lengths)]
    with torch.no_grad():
        prompt = torch.zeros(2, 8, 128, dtype=dtype)
        for i, L in enumerate(lengths):
            prompt[i, 8 - L:] = rows[i][0, :L]
        cache = m.new_cache(2, 12)
        cache.mark_left_padding(torch.tensor([8 - L for L in lengths]))
        y_prompt = m(prompt, cache=cache)
        assert cache.positions(1).tolist() == [[4], [8]]
        y1 = m(torch.stack([r[0, L:L + 1] for r, L in zip(rows, lengths, strict=True)]), cache=cache)
        y3 = m(torch.stack([r[0, L + 1:L + 4] for r, L in zip(rows, lengths, strict=True)]),
               cache=cache)
        for i, L in enumerate(lengths):
            got = torch.cat([y_prompt[i:i + 1, 8 - L:], y1[i:i + 1], y3[i:i + 1]], dim=1)
            _assert_budget(got, m, rows[i], f"row {i}")


def test_overflow_refuses_and_leaves_the_cache_bitwise_intact():
    m, x = _module(torch.float32), _x(2, 10, torch.float32)
    with torch.no_grad():
        cache = m.new_cache(2, 8)
        y6 = m(x[:, :6], cache=cache)
        k0, v0, L0, ptr = cache.k.clone(), cache.v.clone(), cache.lengths.clone(), cache.k.data_ptr()
        with pytest.raises(ValueError, match="T_max=8"):
            m(x[:, 6:9], cache=cache)
        assert torch.equal(cache.k, k0) and torch.equal(cache.v, v0)
        assert torch.equal(cache.lengths, L0) and cache.k.data_ptr() == ptr
        cache.truncate(torch.tensor([6, 5]))  # ragged: only row 0 would overflow
        with pytest.raises(ValueError, match="capacity T_max=8"):
            cache.append(torch.zeros(2, 8, 3, 16), torch.zeros(2, 8, 3, 16))
        assert cache.lengths.tolist() == [6, 5] and torch.equal(cache.k, k0)
        cache.truncate(5)
        got = torch.cat([y6[:, :5], m(x[:, 5:8], cache=cache)], dim=1)
        _assert_budget(got, m, x[:, :8], "still usable")


def test_a_failing_attention_call_undoes_its_append():
    m, x = _module(torch.float32), _x(1, 20, torch.float32)
    with torch.no_grad():
        cache = m.new_cache(1, 40)
        m(x[:, :2], cache=cache)
        with pytest.raises(mha.BackendError):  # Tq=17 > 16: the forced decode kernel refuses
            m(x[:, :17], cache=cache, backend="flash_decode")
        assert cache.lengths.tolist() == [2]


def test_truncate_and_reset_are_cheap_and_exact():
    m, x = _module(torch.float32), _x(2, 12, torch.float32)
    with torch.no_grad():
        cache = m.new_cache(2, 16)
        ptrs = (cache.k.data_ptr(), cache.v.data_ptr())
        m(x[:, :8], cache=cache)
        first = m(x[:, 8:12], cache=cache)  # e.g. 4 speculated tokens
        cache.truncate(8)  # rejected: roll back
        again = m(x[:, 8:12], cache=cache)
        assert torch.equal(first, again)
        cache.reset()
        assert cache.lengths.tolist() == [0, 0] and cache.max_length == 0
        restart = m(x[:, :8], cache=cache)
        assert torch.equal(restart, m(x[:, :8], cache=m.new_cache(2, 16)))
        assert (cache.k.data_ptr(), cache.v.data_ptr()) == ptrs
    with pytest.raises(ValueError, match="current length"):
        cache.truncate(9)
    with pytest.raises(ValueError, match=r"\(B,\) = \(2,\)"):
        cache.truncate(torch.tensor([1, 2, 3]))


def test_cache_follows_the_module_and_checks_its_inputs():
    m = _module(torch.bfloat16, num_kv_heads=2)
    cache = m.new_cache(3, 5)
    assert (cache.k.shape, cache.v.shape) == ((3, 2, 5, 16), (3, 2, 5, 16))
    assert cache.dtype == torch.bfloat16 and cache.capacity == 5 and cache.batch_size == 3
    with pytest.raises(ValueError, match=r"k_new \(B, h_kv, Tn, d_k\) = \(3, 2, Tn, 16\)"):
        cache.append(torch.zeros(3, 4, 1, 16, dtype=torch.bfloat16),
                     torch.zeros(3, 4, 1, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        cache.append(torch.zeros(3, 2, 1, 16), torch.zeros(3, 2, 1, 16))
    x = _x(3, 2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="inference"):
        m(x, cache=cache)  # grad enabled and weights require grad
    with torch.no_grad(), pytest.raises(ValueError, match="self-attention only"):
        m(x, x, cache=cache)
    with torch.no_grad(), pytest.raises(ValueError, match="mask and key_lengths"):
        m(x, cache=cache, key_lengths=torch.tensor([1, 1, 1]))
    assert cache.lengths.tolist() == [0, 0, 0]


def test_weights_through_the_cache_cover_each_rows_own_keys():
    m, x = _module(torch.float32), _x(2, 6, torch.float32)
    with torch.no_grad():
        cache = m.new_cache(2, 8)
        m(x[:, :4], cache=cache)
        cache.truncate(torch.tensor([4, 2]))
        _, w = m(x[:, 4:6], cache=cache, need_weights=True)  # (B, h, 2, Tk=6)
    assert w.shape == (2, 8, 2, 6)  # lengths are now [6, 4]
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 8, 2))
    assert torch.all(w[0, :, 0, 5] == 0) and torch.all(w[0, :, 0, :5] > 0)  # causal in row 0
    assert torch.all(w[1, :, 0, 3:] == 0) and torch.all(w[1, :, 0, :3] > 0)  # row 1: 3 keys
    assert torch.all(w[1, :, 1, 4:] == 0) and torch.all(w[1, :, 1, :4] > 0)  # then 4


def test_concat_baseline_has_the_same_protocol():
    m, x = _module(torch.float32), _x(2, 10, torch.float32)
    with torch.no_grad():
        base = ConcatKVCache()
        got = torch.cat([m(x[:, :7], cache=base), m(x[:, 7:8], cache=base),
                         m(x[:, 8:10], cache=base)], dim=1)
        _assert_budget(got, m, x, "concat")
    assert base.max_length == 10


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("rows", ["equal", "ragged", "left padded"])
@pytest.mark.parametrize("Tn", [1, 3])
def test_appending_yields_what_keys_values_and_masks_give_and_undoes_on_error(rows, Tn,
                                                                              kv_dtype):
    g = torch.Generator().manual_seed(0)
    c = mha.KVCache(3, 2, 12, 8, kv_dtype=kv_dtype)  # (B, h_kv, T_max, d)
    if rows == "left padded":
        c.mark_left_padding(torch.tensor([0, 2, 1]))
    c.append(*(torch.randn(3, 2, 4, 8, generator=g) for _ in range(2)))  # 4 tokens a row
    if rows == "ragged":
        c.truncate(torch.tensor([4, 2, 3]))
    new = [torch.randn(3, 2, Tn, 8, generator=g) for _ in range(2)]  # (B, h_kv, Tn, d)
    before = c.lengths.clone()
    with c.appending(*new) as (k_all, v_all, masks):
        assert torch.equal(k_all, c.keys()) and torch.equal(v_all, c.values())
        want = c.masks(Tn)
        assert masks.keys() == want.keys()
        assert all(torch.equal(masks[n], want[n]) if isinstance(want[n], torch.Tensor)
                   else masks[n] == want[n] for n in want)
    assert torch.equal(c.lengths, before + Tn)
    with pytest.raises(RuntimeError, match="the body"), c.appending(*new):
        raise RuntimeError("the body")
    assert torch.equal(c.lengths, before + Tn)  # the second append undone
