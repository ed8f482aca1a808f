"""Fuzzing every backend as a hostile user would: shapes (0-size included), strides, dtypes,
head dims, masks, windows, gradients, weights, dropout and non-finite values, all drawn by
hypothesis. Each backend, forced, must either agree with the float64 oracle or refuse with a
:class:`mha.BackendError` giving the very reasons ``mha.explain`` gives — never crash, never a
wrong answer.

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d_k / d_v head dims.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import mha
from mha.backends import ORDER
from mha.functional import make_call

from oracle import FLOOR, assert_within_budget, max_err, naive, oracle, rule_oracle

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _tensor(draw, g, B, H, T, d, dtype):
    """``(B, H, T, d)`` in one of the layouts users hand in."""
    layout = draw(st.sampled_from(["contiguous", "bthd", "strided", "broadcast_batch"]))
    if layout == "bthd":  # a view of the module's (B, T, H, d)
        return torch.randn(B, T, H, d, generator=g).to(dtype).transpose(1, 2)
    if layout == "strided":  # last-dim stride 2
        return torch.randn(B, H, T, 2 * d, generator=g).to(dtype)[..., ::2]
    if layout == "broadcast_batch":  # stride 0 over the batch
        return torch.randn(1, H, T, d, generator=g).to(dtype).expand(B, H, T, d)
    return torch.randn(B, H, T, d, generator=g).to(dtype)


HEAD_DIMS = (1, 8, 16, 33, 64, 128, 300)
SERVED_DIMS = (16, 32, 48, 64)  # dims every backend serves: the draws that reach the kernels


@st.composite
def calls(draw, dtypes=DTYPES, dims=HEAD_DIMS):
    """(q, k, v, kwargs): one attention call of any shape, layout, dtype and masking."""
    dtype = draw(st.sampled_from(dtypes))
    B = draw(st.integers(0, 2) if draw(st.integers(0, 9)) == 0 else st.integers(1, 2))
    h_kv = draw(st.integers(1, 3))
    h = h_kv * draw(st.integers(1, 3))
    Tq = draw(st.sampled_from([0, 1, 2, 5, 17, 40]))
    Tk = draw(st.sampled_from([0, 1, 3, 16, 33, 80]))
    d_k = draw(st.sampled_from(dims))
    d_v = draw(st.sampled_from([d_k, *dims[-2:]]) if dims is SERVED_DIMS
               else st.sampled_from([d_k, 8, 48, 260]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = _tensor(draw, g, B, h, Tq, d_k, dtype)
    k = _tensor(draw, g, B, h_kv, Tk, d_k, dtype)
    v = _tensor(draw, g, B, h_kv, Tk, d_v, dtype)
    kw: dict = {}
    if draw(st.booleans()):
        kw["causal"] = True
        if draw(st.booleans()):
            kw["window"] = draw(st.integers(1, 40))
    if draw(st.booleans()):
        kw["key_lengths"] = torch.randint(0, Tk + 1, (B,), generator=g)
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(B, h, Tq, Tk), (B, 1, Tq, Tk), (Tq, Tk), (B, 1, 1, Tk),
                                      (1, h, Tq, 1)]))
        kw["mask"] = torch.rand(shape, generator=g) > draw(st.sampled_from([0.1, 0.5, 0.9]))
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.01, 2.0))
    if draw(st.integers(0, 4)) == 0:
        kw["return_weights"] = True
    return q, k, v, kw


def _verdicts(q, k, v, kw):
    return {vd.backend: vd for vd in mha.explain(q, k, v, **kw)}


def _allowed(q, k, v, kw):
    call = make_call(q, k, v, **{n: a for n, a in kw.items() if n != "return_weights"})
    return call.masks.materialize(call.B, call.h, call.Tq, call.Tk)


def _forced(backend, q, k, v, kw):
    """Force ``backend``: its result, or the BackendError's text when it refuses."""
    try:
        return mha.attention(q, k, v, backend=backend, **kw), None
    except mha.BackendError as e:
        return None, str(e)


@pytest.mark.parametrize("backend", ORDER)
@settings(max_examples=60)
@given(problem=calls())
def test_every_backend_agrees_with_float64_or_refuses_as_explain_says(backend, problem):
    q, k, v, kw = problem
    verdict = _verdicts(q, k, v, kw)[backend]
    with torch.no_grad():
        result, refusal = _forced(backend, q, k, v, kw)
    if q.numel() == 0 or k.numel() == 0 or q.shape[0] == 0:
        assert refusal is None, "empty inputs are answered before dispatch"
    elif not verdict.ok:
        event("refused")
        assert refusal is not None, f"{backend} ran although explain said: {verdict.reasons}"
        for reason in verdict.reasons:
            assert reason in refusal
        return
    else:
        assert refusal is None, f"explain said {backend} can serve, but it refused: {refusal}"
    event(f"served {str(q.dtype)[6:]}")
    out, weights = result if kw.get("return_weights") else (result, None)
    B, h, Tq, _ = q.shape
    assert out.shape == (B, h, Tq, v.shape[3]) and out.dtype == q.dtype
    allowed = _allowed(q, k, v, kw)
    # 4x rather than the usual 2x: with scale up to 2 and d_k up to 300 the softmax is peaky,
    # and the naive per-head loop's own summation order can be ~2x lucky on a single draw
    assert_within_budget(out, q, k, v, allowed, kw.get("scale"), factor=4)
    if weights is not None:
        assert_within_budget(weights, q, k, v, allowed, kw.get("scale"), index=1,
                             what="weights", factor=4)


@pytest.mark.parametrize("backend", ORDER)
@settings(max_examples=25)
@given(problem=calls(dtypes=(torch.float32, torch.float64), dims=SERVED_DIMS),
       seed=st.integers(0, 2**16))
def test_gradients_agree_with_float64_or_the_backend_refuses(backend, problem, seed):
    q, k, v, kw = problem
    kw.pop("return_weights", None)
    if q.numel() == 0 or k.numel() == 0:
        return  # answered before dispatch (low-precision gradients: test_flash_bwd's rule)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    verdict = _verdicts(*leaves, kw)[backend]
    result, refusal = _forced(backend, *leaves, kw)
    if not verdict.ok:
        assert refusal is not None and all(r in refusal for r in verdict.reasons)
        return
    assert refusal is None, refusal
    event("gradients compared")
    gy = torch.randn(result.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype)
    got = torch.autograd.grad((result * gy).sum(), leaves, allow_unused=True)
    allowed = _allowed(q, k, v, kw)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((oracle(*ref_in, allowed, kw.get("scale"))[0]
                                * gy.double()).sum(), ref_in, allow_unused=True)
    low_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low = torch.autograd.grad((naive(*low_in, allowed, kw.get("scale"))[0] * gy).sum(),
                              low_in, allow_unused=True)
    for name, a, w, n in zip("qkv", got, want, low, strict=True):
        a = torch.zeros_like(w) if a is None else a
        w = torch.zeros_like(a, dtype=torch.float64) if w is None else w
        n = torch.zeros_like(a) if n is None else n
        # the floor scales with the gradient's size: dS = P (dP - rowsum(dO O)) cancels, and
        # that rounding no summation order avoids (tests/test_flash_bwd.py states it exactly)
        scale_of = max(1.0, w.abs().max().item(), (gy.double().abs().sum(-1)).max().item())
        budget = 4 * max_err(n, w) + 10 * FLOOR[q.dtype] * scale_of
        assert max_err(a, w) <= budget, f"d{name}: {max_err(a, w):.2e} > {budget:.2e}"


@pytest.mark.parametrize("backend", ORDER)
@settings(max_examples=30)
@given(problem=calls(dtypes=(torch.float32, torch.bfloat16), dims=SERVED_DIMS),
       where=st.sampled_from("qkv"), value=st.sampled_from(
    [float("nan"), float("inf"), -float("inf")]), spot=st.integers(0, 2**16))
def test_nonfinite_inputs_follow_the_rule_on_every_backend(backend, problem, where, value,
                                                           spot):
    q, k, v, kw = problem
    kw.pop("return_weights", None)
    kw.pop("scale", None)
    q, k, v = (t.contiguous().clone() for t in (q, k, v))
    t = {"q": q, "k": k, "v": v}[where]
    if t.numel() == 0 or q.numel() == 0:
        return
    t.view(-1)[spot % t.numel()] = value
    if not _verdicts(q, k, v, kw)[backend].ok:
        return  # refusals are the first test's business
    event(f"served, {where}")
    with torch.no_grad():
        out = mha.attention(q, k, v, backend=backend, **kw)
    ref = rule_oracle(q, k, v, _allowed(q, k, v, kw))
    assert torch.equal(out.isnan(), ref.isnan()), f"NaN pattern differs ({where}={value})"
    assert torch.equal(out.isfinite(), ref.isfinite()), f"Inf pattern differs ({where}={value})"
    fin = ref.isfinite()
    if fin.any():  # the error scale: the same call on the inputs with the bad value zeroed
        clean = [x.masked_fill(~x.isfinite(), 0) for x in (q, k, v)]
        allowed = _allowed(q, k, v, kw)
        tol = 8 * max_err(naive(*clean, allowed)[0], oracle(*clean, allowed)[0])
        assert max_err(out[fin], ref[fin]) <= tol + 10 * FLOOR[q.dtype]
