"""The small-problem path of the native kernel (``csrc/flash_small.h``, Tk <= 64) vs the fp64 oracle.

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.
Accuracy rule as in test_flash_cpu.py: error vs fp64 at most twice the naive computation's
error in the input dtype, plus a tiny epsilon. The path is reached two ways: the op's automatic
choice (``torch.ops.mha.flash_attention_fwd`` when Tk <= 64) and the test-only kernel name
``"small"`` of ``torch.ops.mha._flash_attention_fwd_kernel``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples import examples
from kernel_inputs import bool_mask as _mask
from kernel_inputs import key_lengths
from kernel_inputs import qkv as _inputs
from mha import reference
from mha.masks import MaskSpec
from mha.ops import flash
from threads import with_threads

EPS = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
MAX_KEYS = 64  # kSmallMaxKeys in flash_small.h


@pytest.fixture(scope="module", autouse=True)
def built():
    assert flash.unavailable() is None, flash.unavailable()
    if "avx512f" not in flash.isa().split(","):
        pytest.skip("the small path is compiled only with AVX-512")


def _auto_takes_small(dtype, Tk: int) -> bool:
    """The op's own choice (flash_small.h small_path_applies): Tk <= 64, <= 32 for bf16 on AMX."""
    tiles = flash.kernels()["float32" if dtype == torch.float32 else "bfloat16"]
    return tiles != "portable" and Tk <= (32 if tiles == "amx" else MAX_KEYS)


def _check(out, lse, q, k, v, causal, kl, mask, scale):
    B, h, Tq, _ = q.shape
    Tk = k.shape[2]
    allowed = MaskSpec(causal, kl, mask).materialize(B, h, Tq, Tk)
    exact = reference.attention(q, k, v, allowed=allowed, scale=scale, upcast=True)[0]
    naive = reference.attention(q, k, v, allowed=allowed, scale=scale, upcast=False)[0]
    err = (out.double() - exact.double()).abs().max().item()
    naive_err = (naive.double() - exact.double()).abs().max().item()
    assert err <= 2 * naive_err + EPS[q.dtype], (err, naive_err)
    dense = MaskSpec(causal, kl, mask).dense(B, h, Tq, Tk)  # (B, h, Tq, Tk)
    group = h // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(),
                     k.double().repeat_interleave(group, 1)) * scale  # (B, h, Tq, Tk)
    want = s.masked_fill(~dense, float("-inf")).logsumexp(-1)  # (B, h, Tq)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(lse))
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    assert torch.allclose(lse.double()[finite], want[finite], atol=tol, rtol=tol)
    assert torch.equal(out[~finite], torch.zeros_like(out[~finite]))  # rows seeing no key


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), group=st.sampled_from([1, 3]),
       Tq=st.sampled_from([1, 2, 15, 16, 17, 20, 63, 64, 65, 130]),
       Tk=st.sampled_from([1, 2, 13, 16, 20, 33, 64]),
       d_k=st.sampled_from([3, 16, 17, 64, 256]), d_v=st.sampled_from([5, 16, 24, 64, 100]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), causal=st.booleans(),
       lengths=st.booleans(), mask=st.sampled_from([None, "full", "rows", "keys", "queries"]),
       layout=st.sampled_from(["bthd", "contiguous", "strided"]), seed=st.integers(0, 99))
def test_small_path_matches_fp64(B, h_kv, group, Tq, Tk, d_k, d_v, dtype, causal, lengths,
                                 mask, layout, seed):
    h = h_kv * group
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout, seed)
    kl = key_lengths(B, Tk, seed, lengths)
    m = _mask(mask, B, h, Tq, Tk, seed)
    scale = d_k ** -0.5
    out, lse = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, kl, m, causal, scale, "small")
    assert out.shape == (B, h, Tq, d_v) and out.dtype == dtype
    _check(out, lse, q, k, v, causal, kl, m, scale)
    if _auto_takes_small(dtype, Tk):  # the op's automatic choice: same bits
        auto = torch.ops.mha.flash_attention_fwd(q, k, v, kl, m, causal, scale)
        assert torch.equal(auto[0], out) and torch.equal(auto[1], lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seed_shape_every_mask_kind(dtype):
    """The seeds' shape (B=32, h=8, T=20, d=64), scaled down in B, with causal Tq != Tk."""
    q, k, v = _inputs(4, 8, 8, 20, 20, 64, 64, dtype, "contiguous", 1)
    kl = torch.tensor([20, 7, 0, 1])
    for causal, lengths, mask in [(False, None, None), (True, None, None), (True, kl, "full"),
                                  (False, kl, "keys")]:
        m = _mask(mask, 4, 8, 20, 20, 2)
        out, lse = flash.flash_attention(q, k, v, causal=causal, key_lengths=lengths, mask=m)
        _check(out, lse, q, k, v, causal, lengths, m, 64 ** -0.5)
    # causal with Tq != Tk (bottom-right): Tq > Tk gives fully masked leading rows
    q2 = q[:, :, :1].contiguous()
    k2, v2 = k[:, :, :5], v[:, :, :5]
    for qq, kk, vv in [(q2, k, v), (q, k2, v2)]:
        out, lse = flash.flash_attention(qq, kk, vv, causal=True)
        _check(out, lse, qq, kk, vv, True, None, None, 64 ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_and_layout_independent(dtype):
    q, k, v = _inputs(3, 4, 2, 37, 29, 64, 48, dtype, "strided", 3)
    m = _mask("full", 3, 4, 37, 29, 4)
    first = flash.flash_attention(q, k, v, causal=True, mask=m)
    contig = flash.flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                                    mask=m)
    single = with_threads(1, lambda: flash.flash_attention(q, k, v, causal=True, mask=m))
    for a, b, c in zip(first, contig, single, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_fully_masked_rows_give_zeros_and_finite_grads():
    q, k, v = (t.requires_grad_() for t in _inputs(2, 2, 2, 6, 9, 32, 32, torch.float32,
                                                     "contiguous", 5))
    m = torch.ones(2, 2, 6, 9, dtype=torch.bool)
    m[0, :, :3] = False  # rows 0-2 of batch 0 see no key
    out, lse = flash.flash_attention(q, k, v, mask=m, key_lengths=torch.tensor([9, 0]))
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # key_lengths 0: every row empty
    assert torch.isinf(lse[0, :, :3]).all() and torch.isinf(lse[1]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_small_kernel_name_rejects_long_keys_in_words():
    q, k, v = _inputs(1, 1, 1, 4, MAX_KEYS + 1, 16, 16, torch.float32, "contiguous", 0)
    with pytest.raises(RuntimeError, match=f"small path serves Tk <= {MAX_KEYS}"):
        torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, False, 0.25, "small")
