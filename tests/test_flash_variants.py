"""The score variants (softcap, sinks, bias, ALiBi) inside the native flash kernel: forward and
fused backward against the float64 loop with the tolerance rule of ``oracle.py``, at shapes that
cross the kernel's query / key blocks (48 x 128 forward, 64 x 64 backward).

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths, d_k / d_v head dims.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import mha
from mha import reference
from mha.ops import flash
from test_flash_bwd import _cancellation
from test_variants import Sizes, _allowed, _within_budget, calls, differentiable
from threads import with_threads

from oracle import FLOOR, max_err

pytestmark = pytest.mark.skipif(flash.unavailable() is not None,
                                reason=f"native kernel unavailable: {flash.unavailable()}")


def sizes(max_len: int) -> Sizes:
    """Calls that cross the kernel's query / key blocks, at the head dims its tiles take."""
    return Sizes(max_len=max_len, d_k=(16, 32), d_v=(16, 24), groups=(1, 3), max_window=40,
                 keep=0.8, softcaps=(0.5, 5.0, 50.0))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=calls(dtypes=(torch.float32, torch.bfloat16), sizes=sizes(150)))
def test_the_kernel_forward_and_lse_match_the_float64_loop(case):
    q, k, v, masks, variants = case
    allowed = _allowed(q, k, masks)
    ref, _ = reference.attention(q, k, v, allowed=allowed, upcast=True, **variants)
    low, _ = reference.attention(q, k, v, allowed=allowed, **variants)
    verdict = next(x for x in mha.explain(q, k, v, **masks, **variants) if x.backend == "flash_cpu")
    assert verdict.ok, verdict.reasons  # the kernel serves every variant combination
    out, lse = mha.attention(q, k, v, backend="flash_cpu", return_lse=True, **masks, **variants)
    _within_budget(out, ref, low, q.dtype, "flash_cpu output")
    _, want = mha.attention(*(t.double() for t in (q, k, v)), backend="math", return_lse=True,
                            **masks, **{n: (t.double() if torch.is_tensor(t) else t)
                                        for n, t in variants.items()})
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(lse))
    tol = 1e-4 if q.dtype == torch.float32 else 5e-2
    torch.testing.assert_close(lse[finite].double(), want[finite].double(), atol=tol, rtol=tol)


def _grads(fn, tensors, seed=1):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*tensors)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    out.backward(go)
    return [t.grad for t in tensors], go, out.detach()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=calls(sizes=sizes(100)))
def test_the_fused_backward_matches_float64_autograd(case):
    q, k, v, masks, variants = case
    names, inputs, run = differentiable(q, k, v, masks, variants)
    ref, go, out = _grads(run(upcast=True), [t.double() for t in inputs])
    low = _grads(run(), inputs)[0]
    got = _grads(run("flash_cpu"), inputs)[0]
    # the floor of test_flash_bwd: dS = P (dP - rowsum(dO O)) cancels (exactly for a row that
    # sees one key), a rounding every flash backward inherits, scaled by the softcap's
    # derivative (<= 1) and by the bias (whose gradient is dS itself)
    size = max(1.0, _cancellation(q, k, go, out, q.shape[-1] ** -0.5))
    for what, a, r, lo in zip(["q", "k", "v", *names], got, ref, low, strict=True):
        assert a.shape == r.shape, f"grad {what}: shape {a.shape} != {r.shape}"
        assert torch.isfinite(a).all(), f"grad {what} not finite"
        budget = 2 * max_err(lo, r) + FLOOR[q.dtype] * max(size, r.abs().max().item())
        err = max_err(a, r)
        assert err <= budget, f"flash_cpu grad {what}: error {err:.3e} > budget {budget:.3e}"


@pytest.mark.parametrize("bias_shape", [(2, 3, 70, 90), (1, 3, 70, 1), (2, 1, 1, 90)])
def test_the_fused_backward_equals_the_pytorch_backward(bias_shape):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 70, 32, generator=g)
    k, v = torch.randn(2, 1, 90, 32, generator=g), torch.randn(2, 1, 90, 16, generator=g)
    bias = torch.randn(*bias_shape, generator=g)
    sinks, slopes = torch.randn(3, generator=g), mha.alibi_slopes(3)[None]
    out, lse = flash.flash_attention(q, k, v, causal=True, softcap=4.0, sinks=sinks, bias=bias,
                                     alibi_slopes=slopes)
    lse64 = torch.ops.mha.flash_attention_fwd(q, k, v, None, None, True, 32 ** -0.5, 0, 4.0,
                                              sinks, bias, slopes)[1]
    go = torch.randn(out.shape, generator=g)
    args = (go, None, q, k, v, out, lse64, None, None, True, 32 ** -0.5, 0, 4.0, sinks, bias,
            slopes, True)
    fused = torch.ops.mha.flash_attention_bwd_fused(*args)
    ref = flash.flash_attention_bwd_torch(*args)
    for what, a, b in zip(("dq", "dk", "dv", "dbias"), fused, ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=what)


def test_a_row_with_no_key_gives_zeros_and_the_sink_as_its_lse():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 60, 16, generator=g, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, generator=g, requires_grad=True)
    bias = torch.randn(2, 60, 60, generator=g, requires_grad=True)
    mask = torch.ones(1, 1, 60, 60, dtype=torch.bool)
    mask[..., 7, :] = False  # query 7 may attend nothing
    out, lse = mha.attention(q, k, v, mask=mask, sinks=sinks, bias=bias, softcap=2.0,
                             backend="flash_cpu", return_lse=True)
    assert torch.equal(out[:, :, 7], torch.zeros_like(out[:, :, 7]))
    torch.testing.assert_close(lse[0, :, 7], sinks.detach())
    (out.sum() + lse.sum()).backward()
    for t in (q, k, v, sinks, bias):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(bias.grad[:, 7], torch.zeros_like(bias.grad[:, 7]))  # never read
    ref = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks, bias)]
    o, l_ = mha.attention(*ref[:3], mask=mask, sinks=ref[3], bias=ref[4], softcap=2.0,
                          backend="math", return_lse=True)
    (o.sum() + l_.sum()).backward()
    for a, b in zip((q, k, v, sinks, bias), ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_the_variants_are_deterministic_across_thread_counts():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 200, 32, generator=g) for _ in range(3))
    bias = torch.randn(1, 4, 200, 200, generator=g)

    def run():
        ts = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
        out = mha.attention(*ts[:3], bias=ts[3], softcap=5.0, alibi_slopes=mha.alibi_slopes(4),
                            causal=True, backend="flash_cpu")
        out.sum().backward()
        return [out.detach()] + [t.grad for t in ts]

    one, two = with_threads(1, run), with_threads(2, run)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


def test_the_kernel_refuses_bad_variant_arguments_by_name():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    op = torch.ops.mha.flash_attention_fwd
    with pytest.raises(RuntimeError, match="sinks must be"):
        op(q, k, v, None, None, False, 0.25, 0, 0.0, torch.zeros(3), None, None)
    with pytest.raises(RuntimeError, match="bias of shape"):
        op(q, k, v, None, None, False, 0.25, 0, 0.0, None, torch.zeros(1, 2, 8, 5), None)
    with pytest.raises(RuntimeError, match="softcap must be"):
        op(q, k, v, None, None, False, 0.25, 0, -1.0, None, None, None)
    with pytest.raises(RuntimeError, match="alibi_slopes must be"):
        op(q, k, v, None, None, False, 0.25, 0, 0.0, None, None, torch.zeros(3, 2))
    with pytest.raises(RuntimeError, match="does not apply the score variants"):
        torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, False, 0.25, "small", 0,
                                                  1.0, None, None, None)


def test_the_dispatch_sends_variant_training_to_the_kernel():
    q, k, v = (torch.randn(1, 2, 600, 32, requires_grad=True) for _ in range(3))
    bias = torch.zeros(1, 2, 600, 600, requires_grad=True)
    ex = mha.explain(q, k, v, bias=bias, causal=True)
    assert ex.chosen == "flash_cpu", ex  # never deferred to sdpa's materialized float mask
