"""Dispatch's cache of capability-table verdicts (``Backend.rejects``, keyed by
``AttentionCall.signature``): every input that changes a decision changes the choice, the same
as the uncached verdicts of ``mha.explain``; validation still runs on every call."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import mha
from mha import backends, dispatch
from mha.functional import make_call

SHAPE = (1, 2, 4, 32)  # (B, h, Tq, d): small enough for every backend


def _qkv(shape=SHAPE, dtype=torch.float32, grad=False, kv_heads=None, Tk=None, d=None):
    B, h, Tq, dq = shape
    d = d or dq
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, h, Tq, d, generator=g).to(dtype).requires_grad_(grad)
    kv = (B, kv_heads or h, Tk or Tq, d)
    k, v = (torch.randn(kv, generator=g).to(dtype).requires_grad_(grad) for _ in range(2))
    return q, k, v


def _chosen(q, k, v, **kw) -> str:
    """The backend ``mha.attention`` would run (cached path), checked against ``mha.explain``'s
    uncached verdicts."""
    got = dispatch.choose(make_call(q, k, v, **kw)).name
    assert got == mha.explain(q, k, v, **kw).chosen
    return got


def _flash_ready() -> bool:
    return (backends.get("flash_cpu").unavailable() is None
            and backends.get("flash_decode").unavailable() is None)


def _grid_calls():
    """Calls over a product of every input the capability tables read (dtype, grad, mask
    kinds, score variants and score_mod, what is returned, dropout, head dims d_k / d_v,
    grouped heads) and two query lengths (read by a backend's own check)."""
    slopes = mha.alibi_slopes(2)
    for dtype, grad, masks, variant, ret, dropout, (d_k, d_v), kv_heads, Tq in itertools.product(
            (torch.float32, torch.bfloat16, torch.float64), (False, True),
            ("none", "window", "mask"), ("none", "alibi", "alibi_grad", "softcap", "score_mod"),
            ("out", "weights", "lse"), (0.0, 0.1), ((8, 8), (32, 32), (32, 300), (32, 8)),
            (2, 1), (1, 17)):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, Tq, d_k, generator=g).to(dtype).requires_grad_(grad)
        k = torch.randn(1, kv_heads, 20, d_k, generator=g).to(dtype).requires_grad_(grad)
        v = torch.randn(1, kv_heads, 20, d_v, generator=g).to(dtype).requires_grad_(grad)
        kw = {"causal": masks == "window", "window": 3 if masks == "window" else None,
              "mask": torch.ones(Tq, 20, dtype=torch.bool) if masks == "mask" else None,
              "dropout_p": dropout, "return_weights": ret == "weights",
              "return_lse": ret == "lse"}
        if variant.startswith("alibi"):
            kw["alibi_slopes"] = slopes.clone().requires_grad_(variant == "alibi_grad")
        if variant == "softcap":
            kw["softcap"] = 5.0
        if variant == "score_mod":
            kw["score_mod"] = lambda s, b, h, i, j: s
        yield make_call(q, k, v, **kw)


@pytest.mark.parametrize("tables", ["shipped", "every limit"])
def test_cached_verdicts_equal_fresh_reasons_over_a_grid_of_calls(monkeypatch, tables):
    """Each call's cached verdict (possibly filled by another call with the same signature)
    equals its own fresh reasons, for every backend: the signature holds everything the
    capability table reads. "every limit": math's table also limits what no shipped table
    does (grouped heads, d_v != d_k)."""
    if tables == "every limit":
        b = backends.get("math")
        monkeypatch.setattr(b, "caps", dataclasses.replace(
            b.caps, dtypes=frozenset({torch.float32}), mask_kinds=frozenset({"mask"}),
            min_head_dim=16, max_head_dim=64, gqa=False, different_v_dim=False, dropout=False,
            weights=False, lse=False, grad=False, variants=frozenset({"alibi"}),
            alibi_grad=False))
    calls = list(_grid_calls())
    for call in calls + calls[::-1]:  # the second pass reads what the first one cached
        for b in backends.all_backends():
            assert b.rejects(call, call.signature()) == bool(b.not_supported_reasons(call)), (
                b.name, call.describe())


def test_choice_follows_each_input_that_decides_it():
    if not _flash_ready():
        pytest.skip("the native kernels are not available here")
    q, k, v = _qkv()
    base = _chosen(q, k, v)
    assert base == "flash_decode"  # Tq <= 16, inference
    # dtype: float64 runs on no native kernel
    assert _chosen(*(t.double() for t in (q, k, v))) == "sdpa"
    # requires_grad: flash_decode has no backward; grad mode off makes it inference again
    qg, kg, vg = _qkv(grad=True)
    assert _chosen(qg, kg, vg) == "flash_cpu"
    with torch.no_grad():
        assert _chosen(qg, kg, vg) == "flash_decode"
    # a mask kind flash_decode lacks (window), and what is returned
    assert _chosen(q, k, v, causal=True, window=2) == "flash_cpu"
    assert _chosen(q, k, v, return_lse=True) == "flash_cpu"
    assert _chosen(q, k, v, return_weights=True) == "math"
    assert _chosen(q, k, v, dropout_p=0.1) == "sdpa"
    # head dims: flash_cpu needs 16 <= d <= 256 (asked with grad, past flash_decode)
    assert _chosen(*_qkv(grad=True, d=8)) == "sdpa"
    assert _chosen(*_qkv(grad=True, d=16)) == "flash_cpu"
    # sizes the table does not read still decide: Tq > 16 is not a decoding step
    assert _chosen(*_qkv((1, 2, 17, 32))) == "flash_cpu"
    # ALiBi slopes that require grad: the kernels read them as constants
    slopes = mha.alibi_slopes(2)
    assert _chosen(q, k, v, alibi_slopes=slopes) == "flash_decode"
    assert _chosen(qg, kg, vg, alibi_slopes=slopes.clone().requires_grad_()) == "sdpa"
    assert _chosen(q, k, v) == base  # and back


def test_device_in_the_signature():
    q, k, v = _qkv()
    _chosen(q, k, v)
    meta = [t.to("meta") for t in (q, k, v)]
    with pytest.raises(mha.BackendError, match="no backend can serve"):
        dispatch.choose(make_call(*meta))
    assert dispatch.choose(make_call(q, k, v)).name == mha.explain(q, k, v).chosen


def test_forced_backend_and_use_backend_follow():
    q, k, v = _qkv()
    auto = _chosen(q, k, v)
    assert dispatch.choose(make_call(q, k, v), "math").name == "math"
    with mha.use_backend("reference"):
        assert dispatch.choose(make_call(q, k, v)).name == "reference"
        with pytest.raises(mha.BackendError, match="backend='reference' cannot serve"):
            dispatch.choose(make_call(q, k, v, dropout_p=0.1, return_lse=True, score_mod=lambda
                                      s, b, h, i, j: s))
    with pytest.raises(mha.BackendError, match=r"backend='sdpa' cannot serve .*softcap"):
        mha.attention(q, k, v, softcap=5.0, backend="sdpa")
    assert dispatch.choose(make_call(q, k, v)).name == auto


def test_replaced_capabilities_drop_the_cached_verdicts(monkeypatch):
    q, k, v = _qkv()
    first = _chosen(q, k, v)
    b = backends.get(first)
    monkeypatch.setattr(b, "caps", dataclasses.replace(b.caps, dtypes=frozenset({torch.float64})))
    assert _chosen(q, k, v) != first
    monkeypatch.undo()
    assert _chosen(q, k, v) == first


def test_backend_hooks_are_asked_every_call(monkeypatch):
    """unavailable / extra_reasons / defers are not cached: a change shows at the next call."""
    q, k, v = _qkv()
    first = _chosen(q, k, v)
    b = backends.get(first)
    monkeypatch.setattr(b, "extra_reasons", lambda call: ["says no (test)"])
    assert _chosen(q, k, v) != first
    monkeypatch.undo()
    monkeypatch.setattr(b, "unavailable", lambda: "gone (test)")
    assert _chosen(q, k, v) != first
    monkeypatch.undo()
    monkeypatch.setattr(b, "defers", lambda call: "slower here (test)")
    assert _chosen(q, k, v) != first
    monkeypatch.undo()
    assert _chosen(q, k, v) == first


def test_validation_runs_on_every_call_after_a_cached_one():
    q, k, v = _qkv()
    mha.attention(q, k, v, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        mha.attention(q, k, v, mask=torch.ones(4, 4))
    with pytest.raises(ValueError, match="not broadcastable"):
        mha.attention(q, k, v, mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p must lie in"):
        mha.attention(q, k, v, dropout_p=float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        mha.attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        mha.attention(q, k.double(), v)
    with pytest.raises(ValueError, match="h_kv"):
        mha.attention(q, *_qkv(kv_heads=3, shape=(1, 3, 4, 32))[1:])
