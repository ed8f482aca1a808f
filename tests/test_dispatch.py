"""Dispatch: capabilities as data, verdicts in words, forced backends checked alike."""

from __future__ import annotations

import pytest
import torch

import mha
from mha import backends
from mha.functional import make_call


def test_explain_lists_every_backend_in_order_with_one_chosen():
    q = torch.randn(1, 2, 3, 8)
    ex = mha.explain(q, q, q, return_weights=True)
    assert [v.backend for v in ex] == list(backends.ORDER)
    assert sum(v.chosen for v in ex) == 1
    assert ex.chosen == "math"  # the first backend that can return weights
    sdpa = next(v for v in ex if v.backend == "sdpa")
    assert "cannot return attention weights" in sdpa.reasons
    assert "sdpa" in str(ex) and "rejected" in str(ex)


def test_auto_dispatch_runs_the_chosen_backend(monkeypatch):
    q = torch.randn(1, 2, 3, 8)
    chosen = mha.explain(q, q, q).chosen
    seen = []
    b = backends.get(chosen)
    real = b.forward
    monkeypatch.setattr(b, "forward", lambda call: seen.append(call) or real(call))
    mha.attention(q, q, q)
    assert len(seen) == 1


def test_reasons_come_from_the_capability_table():
    b = backends.get("sdpa")
    call = make_call(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8),
                     return_weights=True, dropout_p=0.1)
    assert b.not_supported_reasons(call) == ["cannot return attention weights"]


def test_no_backend_error_lists_each_backends_reasons(monkeypatch):
    q = torch.randn(1, 2, 3, 8)
    for b in backends.all_backends():
        monkeypatch.setattr(b, "extra_reasons", lambda call, n=b.name: [f"{n} says no"])
    with pytest.raises(mha.BackendError) as e:
        mha.attention(q, q, q)
    for name in backends.ORDER:
        assert name in str(e.value)


@pytest.mark.parametrize("portable", [True, False])
def test_portable_kernel_defers_large_calls_to_sdpa(monkeypatch, portable):
    """On a CPU without AVX-512 (the kernel's portable loops) flash_cpu can serve but leaves
    large calls sdpa runs without a (Tq, Tk) mask to sdpa; forcing it still works."""
    import mha.backends.flash_cpu as fc

    if fc.BACKEND.unavailable():
        pytest.skip(f"flash_cpu cannot run here: {fc.BACKEND.unavailable()}")
    monkeypatch.setattr(fc, "_portable", lambda dtype: portable)
    q = torch.randn(1, 1, fc.PORTABLE_MIN_TK, 16)
    ex = mha.explain(q, q, q, causal=True)
    flash = next(v for v in ex if v.backend == "flash_cpu")
    assert flash.ok
    if portable:
        assert ex.chosen == "sdpa" and "portable loops" in flash.defers
        assert "defers" in str(ex)
    else:
        assert ex.chosen == "flash_cpu" and flash.defers is None
    forced = mha.attention(q, q, q, causal=True, backend="flash_cpu")
    torch.testing.assert_close(forced, mha.attention(q, q, q, causal=True, backend="math"))
    # where the portable loops measured faster, flash_cpu keeps the call
    small = q[:, :, :64]
    assert mha.explain(small, small, small, causal=True).chosen == "flash_cpu"
    assert mha.explain(q, q, q, causal=True, window=64).chosen == "flash_cpu"
    qb = q.bfloat16().requires_grad_()
    assert mha.explain(qb, qb, qb, causal=True).chosen == "flash_cpu"


def test_when_every_capable_backend_defers_the_first_one_runs(monkeypatch):
    q = torch.randn(1, 2, 3, 8)
    for b in backends.all_backends():
        monkeypatch.setattr(b, "defers", lambda call: "slower here")
    ex = mha.explain(q, q, q)
    first_ok = next(v.backend for v in ex if v.ok)
    assert ex.chosen == first_ok
    assert mha.dispatch.choose(make_call(q, q, q)).name == first_ok



def test_use_backend_forces_calls_without_a_backend_and_restores():
    from mha import dispatch

    q = torch.randn(1, 2, 5, 16)
    capped = dict(softcap=5.0)  # math serves it; sdpa cannot
    mha.attention(q, q, q, **capped)
    with mha.use_backend("sdpa"):
        with pytest.raises(mha.BackendError, match="backend='sdpa'"):
            mha.attention(q, q, q, **capped)
        with mha.use_backend("math"):  # nested: the inner choice
            torch.testing.assert_close(mha.attention(q, q, q, **capped),
                                       mha.attention(q, q, q, backend="math", **capped))
        with pytest.raises(mha.BackendError, match="backend='sdpa'"):  # the outer one is back
            mha.attention(q, q, q, **capped)
        assert torch.equal(mha.attention(q, q, q, backend="math", **capped),
                           mha.attention(q, q, q, backend="math", **capped))  # explicit wins
    assert dispatch._preferred is None
    with pytest.raises(RuntimeError), mha.use_backend("math"):
        raise RuntimeError("the block fails")
    assert dispatch._preferred is None  # restored after an exception too
    with pytest.raises(ValueError, match="unknown backend 'nope'"), mha.use_backend("nope"):
        pass
