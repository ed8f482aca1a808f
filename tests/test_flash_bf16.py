"""The bf16 tile kernels of the native flash kernel (``flash_cpu``: ``avx512bf16``, and ``amx``
where the CPU has it) against fp64.

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.
Both share a softmax of their own (one pass, a degree-3 exp2 because P is rounded to bf16, a
lazy running max checked by the block's sums, rescaling of O only when it moves); the AMX path
also has its own key loop (16-row tile groups walking their key blocks; O kept in tiles when
d_v <= 64). Every test runs on each of the two that is compiled in. Output: the repo's rule
(error <= 2x the naive bf16 error + 1e-3, tests/oracle.py); lse: much tighter than bf16 (it is
computed in fp32 from exact bf16 products, so the exp2 polynomial's error shows directly).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples import examples
from mha import reference
from mha.masks import MaskSpec
from mha.ops import flash

EPS = 1e-3  # absolute floor of the bf16 output budget (as in test_flash_cpu.py)
LSE_TOL = 2e-4  # exp2 polynomial: relative error 7.5e-5 -> lse error <= 7.5e-5 (+ fp32 sums)


def _kernels() -> list[str]:
    assert flash.unavailable() is None, flash.unavailable()
    isa = flash.isa().split(",")  # "amx-emulated": the amx kernel on software tiles
    return [k for k in ("avx512bf16", "amx") if k in isa or f"{k}-emulated" in isa]


KERNELS = _kernels()
pytestmark = [
    pytest.mark.skipif(not KERNELS, reason="no bf16 tile kernel is compiled in (needs a CPU with "
                       "avx512_bf16 or amx_bf16 and a compiler that targets it)"),
    pytest.mark.parametrize("kernel", KERNELS),
]


def _run(kernel, q, k, v, *, causal=False, key_lengths=None, mask=None, scale):
    return torch.ops.mha._flash_attention_fwd_kernel(q, k, v, key_lengths, mask, causal, scale,
                                                     kernel)


def _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, h, d_k, generator=g).bfloat16().transpose(1, 2)  # (B, h, Tq, d_k)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g).bfloat16()
    v = torch.randn(B, h_kv, Tk, d_v, generator=g).bfloat16()
    return q, k, v


def _check(q, k, v, out, lse, *, causal=False, key_lengths=None, mask=None, scale):
    """out within the bf16 budget of the fp64 oracle; lse within LSE_TOL; -inf where no key."""
    B, h, Tq, _ = q.shape
    Tk = k.shape[2]
    allowed = MaskSpec(causal, key_lengths, mask).materialize(B, h, Tq, Tk)
    exact = reference.attention(q, k, v, allowed=allowed, scale=scale, upcast=True)[0]
    naive = reference.attention(q, k, v, allowed=allowed, scale=scale, upcast=False)[0]
    assert torch.isfinite(out).all()
    err = (out.double() - exact.double()).abs().max().item()
    naive_err = (naive.double() - exact.double()).abs().max().item()
    assert err <= 2 * naive_err + EPS, f"output error {err:.3e} > 2 x {naive_err:.3e} + {EPS}"
    dense = MaskSpec(causal, key_lengths, mask).dense(B, h, Tq, Tk)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(),
                     k.double().repeat_interleave(h // k.shape[1], 1)) * scale  # (B, h, Tq, Tk)
    want = s.masked_fill(~dense, float("-inf")).logsumexp(-1)  # (B, h, Tq)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.equal(out[~finite], torch.zeros_like(out[~finite]))  # rows that see no key
    lerr = (lse.double()[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert lerr <= LSE_TOL, f"lse error {lerr:.3e} > {LSE_TOL}"


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       Tq=st.integers(1, 150), Tk=st.integers(1, 300),
       d_k=st.sampled_from([16, 24, 48, 64, 96, 128, 256]),
       d_v=st.sampled_from([16, 40, 64, 128]), causal=st.booleans(), lengths=st.booleans(),
       mask=st.sampled_from([None, "full", "keys"]), negative_scale=st.booleans(),
       seed=st.integers(0, 999))
def test_matches_fp64(kernel, B, h_kv, group, Tq, Tk, d_k, d_v, causal, lengths, mask,
                          negative_scale, seed):
    """Shapes across tile (16 rows, 32 keys) and block (48 rows, 128 keys) boundaries, GQA,
    d_v != d_k, every mask kind; a negative scale takes the two-pass softmax instead."""
    h = h_kv * group
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, seed)
    g = torch.Generator().manual_seed(seed + 1)
    kl = torch.randint(0, Tk + 1, (B,), generator=g) if lengths else None
    m = None
    if mask == "full":
        m = torch.rand(B, h, Tq, Tk, generator=g) > 0.3
    elif mask == "keys":  # (B, 1, 1, Tk) broadcast with stride-0 dims
        m = (torch.rand(B, 1, 1, Tk, generator=g) > 0.2).expand(B, h, Tq, Tk)
    scale = (-1.0 if negative_scale else 1.0) * d_k ** -0.5
    out, lse = _run(kernel, q, k, v, causal=causal, key_lengths=kl, mask=m, scale=scale)
    assert out.shape == (B, h, Tq, d_v) and out.dtype == torch.bfloat16
    _check(q, k, v, out, lse, causal=causal, key_lengths=kl, mask=m, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
def test_long_gqa(kernel, causal):
    """Many key blocks and query blocks, GQA, d_v != d_k, ragged ends."""
    q, k, v = _inputs(1, 4, 2, 333, 517, 128, 64, seed=3)
    kl = torch.tensor([500])
    out, lse = _run(kernel, q, k, v, causal=causal, key_lengths=kl, scale=0.09)
    _check(q, k, v, out, lse, causal=causal, key_lengths=kl, scale=0.09)


@pytest.mark.parametrize("d_v", [32, 48, 64, 128])
@pytest.mark.parametrize("growth", [0.05, 0.6, 2.0, 8.0, -0.6])
def test_lazy_rescale(kernel, growth, d_v):
    """Scores that grow along the keys: by a little per 128-key block (the running max stays
    stale, P up to 2^16), by enough to move it once or twice, by a lot (O rescaled at every
    block), or that shrink (never); O kept in 2, 3 or 4 tiles (d_v <= 64), or (d_v = 128)
    groups taken two at a time (the second one full, then partial) over runs of key blocks."""
    B, h, Tq, Tk, d = 1, 2, 40 if d_v <= 64 else 56, 700, 32
    q, k, v = _inputs(B, h, h, Tq, Tk, d, d_v, seed=5)
    u = torch.ones(d) / d ** 0.5
    q = (q.float() * 0.1 + u).bfloat16()  # every query close to u
    ramp = torch.arange(Tk, dtype=torch.float32)[:, None] * growth / 128  # score gain per key
    k = (k.float() * 0.1 + ramp * u * d ** 0.5).bfloat16()  # (B, h, Tk, d)
    out, lse = _run(kernel, q, k, v, scale=1.0)
    _check(q, k, v, out, lse, scale=1.0)


def test_masked_keys_with_huge_scores(kernel):
    """Keys masked out by the bool mask have scores far above the visible ones: their lanes
    must give exactly no weight (no inf / NaN from the exp of a large positive logit)."""
    B, h, Tq, Tk, d = 1, 2, 37, 150, 64
    q, k, v = _inputs(B, h, h, Tq, Tk, d, d, seed=7)
    m = torch.ones(B, h, Tq, Tk, dtype=torch.bool)
    hot = torch.arange(Tk) % 5 == 0
    m[..., hot] = False
    k[:, :, hot] = (q.float().mean(2, keepdim=True) * 40).bfloat16()  # scores ~ 40 |q|^2
    out, lse = _run(kernel, q, k, v, mask=m, scale=d ** -0.5)
    _check(q, k, v, out, lse, mask=m, scale=d ** -0.5)


def test_rows_without_keys(kernel):
    """Rows that see no key (bool mask, key_lengths 0, inside a 16-row tile group) give zeros
    and lse = -inf; the other rows of the group are unaffected."""
    B, h, Tq, Tk, d = 2, 2, 40, 70, 64
    q, k, v = _inputs(B, h, h, Tq, Tk, d, d, seed=9)
    m = torch.rand(B, h, Tq, Tk, generator=torch.Generator().manual_seed(0)) > 0.4
    m[0, :, 5] = False
    m[0, 1, 17:20] = False
    kl = torch.tensor([70, 0])
    out, lse = _run(kernel, q, k, v, key_lengths=kl, mask=m, causal=True, scale=0.125)
    assert torch.isinf(lse[0, :, 5]).all() and torch.isinf(lse[1]).all()
    _check(q, k, v, out, lse, key_lengths=kl, mask=m, causal=True, scale=0.125)


def test_lse_of_single_key_rows(kernel):
    """Causal, Tq = Tk: row i sees keys 0..i, so row 0's lse is its one scaled score; the first
    rows show the exp2 polynomial's error directly (a degree-2 fit would miss by ~1e-3)."""
    q, k, v = _inputs(1, 4, 4, 64, 64, 64, 64, seed=11)
    out, lse = _run(kernel, q, k, v, causal=True, scale=0.125)
    s0 = (q[..., 0, :].double() * k[..., 0, :].double()).sum(-1) * 0.125  # (B, h)
    assert (lse[..., 0].double() - s0).abs().max().item() <= 1e-4
    _check(q, k, v, out, lse, causal=True, scale=0.125)


def test_deterministic_across_threads(kernel):
    q, k, v = _inputs(2, 4, 2, 300, 300, 64, 64, seed=13)
    before = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            runs.append(_run(kernel, q, k, v, causal=True, scale=0.125))
    finally:
        torch.set_num_threads(before)
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


def test_flush_to_zero_stays_inside_the_kernel(kernel):
    """The bf16 workers run with flush-to-zero; the caller's thread (at::parallel_for runs a
    chunk on it) must get its own floating-point mode back: denormals survive afterwards."""
    q, k, v = _inputs(1, 2, 2, 100, 100, 64, 64, seed=17)
    tiny = torch.tensor([1e-38], dtype=torch.float32)
    assert (tiny * 0.01).item() != 0.0  # a denormal before
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            _run(kernel, q, k, v, scale=0.125)
            assert (tiny * 0.01).item() != 0.0, f"flush-to-zero leaked ({n} threads)"
    finally:
        torch.set_num_threads(before)
