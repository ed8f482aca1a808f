"""torch.compile(fullgraph=True) over mha: the dispatcher, both native kernels (their fake
twins), the module and the backward trace without graph breaks and give the eager numbers.

Shape legend: B batch, h heads, T length, d head dim.
"""

from __future__ import annotations

import pytest
import torch

import mha


def test_fullgraph_attention_decode_and_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 40, 32) for _ in range(3))  # (B, h, T, d)
    f = torch.compile(lambda q, k, v: mha.attention(q, k, v, causal=True), fullgraph=True)
    torch.testing.assert_close(f(q, k, v), mha.attention(q, k, v, causal=True))
    step = torch.randn(1, 4, 1, 32)  # one decode step: the flash_decode kernel
    with torch.no_grad():
        torch.testing.assert_close(f(step, k, v), mha.attention(step, k, v, causal=True))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    f(*leaves).square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    mha.attention(*ref, causal=True).square().sum().backward()
    for a, b in zip(leaves, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_fullgraph_module():
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(64, 4).eval()
    x = torch.randn(2, 33, 64)  # (B, T, d_model)
    compiled = torch.compile(m, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, causal=True), m(x, causal=True))


def test_fullgraph_with_dynamic_shapes():
    """dynamic=True makes Python floats symbolic too: the boundary's checks of scale and
    dropout_p must trace (math.isfinite on a symbolic float was a graph break, so fullgraph
    raised torch._dynamo's Unsupported)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 33, 32)  # (B, h, Tq, d)
    k, v = torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)  # (B, h_kv, Tk, d)

    def f(q, k, v):
        return mha.attention(q, k, v, causal=True, scale=0.3)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))
    m = mha.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 16, 32)  # (B, T, d_model)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, fullgraph=True, dynamic=True)(x), m(x))


def test_fullgraph_with_tensors_whose_values_are_checked():
    """key_lengths and alibi_slopes are checked by value; a trace cannot branch on values, so
    under torch.compile the check runs with the compiled code (a RuntimeError naming the
    argument) instead of raising torch's 'Could not guard on data-dependent expression' while
    tracing, as it did."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 32) for _ in range(3))  # (B, h, T, d)

    def f(q, k, v, key_lengths, slopes):
        return mha.attention(q, k, v, causal=True, key_lengths=key_lengths, alibi_slopes=slopes)

    compiled = torch.compile(f, fullgraph=True)
    slopes = mha.alibi_slopes(4)  # (h,)
    for lengths in ([10, 40], [0, 33]):
        kl = torch.tensor(lengths)  # (B,)
        torch.testing.assert_close(compiled(q, k, v, kl, slopes), f(q, k, v, kl, slopes))
    with pytest.raises(RuntimeError, match=r"key_lengths must lie in \[0, Tk=40\]"):
        compiled(q, k, v, torch.tensor([41, 3]), slopes)
    with pytest.raises(RuntimeError, match="alibi_slopes must be finite"):
        compiled(q, k, v, torch.tensor([4, 3]), slopes * float("nan"))
    m = mha.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 16, 32)  # (B, T, d_model)
    kl = torch.tensor([5, 16])  # (B,)
    with torch.no_grad():
        torch.testing.assert_close(
            torch.compile(lambda x, kl: m(x, key_lengths=kl), fullgraph=True)(x, kl),
            m(x, key_lengths=kl))
