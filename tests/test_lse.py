"""``mha.attention(..., return_lse=True)``: the log-sum-exp of each row, a backend capability.

Every backend whose capabilities say ``lse`` returns ``log(sum_j exp(s_ij) + exp(sink))`` over
the keys row i may attend, judged against the float64 formula written here plainly, with the
repo's rule (at most twice the error of the same formula in the inputs' precision, plus a
floor); the others reject the call with the reason, and dispatch picks a capable one.
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha import backends
from mha.masks import MaskSpec

from oracle import FLOOR, max_err

LSE_BACKENDS = [b.name for b in backends.all_backends() if b.caps.lse]


def _lse_formula(q, k, v, allowed, scale, sinks=None, dtype=torch.float64):
    """``(B, h, Tq)``: log of each row's softmax denominator, head by head, in ``dtype``."""
    B, h, Tq, d_k = q.shape
    g = h // k.shape[1]
    s = torch.stack([(q[:, i].to(dtype) @ k[:, i // g].to(dtype).transpose(-2, -1)) * scale
                     for i in range(h)], dim=1)  # (B, h, Tq, Tk)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, h, Tq)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(dtype).view(1, -1, 1))
    return lse


def _problem(seed, B=2, h=4, h_kv=2, Tq=9, Tk=13, d_k=16, d_v=24, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Tq, d_k, generator=g).to(dtype)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g).to(dtype)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g).to(dtype)
    return q, k, v


MASKINGS = {
    "none": {},
    "causal": {"causal": True},
    "key_lengths": {"key_lengths": torch.tensor([13, 5])},
    "window": {"causal": True, "window": 3},
    # row 0 of every head sees nothing: lse -inf, out 0
    "mask_empty_row": {"mask": torch.ones(9, 13, dtype=torch.bool).index_fill(0, torch.tensor([0]),
                                                                             False)},
}


def test_the_capability_is_data():
    assert {"flash_cpu", "math", "reference"} <= set(LSE_BACKENDS)
    assert "sdpa" not in LSE_BACKENDS


@pytest.mark.parametrize("backend", LSE_BACKENDS)
@pytest.mark.parametrize("masking", sorted(MASKINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lse_against_the_float64_formula(backend, masking, dtype):
    q, k, v = _problem(3, dtype=dtype)
    kw = MASKINGS[masking]
    out, lse = mha.attention(q, k, v, return_lse=True, backend=backend, **kw)
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    scale = 16 ** -0.5
    allowed = MaskSpec(kw.get("causal", False), kw.get("key_lengths"), kw.get("mask"),
                       kw.get("window")).materialize(2, 4, 9, 13, q.device)
    ref = _lse_formula(q, k, v, allowed, scale)
    low = _lse_formula(q, k, v, allowed, scale, dtype=dtype).float()
    empty = ref == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows that see no key: lse = -inf"
    budget = 2 * max_err(low[~empty], ref[~empty]) + FLOOR[torch.float32] * 10
    assert max_err(lse[~empty], ref[~empty]) <= budget
    assert torch.all(out[empty] == 0)
    # the same out as without return_lse
    torch.testing.assert_close(out, mha.attention(q, k, v, backend=backend, **kw), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["math", "reference"])
def test_lse_includes_the_sink(backend):
    q, k, v = _problem(5)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mask = MASKINGS["mask_empty_row"]["mask"]
    _, lse = mha.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True, backend=backend)
    ref = _lse_formula(q, k, v, mask, 16 ** -0.5, sinks=sinks)
    torch.testing.assert_close(lse.double(), ref, rtol=1e-6, atol=1e-6)
    # a row that sees no key: the sink alone
    torch.testing.assert_close(lse[:, :, 0], sinks.expand(2, 4))


def test_empty_keys_give_minus_infinity_or_the_sink():
    q = torch.randn(1, 2, 3, 8)
    kv = torch.randn(1, 2, 0, 8)
    _, lse = mha.attention(q, kv, kv, return_lse=True)
    assert lse.shape == (1, 2, 3) and torch.all(lse == float("-inf"))
    _, lse = mha.attention(q, kv, kv, return_lse=True, sinks=torch.tensor([1.0, -2.0]))
    torch.testing.assert_close(lse, torch.tensor([1.0, -2.0]).view(1, 2, 1).expand(1, 2, 3))


def test_explain_names_the_capability_and_dispatch_picks_a_capable_backend():
    q, k, v = _problem(7)
    ex = mha.explain(q, k, v, return_lse=True)
    verdicts = {vd.backend: vd for vd in ex}
    assert "cannot return the log-sum-exp" in verdicts["sdpa"].reasons
    assert ex.chosen in LSE_BACKENDS
    with pytest.raises(mha.BackendError, match="cannot return the log-sum-exp"):
        mha.attention(q, k, v, return_lse=True, backend="sdpa")


def test_weights_and_lse_together_are_refused_by_name():
    q, k, v = _problem(8)
    with pytest.raises(ValueError, match="return_weights and return_lse"):
        mha.attention(q, k, v, return_weights=True, return_lse=True)
    with pytest.raises(TypeError, match="return_lse"):
        mha.attention(q, k, v, return_lse="yes")


@pytest.mark.parametrize("backend", ["flash_cpu", "math"])
def test_lse_is_differentiable(backend):
    """Gradients through the lse (and out) equal float64 autograd through the formula."""
    q, k, v = (t.requires_grad_() for t in _problem(9, Tq=6, Tk=6))
    out, lse = mha.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    w = torch.randn_like(lse)
    got = torch.autograd.grad((lse * w).sum() + out.sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    allowed = MaskSpec(True, None, None).materialize(2, 4, 6, 6, q.device)
    ref_lse = _lse_formula(qd, kd, vd, allowed, 16 ** -0.5)
    ref_out = mha.attention(qd, kd, vd, causal=True, backend="reference")
    want = torch.autograd.grad((ref_lse * w.double()).sum() + ref_out.sum(), (qd, kd, vd))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
