"""NaN and Inf on every backend: the rule of :mod:`mha.nonfinite` (README, "Guarantees").

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d_k / d_v head dims.

1. A NaN / Inf a row may attend reaches that row (non-finite where the float64 rule oracle is).
2. A NaN / Inf a row may not attend (mask, causal, window, key_lengths) never reaches it.
3. Rows that may attend nothing are zeros, whatever their query holds.
Each backend that ``mha.explain`` says can serve a call is forced in turn, so a backend dispatch
would pick and one it would not are held to the same answer.
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha.functional import make_call

from oracle import rule_oracle

NAN, INF = float("nan"), float("inf")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _serving(q, k, v, **kw):
    """The backends mha.explain says can serve this call."""
    return [vd.backend for vd in mha.explain(q, k, v, **kw) if vd.ok]


def _allowed(q, k, v, kw):
    call = make_call(q, k, v, **kw)
    return call.masks.materialize(call.B, call.h, call.Tq, call.Tk)


def _check(out, ref, dtype, what):
    assert torch.equal(out.isnan(), ref.isnan()), f"{what}: NaN pattern differs from the rule"
    assert torch.equal(out.isfinite(), ref.isfinite()), f"{what}: Inf pattern differs"
    fin = ref.isfinite()
    torch.testing.assert_close(out.double()[fin], ref[fin], **TOL[dtype], msg=what)


def _problem(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, Tq, d_k, generator=g).to(dtype),
            torch.randn(B, h_kv, Tk, d_k, generator=g).to(dtype),
            torch.randn(B, h_kv, Tk, d_v, generator=g).to(dtype))


SHAPES = [  # (B, h, h_kv, Tq, Tk, d_k, d_v): small path, tiled path, GQA, d_v != d_k, decode
    (2, 4, 2, 9, 9, 16, 16),
    (1, 2, 1, 33, 67, 32, 48),
    (1, 2, 2, 1, 200, 64, 64),
]
MASKS = [
    dict(),
    dict(causal=True),
    dict(causal=True, window=3),
    dict(key_lengths="half"),
    dict(mask="random"),
]
PLACES = [("q", 0), ("k", 0), ("k", -1), ("v", 0), ("v", -1), ("k", "mid"), ("v", "mid")]


def _kwargs(spec, B, Tq, Tk, seed):
    kw = dict(spec)
    if kw.get("key_lengths") == "half":
        kw["key_lengths"] = torch.tensor([max(1, Tk // 2), Tk][:B] + [Tk] * (B - 2))[:B]
    if kw.get("mask") == "random":
        g = torch.Generator().manual_seed(seed)
        kw["mask"] = torch.rand(B, 1, Tq, Tk, generator=g) > 0.4
    return kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("spec", MASKS, ids=lambda s: ",".join(s) or "nomask")
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_nonfinite_follows_the_rule_on_every_backend(dtype, shape, spec, value):
    B, h, h_kv, Tq, Tk, d_k, d_v = shape
    for n, (name, pos) in enumerate(PLACES):
        q, k, v = _problem(*shape, dtype, seed=n)
        t = {"q": q, "k": k, "v": v}[name]
        row = {0: 0, -1: t.shape[2] - 1, "mid": t.shape[2] // 2}[pos]
        t[0, 0, row, 1] = value
        kw = _kwargs(spec, B, Tq, Tk, seed=n)
        ref = rule_oracle(q, k, v, _allowed(q, k, v, kw))
        for backend in _serving(q, k, v, **kw):
            with torch.no_grad():
                out = mha.attention(q, k, v, backend=backend, **kw)
            _check(out, ref, dtype, f"{backend}, {value} in {name}[{row}], {spec}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["key_lengths", "mask_column", "mask_rows_empty"])
def test_unreadable_nonfinite_keys_leave_outputs_and_gradients_finite(dtype, how):
    """NaN/Inf at keys no query row may attend: every output and every gradient stays finite,
    equal to the same call with those keys zeroed (they are never read); fully masked rows
    with a NaN query are zeros with zero gradient."""
    B, h, h_kv, Tq, Tk, d_k, d_v = 2, 4, 2, 33, 70, 32, 32
    q, k, v = _problem(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, seed=3)
    kw: dict = {}
    bad_keys = slice(50, 70)
    if how == "key_lengths":
        kw["key_lengths"] = torch.tensor([50, 50])
    else:
        mask = torch.ones(B, 1, Tq, Tk, dtype=torch.bool)
        mask[..., bad_keys] = False
        if how == "mask_rows_empty":
            mask[:, :, 5] = False  # query row 5 sees nothing
            q[:, :, 5] = NAN
        kw["mask"] = mask
    clean_k, clean_v = k.clone(), v.clone()
    k[:, :, bad_keys] = NAN
    v[:, :, bad_keys] = INF
    clean_q = q.nan_to_num(0.0)
    for backend in _serving(q, k, v, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grad_ok = any(vd.ok and vd.backend == backend
                      for vd in mha.explain(*leaves, **kw))
        if not grad_ok:
            continue  # e.g. flash_decode: inference only (its no-grad run is checked above)
        out = mha.attention(*leaves, backend=backend, **kw)
        ref_leaves = [t.clone().requires_grad_() for t in (clean_q, clean_k, clean_v)]
        ref = mha.attention(*ref_leaves, backend=backend, **kw)
        assert out.isfinite().all(), f"{backend}: an unreadable NaN reached the output"
        torch.testing.assert_close(out, ref, **TOL[dtype])
        gy = torch.randn_like(out)
        (out * gy).sum().backward()
        (ref * gy).sum().backward()
        for name, a, b in zip("qkv", leaves, ref_leaves, strict=True):
            assert a.grad.isfinite().all(), f"{backend}: d{name} has NaN/Inf"
            torch.testing.assert_close(a.grad, b.grad, **TOL[dtype],
                                       msg=f"{backend}: d{name}")
        assert (leaves[1].grad[:, :, bad_keys] == 0).all(), f"{backend}: dk at unread keys"
        if how == "mask_rows_empty":
            assert (out[:, :, 5] == 0).all() and (leaves[0].grad[:, :, 5] == 0).all()


def test_sdpa_leaks_where_mha_does_not():
    """The case that makes the rule necessary: SDPA's own causal kernel lets a NaN in the last
    value row reach rows that may not attend it; every mha backend keeps those rows finite."""
    q, k, v = _problem(1, 1, 1, 64, 64, 64, 64, torch.float32, seed=0)
    v[0, 0, -1] = NAN
    leaked = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for backend in _serving(q, k, v, causal=True):
        with torch.no_grad():
            out = mha.attention(q, k, v, causal=True, backend=backend)
        assert out[0, 0, :-1].isfinite().all(), backend
        assert out[0, 0, -1].isnan().all(), backend
    # documents why: if SDPA ever stops leaking, this line says so and can go
    assert leaked[0, 0, :-1].isnan().any()
