"""The native decode kernel (``mha.ops.decode.flash_decode``, op ``mha::flash_decode``) against the
fp64 seed-000 oracle, its determinism, its op registration, and its backend's capabilities.

Shape legend: B batch, h / h_kv query / key-value heads, Tq / Tk lengths, d_k / d_v head dims.
"""

from __future__ import annotations

import math

import pytest
import torch

import mha
from mha.masks import MaskSpec
from mha.ops import build, decode
from threads import with_threads

from oracle import assert_within_budget

NEEDS_KERNEL = pytest.mark.skipif(decode.unavailable() is not None,
                                  reason=f"decode kernel unavailable: {decode.unavailable()}")

# (B, h, h_kv, Tq, Tk, d_k, d_v): MHA / GQA / MQA, one and several key splits (64 … 1024
# keys each, by shape), Tk and head dims off the vector widths, d_v != d_k, d > 128 (two column
# blocks), Tq = 16, d_k = 256 (fp32: each of a score's 16 lanes sums 16 of its products). bf16
# with d_k % 32 == 0, d_k <= 128 and G = h / h_kv * Tq <= 16 scores on AMX tiles (32 keys at a
# time, the rest of a split on AVX-512): G = 1, 4, 6, 8, 16 below; G = 24 and 32, and d_k = 40,
# 200 or 256, take the vdpbf16ps path. G = 1 with d_k a whole number of vectors reads each
# block's K rows one after the other (qk_rows' one-row order), the blocks' tails masked.
SHAPES = [
    (1, 4, 4, 1, 1, 16, 16),
    (1, 4, 4, 1, 1000, 128, 128),
    (1, 3, 3, 1, 530, 64, 48),
    (1, 16, 1, 1, 333, 32, 32),
    (1, 8, 1, 3, 300, 64, 40),
    (2, 8, 2, 1, 300, 64, 64),
    (1, 8, 1, 4, 777, 40, 24),
    (3, 6, 3, 16, 520, 128, 128),
    (1, 2, 2, 7, 1100, 200, 136),
    (2, 4, 2, 3, 33, 96, 72),
    (2, 4, 2, 2, 300, 256, 128),
]
MASKS = ("none", "causal", "key_lengths", "mask", "all")


def _problem(shape, dtype, masks, seed=0):
    B, h, h_kv, Tq, Tk, d_k, d_v = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Tq, d_k, generator=g).to(dtype)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g).to(dtype)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g).to(dtype)
    kw = {}
    if masks in ("causal", "all"):
        kw["causal"] = True
    if masks in ("key_lengths", "all"):
        kl = torch.randint(0, Tk + 1, (B,), generator=g)
        kl[0] = Tk  # one full row; others random (possibly 0: that row returns zeros)
        kw["key_lengths"] = kl
    if masks in ("mask", "all"):
        kw["mask"] = torch.rand(B, 1, Tq, Tk, generator=g) > 0.3
    return q, k, v, kw


def _allowed(q, k, kw):
    spec = MaskSpec(kw.get("causal", False), kw.get("key_lengths"), kw.get("mask"))
    return spec.materialize(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def test_kernel_builds_here():
    """The project's machines have a compiler: the kernel must build (not silently skip)."""
    assert decode.unavailable() is None


@NEEDS_KERNEL
@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_the_oracle(shape, masks, dtype, portable):
    q, k, v, kw = _problem(shape, dtype, masks)
    out = decode.flash_decode(q, k, v, portable=portable, **kw)
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert_within_budget(out, q, k, v, _allowed(q, k, kw))


@NEEDS_KERNEL
def test_rows_without_keys_are_zeros():
    q, k, v, _ = _problem((2, 4, 2, 3, 40, 32, 32), torch.float32, "none")
    out = decode.flash_decode(q, k, v, key_lengths=torch.tensor([0, 40]),
                              mask=torch.zeros(1, 1, 3, 40, dtype=torch.bool).index_fill_(
                                  3, torch.tensor([5]), True))
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no key at all
    empty = torch.zeros(2, 2, 0, 32)  # Tk = 0: the op itself returns zeros too
    assert torch.equal(torch.ops.mha.flash_decode(q, empty, empty, None, None, 1.0, False),
                       torch.zeros(2, 4, 3, 32))
    assert torch.allclose(out[1], v[1, :, 5:6].repeat_interleave(2, 0).expand(4, 3, 32))


@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deterministic_and_thread_count_independent(dtype):
    q, k, v, kw = _problem((1, 8, 2, 2, 3000, 64, 64), dtype, "all", seed=3)
    first = decode.flash_decode(q, k, v, **kw)
    single = with_threads(1, lambda: decode.flash_decode(q, k, v, **kw))
    for _ in range(3):
        assert torch.equal(decode.flash_decode(q, k, v, **kw), first)
    assert torch.equal(single, first)


@NEEDS_KERNEL
def test_reads_a_strided_cache_view_in_place():
    """A (B, h_kv, Tk, d) view of longer storage gives the same bits as a contiguous copy."""
    q, k, v, _ = _problem((2, 4, 2, 1, 500, 64, 64), torch.float32, "none")
    store_k = torch.zeros(2, 2, 800, 64)
    store_v = torch.zeros(2, 2, 800, 64)
    store_k[:, :, :500], store_v[:, :, :500] = k, v
    view_k, view_v = store_k[:, :, :500], store_v[:, :, :500]
    assert not view_k.is_contiguous()
    assert torch.equal(decode.flash_decode(q, view_k, view_v), decode.flash_decode(q, k, v))


@NEEDS_KERNEL
def test_refuses_gradients_with_a_reason():
    q, k, v, _ = _problem((1, 2, 2, 1, 10, 16, 16), torch.float32, "none")
    with pytest.raises(RuntimeError, match="inference"):
        decode.flash_decode(q.requires_grad_(), k, v)
    with pytest.raises(RuntimeError, match="no backward pass"):  # the op itself, too
        torch.ops.mha.flash_decode(q, k, v, None, None, 0.25, False)
    with torch.no_grad():
        assert torch.ops.mha.flash_decode(q, k, v, None, None, 0.25, False).shape == (1, 2, 1, 16)
    reasons = {vd.backend: vd.reasons for vd in mha.explain(q, k, v)}["flash_decode"]
    assert any("no backward" in r for r in reasons)


@NEEDS_KERNEL
def test_backend_reasons_in_words():
    q, k, v, _ = _problem((1, 2, 2, 17, 20, 16, 16), torch.float32, "none")
    verdicts = {vd.backend: vd for vd in mha.explain(q, k, v, causal=True)}
    assert "Tq=17 > 16" in "; ".join(verdicts["flash_decode"].reasons)
    assert mha.explain(q[:, :, :8], k, v).chosen == "flash_decode"
    # 16 query rows per K/V head against 20 keys: it can serve, and leaves it to the tiles
    at16 = mha.explain(q[:, :, :16], k, v)
    decode_verdict = next(x for x in at16 if x.backend == "flash_decode")
    assert decode_verdict.ok and "16 query rows per K/V head" in decode_verdict.defers
    assert at16.chosen == "flash_cpu"
    r64 = {vd.backend: vd for vd in mha.explain(q.double(), k.double(), v.double())}
    assert any("dtype float64" in r for r in r64["flash_decode"].reasons)
    with pytest.raises(mha.BackendError, match="flash_decode"):
        mha.attention(q, k, v, backend="flash_decode", dropout_p=0.1)


@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masks", ["none", "all"])
def test_opcheck(dtype, masks):
    q, k, v, kw = _problem((2, 4, 2, 3, 70, 32, 16), dtype, masks)
    args = (q, k, v, kw.get("key_lengths"), kw.get("mask"), 1 / math.sqrt(32),
            kw.get("causal", False))
    for op in (torch.ops.mha.flash_decode.default, torch.ops.mha.flash_decode_portable.default):
        torch.library.opcheck(op, args)


def test_a_failed_build_warns_once_and_dispatch_falls_back(monkeypatch):
    def broken(name, sources, verbose=False):
        raise build.BuildError("no C++ compiler found (simulated)")

    monkeypatch.setattr(build, "load", broken)
    build.forget(decode.EXTENSION)
    try:
        with pytest.warns(RuntimeWarning, match="simulated"):
            reason = decode.unavailable()
        assert "simulated" in reason
        q, k, v, _ = _problem((1, 2, 2, 1, 10, 16, 16), torch.float32, "none")
        verdicts = {vd.backend: vd for vd in mha.explain(q, k, v)}
        assert verdicts["flash_decode"].reasons == (reason,)
        assert mha.explain(q, k, v).chosen != "flash_decode"
        torch.testing.assert_close(mha.attention(q, k, v), mha.attention(q, k, v, backend="math"))
    finally:
        monkeypatch.undo()
        build.forget(decode.EXTENSION)
    assert decode.unavailable() is None


def test_bench_suite_states_bandwidth_against_the_faster_read_row():
    from mha.bench.core import Context, Row
    from mha.bench.decode import READS, all_cases, relative_to_read

    names = [c.name for c in all_cases(Context(quick=True))]
    assert "step B1 h32 d128 Tk4096 float32" in names and "step B1 h32 d128 Tk4096 bfloat16" in names
    case = next(c for c in all_cases(Context(quick=True)) if c.name.endswith("Tk4096 float32"))
    assert {i.name for i in case.impls} >= {"mha", "torch sdpa", "torch.cat + sdpa",
                                            "onnxruntime GQA", *READS}
    rows = [Row("decode", "c", name, seconds=s, bytes=1e9, metric="gbs")
            for name, s in (("mha", 0.05), (READS[0], 0.04), (READS[1], 0.025))]
    relative_to_read(rows)
    assert [round(r.pct_peak) for r in rows] == [50, 62, 100]  # vs the faster read (40 GB/s)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16-as-fp16"])
@pytest.mark.parametrize("h_kv", [4, 2])
def test_ort_gqa_decode_peer_computes_the_same_step(dtype, tol, h_kv):
    """The ONNX Runtime GroupQueryAttention peer of the decode suite: one step against a past
    cache gives SDPA's output (over the cache including the new token), call after call."""
    pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install 'mha[onnx]')")
    from mha.bench import peers

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 32, generator=g).to(dtype)  # (B, h, 1, d)
    k = torch.randn(2, h_kv, 70, 32, generator=g).to(dtype)  # (B, h_kv, Tk, d), new token last
    v = torch.randn(2, h_kv, 70, 32, generator=g).to(dtype)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           enable_gqa=True)
    fn = peers.ort_gqa_decode(q, k, v)
    for _ in range(2):  # the in-place append rewrites the same position: repeatable
        fn()
        assert (fn.result() - ref).abs().max().item() <= tol
    assert ("fp16" in fn.note) == (dtype == torch.bfloat16)


@NEEDS_KERNEL
@pytest.mark.parametrize(("dtype", "h", "h_kv", "Tq", "Tk", "chosen"), [
    (torch.float32, 8, 8, 8, 20, "flash_decode"),     # 8 rows per K/V head
    (torch.float32, 8, 8, 16, 20, "flash_cpu"),       # 16 rows, short keys
    (torch.float32, 8, 8, 16, 256, "flash_decode"),   # one query head per K/V head, long keys
    (torch.float32, 9, 3, 8, 256, "flash_cpu"),       # 24 rows with GQA, long keys too
    (torch.float32, 9, 3, 4, 256, "flash_decode"),    # 12 rows
    (torch.bfloat16, 8, 8, 16, 20, "flash_decode"),   # bf16: from 32 rows
    (torch.bfloat16, 9, 3, 16, 64, "flash_cpu"),      # 48 rows
])
def test_few_query_rows_go_to_the_measured_kernel(dtype, h, h_kv, Tq, Tk, chosen):
    """Inference with Tq <= 16: flash_decode leaves calls of many query rows per K/V head to
    the tile kernel (mha.backends.flash_decode.DEFER_ROWS), and both agree with the oracle."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, Tq, 64, generator=g).to(dtype)  # (B, h, Tq, d)
    k, v = (torch.randn(1, h_kv, Tk, 64, generator=g).to(dtype) for _ in range(2))
    from mha.backends.flash_decode import tiles_measured

    if not tiles_measured(dtype):  # (the portable loops, AMX tiles: not measured, kept on decode)
        chosen = "flash_decode"
    assert mha.explain(q, k, v).chosen == chosen
    ref = mha.attention(q.double(), k.double(), v.double(), backend="reference")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for backend in (None, "flash_decode", "flash_cpu"):
        torch.testing.assert_close(mha.attention(q, k, v, backend=backend).double(), ref,
                                   atol=tol, rtol=tol)
