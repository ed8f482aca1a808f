"""mha.linear's bf16 tiles (``vdpbf16ps``): bfloat16 projections forward and backward.

Shape legend: x (..., K), weight (N, K), bias (N,), result (..., N); M rows of x.

The oracle is float64 on the same bf16 values (every bf16 is exact in float64), and the
yardstick is torch's own bf16 GEMM (``F.linear`` in bf16): both sum exact products in fp32 and
round each output to bf16 once, so the tiles' error must be at most 2 x torch's plus a bound of
K eps_fp32 sum |x w| (the two sum in different orders).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autograd_nodes import node_names
from examples import examples
from mha.ops import linear

pytestmark = pytest.mark.usefixtures("native_linear")  # MHA_LINEAR=native: bf16 goes to the tiles


@pytest.fixture(autouse=True)
def _tiles():
    if not linear.bf16_tiles():
        pytest.skip("the native op has no bf16 tiles here (its build lacks AVX512_BF16)")


def _bf16(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _assert_close_to_float64(got, want64, torch_bf16, abs_sum, K, what="out"):
    """The repository's rule: error vs float64 at most 2 x torch's bf16 GEMM's, plus K eps
    sum |x w|."""
    err = (got.double() - want64).abs().max().item()
    ref_err = (torch_bf16.double() - want64).abs().max().item()
    bound = K * 6e-8 * abs_sum
    assert err <= 2 * ref_err + bound, f"{what}: error {err:.3e} vs torch's bf16 {ref_err:.3e}"


def _check(x, w, b):
    with torch.no_grad():
        assert linear.describe(x, w, b).startswith("the native bf16 tiles")
        got = linear.linear(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        ref = F.linear(x, w, b)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    abs_sum = (x.abs().double().reshape(-1, x.shape[-1]) @ w.abs().double().t()).max().item()
    _assert_close_to_float64(got, want, ref, abs_sum, x.shape[-1])


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=st.integers(1, 300), K16=st.integers(1, 40), N16=st.integers(1, 20),
       bias=st.booleans(), lead=st.sampled_from([(), (3,), (2, 5)]), seed=st.integers(0, 999))
def test_matches_float64(M, K16, N16, bias, lead, seed):
    """Any rows (tiles of 6, blocks of 96, odd M), K across 128-pair chunks, N across
    64-column panels (partial panels of 16, 32, 48)."""
    N, K = 16 * N16, 16 * K16
    g = torch.Generator().manual_seed(seed)
    x = _bf16(*lead, M, K, g=g)
    if x.numel() * N < linear.SMALL:  # big enough to go native
        x = _bf16(*lead, linear.SMALL // (K * N) + 1, K, g=g)
    _check(x, _bf16(N, K, g=g), _bf16(N, g=g) if bias else None)


def test_strided_and_odd_offset_weights():
    """Weights whose rows are not pairs in place (a K stride, an odd element offset, a
    transpose) are copied first; x with a row stride is read in place."""
    g = torch.Generator().manual_seed(1)
    x = _bf16(40, 30, 2 * 256, g=g)[..., ::2].contiguous()
    W = _bf16(3 * 256, 256, g=g)
    _check(x, W[256:512], None)  # the module's W^K: a view of the packed weight
    _check(x, _bf16(208, 257, g=g)[:, 1:], None)  # starts at an odd element: 2-byte aligned
    _check(x, _bf16(256, 208, g=g).t(), _bf16(208, g=g))  # (N, K) = (208, 256), K stride 208
    _check(_bf16(1300, 512, g=g)[:, :256], W[:256], None)  # x rows 512 apart


def test_non_finite_values_propagate():
    """A NaN in x makes its output row NaN, an inf in the weight its column inf or NaN; the
    other outputs are untouched (NaN propagates as torch's GEMM does)."""
    g = torch.Generator().manual_seed(2)
    x, w, b = _bf16(64, 256, g=g), _bf16(512, 256, g=g), _bf16(512, g=g)
    clean = linear.linear(x, w, b)
    x2, w2 = x.clone(), w.clone()
    x2[5, 17] = float("nan")
    w2[40, 3] = float("inf")
    with torch.no_grad():
        got = linear.linear(x2, w2, b)
    assert got[5].isnan().all()
    assert (~got[:, 40].isfinite()).all() and (got[:, 40].isinf() | got[:, 40].isnan()).all()
    keep = torch.ones_like(got, dtype=torch.bool)
    keep[5], keep[:, 40] = False, False
    assert torch.equal(got[keep], clean[keep])


def test_opcheck_and_refusals():
    """Schema, fake twin and dispatch agree (opcheck); bad arguments are refused by name."""
    g = torch.Generator().manual_seed(3)
    x, w, b = _bf16(96, 128, g=g), _bf16(192, 128, g=g), _bf16(192, g=g)
    for args in ((x, w, b), (x, w, None), (x, _bf16(192, 256, g=g)[:, ::2], b)):
        torch.library.opcheck(torch.ops.mha.linear_bf16.default, args)
    with pytest.raises(RuntimeError, match="K even"):
        torch.ops.mha.linear_bf16(_bf16(4, 15, g=g), _bf16(16, 15, g=g), None)
    with pytest.raises(RuntimeError, match="N % 16"):
        torch.ops.mha.linear_bf16(x, w[:100], None)
    with pytest.raises(RuntimeError, match="bias must be a bfloat16"):
        torch.ops.mha.linear_bf16(x, w, b.float())


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=st.integers(1, 260), K16=st.integers(1, 24), N16=st.integers(1, 16),
       bias=st.booleans(), need_x=st.booleans(), seed=st.integers(0, 999))
def test_gradients_match_float64(M, K16, N16, bias, need_x, seed):
    """grad_out W for x, grad_out^T x for the weight (pairs over M: an odd M is zero-padded),
    row sums for the bias, each rounded to bf16 once; against float64 autograd with torch's
    bf16 gradients as the yardstick."""
    N, K = 16 * N16, 16 * K16
    g = torch.Generator().manual_seed(seed)
    M = max(M, linear.SMALL // (K * N) + 1)
    x, w, gy = _bf16(M, K, g=g), _bf16(N, K, g=g), _bf16(M, N, g=g)
    b = _bf16(N, g=g) if bias else None

    def grads(fn, dtype):
        leaf = lambda t: t.to(dtype, copy=True)  # noqa: E731 - a fresh leaf per run
        ins = [leaf(x).requires_grad_(need_x), leaf(w).requires_grad_()]
        ins.append(None if b is None else leaf(b).requires_grad_())
        y = fn(*ins)
        y.backward(gy.to(dtype))
        return y, [None if t is None else t.grad for t in ins]

    y, got = grads(linear.linear, torch.bfloat16)
    assert type(y.grad_fn.next_functions[0][0]).__name__ == "_LinearBf16Backward"  # the tiles
    _, want = grads(F.linear, torch.float64)
    _, ref = grads(F.linear, torch.bfloat16)
    sums = {"x": (gy.abs().double() @ w.abs().double()).max().item(),
            "w": (gy.abs().double().t() @ x.abs().double()).max().item(),
            "b": gy.abs().double().sum(0).max().item()}
    for name, a, e, r, n in zip(("x", "w", "b"), got, want, ref, (N, M, M), strict=True):
        if e is None:
            assert a is None, f"grad_{name} should be None"
            continue
        assert a.dtype == torch.bfloat16
        _assert_close_to_float64(a, e, r, sums[name], n, what=f"grad_{name}")


def test_module_gradients_match_float64(monkeypatch):
    """The bf16 module on the tiles (QKV and W_O through the bf16 autograd function): its
    parameter gradients within 2x the error of the same module on torch's bf16 GEMM, both
    against the float64 module."""
    import mha

    torch.manual_seed(0)
    m = mha.MultiHeadAttention(256, 4)
    x = torch.randn(8, 40, 256)
    dy = torch.randn(8, 40, 256)

    def grads(module, inp, out_grad, proj):
        monkeypatch.setattr("mha.module.linear", proj)
        module.zero_grad()
        y = module(inp)
        y.backward(out_grad)
        return {n: p.grad.double() for n, p in module.named_parameters()}, node_names(y)

    m64 = mha.MultiHeadAttention(256, 4).double()
    m64.load_state_dict(m.state_dict())
    m16 = m.bfloat16()
    want, _ = grads(m64, x.double(), dy.double(), F.linear)
    ref, _ = grads(m16, x.bfloat16(), dy.bfloat16(), F.linear)
    got, nodes = grads(m16, x.bfloat16(), dy.bfloat16(), linear.linear)
    assert "_LinearBf16Backward" in nodes  # the tiles' autograd function ran
    for name, e in want.items():
        err = (got[name] - e).abs().max().item()
        ref_err = (ref[name] - e).abs().max().item()
        assert err <= 2 * ref_err + 1e-3 * e.abs().max().item(), \
            f"grad {name}: {err:.3e} vs torch's bf16 {ref_err:.3e}"


