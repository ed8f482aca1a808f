"""Bad score variants (softcap, sinks, bias, alibi_slopes) are refused at the boundary with an
error that names the argument — by mha.attention, mha.explain, varlen_attention and the decode
entry point alike — and a backend that cannot serve one says so.

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d head dim.
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha.ops.decode import flash_decode

B, H, TQ, TK, D = 2, 4, 3, 5, 8


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, TQ, D, generator=g), torch.randn(B, 2, TK, D, generator=g),
            torch.randn(B, 2, TK, D, generator=g))


BAD = [
    ("softcap", 0.0, ValueError),
    ("softcap", -1.0, ValueError),
    ("softcap", float("nan"), ValueError),
    ("softcap", float("inf"), ValueError),
    ("softcap", True, TypeError),
    ("softcap", "30", TypeError),
    ("softcap", torch.tensor(30.0), TypeError),
    ("sinks", torch.zeros(H + 1), ValueError),
    ("sinks", torch.zeros(1, H), ValueError),
    ("sinks", torch.zeros(H, dtype=torch.int64), TypeError),
    ("sinks", [0.0] * H, TypeError),
    ("sinks", torch.zeros(H, device="meta"), ValueError),
    ("bias", torch.zeros(TQ, TK + 1), ValueError),
    ("bias", torch.zeros(B, H + 1, TQ, TK), ValueError),
    ("bias", torch.zeros(1, B, H, TQ, TK), ValueError),
    ("bias", torch.zeros(TQ, TK, dtype=torch.bool), TypeError),
    ("bias", torch.zeros(TQ, TK, dtype=torch.int32), TypeError),
    ("bias", 0.5, TypeError),
    ("bias", torch.zeros(TQ, TK).to_sparse(), TypeError),
    ("alibi_slopes", torch.ones(H + 1), ValueError),
    ("alibi_slopes", torch.ones(B, H, 1), ValueError),
    ("alibi_slopes", torch.ones(B + 1, H), ValueError),
    ("alibi_slopes", torch.tensor([1.0, float("nan"), 1.0, 1.0]), ValueError),
    ("alibi_slopes", torch.ones(H, dtype=torch.int64), TypeError),
    ("alibi_slopes", [0.5] * H, TypeError),
]


@pytest.mark.parametrize("name,value,error", BAD,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_attention_and_explain_name_the_bad_argument(name, value, error):
    q, k, v = _qkv()
    for call in (mha.attention, mha.explain):
        with pytest.raises(error, match=name):
            call(q, k, v, **{name: value})


@pytest.mark.parametrize("name,value,error", BAD,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_the_decode_entry_point_names_the_bad_argument(name, value, error):
    q, k, v = _qkv()
    with torch.no_grad(), pytest.raises(error, match=name):
        flash_decode(q, k, v, **{name: value})


@pytest.mark.parametrize("name,value,error", [
    ("scale", float("nan"), ValueError), ("scale", float("inf"), ValueError),
    ("scale", -1.0, ValueError), ("scale", "0.5", TypeError), ("scale", True, TypeError),
    ("scale", torch.tensor(0.5), TypeError), ("causal", "yes", TypeError),
    ("causal", 1, TypeError), ("causal", None, TypeError), ("portable", "no", TypeError),
    ("portable", 1, TypeError)])
def test_the_decode_entry_point_checks_its_scalars_as_attention_does(name, value, error):
    q, k, v = _qkv()
    with torch.no_grad(), pytest.raises(error, match=f"^{name} must"):
        flash_decode(q, k, v, **{name: value})
    if name != "portable":  # mha.attention has no portable flag
        with pytest.raises(error, match=f"^{name} must"):
            mha.attention(q, k, v, **{name: value})


def test_varlen_refuses_bad_variants_by_name():
    q, k, v = torch.randn(6, H, D), torch.randn(6, 2, D), torch.randn(6, 2, D)
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match="softcap"):
        mha.varlen_attention(q, k, v, cu, softcap=-2.0)
    with pytest.raises(ValueError, match="sinks"):
        mha.varlen_attention(q, k, v, cu, sinks=torch.zeros(H - 1))
    with pytest.raises(ValueError, match="alibi_slopes"):
        mha.varlen_attention(q, k, v, cu, alibi_slopes=torch.ones(2, H))  # per head only
    with pytest.raises(TypeError, match="bias"):
        mha.varlen_attention(q, k, v, cu, bias=torch.zeros(6, 6))


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "8", None])
def test_alibi_slopes_helper_refuses_a_bad_head_count(n):
    with pytest.raises((TypeError, ValueError), match="n_heads"):
        mha.alibi_slopes(n)


def test_a_forced_backend_that_cannot_serve_a_variant_says_which():
    q, k, v = _qkv()
    with pytest.raises(mha.BackendError, match="softcap cannot be served"):
        mha.attention(q, k, v, softcap=5.0, backend="sdpa")
    with pytest.raises(mha.BackendError, match="sinks cannot be served"):
        mha.attention(q, k, v, sinks=torch.zeros(H), backend="sdpa")
    q16, k16, v16 = (torch.randn(1, H, 40, 16) for _ in range(3))  # past the decode kernel
    with pytest.raises(mha.BackendError, match="head dim 8 < 16"):
        mha.attention(q, k, v, softcap=5.0, backend="flash_cpu")
    assert mha.explain(q16, k16, v16, softcap=5.0, scale=0.0).chosen == "flash_cpu"


def test_a_refused_call_leaves_the_inputs_unchanged():
    q, k, v = _qkv()
    sinks = torch.zeros(H + 1)
    before = [t.clone() for t in (q, k, v, sinks)]
    with pytest.raises(ValueError):
        mha.attention(q, k, v, sinks=sinks, bias=torch.zeros(TQ, TK))
    for t, b in zip((q, k, v, sinks), before, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize("backend", [None, *mha.backends.ORDER])
@pytest.mark.parametrize("q_grad", [False, True])
def test_alibi_slopes_that_require_grad_get_their_gradient_or_a_refusal(backend, q_grad):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, TQ, 16, generator=g).requires_grad_(q_grad)  # (B, h, Tq, d)
    k, v = (torch.randn(B, 2, TK, 16, generator=g) for _ in range(2))  # (B, h_kv, Tk, d)
    slopes = torch.linspace(0.1, 0.9, H).requires_grad_()  # (h,)
    try:
        out = mha.attention(q, k, v, causal=True, alibi_slopes=slopes, backend=backend)
    except mha.BackendError as e:
        assert backend is not None, "the default dispatch found no backend"
        assert "alibi" in str(e)
        return
    out.sum().backward()
    want = slopes.detach().double().requires_grad_()
    mha.attention(q.detach().double(), k.double(), v.double(), causal=True, alibi_slopes=want,
                  backend="reference").sum().backward()
    assert slopes.grad is not None, "the slopes' gradient was dropped"
    torch.testing.assert_close(slopes.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["sinks", "bias", "alibi_slopes"])
def test_the_decode_entry_point_refuses_variants_that_require_grad(name):
    q, k, v = _qkv()
    value = {"sinks": torch.zeros(H), "bias": torch.zeros(TQ, TK),
             "alibi_slopes": torch.linspace(0.1, 0.9, H)}[name].requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only .*" + name):
        flash_decode(q, k, v, **{name: value})
    with torch.no_grad():  # no gradient asked for: served
        assert flash_decode(q, k, v, **{name: value}).shape == (B, H, TQ, D)
