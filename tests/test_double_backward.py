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


# The backends without a second derivative, and the refusal each gives (its message).
REFUSALS = {
    # SDPA's own CPU kernel in float32: its backward has no derivative in torch
    "sdpa": "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not "
            "implemented",
    # the native kernel refuses naming itself (tests/test_flash_bwd.py)
    "flash_cpu": r"double backward .* is not supported by the native kernel \(backend \"flash_cpu\"\)",
}


@pytest.mark.parametrize("backend", sorted(REFUSALS))
def test_other_backends_refuse_by_name(backend):
    """A gradient of the gradients through these backends raises the backend's own refusal
    rather than returning a wrong second derivative."""
    q, k, v = _qkv(torch.float32)
    out = mha.attention(q, k, v, causal=True, backend=backend)
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=REFUSALS[backend]):
        torch.autograd.grad(dq.square().sum(), (k, v))
