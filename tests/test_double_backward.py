"""Double backward (``torch.autograd.grad(..., create_graph=True)``, then a gradient of that
gradient: gradient penalties, Hessian-vector products) on every backend: the right answer
(``torch.autograd.gradgradcheck`` in float64) or an error, never a wrong number.

Shape legend: B batch, h / h_kv heads, T length, d head dim.
"""

from __future__ import annotations

import pytest
import torch

import mha


def _qkv(dtype, h=4, T=6, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, T, d, generator=g, dtype=dtype)  # (B, h, T, d)
    k, v = (torch.randn(1, h // 2, T, d, generator=g, dtype=dtype)  # (B, h_kv, T, d)
            for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["math", "reference", "blocksparse"])
def test_dense_backends_give_the_second_derivative(backend, causal):
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: mha.attention(q, k, v, causal=causal, backend=backend),
        _qkv(torch.float64, h=2, T=4, d=4))  # GQA, 64 inputs: one gradgrad each


@pytest.mark.parametrize("backend", ["sdpa", "flash_cpu"])
def test_other_backends_match_the_reference_or_refuse(backend):
    """sdpa in float32 is SDPA's own CPU kernel, whose backward has no derivative (torch's
    'derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not
    implemented'); flash_cpu refuses naming itself (tests/test_flash_bwd.py). Whichever
    answers must answer right."""
    def hvp(backend, dtype):
        q, k, v = _qkv(dtype)
        out = mha.attention(q, k, v, causal=True, backend=backend)
        dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return torch.autograd.grad(dq.square().sum(), (k, v))

    want = hvp("reference", torch.float64)
    try:
        got = hvp(backend, torch.float32)
    except RuntimeError as e:
        assert "not implemented" in str(e) or "double backward" in str(e), e
        return
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-4)
