"""Sliding-window attention (``window`` with ``causal``): every backend that declares the mask
kind against the float64 loop; flash_cpu serves it without gradients, the kernels that do not
(flash_decode; flash_cpu when training) say why in words and dispatch moves on.

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d head dim, w window.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha.backends import all_backends
from mha.masks import causal_mask, window_mask

from oracle import assert_within_budget

WINDOW_BACKENDS = [b.name for b in all_backends() if "window" in b.caps.mask_kinds]


def _qkv(B, h, h_kv, Tq, Tk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, Tq, d, generator=g).to(dtype),
            torch.randn(B, h_kv, Tk, d, generator=g).to(dtype),
            torch.randn(B, h_kv, Tk, d, generator=g).to(dtype))


@pytest.mark.parametrize("backend", WINDOW_BACKENDS)
@given(Tq=st.integers(1, 12), Tk=st.integers(1, 12), w=st.integers(1, 14),
       kv=st.sampled_from([1, 2]), lengths=st.booleans())
def test_window_matches_the_oracle(backend, Tq, Tk, w, kv, lengths):
    q, k, v = _qkv(2, 2, kv, Tq, Tk, 16)
    kl = torch.tensor([Tk, max(0, Tk - 3)]) if lengths else None
    out = mha.attention(q, k, v, causal=True, window=w, key_lengths=kl, backend=backend)
    allowed = (causal_mask(Tq, Tk) & window_mask(Tq, Tk, w))[None, None]  # (1, 1, Tq, Tk)
    if kl is not None:
        allowed = allowed & (torch.arange(Tk) < kl[:, None])[:, None, None, :]  # (B, 1, Tq, Tk)
    assert_within_budget(out, q, k, v, allowed)


def test_the_docstring_picture():
    q, k, v = _qkv(1, 1, 1, 4, 4, 16)
    _, w = mha.attention(q, k, v, causal=True, window=2, return_weights=True)
    seen = (w[0, 0] > 0).int().tolist()
    assert seen == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_a_window_as_long_as_the_keys_is_plain_causal():
    q, k, v = _qkv(2, 4, 2, 9, 9, 32)
    torch.testing.assert_close(mha.attention(q, k, v, causal=True, window=9),
                               mha.attention(q, k, v, causal=True), rtol=0, atol=1e-6)


def test_flash_cpu_serves_the_window_and_flash_decode_says_why_not():
    q, k, v = _qkv(1, 2, 2, 20, 20, 32)
    ex = mha.explain(q, k, v, causal=True, window=4)
    flash = next(v for v in ex if v.backend == "flash_cpu")
    assert not flash.reasons and ex.chosen == "flash_cpu"
    q1 = q[:, :, -1:]  # a decode step: flash_decode's shape, but it has no window
    decode = next(v for v in mha.explain(q1, k, v, causal=True, window=4)
                  if v.backend == "flash_decode")
    assert "mask kind 'window' not supported" in "; ".join(decode.reasons)


def test_training_with_a_window_stays_on_flash_cpu():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 20, 20, 32))
    ex = mha.explain(q, k, v, causal=True, window=4)
    flash = next(v for v in ex if v.backend == "flash_cpu")
    assert not flash.reasons and ex.chosen == "flash_cpu"


def test_gradients_are_finite_and_match_the_mask():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 6, 4, 16))  # Tq > Tk: rows see nothing
    out = mha.attention(q, k, v, causal=True, window=2)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))  # first rows: no keys


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(window=3), ValueError, "pass causal=True"),
    (dict(window=0, causal=True), ValueError, "window must be >= 1"),
    (dict(window=2.5, causal=True), TypeError, "window must be a positive int"),
])
def test_bad_windows_are_named(kwargs, err, match):
    q, k, v = _qkv(1, 1, 1, 3, 3, 16)
    with pytest.raises(err, match=match):
        mha.attention(q, k, v, **kwargs)


def test_module_passes_the_window():
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 7, 32)
    y, w = m(x, causal=True, window=3, need_weights=True)
    assert ((w > 0).sum(-1) <= 3).all() and y.shape == x.shape
    with pytest.raises(ValueError, match="KV cache"):
        m(x, window=3, causal=True, cache=m.new_cache(2, 16))
