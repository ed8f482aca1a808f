"""The small-problem path of the fused backward (``csrc/flash/bwd_small.h``, Tk <= 64).

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.
Accuracy rule (tests/oracle.py): each gradient's error vs the fp64 reference is at most twice
the error of the same gradient computed naively in the input dtype, plus a small floor. The
path is reached two ways: the op's automatic choice (``flash_attention_bwd_fused`` when Tq and
Tk are <= 64 and nothing it does not serve is asked for) and the test-only math name
``"small"`` of ``_flash_attention_bwd_fused_math``; ``"fp32"`` there is the block driver.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from examples import examples
from kernel_inputs import bool_mask as _mask
from kernel_inputs import key_lengths, layout_tensor, qkv
from mha.masks import MaskSpec
from mha.ops import flash
from test_flash_bwd import _reference_grads
from test_hostile_nan_backward import _assert_rule, rule_reference

from oracle import FLOOR, max_err

MAX_KEYS = 64  # kSmallBwdMaxKeys in bwd_small.h
MAX_ROWS = 64  # kSmallBwdMaxRows: the auto choice's largest Tq


@pytest.fixture(scope="module", autouse=True)
def built():
    assert flash.unavailable() is None, flash.unavailable()
    assert flash.load_backward() is None  # a build failure fails these tests
    if "avx512f" not in flash.isa().split(","):
        pytest.skip("the small backward is compiled only with AVX-512")


def _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout, seed):
    """q, k, v, grad_out (B, h, Tq, d_v), grad_lse (B, h, Tq) in float32."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout, g=g)
    go = layout_tensor(B, h, Tq, d_v, dtype, layout, g)  # (B, h, Tq, d_v)
    return q, k, v, go, torch.randn(B, h, Tq, generator=g)


def _bwd(math, go, gl, q, k, v, spec, scale, window=0):
    """dq, dk, dv of the fused backward with the products named by ``math``, fed the
    forward's own out and lse."""
    out, lse = torch.ops.mha.flash_attention_fwd(q, k, v, spec.key_lengths, spec.mask,
                                                 spec.causal, scale, window)
    args = (go, gl, q, k, v, out, lse, spec.key_lengths, spec.mask, spec.causal, scale)
    if math == "auto":
        return torch.ops.mha.flash_attention_bwd_fused(*args, window)[:3]
    return torch.ops.mha._flash_attention_bwd_fused_math(*args, math, window)


def _cancellation(q, k, go, out, scale) -> float:
    """The rounding dS = P (dP - rowsum(dO O)) cannot avoid (see test_flash_bwd.py)."""
    if go is None:
        return 1.0
    terms = (go.double() * out.double()).abs().sum(-1).max().item()  # max_row sum |dO O|
    return terms * scale * max(q.abs().max().item(), k.abs().max().item(), 1.0)


def _assert_within_budget(got, q, k, v, go, gl, spec, scale):
    want, out = _reference_grads(q, k, v, go, gl, spec, scale, upcast=True)
    low, _ = _reference_grads(q, k, v, go, gl, spec, scale, upcast=False)
    size = max(1.0, _cancellation(q, k, go, out, scale))
    for name, a, w, lo in zip("qkv", got, want, low, strict=True):
        assert a.dtype == q.dtype and a.shape == w.shape
        assert torch.isfinite(a).all(), f"d{name} not finite"
        budget = 2 * max_err(lo, w) + FLOOR[q.dtype] * max(size, w.abs().max().item())
        assert max_err(a, w) <= budget, f"d{name}: error {max_err(a, w):.3e} > {budget:.3e}"


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), h_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       Tq=st.sampled_from([1, 2, 15, 16, 17, 20, 33, 63, 64, 65, 130]),
       Tk=st.sampled_from([1, 2, 13, 16, 20, 33, 63, 64]),
       d_k=st.sampled_from([3, 16, 40, 64, 72, 80, 256]),
       d_v=st.sampled_from([5, 16, 24, 40, 64, 100, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), causal=st.booleans(),
       lengths=st.booleans(), mask=st.sampled_from([None, "full", "rows", "keys", "queries"]),
       layout=st.sampled_from(["bthd", "contiguous", "strided"]),
       grads=st.sampled_from(["out", "lse", "both"]), seed=st.integers(0, 2**16))
@example(B=2, h_kv=1, group=3, Tq=1, Tk=1, d_k=40, d_v=72, dtype=torch.float32, causal=True,
         lengths=False, mask=None, layout="bthd", grads="both", seed=1)
@example(B=1, h_kv=2, group=2, Tq=64, Tk=64, d_k=80, d_v=40, dtype=torch.bfloat16,
         causal=True, lengths=True, mask="full", layout="strided", grads="both", seed=2)
@example(B=2, h_kv=1, group=1, Tq=20, Tk=64, d_k=256, d_v=256, dtype=torch.float32,
         causal=False, lengths=True, mask="keys", layout="contiguous", grads="out", seed=3)
def test_small_backward_vs_fp64_reference(B, h_kv, group, Tq, Tk, d_k, d_v, dtype, causal,
                                          lengths, mask, layout, grads, seed):
    h = h_kv * group
    q, k, v, go, gl = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, layout, seed)
    go = go if grads in ("out", "both") else None
    gl = gl if grads in ("lse", "both") else None
    spec = MaskSpec(causal, key_lengths(B, Tk, seed, lengths), _mask(mask, B, h, Tq, Tk, seed))
    scale = 0.3
    got = _bwd("small", go, gl, q, k, v, spec, scale)
    _assert_within_budget(got, q, k, v, go, gl, spec, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 8, 8, 20, 20, 64, 64), (1, 6, 2, 17, 33, 40, 72),
                                   (2, 4, 1, 64, 64, 80, 80), (1, 2, 2, 100, 9, 72, 24),
                                   (3, 2, 1, 1, 64, 256, 16)])
@pytest.mark.parametrize("causal,lengths,mask", [(False, False, None), (True, True, "full"),
                                                 (True, False, "rows"), (False, True, "queries")])
def test_small_backward_agrees_with_the_block_driver(dtype, shape, causal, lengths, mask):
    """The same gradients as the block driver's fp32 products (both sum in fp32; bf16
    gradients within one rounding)."""
    B, h, h_kv, Tq, Tk, d_k, d_v = shape
    q, k, v, go, gl = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, "bthd", seed=5)
    spec = MaskSpec(causal, key_lengths(B, Tk, 5, lengths), _mask(mask, B, h, Tq, Tk, 5))
    small = _bwd("small", go, gl, q, k, v, spec, 0.125)
    block = _bwd("fp32", go, gl, q, k, v, spec, 0.125)
    for name, a, b in zip("qkv", small, block, strict=True):
        tol = (1e-5 if dtype == torch.float32 else 1e-2) * max(1.0, b.abs().max().item())
        assert max_err(a, b) <= tol, f"d{name}: {max_err(a, b):.3e} > {tol:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Tq,Tk,small", [(1, 1, True), (20, 20, True), (64, 64, True),
                                         (17, 64, True), (65, 20, False), (20, 65, False),
                                         (128, 64, False)])
def test_auto_choice_takes_the_small_path_where_intended(dtype, Tq, Tk, small):
    """Bit for bit the small path's result where Tq, Tk <= 64, the block driver's elsewhere.
    With d_v = 200 the two sum dP = dO V^T differently (the small path in blocks of 128
    products), so for fp32 the bits tell the paths apart; bf16 rounding may hide that."""
    q, k, v, go, gl = _inputs(2, 4, 2, Tq, Tk, 40, 200, dtype, "bthd", seed=11)
    spec = MaskSpec(True, None, None)
    auto = _bwd("auto", go, gl, q, k, v, spec, 0.3)
    big = Tq >= 64 and Tk >= 64  # bf16: the block driver's products as it picks them
    block = torch.ops.mha.flash_attention_bwd_bf16_math() if dtype == torch.bfloat16 and big \
        else "fp32"
    named = _bwd("small" if small else block, go, gl, q, k, v, spec, 0.3)
    for a, b in zip(auto, named, strict=True):
        assert torch.equal(a, b)
    if dtype == torch.float32:  # the comparison above can fail: the two paths' bits differ
        other = _bwd("fp32" if small else "small", go, gl, q, k, v, spec, 0.3) if Tk <= MAX_KEYS \
            else None
        if other is not None:
            assert not all(torch.equal(a, b) for a, b in zip(auto, other, strict=True))


def test_a_window_falls_through_to_the_block_driver():
    q, k, v, go, gl = _inputs(1, 2, 1, 20, 20, 16, 16, torch.float32, "bthd", seed=3)
    spec = MaskSpec(True, None, None)
    auto = _bwd("auto", go, gl, q, k, v, spec, 0.3, window=5)
    block = _bwd("fp32", go, gl, q, k, v, spec, 0.3, window=5)
    for a, b in zip(auto, block, strict=True):
        assert torch.equal(a, b)


def test_named_small_path_refuses_what_it_does_not_serve():
    q, k, v, go, gl = _inputs(1, 2, 1, 8, 65, 16, 16, torch.float32, "bthd", seed=3)
    with pytest.raises(RuntimeError, match="small path serves Tk <= 64.*Tk=65"):
        _bwd("small", go, gl, q, k, v, MaskSpec(False, None, None), 0.3)
    q, k, v, go, gl = _inputs(1, 2, 1, 8, 20, 16, 16, torch.float32, "bthd", seed=3)
    with pytest.raises(RuntimeError, match="without a window"):
        _bwd("small", go, gl, q, k, v, MaskSpec(True, None, None), 0.3, window=4)


def test_small_backward_is_bitwise_the_same_for_any_thread_count():
    q, k, v, go, gl = _inputs(16, 8, 4, 20, 20, 64, 64, torch.float32, "bthd", seed=9)
    spec = MaskSpec(True, key_lengths(16, 20, 9), None)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (2, 1, 2):
            torch.set_num_threads(n)
            runs.append(_bwd("small", go, gl, q, k, v, spec, 0.125))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


# NaN / Inf: the rule of test_hostile_nan_backward.py at shapes the small path serves.
NAN, INF = float("nan"), float("inf")
B, H, H_KV, TQ, TK, D_K, D_V = 2, 4, 2, 50, 40, 32, 24


def _poison(q, k, v, case):
    """Copies of q, k, v with NaN / Inf planted for ``case``."""
    q, k, v = q.clone(), k.clone(), v.clone()
    if case == "kv_seen_by_some_rows":
        k[0, 0, 30, 3] = NAN
        k[1, 1, 13] = NAN
        v[0, 1, 35, 5] = NAN
        v[1, 0, 20] = -INF
        v[0, 0, 39] = INF
    elif case == "kv_past_key_lengths":  # key_lengths[1] = 25: never seen by any row
        k[1, :, 28:] = NAN
        v[1, :, 25:] = INF
    elif case == "q_rows":  # a row that sees keys, one that sees none (Tq > Tk: row 5)
        q[0, 1, 45] = NAN
        q[1, 2, 5, 7] = INF
        q[1, 3, 37, 0] = NAN
    return q, k, v


NAN_SPECS = {
    "causal": lambda: MaskSpec(True, torch.tensor([TK, 25]), None),
    "mask": lambda: MaskSpec(True, torch.tensor([TK, 25]),
                             torch.rand(B, 1, TQ, TK, generator=torch.Generator().manual_seed(1))
                             > 0.3),
    "no_causal": lambda: MaskSpec(False, torch.tensor([30, 25]), None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["kv_seen_by_some_rows", "kv_past_key_lengths", "q_rows"])
@pytest.mark.parametrize("masks", sorted(NAN_SPECS))
def test_small_backward_follows_the_nan_rule(dtype, case, masks):
    spec = NAN_SPECS[masks]()
    q, k, v = _poison(*qkv(B, H, H_KV, TQ, TK, D_K, D_V, dtype, "bthd", seed=7), case)
    go = torch.randn(B, H, TQ, D_V, generator=torch.Generator().manual_seed(8)).to(dtype)
    allowed = spec.dense(B, H, TQ, TK)  # (B, H, TQ, TK)
    out, lse, want = rule_reference(q, k, v, go, allowed, 0.25, torch.float64)
    _, _, low = rule_reference(q, k, v, go, allowed, 0.25, dtype)
    args = (go, None, q, k, v, out.to(dtype), lse.float(), spec.key_lengths, spec.mask,
            spec.causal, 0.25)
    got = torch.ops.mha._flash_attention_bwd_fused_math(*args, "small", 0)
    block = torch.ops.mha._flash_attention_bwd_fused_math(*args, "fp32", 0)
    for name, a, w, lo, bl in zip("qkv", got, want, low, block, strict=True):
        assert a.dtype == dtype
        _assert_rule(a.double(), w, lo.double(), dtype, f"d{name}")
        assert torch.equal(torch.isnan(a), torch.isnan(bl)), f"d{name}: NaN unlike the block's"
    if case != "q_rows":  # the planted values do reach some gradient: the case tests something
        assert any(torch.isnan(w).any() for w in want) or case == "kv_past_key_lengths"
