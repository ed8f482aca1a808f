"""mha.attention against the fp64 seed-000 oracle, for every backend, generated from the same
capability table that drives dispatch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha.backends import all_backends
from mha.functional import make_call
from mha.masks import MaskSpec, causal_mask

from oracle import assert_within_budget, max_err, oracle

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _backend_dtype_cases():
    """(backend, dtype) pairs the capability table says are served."""
    return [pytest.param(b.name, d, id=f"{b.name}-{str(d)[6:]}")
            for b in all_backends() for d in DTYPES if d in b.caps.dtypes]


@st.composite
def problems(draw, dtype=torch.float32):
    """A random attention problem: shapes, GQA ratio, d_v != d_k, masks of every kind."""
    B = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 3))
    h = h_kv * draw(st.integers(1, 3))
    Tq, Tk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d_k = draw(st.sampled_from([16, 32, 64]))
    d_v = draw(st.sampled_from([d_k, 16, 48]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Tq, d_k, generator=g).to(dtype)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g).to(dtype)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g).to(dtype)
    kwargs = {}
    if draw(st.booleans()):
        kwargs["causal"] = True
    if draw(st.booleans()):
        kwargs["key_lengths"] = torch.randint(0, Tk + 1, (B,), generator=g)
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(B, h, Tq, Tk), (B, 1, Tq, Tk), (Tq, Tk), (B, 1, 1, Tk)]))
        kwargs["mask"] = torch.rand(shape, generator=g) > draw(st.sampled_from([0.2, 0.5, 0.9]))
    return q, k, v, kwargs


def _allowed(q, k, kwargs):
    call = make_call(q, k, k[..., :1].expand(*k.shape[:3], 1), **kwargs)
    return call.masks.materialize(call.B, call.h, call.Tq, call.Tk)


@pytest.mark.parametrize("backend, dtype", _backend_dtype_cases())
@given(data=st.data())
def test_every_backend_matches_the_oracle(backend, dtype, data):
    q, k, v, kwargs = data.draw(problems(dtype))
    verdict = {vd.backend: vd for vd in mha.explain(q, k, v, **kwargs)}[backend]
    if not verdict.ok:  # the capability table says no: then forcing it must raise, in words
        with pytest.raises(mha.BackendError, match=backend):
            mha.attention(q, k, v, backend=backend, **kwargs)
        return
    out = mha.attention(q, k, v, backend=backend, **kwargs)
    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert_within_budget(out, q, k, v, _allowed(q, k, kwargs))


@pytest.mark.parametrize("backend", [b.name for b in all_backends() if b.caps.weights])
@given(data=st.data())
def test_returned_weights_match_the_oracle(backend, data):
    q, k, v, kwargs = data.draw(problems())
    out, w = mha.attention(q, k, v, backend=backend, return_weights=True, **kwargs)
    allowed = _allowed(q, k, kwargs)
    assert w.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    assert_within_budget(w, q, k, v, allowed, index=1, what="weights")
    if allowed is not None:  # masked positions carry exactly zero weight
        assert (w.masked_select(~allowed.expand_as(w)) == 0).all()


def test_auto_dispatch_matches_sdpa_on_plain_inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    assert max_err(mha.attention(q, k, v), want) < 1e-5
    want_c = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert max_err(mha.attention(q, k, v, causal=True), want_c) < 1e-5


def test_gqa_equals_repeated_kv():
    torch.manual_seed(1)
    q = torch.randn(2, 8, 5, 16)
    k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 24)
    rep = lambda t: t.repeat_interleave(4, dim=1)  # (B, h_kv, Tk, d) -> (B, h, Tk, d)  # noqa: E731
    for b in ("reference", "math", "sdpa", None):
        got = mha.attention(q, k, v, backend=b)
        want = mha.attention(q, rep(k), rep(v), backend="reference")
        assert max_err(got, want) < 1e-5, b


def test_causal_is_bottom_right_aligned():
    assert causal_mask(2, 5).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert causal_mask(5, 2).int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("Tq, Tk, name, error", [(-1, 3, "Tq", ValueError), (3, -2, "Tk", ValueError),
                                                  (2.0, 3, "Tq", TypeError), (2, True, "Tk", TypeError)])
def test_causal_mask_refuses_bad_sizes(Tq, Tk, name, error):
    with pytest.raises(error, match=f"^{name} must be an int >= 0"):
        causal_mask(Tq, Tk)
    assert causal_mask(0, 3).shape == (0, 3)


def test_token_t_sees_1_to_t():
    """Seed 002: the output at t depends only on tokens 1..t (changing later ones changes nothing)."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    out = mha.attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4:] += 10
    v2[:, :, 4:] -= 10
    out2 = mha.attention(q, k2, v2, causal=True)
    assert torch.equal(out[:, :, :4], out2[:, :, :4])
    assert not torch.allclose(out[:, :, 4:], out2[:, :, 4:])
    # and row t is exactly single-head softmax over 1..t (seed 002's formula)
    t = 3
    s = (q[0, 0, t] @ k[0, 0, : t + 1].T) / math.sqrt(8)
    assert torch.allclose(out[0, 0, t], torch.softmax(s, -1) @ v[0, 0, : t + 1], atol=1e-6)


@pytest.mark.parametrize("backend", [b.name for b in all_backends() if b.caps.grad])
def test_fully_masked_rows_give_zeros_and_finite_grads(backend):
    torch.manual_seed(3)
    q = torch.randn(2, 2, 4, 16, requires_grad=True)
    k = torch.randn(2, 2, 6, 16, requires_grad=True)
    v = torch.randn(2, 2, 6, 16, requires_grad=True)
    mask = torch.ones(2, 1, 4, 6, dtype=torch.bool)
    mask[0, :, 1] = False  # batch 0, query row 1 sees nothing
    kl = torch.tensor([6, 0])  # batch 1 has no real keys at all
    call = make_call(q, k, v, mask=mask, key_lengths=kl)
    b = mha.backends.get(backend)
    if b.not_supported_reasons(call):
        pytest.skip(f"{backend} cannot serve this call: {b.not_supported_reasons(call)}")
    out = mha.attention(q, k, v, mask=mask, key_lengths=kl, backend=backend)
    assert (out[0, :, 1] == 0).all() and (out[1] == 0).all()
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[1] == 0).all() and (q.grad[0, :, 1] == 0).all()


@pytest.mark.parametrize("backend", [b.name for b in all_backends() if b.caps.grad])
def test_gradients_match_the_oracle(backend):
    torch.manual_seed(4)
    q = torch.randn(2, 4, 5, 16, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 16, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 24, dtype=torch.float64)
    if backend not in {vd.backend for vd in mha.explain(q, k, v, causal=True) if vd.ok}:
        q, k, v = q.float(), k.float(), v.float()
    reasons = mha.backends.get(backend).not_supported_reasons(make_call(q, k, v, causal=True))
    if reasons:
        pytest.skip(f"{backend} cannot serve this call: {reasons}")
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    g = torch.randn(2, 4, 5, 24, dtype=torch.float64)
    (mha.attention(*ins, causal=True, backend=backend) * g.to(q.dtype)).sum().backward()
    (oracle(*ref, allowed=causal_mask(5, 7))[0] * g).sum().backward()
    tol = 1e-9 if q.dtype == torch.float64 else 1e-4
    for a, r in zip(ins, ref, strict=True):
        assert max_err(a.grad, r.grad) < tol


@pytest.mark.parametrize("Tq, Tk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(Tq, Tk):
    q, k, v = torch.randn(2, 4, Tq, 8), torch.randn(2, 2, Tk, 8), torch.randn(2, 2, Tk, 6)
    out, w = mha.attention(q, k, v, return_weights=True, causal=True)
    assert out.shape == (2, 4, Tq, 6) and w.shape == (2, 4, Tq, Tk)
    assert (out == 0).all()


def test_scale_and_dropout():
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    a = mha.attention(q, k, v, scale=0.5, backend="math")
    b = mha.attention(q * 0.5 * math.sqrt(8), k, v, backend="math")
    assert max_err(a, b) < 1e-5
    torch.manual_seed(6)
    d1 = mha.attention(q, k, v, dropout_p=0.5, backend="math")
    assert not torch.allclose(d1, mha.attention(q, k, v, backend="math"))


def test_mask_spec_materialize_combines_with_and():
    kl = torch.tensor([2, 3])
    m = torch.tensor([[True, False, True]])
    spec = MaskSpec(causal=True, key_lengths=kl, mask=m)
    dense = spec.dense(2, 1, 3, 3)
    want = causal_mask(3, 3) & m & (torch.arange(3)[None, :] < kl[:, None, None])[:, None]
    assert torch.equal(dense, want.expand(2, 1, 3, 3))
    assert MaskSpec().materialize(2, 1, 3, 3) is None
