"""int8 K/V storage: ``mha.KVCache(..., kv_dtype="int8")`` quantizes on append and decodes
through ``flash_decode``'s int8 path (``k_scale`` / ``v_scale``). The kernel against the float64
loop on the dequantized K/V (the rule of ``oracle.py``); the error against the same cache in
full precision within the bound derived in the KVCache docstring; refusals.

Shape legend: B batch, h / h_kv query / key-value heads, Tq / Tk lengths, d head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha import reference
from mha.ops import decode
from test_decode import NEEDS_KERNEL

from oracle import FLOOR, max_err


def _caches(B, h_kv, Tk, d, dtype, g, lengths=None):
    """The same K/V appended to a full-precision and an int8 cache (ragged when ``lengths``)."""
    k, v = (torch.randn(B, h_kv, Tk, d, generator=g).to(dtype) for _ in range(2))
    k = k * (1 + 3 * torch.rand(B, h_kv, Tk, 1, generator=g)).to(dtype)  # rows of mixed ranges
    full = mha.KVCache(B, h_kv, Tk + 4, d, dtype=dtype)
    int8 = mha.KVCache(B, h_kv, Tk + 4, d, dtype=dtype, kv_dtype="int8")
    with torch.no_grad():
        for c in (full, int8):
            c.append(k, v)
            if lengths is not None:
                c.truncate(lengths)
    return full, int8


def _variants(names, h, g):
    out = {}
    if "softcap" in names:
        out["softcap"] = 3.0
    if "sinks" in names:
        out["sinks"] = torch.randn(h, generator=g)
    if "alibi_slopes" in names:
        out["alibi_slopes"] = mha.alibi_slopes(h)
    return out


def _bound(q, full: mha.KVCache, scale: float) -> torch.Tensor:
    """``(B, h, Tq, d_v)`` float64: the KVCache docstring's bound, with the maxima taken over
    every cached key of the row's K/V head (a superset of the keys a row sees: still a bound).

    eps = scale * ||q||_1 * max_j absmax(k_j) / 254;
    bound[c] = max_j absmax(v_j) / 254 + (e^(2 eps) - 1) * max_j |v_j[c]|."""
    B, h, Tq, _ = q.shape
    k, v = full.keys().double(), full.values().double()  # (B, h_kv, Tk, d)
    g = h // k.shape[1]
    kmax = k.abs().amax(dim=(2, 3)).repeat_interleave(g, 1)  # (B, h_kv) -> (B, h)
    vrow = v.abs().amax(dim=(2, 3)).repeat_interleave(g, 1)  # (B, h): max_j absmax(v_j)
    vcol = v.abs().amax(dim=2).repeat_interleave(g, 1)  # (B, h, d_v): max_j |v_j[c]|
    eps = scale * q.double().abs().sum(-1) * kmax[:, :, None] / 254  # (B, h, Tq)
    return (vrow[:, :, None, None] / 254
            + torch.expm1(2 * eps)[..., None] * vcol[:, :, None, :])  # (B, h, Tq, d_v)


@NEEDS_KERNEL
@given(B=st.integers(1, 2), h_kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       Tq=st.integers(1, 4), Tk=st.integers(4, 600), d=st.sampled_from([16, 64]),
       names=st.sets(st.sampled_from(["softcap", "sinks", "alibi_slopes"])),
       seed=st.integers(0, 2**16))
def test_int8_cache_is_within_the_derived_bound_of_the_fp32_cache(B, h_kv, group, Tq, Tk, d,
                                                                     names, seed):
    g = torch.Generator().manual_seed(seed)
    h = h_kv * group
    full, int8 = _caches(B, h_kv, Tk, d, torch.float32, g)
    q = torch.randn(B, h, Tq, d, generator=g) * 2  # (B, h, Tq, d)
    kw = _variants(names, h, g)
    masks = full.masks(Tq)
    allowed = None if not masks else mha.causal_mask(Tq, Tk)
    with torch.no_grad():
        got, want = int8.attend(q, **kw), full.attend(q, **kw)  # (B, h, Tq, d)
    bound = _bound(q, full, 1 / math.sqrt(d))
    # exact (float64) outputs on the dequantized and on the original K/V: the bound is math
    ref8 = reference.attention(q, int8.keys(), int8.values(), allowed=allowed, upcast=True, **kw)[0]
    ref = reference.attention(q, full.keys(), full.values(), allowed=allowed, upcast=True, **kw)[0]
    assert ((ref8 - ref).abs() <= bound * (1 + 1e-9) + 1e-12).all()
    # the kernels: the same, plus each one's own measured float32 error (triangle inequality)
    slack = (got.double() - ref8).abs() + (want.double() - ref).abs()
    assert ((got.double() - want.double()).abs() <= bound + slack).all()
    assert (got.double() - want.double()).abs().max() > 0  # int8 is not lossless here


@NEEDS_KERNEL
@pytest.mark.parametrize("portable", [False, True], ids=["vec", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Tq", [1, 3, 16])
def test_int8_kernel_matches_the_float64_loop_on_the_dequantized_cache(Tq, dtype, portable):
    """Ragged rows (key_lengths + a per-row mask), GQA, several key splits, every variant."""
    g = torch.Generator().manual_seed(Tq)
    B, h_kv, h, Tk, d = 2, 2, 6, 1500, 64
    _, int8 = _caches(B, h_kv, Tk, d, dtype, g, lengths=torch.tensor([Tk, 700]))
    q = torch.randn(B, h, Tq, d, generator=g).to(dtype)
    kw = dict(softcap=5.0, sinks=torch.randn(h, generator=g), alibi_slopes=mha.alibi_slopes(h),
              bias=torch.randn(h, 1, Tk, generator=g))
    masks = int8.masks(Tq)
    Tk_ = int8.max_length
    with torch.no_grad():
        got = decode.flash_decode(q, int8.k[:, :, :Tk_], int8.v[:, :, :Tk_],
                                  k_scale=int8.k_scale[:, :, :Tk_], v_scale=int8.v_scale[:, :, :Tk_],
                                  portable=portable, **masks, **kw)
        assert torch.equal(got, int8.attend(q, **kw)) or portable
    k, v = int8.keys(), int8.values()  # dequantized (B, h_kv, Tk, d), in dtype
    allowed = mha.MaskSpec(masks.get("causal", False), masks.get("key_lengths"),
                           masks.get("mask")).materialize(B, h, Tq, Tk_)
    ref = reference.attention(q, k, v, allowed=allowed, upcast=True, **kw)[0]
    low = reference.attention(q, k, v, allowed=allowed, **kw)[0]
    if dtype == torch.bfloat16:  # the kernel reads the exact int8 * scale, not its bf16 copy
        k32, v32 = (t.float() * s[:, :, :Tk_, None] for t, s in
                    ((int8.k[:, :, :Tk_], int8.k_scale), (int8.v[:, :, :Tk_], int8.v_scale)))
        ref = reference.attention(q.float(), k32, v32, allowed=allowed, upcast=True, **kw)[0]
    budget = 2.0 * max_err(low, ref) + FLOOR[dtype]
    assert max_err(got, ref) <= budget


def test_quantize_int8_meets_its_stated_element_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g) * torch.rand(3, 5, 1, generator=g) * 10
    x[0, 0] = 0.0  # a zero row: scale 0, zeros back
    xq, s = decode.quantize_int8(x)
    assert xq.dtype == torch.int8 and s.shape == (3, 5) and s.dtype == torch.float32
    back = xq.float() * s[..., None]
    absmax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= absmax / 254 * (1 + 1e-6)).all()
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert int(xq.abs().max()) == 127


def test_int8_storage_is_one_byte_per_element_with_fp32_scales():
    c = mha.KVCache(2, 3, 10, 16, 8, dtype=torch.bfloat16, kv_dtype="int8")
    assert c.k.dtype == c.v.dtype == torch.int8 and c.dtype == torch.bfloat16
    assert c.k_scale.shape == c.v_scale.shape == (2, 3, 10) and c.k_scale.dtype == torch.float32
    assert "kv_dtype=int8" in repr(c)
    assert mha.KVCache(1, 1, 4, 8).k_scale is None


@pytest.mark.parametrize("bad", ["int4", "fp8", torch.float16, torch.uint8, 8, ""])
def test_a_bad_kv_dtype_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="kv_dtype"):
        mha.KVCache(1, 2, 8, 16, kv_dtype=bad)


def test_a_refused_append_leaves_the_int8_cache_unchanged():
    g = torch.Generator().manual_seed(0)
    c = mha.KVCache(2, 2, 6, 8, kv_dtype="int8")
    with torch.no_grad():
        c.append(torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g))
        before = [t.clone() for t in (c.k, c.v, c.k_scale, c.v_scale, c.lengths)]
        bad_k = torch.randn(2, 2, 2, 8, generator=g)
        bad_k[1, 0, 1, 3] = math.inf
        with pytest.raises(ValueError, match="k_new"):
            c.append(bad_k, torch.randn(2, 2, 2, 8, generator=g))
        with pytest.raises(ValueError, match="capacity"):
            c.append(torch.randn(2, 2, 4, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g))
        with pytest.raises(TypeError, match="k_new"):
            c.append(torch.randn(2, 2, 1, 8).double(), torch.randn(2, 2, 1, 8))
    for t, b in zip((c.k, c.v, c.k_scale, c.v_scale, c.lengths), before, strict=True):
        assert torch.equal(t, b)


@NEEDS_KERNEL
def test_reorder_moves_the_scales_with_their_rows():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 9, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g)
    a = mha.KVCache(3, 2, 12, 16, kv_dtype="int8")
    b = mha.KVCache(3, 2, 12, 16, kv_dtype="int8")
    index = torch.tensor([2, 2, 0])
    q = torch.randn(3, 4, 1, 16, generator=g)
    with torch.no_grad():
        a.append(k, v)
        a.reorder(index)
        b.append(k[index], v[index])
        assert torch.equal(a.attend(q), b.attend(q))


@NEEDS_KERNEL
def test_the_module_decodes_through_an_int8_cache():
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 10, 32)
    full = m.new_cache(2, 12)
    int8 = mha.KVCache(2, 2, 12, 8, kv_dtype="int8")
    with torch.no_grad():
        a, b = m(x, cache=full), m(x, cache=int8)
        assert b.shape == a.shape and (a - b).abs().max() < 0.05
        a, b = m(x[:, :1], cache=full), m(x[:, :1], cache=int8)
        assert (a - b).abs().max() < 0.05


BAD_INT8 = [  # (keyword arguments, error, the argument named)
    (dict(k_scale=torch.ones(1, 2, 8)), TypeError, "v_scale"),
    (dict(k_scale=torch.ones(1, 2, 8), v_scale=torch.ones(1, 2, 7)), ValueError, "v_scale"),
    (dict(k_scale=torch.ones(1, 2, 8).double(), v_scale=torch.ones(1, 2, 8)), TypeError,
     "k_scale"),
]


@pytest.mark.parametrize("kw,error,name", BAD_INT8, ids=[n for _, _, n in BAD_INT8])
def test_the_int8_entry_point_names_a_bad_scale(kw, error, name):
    q = torch.randn(1, 4, 1, 16)
    k = torch.zeros(1, 2, 8, 16, dtype=torch.int8)
    with torch.no_grad(), pytest.raises(error, match=name):
        decode.flash_decode(q, k, k, **kw)
    with torch.no_grad(), pytest.raises(TypeError, match="k must be an int8"):
        decode.flash_decode(q, k.float(), k, k_scale=torch.ones(1, 2, 8),
                            v_scale=torch.ones(1, 2, 8))


@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck_with_int8_kv(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 32, generator=g).to(dtype)
    kq, ks = decode.quantize_int8(torch.randn(2, 2, 70, 32, generator=g))
    vq, vs = decode.quantize_int8(torch.randn(2, 2, 70, 16, generator=g))
    args = (q, kq, vq, torch.tensor([70, 33]), None, 1 / math.sqrt(32), True, None, None, None,
            None, ks, vs)
    for op in (torch.ops.mha.flash_decode.default, torch.ops.mha.flash_decode_portable.default):
        torch.library.opcheck(op, args)
