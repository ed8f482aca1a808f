"""The score variants (softcap, sinks, bias, ALiBi) inside the native decode kernel
(``mha.ops.decode.flash_decode``, both ops), against the float64 per-head loop with the
tolerance rule of ``oracle.py``; the sink counted once across key splits; rows without keys;
the bias read in place; dispatch and the errors of the decode entry point.

Shape legend: B batch, h / h_kv query / key-value heads, Tq / Tk lengths, d_k / d_v head dims.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha import reference
from mha.masks import MaskSpec
from mha.ops import decode
from test_decode import NEEDS_KERNEL, SHAPES, _problem
from threads import with_threads

from oracle import FLOOR, max_err

VARIANT_ARGS = ("softcap", "sinks", "bias", "alibi_slopes")
PATHS = pytest.mark.parametrize("portable", [False, True], ids=["vec", "portable"])


def _allowed(q, k, kw):
    spec = MaskSpec(kw.get("causal", False), kw.get("key_lengths"), kw.get("mask"))
    return spec.materialize(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _check(got, q, k, v, kw, variants, what="flash_decode"):
    """The rule of oracle.py: error vs the float64 loop <= 2x the naive low-precision loop's
    error + floor (the variants go to the loop as given)."""
    allowed = _allowed(q, k, kw)
    ref = reference.attention(q, k, v, allowed=allowed, upcast=True, **variants)[0]
    low = reference.attention(q, k, v, allowed=allowed, **variants)[0]
    budget = 2.0 * max_err(low, ref) + FLOOR[q.dtype]
    err = max_err(got, ref)
    assert err <= budget, f"{what}: error {err:.3e} > budget {budget:.3e}"


def _variants(names, B, h, Tq, Tk, dtype, g):
    """One value per variant name: sinks (h,), a (B, h, Tq, Tk) bias, the paper's slopes."""
    out = {}
    if "softcap" in names:
        out["softcap"] = 2.0
    if "sinks" in names:
        out["sinks"] = torch.randn(h, generator=g) * 2
    if "bias" in names:
        out["bias"] = torch.randn(B, h, Tq, Tk, generator=g).to(dtype)
    if "alibi_slopes" in names:
        out["alibi_slopes"] = mha.alibi_slopes(h)
    return out


# ------------------------------------------------------------------ the table

COMBOS = [("softcap",), ("sinks",), ("bias",), ("alibi_slopes",), ("softcap", "sinks"),
          ("bias", "alibi_slopes"), VARIANT_ARGS]


@NEEDS_KERNEL
@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("names", COMBOS, ids=lambda n: "+".join(n))
@pytest.mark.parametrize("shape", SHAPES[1:7], ids=lambda s: "x".join(map(str, s)))
def test_each_variant_and_combination_matches_the_oracle(shape, names, dtype, portable):
    q, k, v, kw = _problem(shape, dtype, "all", seed=1)
    B, h, _, Tq, Tk, _, _ = shape
    variants = _variants(names, B, h, Tq, Tk, dtype, torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = decode.flash_decode(q, k, v, portable=portable, **kw, **variants)
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == dtype
    assert torch.isfinite(out).all()
    _check(out, q, k, v, kw, variants)


# ------------------------------------------------------------------ the property


@st.composite
def decode_calls(draw):
    """A decode call: GQA, Tq in 1..16, Tq != Tk (possibly Tq > Tk: rows without keys), a
    drawn mix of masks, and a non-empty set of variants (bias broadcast, strided or converted)."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    B, h_kv = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2, 3]))
    Tq, Tk = draw(st.integers(1, 16)), draw(st.integers(1, 300))
    d_k, d_v = draw(st.sampled_from([16, 40, 64])), draw(st.sampled_from([16, 24, 64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    q, k, v = rand(B, h, Tq, d_k), rand(B, h_kv, Tk, d_k), rand(B, h_kv, Tk, d_v)
    kw = {}
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        kw["key_lengths"] = torch.tensor([draw(st.integers(0, Tk)) for _ in range(B)])
    if draw(st.booleans()):  # may empty whole rows
        kw["mask"] = torch.rand(B, 1, Tq, Tk, generator=g) < draw(st.sampled_from([0.1, 0.8]))
    variants = {}
    chosen = draw(st.sets(st.sampled_from(VARIANT_ARGS), min_size=1))
    if "softcap" in chosen:
        variants["softcap"] = draw(st.sampled_from([0.5, 5.0, 50.0]))
    if "sinks" in chosen:
        variants["sinks"] = rand(h, dt=torch.float32) * 3
    if "bias" in chosen:
        kind = draw(st.sampled_from(["full", "head_key", "key", "row", "transposed", "expanded",
                                     "float64"]))
        if kind == "full":
            variants["bias"] = rand(B, h, Tq, Tk)
        elif kind == "head_key":  # (h, 1, Tk): T5-like, one row for every query
            variants["bias"] = rand(h, 1, Tk)
        elif kind == "key":
            variants["bias"] = rand(Tk)
        elif kind == "row":
            variants["bias"] = rand(B, 1, Tq, 1)
        elif kind == "transposed":  # (B, h, Tk, Tq) memory read as (B, h, Tq, Tk)
            variants["bias"] = rand(B, h, Tk, Tq).transpose(2, 3)
        elif kind == "expanded":  # stride 0 on the batch and query dims
            variants["bias"] = rand(1, h, 1, Tk).expand(B, h, Tq, Tk)
        else:
            variants["bias"] = rand(1, h, Tq, Tk, dt=torch.float64)
    if "alibi_slopes" in chosen:
        variants["alibi_slopes"] = (mha.alibi_slopes(h) if draw(st.booleans())
                                    else rand(B, h, dt=torch.float32).abs())
    return q, k, v, kw, variants, draw(st.booleans())


@NEEDS_KERNEL
@given(case=decode_calls())
def test_decode_with_variants_matches_the_float64_loop(case):
    q, k, v, kw, variants, portable = case
    with torch.no_grad():
        out = decode.flash_decode(q, k, v, portable=portable, **kw, **variants)
        via = mha.attention(q, k, v, backend="flash_decode", **kw, **variants)
    _check(out, q, k, v, kw, variants)
    if not portable:
        assert torch.equal(via, out)  # the backend is the same op
    allowed = _allowed(q, k, kw)
    if allowed is not None:
        no_key = ~allowed.expand(*q.shape[:3], k.shape[2]).any(-1)  # (B, h, Tq)
        assert not out[no_key].any(), "a row with no visible key must be zeros, sink or not"


# ------------------------------------------------------------------ the sink, the rows, the bias


@NEEDS_KERNEL
@PATHS
@pytest.mark.parametrize("Tk", [1, 63, 64, 1000, 5000])
def test_the_sink_enters_each_denominator_once_across_splits(Tk, portable):
    """q = 0: every score is 0, so out = sum_j v_j / (Tk + exp(sink)) exactly as a formula —
    a sink added per split (Tk = 5000 has several) would show up at once."""
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 4, 2, 32)
    k, v = torch.randn(1, 2, Tk, 32, generator=g), torch.randn(1, 2, Tk, 32, generator=g)
    sinks = torch.tensor([0.0, 1.5, -2.0, 4.0])
    with torch.no_grad():
        out = decode.flash_decode(q, k, v, sinks=sinks, portable=portable)  # (1, 4, 2, 32)
    total = v.double().sum(2).repeat_interleave(2, 1)  # (1, 2, 32) -> (1, 4, 32) per head
    want = total / (Tk + sinks.double().exp()).view(1, 4, 1)  # (1, 4, 32)
    torch.testing.assert_close(out.double(), want[:, :, None].expand(1, 4, 2, 32),
                               rtol=1e-4, atol=1e-5)


@NEEDS_KERNEL
@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_without_keys_are_zeros_with_every_variant(dtype, portable):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 3, 32, generator=g).to(dtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # h_kv = 2
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1, :] = False  # query 1 sees nothing
    variants = dict(softcap=1.0, sinks=torch.full((4,), 3.0), bias=torch.randn(3, 3, generator=g),
                    alibi_slopes=mha.alibi_slopes(4))
    with torch.no_grad():
        out = decode.flash_decode(q, k, v, mask=mask, key_lengths=torch.tensor([0, 3]),
                                  portable=portable, **variants)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # key_lengths 0: no key at all
    assert torch.equal(out[1, :, 1], torch.zeros_like(out[1, :, 1]))
    assert out[1, :, 0].abs().sum() > 0
    _check(out, q, k, v, dict(mask=mask, key_lengths=torch.tensor([0, 3])), variants)


@NEEDS_KERNEL
def test_a_broadcast_bias_is_read_in_place_and_equals_its_dense_copy():
    """A stride-0 (expanded) view, a transposed view and a contiguous copy of the same bias
    give the same bits: the kernel reads the bias through its strides."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 64, generator=g)
    k, v = torch.randn(2, 3, 700, 64, generator=g), torch.randn(2, 3, 700, 64, generator=g)
    row = torch.randn(1, 6, 1, 700, generator=g)
    expanded = row.expand(2, 6, 4, 700)
    transposed = row.expand(2, 6, 4, 700).contiguous().transpose(2, 3).contiguous().transpose(2, 3)
    assert expanded.stride(0) == 0 and not transposed.is_contiguous()
    with torch.no_grad():
        outs = [decode.flash_decode(q, k, v, bias=b, causal=True)
                for b in (row, expanded, transposed, expanded.contiguous())]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_a_broadcast_bias_is_converted_without_being_expanded(dtype):
    row = torch.randn(1, 6, 1, 700).to(dtype)  # (1, h, 1, Tk)
    expanded = row.expand(2, 6, 4, 700)  # (B, h, Tq, Tk), stride 0 on B and Tq
    got = decode._fp32(expanded)
    assert got.dtype == torch.float32 and got.shape == expanded.shape
    assert got.stride(0) == 0 and got.stride(2) == 0
    assert got.untyped_storage().nbytes() == row.numel() * 4  # only the stored elements
    assert torch.equal(got, expanded.float())


@NEEDS_KERNEL
def test_a_nan_bias_on_masked_pairs_never_reaches_the_output():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 16, generator=g)
    k, v = torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    allowed = mha.causal_mask(4, 9)  # (4, 9), bottom-right aligned
    bias = torch.randn(2, 4, 9, generator=g)
    with torch.no_grad():
        poisoned = decode.flash_decode(q, k, v, causal=True, bias=bias.masked_fill(~allowed, math.nan))
        clean = decode.flash_decode(q, k, v, causal=True, bias=bias)
    assert torch.equal(poisoned, clean)


@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deterministic_and_thread_count_independent_with_variants(dtype):
    q, k, v, kw = _problem((1, 8, 2, 2, 3000, 64, 64), dtype, "all", seed=3)
    variants = _variants(VARIANT_ARGS, 1, 8, 2, 3000, dtype, torch.Generator().manual_seed(4))
    with torch.no_grad():
        first = decode.flash_decode(q, k, v, **kw, **variants)
        single = with_threads(1, lambda: decode.flash_decode(q, k, v, **kw, **variants))
        assert torch.equal(decode.flash_decode(q, k, v, **kw, **variants), first)
    assert torch.equal(single, first)


# ------------------------------------------------------------------ dispatch, errors, the op


@NEEDS_KERNEL
@pytest.mark.parametrize("names", COMBOS, ids=lambda n: "+".join(n))
def test_explain_names_flash_decode_for_a_decode_step_with_variants(names):
    q, k, v, _ = _problem((1, 4, 2, 1, 50, 32, 32), torch.float32, "none")
    variants = _variants(names, 1, 4, 1, 50, torch.float32, torch.Generator().manual_seed(0))
    ex = mha.explain(q, k, v, **variants)
    assert ex.chosen == "flash_decode", str(ex)  # first in dispatch; flash_cpu could serve it too
    assert next(x for x in ex if x.backend == "flash_cpu").ok


@NEEDS_KERNEL
def test_training_with_variants_goes_elsewhere_and_the_entry_point_refuses_it():
    q, k, v, _ = _problem((1, 4, 2, 1, 50, 32, 32), torch.float32, "none")
    sinks = torch.zeros(4, requires_grad=True)
    reasons = {x.backend: x.reasons for x in mha.explain(q, k, v, sinks=sinks)}
    assert any("no backward" in r for r in reasons["flash_decode"])
    with pytest.raises(RuntimeError, match="inference"):
        decode.flash_decode(q, k, v, sinks=sinks)
    with torch.no_grad():
        assert decode.flash_decode(q, k, v, sinks=sinks).shape == (1, 4, 1, 32)


BAD = [  # (argument, value, error): the decode entry point names the argument
    ("softcap", 0.0, ValueError),
    ("softcap", -3.0, ValueError),
    ("sinks", torch.zeros(5), ValueError),
    ("sinks", torch.zeros(1, 4), ValueError),
    ("bias", torch.zeros(1, 4, 1, 51), ValueError),
    ("bias", torch.zeros(3, 4, 1, 50), ValueError),
    ("alibi_slopes", torch.ones(2, 4), ValueError),
    ("alibi_slopes", torch.ones(4, dtype=torch.int32), TypeError),
]


@pytest.mark.parametrize("name,value,error", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_the_decode_entry_point_names_a_bad_variant(name, value, error):
    q, k, v, _ = _problem((1, 4, 2, 1, 50, 32, 32), torch.float32, "none")
    with torch.no_grad(), pytest.raises(error, match=name):
        decode.flash_decode(q, k, v, **{name: value})


@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck_with_variants(dtype):
    q, k, v, kw = _problem((2, 4, 2, 3, 70, 32, 16), dtype, "all")
    g = torch.Generator().manual_seed(0)
    args = (q, k, v, kw["key_lengths"], kw["mask"], 1 / math.sqrt(32), True, 4.0,
            torch.randn(4, generator=g), torch.randn(1, 4, 1, 70, generator=g),
            mha.alibi_slopes(4).view(1, 4))
    for op in (torch.ops.mha.flash_decode.default, torch.ops.mha.flash_decode_portable.default):
        torch.library.opcheck(op, args)
