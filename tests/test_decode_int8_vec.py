"""The decode kernel's vectorized int8 K/V path (AVX-512: q.k on int8 K widened in registers,
R query rows per block of keys; p.v with v_scale folded into p) against the float64 loop on
the dequantized K/V: GQA groups G = 1 … 8, head dims off the vector width, key counts off the
block and split sizes, every mask and score variant, paged reads, NaN scales, and results that
do not depend on the thread count.

Shape legend: B batch, h / h_kv query / key-value heads, Tq / Tk lengths, d_k / d_v head dims,
G = h / h_kv * Tq query rows per K/V head.
"""

from __future__ import annotations

import math

import pytest
import torch

import mha
from mha import reference
from mha.masks import MaskSpec
from mha.ops import decode
from test_decode import NEEDS_KERNEL
from threads import with_threads

from oracle import FLOOR, max_err, rule_oracle

# (B, h, h_kv, Tq, Tk, d_k, d_v): G = 1 … 8 (rows per block: 4, 3, 2, 1 and their sums),
# d = 64 / 128 and d off 16 (24, 40, 72, 200), Tk odd and off every block (5 keys for G = 3,
# 16 for G = 1) and split (1024) size
SHAPES = [
    (1, 4, 4, 1, 1031, 128, 128),   # G 1
    (1, 4, 2, 1, 77, 64, 64),       # G 2
    (1, 9, 3, 1, 1501, 64, 64),     # G 3 (SmolLM2's heads)
    (2, 8, 2, 1, 333, 40, 24),      # G 4
    (1, 5, 1, 1, 203, 72, 72),      # G 5 = 4 + 1
    (1, 6, 1, 1, 19, 24, 40),       # G 6 = 4 + 2
    (1, 7, 1, 1, 1100, 128, 64),    # G 7 = 4 + 3
    (2, 4, 2, 4, 519, 64, 64),      # G 8, Tq 4
    (1, 2, 1, 3, 5, 200, 136),      # G 6, Tk below one block, d > 128
]
MASKS = ("none", "causal", "all")


def _problem(shape, dtype, masks, seed=0):
    """q in ``dtype``, int8 K/V with their fp32 scales, the float32 dequantized K/V (what the
    kernel computes with), and the masks."""
    B, h, h_kv, Tq, Tk, d_k, d_v = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Tq, d_k, generator=g).to(dtype)  # (B, h, Tq, d_k)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g) * (1 + 3 * torch.rand(B, h_kv, Tk, 1, generator=g))
    v = torch.randn(B, h_kv, Tk, d_v, generator=g)
    kq, ks = decode.quantize_int8(k)  # (B, h_kv, Tk, d_k) int8, (B, h_kv, Tk) fp32
    vq, vs = decode.quantize_int8(v)
    k32 = kq.float() * ks[..., None]  # (B, h_kv, Tk, d_k): exactly what the kernel reads
    v32 = vq.float() * vs[..., None]
    kw = {}
    if masks in ("causal", "all"):
        kw["causal"] = True
    if masks == "all":
        kl = torch.randint(0, Tk + 1, (B,), generator=g)
        kl[0] = Tk
        kw["key_lengths"] = kl
        kw["mask"] = torch.rand(B, 1, Tq, Tk, generator=g) > 0.3
    return q, (kq, ks, vq, vs), (k32, v32), kw


def _allowed(q, Tk, kw):
    spec = MaskSpec(kw.get("causal", False), kw.get("key_lengths"), kw.get("mask"))
    return spec.materialize(q.shape[0], q.shape[1], q.shape[2], Tk)


def _int8(q, kv, **kw):
    kq, ks, vq, vs = kv
    with torch.no_grad():
        return decode.flash_decode(q, kq, vq, k_scale=ks, v_scale=vs, **kw)


def _check(got, q, k32, v32, allowed, dtype, **variants):
    """The tolerance rule of oracle.py on the dequantized K/V: twice the naive error in q's
    precision plus the floor (bf16 q: the oracle widens q exactly; the naive loop rounds K/V
    to bf16 as a bf16 model's would)."""
    ref = reference.attention(q.float(), k32, v32, allowed=allowed, upcast=True, **variants)[0]
    low = reference.attention(q, k32.to(dtype), v32.to(dtype), allowed=allowed, **variants)[0]
    budget = 2.0 * max_err(low, ref) + FLOOR[dtype]
    err = max_err(got, ref)
    assert err <= budget, f"error {err:.3e} > budget {budget:.3e}"


@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_vectorized_int8_matches_the_float64_loop(shape, masks, dtype):
    q, kv, (k32, v32), kw = _problem(shape, dtype, masks)
    got = _int8(q, kv, **kw)
    assert got.dtype == dtype
    _check(got, q, k32, v32, _allowed(q, shape[4], kw), dtype)
    # the portable loops compute the same sums in another order
    portable = _int8(q, kv, portable=True, **kw)
    assert (got.double() - portable.double()).abs().max() <= (1e-5 if dtype == torch.float32
                                                             else 2e-2)


@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3], SHAPES[6]],
                         ids=lambda s: "x".join(map(str, s)))
def test_vectorized_int8_keeps_every_score_variant(shape, dtype):
    q, kv, (k32, v32), kw = _problem(shape, dtype, "all", seed=1)
    B, h, _, Tq, Tk = shape[:5]
    g = torch.Generator().manual_seed(2)
    variants = dict(softcap=5.0, sinks=torch.randn(h, generator=g),
                    alibi_slopes=mha.alibi_slopes(h), bias=torch.randn(h, Tq, Tk, generator=g))
    got = _int8(q, kv, **kw, **variants)
    _check(got, q, k32, v32, _allowed(q, Tk, kw), dtype, **variants)


@NEEDS_KERNEL
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("page", [16, 5, 33])
def test_paged_int8_reads_equal_contiguous_ones_bitwise(G, page):
    """Pages cut the keys into runs at other places than the blocks and splits: q.k is the
    same per key wherever its block starts, p.v adds the keys in order from O."""
    B, h_kv, M, d = 3, 2, 7, 64
    g = torch.Generator().manual_seed(G * page)
    P = B * M + 2
    k = torch.randn(P, h_kv, page, d, generator=g)  # (P, h_kv, page, d)
    v = torch.randn(P, h_kv, page, d, generator=g)
    bt = torch.randperm(P, generator=g)[:B * M].view(B, M).to(torch.int32)  # (B, M)
    kq, ks = decode.quantize_int8(k)  # (P, h_kv, page, d), (P, h_kv, page)
    vq, vs = decode.quantize_int8(v)
    q = torch.randn(B, h_kv * G, 1, d, generator=g)  # (B, h, 1, d)
    lengths = torch.tensor([M * page, page + 3, 2 * page - 1])

    def dense(pool):  # (B, h_kv, M * page, ...) copy of the pages the table names
        x = pool[bt.long()]  # (B, M, h_kv, page, ...)
        return x.transpose(1, 2).reshape(B, h_kv, M * page, *x.shape[4:])

    with torch.no_grad():
        got = decode.flash_decode(q, kq, vq, block_table=bt, key_lengths=lengths, k_scale=ks,
                                  v_scale=vs)
        want = decode.flash_decode(q, dense(kq), dense(vq), key_lengths=lengths,
                                   k_scale=dense(ks), v_scale=dense(vs))
    assert torch.equal(got, want)


@NEEDS_KERNEL
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_a_nan_scale_propagates_like_sdpa_on_the_dequantized_cache(which):
    """A NaN scale makes that key's K (or V) row NaN: rows that may attend it are NaN (all of
    it for K; for V too, as every column of the row is NaN), rows that may not are untouched."""
    shape = (1, 9, 3, 2, 600, 64, 64)
    q, (kq, ks, vq, vs), _, _ = _problem(shape, torch.float32, "none", seed=5)
    sc = ks if which == "k_scale" else vs
    sc[0, 1, 200] = math.nan  # head 1, key 200
    kw = dict(causal=True, mask=torch.ones(1, 1, 2, 600, dtype=torch.bool))
    kw["mask"][..., 1, 200] = False  # query row 1 may not attend key 200; row 0 may
    got = _int8(q, (kq, ks, vq, vs), **kw)
    k32, v32 = kq.float() * ks[..., None], vq.float() * vs[..., None]
    want = rule_oracle(q, k32, v32, allowed=_allowed(q, 600, kw))
    assert torch.equal(got.isnan(), want.isnan())
    assert got[0, 3:6, 0].isnan().all() and not got[0, 3:6, 1].isnan().any()
    assert not got[0, :3].isnan().any() and not got[0, 6:].isnan().any()
    fin = ~want.isnan()
    assert (got.double()[fin] - want[fin]).abs().max() <= 1e-5


@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_is_deterministic_and_thread_count_independent(dtype):
    q, kv, _, kw = _problem((1, 9, 3, 2, 3000, 64, 64), dtype, "all", seed=3)
    first = _int8(q, kv, **kw)
    single = with_threads(1, lambda: _int8(q, kv, **kw))
    for _ in range(3):
        assert torch.equal(_int8(q, kv, **kw), first)
    assert torch.equal(single, first)


def test_bench_int8_rows_count_the_bytes_they_read():
    from mha.bench.core import Context, Row
    from mha.bench.decode import INT8, READS, all_cases, int8_bytes_read, relative_to_read

    case = next(c for c in all_cases(Context(quick=True)) if c.name.endswith("int8 vs bf16"))
    assert case.name == "step B1 h32 d128 Tk4096 int8 vs bf16" and case.baseline == "mha bf16 K/V"
    assert {i.name for i in case.impls} >= {INT8, "mha bf16 K/V", "onnxruntime GQA", *READS}
    bf16, int8 = 2 * 32 * 4096 * 128 * 2, 2 * 32 * 4096 * (128 + 4)  # K+V (+ fp32 scales)
    assert case.bytes == bf16 and case.params["int8_bytes"] == int8
    rows = [Row("decode", case.name, name, seconds=s, bytes=case.bytes, metric="gbs",
                params=dict(case.params)) for name, s in ((INT8, 0.01), (READS[0], 0.02))]
    int8_bytes_read(rows)
    relative_to_read(rows)
    assert rows[0].bytes == int8 and rows[1].bytes == bf16
    assert rows[0].pct_peak == pytest.approx(100 * (int8 / 0.01) / (bf16 / 0.02))


@NEEDS_KERNEL
def test_bf16_query_rows_of_wide_range_stay_within_the_bf16_rule():
    """A bf16 q row against int8 K runs as int16 (one scale per row): a row mixing 1000 with
    1e-3 loses its small elements' low bits, far below what bf16 itself keeps."""
    q, kv, (k32, v32), kw = _problem((1, 9, 3, 1, 700, 64, 64), torch.bfloat16, "causal", seed=7)
    q = q.float() * 1e-3
    q[0, 2, 0, 5] = 1000.0
    q[0, 4, 0, :] *= 1e6
    q = q.bfloat16()
    got = _int8(q, kv, **kw)
    _check(got, q, k32, v32, _allowed(q, 700, kw), torch.bfloat16)


@NEEDS_KERNEL
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_bf16_query_row_gives_the_portable_loops_result(bad):
    """NaN / Inf in a bf16 q row (which the int16 form cannot hold): that row's result is the
    IEEE one of the portable loops (NaN), the other rows unchanged."""
    q, kv, _, kw = _problem((1, 9, 3, 1, 300, 64, 64), torch.bfloat16, "none", seed=8)
    q[0, 4, 0, 10] = bad
    got, portable = _int8(q, kv), _int8(q, kv, portable=True)
    assert torch.equal(got.isnan(), portable.isnan()) and got[0, 4].isnan().all()
    fin = ~portable.isnan()
    assert (got.float()[fin] - portable.float()[fin]).abs().max() <= 2e-2
