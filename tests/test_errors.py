"""Every bad input gets a clear error naming the argument and the expected shape."""

from __future__ import annotations

import pytest
import torch

import mha

q = torch.randn(2, 4, 5, 8)
k = torch.randn(2, 2, 6, 8)
v = torch.randn(2, 2, 6, 3)


@pytest.mark.parametrize("args, kwargs, exc, pattern", [
    ((q[0], k, v), {}, ValueError, r"q must have shape \(B, h, Tq, d_k\) \(4 dims\), got \(4, 5, 8\)"),
    ((q, k[0], v), {}, ValueError, r"k must have shape \(B, h_kv, Tk, d_k\)"),
    (([1.0], k, v), {}, TypeError, r"q must be a torch.Tensor of shape \(B, h, Tq, d_k\), got list"),
    ((q.int(), k, v), {}, TypeError, r"q must be a floating tensor"),
    ((q, k.double(), v), {}, TypeError, r"q, k, v must share one dtype, got q=torch.float32, k=torch.float64"),
    ((q, k[:1], v), {}, ValueError, r"must share the batch size B"),
    ((q, k[..., :4], v), {}, ValueError, r"k must have shape \(B, h_kv, Tk, d_k\) with d_k=8"),
    ((q, k, v[:, :, :5]), {}, ValueError, r"k and v must have the same heads and length"),
    ((q, torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 3)), {}, ValueError,
     r"query heads h=4 must be a multiple of the key/value heads h_kv=3"),
    ((q, k, v), {"mask": torch.ones(5, 6)}, TypeError, r"mask must be a bool tensor \(True = may attend\)"),
    ((q, k, v), {"mask": torch.ones(3, 5, 6, dtype=torch.bool)}, ValueError,
     r"mask of shape \(3, 5, 6\) is not broadcastable to \(B, h, Tq, Tk\) = \(2, 4, 5, 6\)"),
    ((q, k, v), {"mask": [[True]]}, TypeError, r"mask must be a bool torch.Tensor"),
    ((q, k, v), {"key_lengths": torch.tensor([1, 2, 3])}, ValueError, r"key_lengths must have shape \(B,\) = \(2,\)"),
    ((q, k, v), {"key_lengths": torch.tensor([1.0, 2.0])}, TypeError, r"key_lengths must be an integer tensor"),
    ((q, k, v), {"key_lengths": torch.tensor([1, 7])}, ValueError, r"key_lengths must lie in \[0, Tk=6\]"),
    ((q, k, v), {"causal": 1}, TypeError, r"causal must be a bool"),
    ((q, k, v), {"dropout_p": 1.0}, ValueError, r"dropout_p must lie in \[0.0, 1.0\)"),
    ((q, k, v), {"scale": "x"}, TypeError, r"scale must be a number"),
    ((q, k, v), {"backend": "nope"}, ValueError, r"unknown backend 'nope'; known backends"),
    ((q, k, v), {"backend": "sdpa", "return_weights": True}, mha.BackendError,
     r"backend='sdpa' cannot serve this call .*cannot return attention weights"),
])
def test_attention_errors(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        mha.attention(*args, **kwargs)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(d_model=10, num_heads=3), r"d_model=10 must be divisible by num_heads=3 \(d_k = d_model / h"),
    (dict(d_model=16, num_heads=4, num_kv_heads=3), r"num_heads=4 must be a multiple of num_kv_heads=3"),
    (dict(d_model=0, num_heads=4), r"d_model must be a positive int, got 0"),
    (dict(d_model=16, num_heads=4, dropout=1.5), r"dropout must lie in \[0.0, 1.0\)"),
    (dict(d_model=16, num_heads=4, head_dim=-2), r"head_dim must be a positive int"),
])
def test_module_construction_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        mha.MultiHeadAttention(**kwargs)


def test_head_dim_lifts_divisibility():
    m = mha.MultiHeadAttention(10, 3, head_dim=4)
    assert m(torch.randn(1, 2, 10)).shape == (1, 2, 10)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda m: m(torch.randn(2, 5)), ValueError, r"query must have shape \(B, Tq, d_model\) \(3 dims\), got \(2, 5\)"),
    (lambda m: m(torch.randn(2, 5, 8)), ValueError, r"query must have shape \(B, Tq, d_model\) with d_model=16, got \(2, 5, 8\)"),
    (lambda m: m(torch.randn(2, 5, 16).double()), TypeError, r"must share one dtype"),
    (lambda m: m(torch.randn(2, 5, 16), torch.randn(2, 4, 16), torch.randn(2, 3, 16)), ValueError,
     r"must agree on B and Tk"),
    (lambda m: m(torch.randn(2, 5, 16), mask=torch.ones(2, 5, 5)), TypeError, r"mask must be a bool tensor"),
])
def test_module_forward_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(mha.MultiHeadAttention(16, 4))


def test_errors_survive_python_O():
    """Validation uses real exceptions, not asserts (which vanish under -O)."""
    import subprocess
    import sys

    code = ("import torch, mha\n"
            "try:\n    mha.MultiHeadAttention(10, 3)\nexcept ValueError as e:\n    print('ok', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("ok d_model=10 must be divisible")


@pytest.mark.parametrize("call", [
    lambda: __import__("mha.llm.generation", fromlist=["generate"]).generate("hi\udcff"),
    lambda: __import__("mha.integrations.minilm", fromlist=["encode"]).encode(["ok", "a\udcff"]),
], ids=["llm.generate", "minilm.encode"])
def test_text_that_is_not_utf8_is_refused_before_any_work(call):
    """Bytes that are not UTF-8 reach Python as lone surrogates; tokenizers raised their own
    TypeError ('TextEncodeInput must be Union[...]') after the model was loaded."""
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="must be UTF-8 text, got byte 0xff at character"):
        call()
