"""mha.linear: the module's projections on the native fp32 tiles (forward and backward) or
F.linear.

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
from mha.ops import linear

pytestmark = pytest.mark.usefixtures("native_linear")  # tests/conftest.py


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
@given(M=st.integers(1, 300), K16=st.integers(1, 40), N16=st.integers(1, 20),
       bias=st.booleans(), lead=st.sampled_from([(), (3,), (2, 5)]), seed=st.integers(0, 999))
def test_matches_float64(M, K16, N16, bias, lead, seed):
    """Any rows (tiles of 6, blocks of 96), K across 128-chunks, N across 64-column panels."""
    N, K = 16 * N16, 16 * K16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g)
    if x.numel() * N < linear.SMALL:  # big enough to go native
        x = torch.randn(*lead, linear.SMALL // (K * N) + 1, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    _check(x, w, b)


def test_strided_input_and_weight_slices():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 30, 2 * 256, generator=g)[..., ::2]  # last dim stride 2
    W = torch.randn(3 * 256, 256, generator=g)
    _check(x, W[256:512], None)  # a view of a larger weight (the module's W^K)
    _check(x, torch.randn(256, 2 * 208, generator=g)[:, 16:224].t(), None)  # (N, K) = (208, 256)
    _check(x, torch.randn(208, 300, generator=g)[:, 20:276], None)  # rows 300 apart
    _check(x, torch.randn(208, 2 * 256, generator=g)[:, ::2], torch.randn(208, generator=g))


def test_opcheck():
    """Schema, fake (meta) twin and dispatch of mha::linear agree (torch.library.opcheck)."""
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(96, 128, generator=g), torch.randn(192, 128, generator=g), \
        torch.randn(192, generator=g)
    w_strided = torch.randn(192, 256, generator=g)[:, ::2]  # (N, K) = (192, 128), K stride 2
    for args in ((x, w, b), (x, w, None), (x, w_strided, b)):
        torch.library.opcheck(torch.ops.mha.linear.default, args)


def test_weight_read_at_every_call():
    """Nothing derived from the weight is kept: writes that bump no version counter (through
    .data, numpy, the storage) and a rebound .data are all read by the next call."""
    lin = torch.nn.Linear(256, 512)
    x = torch.randn(64, 256)
    w = lin.weight
    with torch.no_grad():
        for change in (lambda: w.data.mul_(2), lambda: w.detach().numpy().__imul__(-1),
                       lambda: setattr(w, "data", torch.randn(512, 256)),
                       lambda: w.untyped_storage().copy_(torch.randn(512, 256).untyped_storage())):
            before = linear.linear_module(lin, x)
            change()
            want = F.linear(x, w, lin.bias)
            torch.testing.assert_close(linear.linear_module(lin, x), want, rtol=1e-4, atol=1e-4)
            assert not torch.allclose(before, want, rtol=1e-2, atol=1e-2)


def test_in_place_weight_updates_are_seen():
    """In-place updates that bump the version counter, and load_state_dict."""
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
    w = torch.randn(512, 256)
    x = torch.randn(64, 256)
    assert linear.why_not_native(x, w, None) is None
    if linear.bf16_tiles():  # forced native: bf16 goes to the bf16 tiles
        assert linear.why_not_native(x.bfloat16(), w.bfloat16(), None) is None
    assert "float32 or bfloat16" in linear.why_not_native(x.half(), w.half(), None)
    assert "one dtype" in linear.why_not_native(x.bfloat16(), w, None)
    assert "multiply-adds" in linear.why_not_native(x[:2, :16].bfloat16(), w[:16, :16].bfloat16(),
                                                    None)
    assert "N % 16" in linear.why_not_native(x, w[:500], None)
    assert "K % 16" in linear.why_not_native(x[:, :250], w[:, :250], None)
    assert "multiply-adds" in linear.why_not_native(x[:2, :16], w[:16, :16], None)


@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=st.integers(1, 260), K16=st.integers(1, 24), N16=st.integers(1, 16),
       bias=st.booleans(), need_x=st.booleans(), seed=st.integers(0, 999))
def test_gradients_match_float64(M, K16, N16, bias, need_x, seed):
    """The native backward (grad_out W for x, grad_out^T x for the weight, row sums for the
    bias) against float64 autograd of F.linear, with F.linear's own fp32 gradients as the
    yardstick; x without requires_grad gets no gradient."""
    N, K = 16 * N16, 16 * K16
    g = torch.Generator().manual_seed(seed)
    M = max(M, linear.SMALL // (K * N) + 1)
    x, w, gy = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((M, K), (N, K), (M, N)))
    b = torch.randn(N, generator=g, dtype=torch.float64) if bias else None

    def grads(fn, dtype):
        ins = [x.detach().to(dtype).requires_grad_(need_x), w.detach().to(dtype).requires_grad_()]
        ins.append(None if b is None else b.detach().to(dtype).requires_grad_())
        fn(*ins).backward(gy.to(dtype))
        return [None if t is None else t.grad for t in ins]

    got, want, ref = grads(linear.linear, torch.float32), grads(F.linear, torch.float64), \
        grads(F.linear, torch.float32)
    assert linear.why_not_native(x.float(), w.float(), None) is None
    for name, a, e, r, n in zip(("x", "w", "b"), got, want, ref, (N, M, M), strict=True):
        if e is None:
            assert a is None, f"grad_{name} should be None"
            continue
        err, ref_err = (a.double() - e).abs().max().item(), (r.double() - e).abs().max().item()
        bound = n * 6e-8 * e.abs().max().item() * 4
        assert err <= 4 * ref_err + bound, f"grad_{name}: {err:.3e} vs F.linear's {ref_err:.3e}"


def test_double_backward_matches_float64():
    """create_graph=True: the gradients are differentiable (a gradient penalty's gradients equal
    float64 autograd of F.linear's)."""
    g = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((96, 128), (192, 128),
                                                                           (192,)))

    def penalty_grads(fn, dtype):
        ins = [t.to(dtype).requires_grad_() for t in (x, w, b)]
        gx, gw, gb = torch.autograd.grad(fn(*ins).square().sum(), ins, create_graph=True)
        return torch.autograd.grad(gx.square().sum() + gw.square().sum() + gb.sum(), ins)

    assert linear.why_not_native(x.float(), w.float(), b.float()) is None
    got, want = penalty_grads(linear.linear, torch.float32), penalty_grads(F.linear, torch.float64)
    for name, a, e in zip(("x", "w", "b"), got, want, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4 * e.abs().max().item(),
                                   msg=lambda m, name=name: f"grad_{name}: {m}")


def test_module_training_step_matches_f_linear(monkeypatch):
    """Three SGD steps of the module (native projections, weights repacked after each step) give
    the same losses as the same module on F.linear, to fp32 rounding."""
    torch.manual_seed(0)
    native_m, torch_m = mha.MultiHeadAttention(256, 4), mha.MultiHeadAttention(256, 4)
    torch_m.load_state_dict(native_m.state_dict())
    x = torch.randn(8, 40, 256)

    def losses(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        out = []
        for _ in range(3):
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    assert linear.why_not_native(x, native_m.in_proj.weight, native_m.in_proj.bias) is None
    got = losses(native_m)
    monkeypatch.setattr("mha.module.linear", F.linear)
    want = losses(torch_m)
    assert got == pytest.approx(want, rel=1e-4)
    assert got[2] != got[0]  # the weights did change


def test_module_uses_it_and_agrees_with_the_reference():
    """The seeds' module on native projections, with and without gradients, against the float64
    per-head loop."""
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(512, 8)
    x = torch.randn(32, 20, 512)
    assert linear.why_not_native(x, m.in_proj.weight, m.in_proj.bias) is None
    with torch.no_grad():
        y = m(x)
        y_ref, _ = mha.reference.multi_head_attention(x, x, upcast=True, **m.per_head_weights())
    y_grad = m(x)  # gradients on: the autograd function
    assert y_grad.grad_fn is not None
    assert (y.double() - y_ref).abs().max().item() < 1e-4
    assert (y - y_grad.detach()).abs().max().item() < 1e-4
