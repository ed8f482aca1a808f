"""Sliding-window attention in the native flash kernel (``window`` of ``mha::flash_attention_fwd``).

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims,
w window. Query i sees keys ``i + Tk - Tq - w < j <= i + Tk - Tq`` (with causal), and-ed with
key_lengths and a bool mask. Every compiled tile kernel and the small path (Tk <= 64) against
the fp64 loop with the repo's rule (tests/oracle.py); lse against fp64; rows that see no key
give zeros and lse = -inf; key blocks left of every window of a query block are never read.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha
from examples import examples
from mha import reference
from mha.masks import MaskSpec
from mha.ops import flash

from oracle import assert_within_budget

LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 100, 127, 128, 129, 160]
LSE_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-3}


def _kernels() -> list[tuple[str, torch.dtype]]:
    """(kernel, dtype) for every kernel compiled in; "small" is the short-key path."""
    assert flash.unavailable() is None, flash.unavailable()
    isa = flash.isa().split(",")
    cases = [(k, dt) for k in ("portable", "avx512f") if k in isa
             for dt in (torch.float32, torch.bfloat16)]
    cases += [(k, torch.bfloat16) for k in ("avx512bf16", "amx")
              if k in isa or f"{k}-emulated" in isa]  # amx on software tiles too
    if "avx512f" in isa:  # the small path is compiled with AVX-512
        cases += [("small", torch.float32), ("small", torch.bfloat16)]
    return cases


def _run(kernel, q, k, v, *, key_lengths=None, mask=None, scale, window):
    return torch.ops.mha._flash_attention_fwd_kernel(q, k, v, key_lengths, mask, True, scale,
                                                     kernel, window)


def _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, h, d_k, generator=g).to(dtype).transpose(1, 2)  # (B, h, Tq, d_k)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g).to(dtype)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g).to(dtype)
    return q, k, v


def _check(q, k, v, out, lse, spec: MaskSpec, scale):
    """out within budget of fp64; lse close, -inf exactly where a row sees no key; those rows 0."""
    B, h, Tq, _ = q.shape
    Tk = k.shape[2]
    allowed = spec.dense(B, h, Tq, Tk)  # (B, h, Tq, Tk)
    assert_within_budget(out, q, k, v, allowed, scale)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(),
                     k.double().repeat_interleave(h // k.shape[1], 1)) * scale  # (B, h, Tq, Tk)
    want = s.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # (B, h, Tq)
    seen = torch.isfinite(want)
    assert torch.equal(seen, torch.isfinite(lse)), "lse = -inf exactly on rows that see no key"
    assert torch.equal(lse[~seen], torch.full_like(lse[~seen], float("-inf")))
    tol = LSE_TOL[q.dtype]
    assert torch.allclose(lse.double()[seen], want[seen], atol=tol, rtol=tol)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))


@pytest.mark.parametrize("kernel,dtype", _kernels())
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_window_matches_the_oracle(kernel, dtype, data):
    lengths = [n for n in LENGTHS if n <= 64] if kernel == "small" else LENGTHS
    Tq = data.draw(st.sampled_from(lengths), label="Tq")
    Tk = data.draw(st.sampled_from(lengths), label="Tk")
    w = data.draw(st.integers(1, Tk + 3), label="w")
    h_kv = data.draw(st.sampled_from([1, 2, 4]), label="h_kv")  # h = 4: GQA and MHA
    d_k, d_v = data.draw(st.sampled_from([(32, 32), (64, 48), (16, 80)]), label="d_k, d_v")
    lengths_on = data.draw(st.booleans(), label="key_lengths")
    mask_kind = data.draw(st.sampled_from([None, "keys", "full"]), label="mask")
    B, h = 2, 4
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, seed=Tq * 1000 + Tk)
    kl = torch.tensor([Tk, data.draw(st.integers(0, Tk), label="len1")]) if lengths_on else None
    g = torch.Generator().manual_seed(w)
    mask = None
    if mask_kind == "keys":  # broadcast over heads and queries: read through stride 0
        mask = torch.rand(B, 1, 1, Tk, generator=g) > 0.3  # (B, 1, 1, Tk)
    elif mask_kind == "full":
        mask = torch.rand(B, h, Tq, Tk, generator=g) > 0.3  # (B, h, Tq, Tk)
    scale = d_k ** -0.5
    out, lse = _run(kernel, q, k, v, key_lengths=kl, mask=mask, scale=scale, window=w)
    _check(q, k, v, out, lse, MaskSpec(True, kl, mask, w), scale)


@pytest.mark.parametrize("kernel,dtype", _kernels())
def test_rows_left_of_every_key_are_zeros(kernel, dtype):
    """Tq > Tk: the first rows see no key; key_lengths empties rows whose window is past it."""
    Tk = 40 if kernel == "small" else 150
    q, k, v = _inputs(2, 4, 2, Tk + 37, Tk, 32, 32, dtype)
    kl = torch.tensor([Tk, 20])  # batch 1: rows whose window starts at or past key 20 see none
    out, lse = _run(kernel, q, k, v, key_lengths=kl, scale=0.2, window=7)
    _check(q, k, v, out, lse, MaskSpec(True, kl, None, 7), 0.2)
    assert torch.isinf(lse[:, :, :37]).all() and torch.isinf(lse[1, :, 37 + 27:]).all()


@pytest.mark.parametrize("kernel,dtype", [c for c in _kernels() if c[0] != "small"])
def test_key_blocks_left_of_the_window_are_never_read(kernel, dtype):
    """NaN in keys [0, 256): rows whose every query block starts its window past key 256 (plus
    a 128-key block and a 48-row query block of slack) stay finite and exact; the tile paths skip
    whole key blocks instead of masking them (0 * NaN would leak through P V)."""
    T, w = 700, 40
    q, k, v = _inputs(1, 2, 1, T, T, 32, 32, dtype)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :256] = float("nan")
    v_nan[:, :, :256] = float("nan")
    out, lse = _run(kernel, q, k_nan, v_nan, scale=0.2, window=w)
    first = 256 + 128 + w + 48  # rows from here on cannot reach a key block holding a NaN
    want, want_lse = _run(kernel, q, k, v, scale=0.2, window=w)
    assert torch.equal(out[:, :, first:], want[:, :, first:])
    assert torch.equal(lse[:, :, first:], want_lse[:, :, first:])
    _check(q, k, v, want, want_lse, MaskSpec(True, None, None, w), 0.2)


@pytest.mark.parametrize("kernel,dtype", _kernels())
def test_a_window_covering_the_keys_is_plain_causal(kernel, dtype):
    Tk = 50 if kernel == "small" else 200
    q, k, v = _inputs(1, 4, 2, Tk, Tk, 32, 32, dtype)
    plain = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, True, 0.2, kernel)
    for w in (Tk, Tk + 1, 10**12):
        got = _run(kernel, q, k, v, scale=0.2, window=w)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    narrower = _run(kernel, q, k, v, scale=0.2, window=Tk - 1)[0]
    assert not torch.equal(narrower, plain[0])  # the last row lost key 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_across_thread_counts(dtype):
    q, k, v = _inputs(2, 4, 2, 333, 400, 64, 64, dtype)
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 2):
            torch.set_num_threads(threads)
            runs.append(flash.flash_attention(q, k, v, causal=True, window=100))
    finally:
        torch.set_num_threads(before)
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


def test_the_function_passes_the_window_and_the_boundary_checks_it():
    """The op function passes the window on; a bad window is refused once, at the public
    boundary (mha.checks), naming the argument, before any backend runs."""
    q, k, v = _inputs(1, 2, 2, 90, 90, 32, 32, torch.float32)
    out, lse = flash.flash_attention(q, k, v, causal=True, window=9)
    _check(q, k, v, out, lse, MaskSpec(True, None, None, 9), 32 ** -0.5)
    for bad in (0, -3, 2.5, True):
        with pytest.raises((ValueError, TypeError), match="window must be"):
            mha.attention(q, k, v, causal=True, window=bad, backend="flash_cpu")


def test_window_gradients_through_autograd():
    """The window reaches the backward: gradients equal autograd through the fp64 loop with the
    window materialized, and differ from plain causal (tests/test_hostile_window_train.py
    covers the cases)."""
    ins = [t.requires_grad_() for t in _inputs(1, 2, 2, 90, 90, 32, 32, torch.float32)]
    out, _ = flash.flash_attention(*ins, causal=True, window=9)
    got = torch.autograd.grad(out.sum(), ins)
    ref_in = [t.detach().double().requires_grad_() for t in ins]
    allowed = MaskSpec(True, None, None, 9).dense(1, 2, 90, 90)  # (1, 2, 90, 90)
    ref = reference.attention(*ref_in, allowed=allowed)[0]  # (1, 2, 90, 32)
    want = torch.autograd.grad(ref.sum(), ref_in)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-4)
    causal = torch.autograd.grad(flash.flash_attention(*ins, causal=True)[0].sum(), ins)
    assert not torch.allclose(got[0], causal[0])


def test_opcheck_with_a_window():
    q, k, v = _inputs(2, 4, 2, 37, 45, 32, 24, torch.float32)
    torch.library.opcheck(torch.ops.mha.flash_attention_fwd,
                          (q, k, v, torch.tensor([45, 30]), None, True, 0.25, 11))
