"""Huge but finite additive biases through the native forward, backward and decode kernels.

Shape legend: B batch, h query heads, Tq/Tk lengths, d head dim.

The rule (README, "NaN propagates like SDPA"): -inf and NaN do what SDPA does; a finite bias,
however large, gives the math's answer. The answer is defined in the inputs' arithmetic: the
logits ``x = fl32(scale * (q . k) + bias)`` (the sum rounded to float32, as every backend
rounds it), then the exact softmax of x. So a row whose bias is -1e10 at every key is the
plain mean of V (no score survives the rounding of s - 1e10), a row of -3e38 too, and a row
mixing 0 and -1e30 sees only its keys at 0. The oracle below computes that in float64.

Every kernel that takes a bias is forced by name (``_flash_attention_fwd_kernel``: portable,
avx512f, avx512bf16 where built), and so is the decode kernel (vectorized and portable).
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha.ops import decode, flash

HUGE = (-1e10, -1e30, -3e38, -torch.finfo(torch.float32).max, 1e30)


def _kernels() -> list[str]:
    assert flash.unavailable() is None, flash.unavailable()
    isa = flash.isa().split(",")
    return ["portable"] + [k for k in ("avx512f", "avx512bf16") if k in isa]


KERNELS = _kernels()
# (kernel, dtype) pairs a kernel serves: avx512bf16 takes bfloat16 inputs only
KERNEL_DTYPES = [(kn, dt) for kn in KERNELS for dt in (torch.float32, torch.bfloat16)
                 if not (kn == "avx512bf16" and dt == torch.float32)]
TOL = {torch.float32: 4e-6, torch.bfloat16: 2e-2}  # the kernels' own rounding, no more


def _bias(B, h, Tq, Tk, value) -> torch.Tensor:
    """(B, h, Tq, Tk) float32: zeros; row 1 all `value`; row 2 `value` at odd keys (0 at even);
    row 3 `value` at even keys and `value / 2` at odd ones (only the larger level survives)."""
    b = torch.zeros(B, h, Tq, Tk)
    b[:, :, 1] = value
    b[:, :, 2, 1::2] = value
    b[:, :, 3, 0::2] = value
    b[:, :, 3, 1::2] = value / 2
    return b


def _inputs(B, h, Tq, Tk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, d, generator=g).to(dtype) for T in (Tq, Tk, Tk))
    return q, k, v


def bias_oracle(q, k, v, bias, scale, causal=False):
    """``(out, lse)`` in float64 of ``softmax(fl32(scale q k^T + bias)) v`` over the visible
    keys (bottom-right causal). q ``(B, h, Tq, d)``, k/v ``(B, h, Tk, d)``, bias
    ``(B, h, Tq, Tk)``."""
    Tq, Tk = q.shape[2], k.shape[2]
    s = (q.double() @ k.double().transpose(-2, -1)) * scale  # (B, h, Tq, Tk)
    x = (s.float() + bias.float()).double()  # (B, h, Tq, Tk): the sum rounded as the inputs' math
    if causal:
        i = torch.arange(Tq)[:, None]
        j = torch.arange(Tk)[None, :]
        x = x.masked_fill(j > i + Tk - Tq, float("-inf"))
    return torch.softmax(x, -1) @ v.double(), torch.logsumexp(x, -1)


@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES,
                         ids=[f"{kn}-{str(dt)[6:]}" for kn, dt in KERNEL_DTYPES])
@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("shape", [(1, 2, 5, 5, 16, False), (1, 2, 40, 300, 64, True)],
                         ids=["5x5", "40x300-causal"])
def test_forward_huge_bias(kernel, dtype, value, shape):
    B, h, Tq, Tk, d, causal = shape
    q, k, v = _inputs(B, h, Tq, Tk, d, dtype, seed=Tk)
    bias = _bias(B, h, Tq, Tk, value)
    scale = d ** -0.5
    out, lse = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, causal, scale,
                                                         kernel, bias=bias)
    ref, ref_lse = bias_oracle(q, k, v, bias, scale, causal)
    assert torch.isfinite(out).all(), "a finite bias gave a non-finite output"
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype], f"output error {err:.3e} > {TOL[dtype]:.1e}"
    rel = ((lse - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)).max().item()
    assert rel <= 1e-6, f"lse relative error {rel:.3e}"


@pytest.mark.parametrize("value", HUGE)
def test_backward_huge_bias(value):
    """flash_cpu's gradients (q, k, v and the bias) against autograd through the oracle."""
    B, h, Tq, Tk, d = 1, 2, 6, 40, 16
    q, k, v = _inputs(B, h, Tq, Tk, d, torch.float32, seed=7)
    bias = _bias(B, h, Tq, Tk, value)
    go = torch.randn(B, h, Tq, d, generator=torch.Generator().manual_seed(8))
    grads = {}
    for name in ("kernel", "oracle"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
        if name == "kernel":
            out = mha.attention(*leaves[:3], bias=leaves[3], backend="flash_cpu")
        else:
            qq, kk, vv, bb = leaves
            x = (qq.double() @ kk.double().transpose(-2, -1)) * d ** -0.5  # (B, h, Tq, Tk)
            x = (x.float() + bb).double()  # rounded to float32 as the kernels round it
            out = torch.softmax(x, -1) @ vv.double()  # (B, h, Tq, d)
        (out.double() * go.double()).sum().backward()
        grads[name] = [t.grad for t in leaves]
    for what, a, b in zip("q k v bias".split(), grads["kernel"], grads["oracle"], strict=True):
        assert torch.isfinite(a).all(), f"d{what} not finite"
        err = (a.double() - b.double()).abs().max().item()
        assert err <= 2e-5, f"d{what}: error {err:.3e}"


@pytest.mark.parametrize("portable", [False, True], ids=["vec", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("value", HUGE + (-1e6,))
@pytest.mark.parametrize("Tk", [300, 2100])  # one split, several (splits of <= 1024 keys)
def test_decode_huge_bias(portable, dtype, value, Tk):
    reason = decode.unavailable()
    if reason:
        pytest.skip(reason)
    B, h, Tq, d = 1, 2, 4, 64
    q, k, v = _inputs(B, h, Tq, Tk, d, dtype, seed=Tk + 1)
    bias = _bias(B, h, Tq, Tk, value)
    scale = d ** -0.5
    with torch.no_grad():
        out = decode.flash_decode(q, k, v, scale=scale, portable=portable, bias=bias)
    ref, _ = bias_oracle(q, k, v, bias, scale)
    assert torch.isfinite(out).all(), "a finite bias gave a non-finite output"
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype], f"output error {err:.3e} > {TOL[dtype]:.1e}"


@pytest.mark.parametrize("backend", ["flash_cpu", "flash_decode", "reference", "sdpa"])
def test_public_function_agrees_on_huge_bias_rows(backend):
    """The audit's case through mha.attention: rows at -1e10 and -3e38 agree with the oracle."""
    q, k, v = _inputs(1, 2, 1 if backend == "flash_decode" else 5, 5, 16, torch.float32, seed=3)
    Tq = q.shape[2]
    for value in (-1e10, -3e38):
        bias = torch.zeros(1, 2, Tq, 5)
        bias[:, :, Tq // 2] = value
        out = mha.attention(q, k, v, bias=bias, backend=backend)
        ref, _ = bias_oracle(q, k, v, bias, 16 ** -0.5)
        err = (out.double() - ref).abs().max().item()
        assert err <= 4e-6, f"{backend} at {value:g}: error {err:.3e}"
