"""The native CPU flash-attention kernel (``flash_cpu``) against the fp64 oracle.

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.
Accuracy rule (flash-attention's): the kernel's error vs the fp64 reference is at most twice
the error of the same math done naively in the input dtype, plus a tiny absolute epsilon.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import mha
from examples import examples
from kernel_inputs import bool_mask as _mask
from kernel_inputs import key_lengths
from kernel_inputs import qkv as _inputs
from mha import reference
from mha.masks import MaskSpec
from mha.ops import flash
from threads import with_threads

EPS = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert flash.unavailable() is None, flash.unavailable()  # a build failure fails these tests


def _ref(q, k, v, *, causal=False, key_lengths=None, mask=None, scale, upcast=True):
    B, h, Tq, _ = q.shape
    allowed = MaskSpec(causal, key_lengths, mask).materialize(B, h, Tq, k.shape[2])
    return reference.attention(q, k, v, allowed=allowed, scale=scale, upcast=upcast)[0]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       Tq=st.integers(1, 70), Tk=st.integers(1, 90),
       d_k=st.sampled_from([16, 17, 32, 64, 80, 128, 256]),
       d_v=st.sampled_from([16, 24, 64, 100, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), causal=st.booleans(),
       lengths=st.booleans(), mask=st.sampled_from([None, "full", "rows", "keys"]),
       layout=st.sampled_from(["bthd", "contiguous", "strided"]), seed=st.integers(0, 99))
# d_k = 256 fp32: over the budget while a score's 256 products were summed in order
@example(B=2, h_kv=1, group=1, Tq=55, Tk=33, d_k=256, d_v=128, dtype=torch.float32, causal=False,
         lengths=True, mask="keys", layout="bthd", seed=18)
def test_accuracy_vs_fp64(B, h_kv, group, Tq, Tk, d_k, d_v, dtype, causal, lengths, mask,
                          layout, seed):
    h = h_kv * group
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout, seed)
    kl = key_lengths(B, Tk, seed, lengths)
    m = _mask(mask, B, h, Tq, Tk, seed)
    scale = d_k ** -0.5
    out, lse = flash.flash_attention(q, k, v, causal=causal, key_lengths=kl, mask=m, scale=scale)
    assert out.shape == (B, h, Tq, d_v) and out.dtype == dtype
    exact = _ref(q, k, v, causal=causal, key_lengths=kl, mask=m, scale=scale)  # fp64
    naive = _ref(q, k, v, causal=causal, key_lengths=kl, mask=m, scale=scale, upcast=False)
    err = (out.double() - exact.double()).abs().max().item()
    naive_err = (naive.double() - exact.double()).abs().max().item()
    assert err <= 2 * naive_err + EPS[dtype], (err, naive_err)
    # lse: log-sum-exp of the visible scores, -inf on rows that see no key
    allowed = MaskSpec(causal, kl, m).dense(B, h, Tq, Tk)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(),
                     k.double().repeat_interleave(group, 1)) * scale  # (B, h, Tq, Tk)
    want = s.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # (B, h, Tq)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(lse))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(lse.double()[finite], want[finite], atol=tol, rtol=tol)


def _kernel_cases():
    """(kernel, dtype) for every tile kernel compiled in; avx512bf16 and amx serve bfloat16."""
    assert flash.unavailable() is None, flash.unavailable()
    isa = flash.isa().split(",")
    cases = [(k, dt) for k in ("portable", "avx512f") if k in isa
             for dt in (torch.float32, torch.bfloat16)]
    return cases + [(k, torch.bfloat16) for k in ("avx512bf16", "amx")
                    if k in isa or f"{k}-emulated" in isa]  # amx on software tiles too


@pytest.mark.parametrize("kernel,dtype", _kernel_cases())
def test_every_compiled_kernel_matches_reference(kernel, dtype):
    """Each compiled kernel, not only the one this CPU picks (see mha.ops.flash.kernels())."""
    for causal, m, kl, shape in [(True, "full", None, (2, 4, 2, 33, 47, 40, 24)),
                                 (False, "keys", [5, 0], (2, 2, 1, 70, 150, 64, 80)),
                                 (True, None, [150, 77], (2, 8, 2, 130, 150, 128, 16))]:
        B, h, h_kv, Tq, Tk, d_k, d_v = shape
        q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype)
        mask = _mask(m, B, h, Tq, Tk, 1)
        kl = None if kl is None else torch.tensor(kl)
        out, lse = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, kl, mask, causal, 0.2,
                                                             kernel)
        exact = _ref(q, k, v, causal=causal, key_lengths=kl, mask=mask, scale=0.2)
        naive = _ref(q, k, v, causal=causal, key_lengths=kl, mask=mask, scale=0.2, upcast=False)
        err = (out.double() - exact.double()).abs().max().item()
        assert err <= 2 * (naive.double() - exact.double()).abs().max().item() + EPS[dtype]


# (B, h, h_kv, Tq, Tk, d_k, d_v, key_lengths): causal shapes whose 48-row query blocks cross the
# diagonal inside a 128-key block, at its edge and across two blocks, with Tq != Tk
# (bottom-right: offsets Tk - Tq of 0, 203, -170, 37), lengths off every tile size, GQA, and
# key_lengths cutting the diagonal
DIAGONAL_SHAPES = [(1, 2, 2, 200, 200, 64, 64, None), (2, 4, 2, 97, 300, 64, 48, None),
                   (1, 2, 1, 300, 130, 17, 80, None), (2, 6, 3, 211, 248, 80, 64, [248, 101]),
                   (1, 1, 1, 385, 385, 32, 16, None)]


@pytest.mark.parametrize("kernel,dtype", _kernel_cases())
@pytest.mark.parametrize("shape", DIAGONAL_SHAPES)
def test_causal_diagonal_blocks(kernel, dtype, shape):
    """Key blocks the first row of a query block does not see to their end (the causal
    diagonal, per-row key limits) over several query and key blocks: every compiled kernel
    against the fp64 oracle; rows that see no key give zeros and lse = -inf."""
    B, h, h_kv, Tq, Tk, d_k, d_v, kl = shape
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, seed=Tq)
    kl = None if kl is None else torch.tensor(kl)
    out, lse = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, kl, None, True, 0.3, kernel)
    exact = _ref(q, k, v, causal=True, key_lengths=kl, scale=0.3)
    naive = _ref(q, k, v, causal=True, key_lengths=kl, scale=0.3, upcast=False)
    err = (out.double() - exact.double()).abs().max().item()
    assert err <= 2 * (naive.double() - exact.double()).abs().max().item() + EPS[dtype], err
    # rows that see no key (Tq > Tk, or key_lengths): zeros and lse -inf, nothing else
    seen = MaskSpec(True, kl, None).dense(B, h, Tq, Tk).any(-1)  # (B, h, Tq)
    assert torch.equal(torch.isfinite(lse), seen)
    assert not out[~seen].any()


def _fp32_kernel_cases():
    """(kernel, Tk) for every fp32 score path of the forward op: the tile kernels compiled in at
    Tk = 33 (one key block) and 150 (several), the small path (AVX-512 only) at Tk = 33."""
    isa = flash.isa().split(",")
    tiles = [k for k in ("portable", "avx512f") if k in isa]
    return [(k, tk) for k in tiles for tk in (33, 150)] + (
        [("small", 33)] if "avx512f" in isa else [])


@pytest.mark.parametrize("kernel,Tk", _fp32_kernel_cases())
def test_every_fp32_kernel_within_budget_at_d_k_256(kernel, Tk):
    """A score of d_k = 256 summed in blocks of 128 (docs/kernel.md, "Scores of d_k > 128"):
    the hypothesis-found case that in-order sums put over the budget, on each fp32 kernel."""
    B, h, Tq, d_k, d_v, seed = 2, 1, 55, 256, 128, 18
    q, k, v = _inputs(B, h, 1, Tq, Tk, d_k, d_v, torch.float32, "bthd", seed)
    kl = key_lengths(B, Tk, seed, True)
    m = _mask("keys", B, h, Tq, Tk, seed)
    scale = d_k ** -0.5
    out, _ = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, kl, m, False, scale, kernel)
    exact = _ref(q, k, v, key_lengths=kl, mask=m, scale=scale)
    naive = _ref(q, k, v, key_lengths=kl, mask=m, scale=scale, upcast=False)
    err = (out.double() - exact.double()).abs().max().item()
    naive_err = (naive.double() - exact.double()).abs().max().item()
    assert err <= 2 * naive_err + EPS[torch.float32], (err, naive_err)


def _needs_avx512_exp2():
    """The exp2 polynomial is AVX-512 code: a portable build (an AVX2-only CPU) answers these
    ops with std::exp2, which keeps denormals, so its flush behaviour is not this test's."""
    if "avx512f" not in flash.isa().split(","):
        pytest.skip(f"the AVX-512 exp2 is not compiled on this CPU (kernel ISA: {flash.isa()}); "
                    "tests/test_isa_compiles.py compiles it")


def test_exp2_polynomial_accuracy():
    _needs_avx512_exp2()
    x = torch.cat([torch.linspace(-125, 0, 200_001), torch.tensor([0.0, -0.5, -1e-8])])
    y = torch.ops.mha._flash_exp2(x)
    want = torch.exp2(x.double())
    rel = ((y.double() - want) / want).abs().max().item()
    assert rel < 2.5e-7  # about 2 ulp of float32
    # below -125 (true value < 3e-38) the kernel flushes to exactly 0, as for masked scores
    flushed = torch.tensor([float("-inf"), -300.0, -125.5])
    assert torch.ops.mha._flash_exp2(flushed).tolist() == [0.0, 0.0, 0.0]


def test_exp2_of_the_one_pass_softmax():
    """The fp32 one-pass softmax evaluates the same polynomial without the clamp, under
    flush-to-zero: as accurate down to -126, exactly 0 below (denormals flushed), and the
    caller's thread keeps its own floating-point mode."""
    _needs_avx512_exp2()
    x = torch.cat([torch.linspace(-126, 0, 200_001), torch.tensor([0.0, -0.5, -1e-8])])
    y = torch.ops.mha._flash_exp2_ftz(x)
    want = torch.exp2(x.double())
    assert ((y.double() - want) / want).abs().max().item() < 2.5e-7
    flushed = torch.tensor([float("-inf"), -300.0, -140.0, -126.5, -1e30])
    assert torch.ops.mha._flash_exp2_ftz(flushed).tolist() == [0.0] * 5
    assert (torch.tensor([1e-38]) * 0.01).item() != 0.0  # denormals still exist out here



@pytest.mark.skipif("avx512f" not in flash.isa().split(","), reason="the avx512f kernel is not "
                    "compiled in (needs a CPU with AVX-512)")
@pytest.mark.parametrize("growth", [0.05, 0.6, 2.0, 8.0, -0.6])
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_lazy_max(growth, causal):
    """The fp32 one-pass softmax keeps a row's running max stale until a block's P sums pass
    2^16: scores that grow along the keys by a little per 128-key block (max stays stale), by
    enough to move it, by a lot (O rescaled at every block), or that shrink (never)."""
    B, h, Tq, Tk, d = 1, 2, 100, 700, 32
    g = torch.Generator().manual_seed(5)
    u = torch.ones(d) / d ** 0.5
    q = torch.randn(B, h, Tq, d, generator=g) * 0.1 + u  # every query close to u
    ramp = torch.arange(Tk, dtype=torch.float32)[:, None] * growth / 128  # score gain per key
    k = torch.randn(B, h, Tk, d, generator=g) * 0.1 + ramp * u * d ** 0.5  # (B, h, Tk, d)
    v = torch.randn(B, h, Tk, d, generator=g)
    out, lse = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, causal, 1.0,
                                                         "avx512f")
    exact = _ref(q, k, v, causal=causal, scale=1.0)
    naive = _ref(q, k, v, causal=causal, scale=1.0, upcast=False)
    err = (out.double() - exact.double()).abs().max().item()
    assert err <= 2 * (naive.double() - exact.double()).abs().max().item() + EPS[torch.float32]
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double())  # (B, h, Tq, Tk)
    allowed = MaskSpec(causal, None, None).dense(B, h, Tq, Tk)
    want = s.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # (B, h, Tq)
    assert (lse.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())

@pytest.mark.skipif("avx512f" not in flash.isa().split(","), reason="the avx512f kernel is not "
                    "compiled in (needs a CPU with AVX-512)")
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_score_far_above_the_stale_max(causal):
    """The one-pass softmax's fast path takes 2^(s c - m) without a clamp: a logit ~2^31 above
    the row's stale max gives +inf there, or -inf where it lies just below a power of two.
    Every such row must leave the fast path (dense: the fused Q K^T tile; causal: the masked
    pass of the diagonal blocks) and see that one key alone: out = v[j], lse = its score."""
    T, d, j = 256, 16, 200
    scale = 1.0
    c = torch.tensor(scale, dtype=torch.float32) * torch.tensor(1.4426950408889634)  # fp32 c
    r = torch.arange(T, dtype=torch.float64) * 1531.0 + 7.0  # logits spread below 2^31
    a = ((2.0**31 - r) / c.double()).float()  # (T,) row i's score against key j
    q = torch.zeros(1, 1, T, d)
    q[0, 0, :, 0] = a
    k = torch.zeros(1, 1, T, d)  # every other score is 0: the first block sets m = 0
    k[0, 0, j, 0] = 1.0
    v = torch.randn(1, 1, T, d, generator=torch.Generator().manual_seed(3))
    out, lse = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, causal, scale,
                                                         "avx512f")
    sees = torch.arange(T) >= j if causal else torch.ones(T, dtype=torch.bool)
    torch.testing.assert_close(out[0, 0, sees], v[0, 0, j].expand(int(sees.sum()), d),
                               rtol=1e-6, atol=0)  # (P v) / P
    want = a[sees].double() * scale
    assert (lse[0, 0, sees].double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    exact = _ref(q, k, v, causal=causal, scale=scale)
    assert (out.double() - exact.double()).abs().max().item() <= 1e-5
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()

SAMPLES = [  # (B, h, h_kv, Tq, Tk, d_k, d_v, dtype, causal, key_lengths, mask)
    (2, 4, 2, 9, 13, 16, 24, torch.float32, False, None, None),
    (1, 2, 1, 12, 7, 32, 32, torch.float32, True, None, None),
    (2, 2, 2, 5, 20, 16, 16, torch.bfloat16, False, [3, 20], "keys"),
    (2, 2, 1, 6, 6, 64, 16, torch.float32, True, [0, 4], "full"),
]


@pytest.mark.parametrize("sample", SAMPLES)
def test_opcheck(sample):
    B, h, h_kv, Tq, Tk, d_k, d_v, dtype, causal, kl, mask = sample
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype)
    if dtype == torch.float32:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    kl = None if kl is None else torch.tensor(kl)
    m = _mask(mask, B, h, Tq, Tk, 0)
    torch.library.opcheck(torch.ops.mha.flash_attention_fwd, (q, k, v, kl, m, causal, 0.25))


def test_fully_masked_rows_zero_output_finite_grad():
    q, k, v = (t.requires_grad_() for t in _inputs(2, 2, 2, 6, 4, 16, 16, torch.float32))
    m = torch.ones(2, 1, 6, 4, dtype=torch.bool)
    m[0, :, 1] = False  # row 1 of batch 0 sees nothing
    # causal with Tq > Tk: rows 0, 1 see nothing; key_lengths 0: batch 1 sees nothing
    out, lse = flash.flash_attention(q, k, v, causal=True, key_lengths=torch.tensor([4, 0]),
                                      mask=m)
    assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isinf(lse[0, :, :2]).all() and torch.isinf(lse[1]).all()
    assert torch.isfinite(lse[0, :, 2:]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert torch.equal(q.grad[0, :, :2], torch.zeros_like(q.grad[0, :, :2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_across_runs_and_thread_counts(dtype):
    q, k, v = _inputs(2, 4, 2, 150, 170, 64, 64, dtype)
    first = flash.flash_attention(q, k, v, causal=True)
    again = flash.flash_attention(q, k, v, causal=True)
    single = with_threads(1, lambda: flash.flash_attention(q, k, v, causal=True))
    for a, b, c in zip(first, again, single, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs_give_identical_results(dtype):
    q, k, v = _inputs(2, 4, 2, 40, 50, 32, 48, dtype, layout="strided")
    assert not any(t.is_contiguous() for t in (q, k, v))
    m = _mask("keys", 2, 4, 40, 50, 3)
    out, lse = flash.flash_attention(q, k, v, mask=m, causal=True)
    out_c, lse_c = flash.flash_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                          mask=m.contiguous(), causal=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


@pytest.mark.parametrize("causal,lengths,mask", [(False, False, None), (True, False, None),
                                                 (True, True, "full"), (False, True, "keys")])
@pytest.mark.parametrize("chunk", [None, 64])  # 64 elements: many backward chunks
def test_gradients_vs_fp64_reference(causal, lengths, mask, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(flash, "_CHUNK_ELEMENTS", chunk)
    B, h, h_kv, Tq, Tk, d_k, d_v = 2, 4, 2, 11, 19, 16, 24
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, torch.float64)
    kl = torch.tensor([19, 7]) if lengths else None
    m = _mask(mask, B, h, Tq, Tk, 5)
    go = torch.randn(B, h, Tq, d_v, dtype=torch.float64)
    g_lse = torch.randn(B, h, Tq, dtype=torch.float64)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    allowed = MaskSpec(causal, kl, m).materialize(B, h, Tq, Tk)
    want = torch.autograd.grad((_ref(*ref_in, causal=causal, key_lengths=kl, mask=m,
                                     scale=0.3) * go).sum(), ref_in)
    got_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out, lse = flash.flash_attention(*got_in, causal=causal, key_lengths=kl, mask=m, scale=0.3)
    got = torch.autograd.grad((out * go.float()).sum(), got_in, retain_graph=True)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5, rtol=1e-4)
    # the gradient through the log-sum-exp too (d lse / d s = softmax weights)
    s = torch.einsum("bhqd,bhkd->bhqk", ref_in[0], ref_in[1].repeat_interleave(2, 1)) * 0.3
    dense = MaskSpec(causal, kl, m).dense(B, h, Tq, Tk) if allowed is not None else None
    s = s if dense is None else s.masked_fill(~dense, float("-inf"))
    lse_ref = s.logsumexp(-1)
    fin = torch.isfinite(lse_ref)
    want_l = torch.autograd.grad((lse_ref[fin] * g_lse[fin]).sum(), ref_in[:2])
    got_l = torch.autograd.grad((lse[fin] * g_lse.float()[fin]).sum(), got_in[:2])
    for a, b in zip(got_l, want_l, strict=True):
        assert torch.allclose(a.double(), b, atol=2e-5, rtol=1e-4)


def test_bf16_gradients_close_to_fp64():
    q, k, v = _inputs(1, 2, 1, 24, 24, 32, 32, torch.float64)
    go = torch.randn(1, 2, 24, 32, dtype=torch.float64)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((_ref(*ref_in, causal=True, scale=0.2) * go).sum(), ref_in)
    got_in = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out, _ = flash.flash_attention(*got_in, causal=True, scale=0.2)
    got = torch.autograd.grad((out * go.bfloat16()).sum(), got_in)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.double() - b).abs().max() <= 0.05 * b.abs().max() + 1e-3


def test_dispatch_prefers_flash_cpu_and_rejects_in_words():
    q = torch.randn(1, 2, 40, 32)  # prefill-sized (short queries may go to a decode kernel)
    assert mha.explain(q, q, q).chosen == "flash_cpu"
    x = torch.randn(1, 2, 40, 32, requires_grad=True)
    mha.attention(x, x, x, causal=True).sum().backward()
    assert torch.isfinite(x.grad).all()

    def reasons(*args, **kw):
        return next(v.reasons for v in mha.explain(*args, **kw) if v.backend == "flash_cpu")

    assert any("dropout" in r for r in reasons(q, q, q, dropout_p=0.1))
    assert any("weights" in r for r in reasons(q, q, q, return_weights=True))
    assert any("float64" in r for r in reasons(q.double(), q.double(), q.double()))
    small = torch.randn(1, 2, 8, 8)
    assert any("head dim 8 < 16" in r for r in reasons(small, small, small))
    big = torch.randn(1, 1, 4, 320)
    assert any("head dim 320 > 256" in r for r in reasons(big, big, big))


def test_build_failure_falls_back_with_reason(tmp_path):
    script = textwrap.dedent("""
        import warnings
        import torch, mha
        q = torch.randn(1, 2, 5, 16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = mha.attention(q, q, q, causal=True)
            mha.attention(q, q, q)
        ref = mha.reference.attention(q, q, q, allowed=mha.causal_mask(5, 5), upcast=True)[0]
        assert torch.allclose(out, ref.float(), atol=1e-5)
        ex = mha.explain(q, q, q)
        print(ex)
        assert ex.chosen != "flash_cpu"
        flash = [w for w in caught if "flash_cpu" in str(w.message)]
        assert len(flash) == 1, [str(w.message) for w in caught]
    """)
    env = dict(os.environ, MHA_CXX="/nonexistent/c++", MHA_BUILD_DIR=str(tmp_path / "build"))
    env.pop("CXX", None)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("flash_cpu"))
    assert "rejected" in line and "no C++ compiler" in line
