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
