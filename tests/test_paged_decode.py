"""``flash_decode(..., block_table=...)``: the decode kernel reading K/V from page pools.

Shape legend: B rows, h / h_kv query / K/V heads, Tq queries per row, P pages in the pool, p
page size, M pages per row in the block table, Tk = M * p, d_k / d_v head dims.

Judged two ways: against the same kernel on the contiguous K/V the pages hold (bitwise on the
portable loops, which run the same arithmetic key by key), and against the float64 oracle
row by row (each row its own sequence: its own length, causal aligned to it).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mha.ops import decode

from oracle import assert_within_budget

pytestmark = pytest.mark.skipif(decode.unavailable() is not None,
                                reason=f"decode kernel unavailable: {decode.unavailable()}")


def _pages(B, h_kv, M, p, d_k, d_v, extra, dtype, seed):
    """Pools with P = B * M + extra pages, and a random block table (B, M) of distinct pages."""
    g = torch.Generator().manual_seed(seed)
    P = B * M + extra
    k = torch.randn(P, h_kv, p, d_k, generator=g).to(dtype)  # (P, h_kv, p, d_k)
    v = torch.randn(P, h_kv, p, d_v, generator=g).to(dtype)  # (P, h_kv, p, d_v)
    bt = torch.randperm(P, generator=g)[:B * M].view(B, M).to(torch.int32)  # (B, M)
    return k, v, bt, g


def _dense(pool, bt):
    """The contiguous ``(B, h_kv, M * p, d)`` K or V the block table describes (a copy)."""
    x = pool[bt.long()]  # (B, M, h_kv, p, d)
    B, M, h_kv, p = x.shape[:4]
    return x.transpose(1, 2).reshape(B, h_kv, M * p, *x.shape[4:])  # (B, h_kv, M * p, d)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), g=st.sampled_from([1, 3]), h_kv=st.integers(1, 2),
       p=st.sampled_from([1, 4, 16, 33]), M=st.integers(1, 6), extra=st.integers(0, 5),
       Tq=st.sampled_from([1, 1, 3]), seed=st.integers(0, 2**16))
def test_paged_equals_dense_bitwise_portable(B, g, h_kv, p, M, extra, Tq, seed):
    k, v, bt, gen = _pages(B, h_kv, M, p, 32, 24, extra, torch.float32, seed)
    Tq = min(Tq, M * p)
    q = torch.randn(B, g * h_kv, Tq, 32, generator=gen)  # (B, h, Tq, d_k)
    lengths = torch.randint(Tq, M * p + 1, (B,), generator=gen)
    with torch.no_grad():
        got = decode.flash_decode(q, k, v, block_table=bt, key_lengths=lengths, portable=True)
        want = decode.flash_decode(q, _dense(k, bt), _dense(v, bt), key_lengths=lengths,
                                   portable=True)
    if Tq == 1:  # one query: causal or not, and the alignment, change nothing
        assert torch.equal(got, want)
    else:  # causal per row: compare with the row's own (1, ., n, .) dense problem. Its
        # split plan (split_length of B h_kv and Tk) differs from the batch's, so the partials
        # merge in another order: equal to within rounding, not bitwise
        with torch.no_grad():
            got = decode.flash_decode(q, k, v, block_table=bt, key_lengths=lengths,
                                      causal=True, portable=True)
            for b in range(B):
                n = int(lengths[b])
                one = decode.flash_decode(q[b:b + 1], _dense(k, bt)[b:b + 1, :, :n],
                                          _dense(v, bt)[b:b + 1, :, :n], causal=True,
                                          portable=True)
                torch.testing.assert_close(got[b:b + 1], one, rtol=2e-6, atol=1e-6)


# (B, h, h_kv, Tq, p, M, d_k, d_v, dtype, variants)
CASES = [
    (3, 4, 4, 1, 16, 5, 64, 64, torch.float32, {}),
    (2, 9, 3, 1, 16, 9, 64, 64, torch.float32, {}),  # SmolLM2's GQA
    (2, 8, 2, 4, 8, 7, 32, 48, torch.float32, {}),
    (3, 6, 2, 1, 16, 70, 64, 64, torch.float32, {}),  # several key splits, pages across them
    (2, 4, 2, 1, 16, 5, 64, 64, torch.bfloat16, {}),
    (2, 4, 2, 2, 16, 5, 64, 64, torch.float32, {"softcap": 5.0}),
    (2, 4, 2, 1, 16, 5, 64, 64, torch.float32, {"sinks": True}),
    (2, 4, 2, 3, 8, 6, 32, 32, torch.float32, {"alibi": True}),
    (2, 4, 2, 2, 8, 6, 32, 32, torch.float32, {"bias": True}),
]


def _variants(var, B, h, Tq, Tk, gen):
    kw, bias = {}, None
    if "softcap" in var:
        kw["softcap"] = var["softcap"]
    if var.get("sinks"):
        kw["sinks"] = torch.randn(h, generator=gen)
    if var.get("alibi"):
        kw["alibi_slopes"] = torch.rand(h, generator=gen)
    if var.get("bias"):
        bias = torch.randn(B, h, Tq, Tk, generator=gen)
        kw["bias"] = bias
    return kw


def _row_oracle(q, k, v, n, Tq, kw, b):
    """Row b as its own sequence of n keys (causal and ALiBi aligned to n), in float64."""
    from mha import reference

    i = torch.arange(Tq).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    allowed = (j <= i + n - Tq).view(1, 1, Tq, n)  # causal, bottom-right at the row's length
    return reference.attention(
        q, k, v, allowed=allowed, upcast=True, softcap=kw.get("softcap"), sinks=kw.get("sinks"),
        alibi_slopes=kw.get("alibi_slopes"),
        bias=None if "bias" not in kw else kw["bias"][b:b + 1, :, :, :n])[0]


@pytest.mark.parametrize("B,h,h_kv,Tq,p,M,d_k,d_v,dtype,var", CASES)
@pytest.mark.parametrize("portable", [False, True])
def test_paged_against_fp64_oracle(B, h, h_kv, Tq, p, M, d_k, d_v, dtype, var, portable):
    k, v, bt, gen = _pages(B, h_kv, M, p, d_k, d_v, 3, dtype, B * M + Tq)
    q = torch.randn(B, h, Tq, d_k, generator=gen).to(dtype)  # (B, h, Tq, d_k)
    lengths = torch.randint(Tq, M * p + 1, (B,), generator=gen)
    lengths[0] = M * p
    kw = _variants(var, B, h, Tq, M * p, gen)
    with torch.no_grad():
        got = decode.flash_decode(q, k, v, block_table=bt, key_lengths=lengths, causal=True,
                                  portable=portable, **kw)  # (B, h, Tq, d_v)
    kd, vd = _dense(k, bt), _dense(v, bt)
    for b in range(B):
        n = int(lengths[b])
        ref = _row_oracle(q[b:b + 1], kd[b:b + 1, :, :n], vd[b:b + 1, :, :n], n, Tq, kw, b)
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
        assert (got[b:b + 1].double() - ref).abs().max().item() <= tol, f"row {b}"
    if not kw:  # the tolerance rule, on the rows as one batch (every row full length)
        full = torch.full((B,), M * p)
        with torch.no_grad():
            got = decode.flash_decode(q, k, v, block_table=bt, key_lengths=full,
                                      portable=portable)
        assert_within_budget(got, q, kd, vd)


@pytest.mark.parametrize("Tq", [1, 2])
def test_paged_int8_equals_dense_int8(Tq):
    k, v, bt, gen = _pages(3, 2, 5, 16, 64, 64, 4, torch.float32, 7)
    kq, ks = decode.quantize_int8(k)  # (P, h_kv, p, d) int8, (P, h_kv, p) float32
    vq, vs = decode.quantize_int8(v)
    q = torch.randn(3, 6, Tq, 64, generator=gen)  # (B, h, Tq, d_k)
    lengths = torch.tensor([80, 17, 33])
    with torch.no_grad():
        got = decode.flash_decode(q, kq, vq, block_table=bt, key_lengths=lengths, k_scale=ks,
                                  v_scale=vs)
        want = decode.flash_decode(q, _dense(kq, bt), _dense(vq, bt), key_lengths=lengths,
                                   k_scale=_dense(ks.unsqueeze(-1), bt)[..., 0],
                                   v_scale=_dense(vs.unsqueeze(-1), bt)[..., 0])
    if Tq == 1:
        assert torch.equal(got, want)
    else:  # full-length row: the same alignment either way
        assert torch.equal(got[0], want[0])


def test_pages_past_a_row_length_are_never_read():
    """Entries past a row's length may be anything (-1, out of the pool): never read."""
    k, v, bt, gen = _pages(2, 2, 4, 8, 32, 32, 0, torch.float32, 3)
    q = torch.randn(2, 2, 1, 32, generator=gen)
    lengths = torch.tensor([9, 32])  # row 0 uses pages 0 and 1 of its block table row only
    with torch.no_grad():
        want = decode.flash_decode(q, k, v, block_table=bt, key_lengths=lengths)
        bt2 = bt.clone()
        bt2[0, 2:] = torch.tensor([-1, 10**6], dtype=torch.int32)
        got = decode.flash_decode(q, k, v, block_table=bt2, key_lengths=lengths)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad,err,words", [
    (lambda bt: bt.long(), TypeError, "int32"),
    (lambda bt: bt[:1], ValueError, "(B, max_pages)"),
    (lambda bt: bt.flatten(), ValueError, "(B, max_pages)"),
    (lambda bt: torch.where(bt == bt[1, 0], torch.tensor(99, dtype=torch.int32), bt),
     RuntimeError, "block_table[1, 0] = 99"),
])
def test_bad_block_table_refused_with_its_name(bad, err, words):
    k, v, bt, gen = _pages(2, 2, 3, 8, 32, 32, 0, torch.float32, 1)
    q = torch.randn(2, 4, 1, 32, generator=gen)
    with torch.no_grad(), pytest.raises(err, match="block_table") as e:
        decode.flash_decode(q, k, v, block_table=bad(bt), key_lengths=torch.tensor([24, 24]))
    assert words in str(e.value)


def test_paged_int8_scales_must_be_page_shaped():
    k, v, bt, gen = _pages(2, 2, 3, 8, 32, 32, 0, torch.float32, 2)
    kq, ks = decode.quantize_int8(k)
    vq, vs = decode.quantize_int8(v)
    q = torch.randn(2, 4, 1, 32, generator=gen)
    with torch.no_grad(), pytest.raises(ValueError, match=r"v_scale must have shape "
                                        r"\(num_pages, h_kv, page_size\)"):
        decode.flash_decode(q, kq, vq, block_table=bt, k_scale=ks, v_scale=vs[:, :, :4])
