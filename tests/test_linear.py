"""mha.linear: the module's projections on the native fp32 tiles (inference) or F.linear.

Shape legend: x (..., K), weight (N, K), bias (N,), result (..., N). The native result must be
as close to the float64 product as F.linear's: within 4 x F.linear's own error plus a bound of
K eps sum |x w| scale (both sum K products in fp32, in different orders).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha
from examples import examples
from mha import linear

pytestmark = pytest.mark.skipif(linear.load() is not None, reason=f"the native projections are "
                                f"unavailable here: {linear.load()}")


def _check(x, w, b):
    with torch.no_grad():
        assert linear.why_not_native(x, w, b) is None
        got = linear.linear(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        ref = F.linear(x, w, b)
    assert got.shape == ref.shape and got.dtype == torch.float32 and got.is_contiguous()
    err = (got.double() - want).abs().max().item()
    ref_err = (ref.double() - want).abs().max().item()
    bound = x.shape[-1] * 6e-8 * (x.abs().double() @ w.abs().double().t()).max().item()
    assert err <= 4 * ref_err + bound, f"error {err:.3e} vs F.linear's {ref_err:.3e}"


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=st.integers(1, 300), K=st.integers(1, 700), N16=st.integers(1, 20),
       bias=st.booleans(), lead=st.sampled_from([(), (3,), (2, 5)]), seed=st.integers(0, 999))
def test_matches_float64(M, K, N16, bias, lead, seed):
    """Any rows (tiles of 6, blocks of 96), K across 128-chunks, N across 64-column panels."""
    N = 16 * N16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g)
    if x.numel() * N < linear.SMALL:  # make it big enough to take the native path
        x = torch.randn(*lead, linear.SMALL // (K * N) + 1, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    _check(x, w, b)


def test_strided_input_and_weight_slices():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 30, 2 * 256, generator=g)[..., ::2]  # last dim stride 2
    W = torch.randn(3 * 256, 256, generator=g)
    _check(x, W[256:512], None)  # a view of a larger weight (the module's W^K)


def test_in_place_weight_updates_are_seen():
    """The packed copy is cached per weight and dropped when the weight changes in place."""
    lin = torch.nn.Linear(256, 512)
    x = torch.randn(64, 256)
    with torch.no_grad():
        first = linear.linear_module(lin, x)
        lin.weight.mul_(2.0)
        second = linear.linear_module(lin, x)
        torch.testing.assert_close(second, F.linear(x, lin.weight, lin.bias))
        assert not torch.allclose(first, second)
        lin.load_state_dict({"weight": torch.zeros(512, 256), "bias": torch.ones(512)})
        torch.testing.assert_close(linear.linear_module(lin, x), torch.ones(64, 512))


def test_falls_back_with_a_reason():
    w = torch.randn(512, 256, requires_grad=True)
    x = torch.randn(64, 256)
    assert "gradient" in linear.why_not_native(x, w, None)
    y = linear.linear(x, w)  # F.linear: differentiable
    y.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        assert linear.why_not_native(x, w, None) is None
        assert "float32" in linear.why_not_native(x.bfloat16(), w.bfloat16(), None)
        assert "N % 16" in linear.why_not_native(x, w[:500], None)
        assert "multiply-adds" in linear.why_not_native(x[:2, :16], w[:16, :16], None)


def test_module_uses_it_and_agrees_with_the_reference():
    """The seeds' module under no_grad (native projections) against the float64 per-head loop,
    and against itself with gradients enabled (F.linear)."""
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(512, 8)
    x = torch.randn(32, 20, 512)
    assert linear.why_not_native(x, m.in_proj.weight.detach(), None) is None
    with torch.no_grad():
        y = m(x)
        y_ref, _ = mha.reference.multi_head_attention(x, x, upcast=True, **m.per_head_weights())
    y_grad = m(x)  # gradients on: F.linear
    assert (y.double() - y_ref).abs().max().item() < 1e-4
    assert (y - y_grad.detach()).abs().max().item() < 1e-4
