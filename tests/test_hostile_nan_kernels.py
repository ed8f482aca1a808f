"""NaN and +-Inf through the native forward and decode kernels, on every path this CPU has.

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.

The rule (docstring of ``csrc/flash_attn.cpp``): output row i depends on q_i and the K/V rows of
the keys it may attend (mask AND causal AND window AND j < key_lengths[b]) only, the way IEEE
arithmetic of ``softmax(q k^T * scale) v`` makes it (a NaN in q_i or a NaN/Inf score: the row
NaN; a NaN in V_j[d] of a visible key: column d NaN); K/V rows of keys it may not attend never
reach it; a row that may attend no key is zeros with lse -inf. The oracle below implements that
rule in float64 with plain torch ops, visible pairs only; the kernel must be NaN where it is NaN,
non-finite where it is +-Inf, and finite within tests/oracle.py's budget where it is finite.

Every kernel path compiled in is forced by name (``_flash_attention_fwd_kernel``): the portable
loops, ``avx512f``, ``avx512bf16``, ``amx``, the small path (``small``, Tk <= 64), and the decode
kernel both vectorized (``flash_decode``) and portable (``flash_decode_portable``).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples import examples
from mha.ops import decode, flash

from oracle import FLOOR, max_err, naive, oracle

NAN, INF = float("nan"), float("inf")


def _kernels() -> list[str]:
    assert flash.unavailable() is None, flash.unavailable()
    isa = flash.isa().split(",")
    names = ["portable"] + [k for k in ("avx512f", "avx512bf16", "amx")
                            if k in isa or f"{k}-emulated" in isa]  # amx: software tiles too
    return names + (["small"] if "avx512f" in isa else [])  # flash_small.h needs AVX-512


KERNELS = _kernels()


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _runs(kernel: str, dtype) -> bool:
    return dtype == torch.bfloat16 or kernel in ("portable", "avx512f", "small")


def allowed_mask(B, h, Tq, Tk, *, causal=False, key_lengths=None, mask=None, window=None):
    """(B, h, Tq, Tk) bool: True where query i may attend key j (bottom-right causal)."""
    i = torch.arange(Tq)[:, None]
    j = torch.arange(Tk)[None, :]
    ok = torch.ones(B, h, Tq, Tk, dtype=torch.bool)
    if causal:
        ok &= j <= i + Tk - Tq
    if window is not None:
        ok &= j > i + Tk - Tq - window
    if key_lengths is not None:
        ok &= j[None, None] < key_lengths[:, None, None, None]
    if mask is not None:
        ok &= mask.expand(B, h, Tq, Tk)
    return ok


def rule_attention(q, k, v, allowed, scale, dtype=torch.float64):
    """The rule in ``dtype``: (out (B, h, Tq, d_v), lse (B, h, Tq)), visible pairs only."""
    h, h_kv = q.shape[1], k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k = k.repeat_interleave(h // h_kv, 1)  # (B, h, Tk, d_k)
    v = v.repeat_interleave(h // h_kv, 1)  # (B, h, Tk, d_v)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, h, Tq, Tk)
    s = s.masked_fill(~allowed, -INF)
    # a row whose visible scores are all -inf (an Inf in K) has no key, as an additive -inf mask
    # would say (mha.nonfinite's rule 3; the kernels tell "no key" by a zero sum)
    any_key = (s != -INF).any(-1)  # (B, h, Tq); NaN scores count as keys
    p = torch.softmax(s, -1).masked_fill(~allowed, 0)  # (B, h, Tq, Tk); empty rows: NaN -> 0
    p = torch.where(any_key[..., None], p, torch.zeros_like(p))
    # out[i, d] = sum over visible j of p[i, j] v[j, d]: masked pairs are never multiplied
    terms = p[..., None] * v[:, :, None, :, :]  # (B, h, Tq, Tk, d_v)
    out = torch.where(allowed[..., None], terms, torch.zeros_like(terms)).sum(-2)
    lse = torch.where(any_key, torch.logsumexp(s, -1), torch.full_like(s[..., 0], -INF))
    return out, lse


def check_rule(out, lse, q, k, v, allowed, scale):
    """out / lse against the float64 rule (lse may be None, as for decode)."""
    want, want_lse = rule_attention(q, k, v, allowed, scale)
    got = out.double()
    nan, fin = want.isnan(), torch.isfinite(want)
    assert torch.equal(got.isnan()[nan], torch.ones_like(got[nan], dtype=torch.bool)), \
        f"{int((~got.isnan()[nan]).sum())} outputs are not NaN where the rule gives NaN"
    inf = ~nan & ~fin
    assert (~torch.isfinite(got[inf])).all(), "outputs finite where the rule gives +-Inf"
    assert torch.isfinite(got[fin]).all(), \
        f"{int((~torch.isfinite(got[fin])).sum())} outputs not finite where the rule is finite"
    # the budget of tests/oracle.py, measured on the same inputs with the hostile values zeroed
    clean = [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (q, k, v)]
    budget = 2 * max_err(naive(*clean, allowed, scale)[0], oracle(*clean, allowed, scale)[0])
    budget += FLOOR[q.dtype]
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= budget, f"output error {err:.3e} > budget {budget:.3e}"
    if lse is None:
        return
    assert lse[want_lse.isnan()].isnan().all(), "lse not NaN where the rule gives NaN"
    assert torch.equal(lse == -INF, want_lse == -INF), "lse -inf only for rows with no key"
    assert (~torch.isfinite(lse[want_lse == INF])).all(), "lse finite where the rule gives inf"
    fl = torch.isfinite(want_lse)
    assert torch.isfinite(lse[fl]).all()
    if fl.any():
        tol = 1e-4 if q.dtype == torch.float32 else 2e-3
        assert (lse.double()[fl] - want_lse[fl]).abs().max().item() <= tol


def _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, h, d_k, generator=g).to(dtype).transpose(1, 2)  # (B, h, Tq, d_k)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g).to(dtype)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g).to(dtype)
    return q, k, v


def _place(t, where, value, g):
    """t[b, head, row, col] = value at one random place; rows from `where` (a list)."""
    t = t.clone()
    B, H, _, D = t.shape
    b = int(torch.randint(B, (1,), generator=g))
    hh = int(torch.randint(H, (1,), generator=g))
    row = where[int(torch.randint(len(where), (1,), generator=g))]
    col = int(torch.randint(D, (1,), generator=g))
    t[b, hh, row, col] = value
    return t


def _poison(kind, q, k, v, allowed, g):
    """q/k/v with one hostile value placed as `kind` says."""
    Tq, Tk = q.shape[2], k.shape[2]
    seen = allowed.any(0).any(0)  # (Tq, Tk): pair visible for some (b, head)
    vis_keys = [j for j in range(Tk) if seen[:, j].any()] or [0]
    part_keys = [j for j in range(Tk) if seen[:, j].any() and not seen[:, j].all()] or vis_keys
    hidden_keys = [j for j in range(Tk) if not seen[:, j].any()] or part_keys
    empty_rows = [i for i in range(Tq) if not seen[i].any()] or list(range(Tq))
    if kind == "q_nan":
        return _place(q, list(range(Tq)), NAN, g), k, v
    if kind == "q_nan_empty_row":  # a row that may attend no key: zeros whatever q is
        return _place(q, empty_rows, NAN, g), k, v
    if kind == "k_nan":
        return q, _place(k, vis_keys, NAN, g), v
    if kind == "k_inf":  # a visible score +inf (or -inf): the row NaN (or that key's P = 0)
        for _ in range(20):  # not a row whose only visible scores are -inf (see check_rule)
            k2 = _place(k, vis_keys, INF, g)
            lse = rule_attention(q, k2, v, allowed, 1.0)[1]
            if not (allowed.any(-1) & (lse == -INF)).any():
                break
        return q, k2, v
    if kind == "v_nan":
        return q, k, _place(v, vis_keys, NAN, g)
    if kind == "v_inf":
        return q, k, _place(v, vis_keys, -INF, g)
    if kind == "v_nan_partial":  # a key some rows see and others may not (masked pairs)
        return q, k, _place(v, part_keys, NAN, g)
    if kind == "kv_nan_hidden":  # keys no row may attend: never read
        k2 = _place(k, hidden_keys, NAN, g)
        return q, k2, _place(v, hidden_keys, INF, g)
    raise ValueError(kind)


POISON = ("q_nan", "q_nan_empty_row", "k_nan", "k_inf", "v_nan", "v_inf", "v_nan_partial",
          "kv_nan_hidden")
MASKS = ("none", "causal", "key_lengths", "bool", "window")


def _mask_args(kind, B, h, Tq, Tk, g):
    kl = mask = window = None
    causal = False
    if kind == "causal":
        causal = True
    elif kind == "key_lengths":
        kl = torch.randint(0, Tk + 1, (B,), generator=g)
        kl[0] = max(1, Tk // 2)
    elif kind == "bool":
        mask = torch.rand(B, 1, Tq, Tk, generator=g) > 0.4
        mask[..., 0, :] = False  # one query row that may attend no key
    elif kind == "window":
        causal, window = True, max(1, Tk // 5)
    return causal, kl, mask, window


def _forward(kernel, q, k, v, causal, kl, mask, scale, window):
    return torch.ops.mha._flash_attention_fwd_kernel(q, k, v, kl, mask, causal, scale, kernel,
                                                     window or 0)


# (B, h, h_kv, Tq, Tk, d_k, d_v): the small path's range, then the tiles' (Tq, Tk not multiples
# of the 48-row query blocks or the 16..128-key blocks; GQA; d_v != d_k; d 16..256).
SMALL_SHAPES = [(2, 2, 1, 20, 20, 64, 64), (1, 4, 2, 7, 33, 16, 40)]
TILE_SHAPES = [(1, 2, 1, 70, 150, 48, 64), (2, 4, 2, 53, 97, 128, 16), (1, 1, 1, 100, 260, 256, 80)]


def _shape(kernel, poison, mask_kind):
    """Every (poison, mask) pair on one shape, the shapes taken in turn (small ones only for
    the small path), so each shape meets every poison and every mask kind."""
    shapes = SMALL_SHAPES if kernel == "small" else SMALL_SHAPES + TILE_SHAPES
    return shapes[(POISON.index(poison) + MASKS.index(mask_kind)) % len(shapes)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("poison", POISON)
def test_forward_follows_the_rule(kernel, dtype, mask_kind, poison):
    if not _runs(kernel, dtype):
        pytest.skip(f"kernel {kernel} serves bf16 inputs only")
    shape = _shape(kernel, poison, mask_kind)
    B, h, h_kv, Tq, Tk, d_k, d_v = shape
    g = torch.Generator().manual_seed(_seed(shape, mask_kind, poison))
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, seed=int(torch.randint(9999, (1,), generator=g)))
    causal, kl, mask, window = _mask_args(mask_kind, B, h, Tq, Tk, g)
    allowed = allowed_mask(B, h, Tq, Tk, causal=causal, key_lengths=kl, mask=mask, window=window)
    q, k, v = _poison(poison, q, k, v, allowed, g)
    scale = d_k ** -0.5
    out, lse = _forward(kernel, q, k, v, causal, kl, mask, scale, window)
    check_rule(out, lse, q, k, v, allowed, scale)


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kernel=st.sampled_from(KERNELS), bf16=st.booleans(), Tq=st.integers(1, 100),
       Tk=st.integers(1, 200), d_k=st.sampled_from([16, 32, 64, 96]),
       d_v=st.sampled_from([16, 24, 64]), mask_kind=st.sampled_from(MASKS),
       poison=st.sampled_from(POISON), seed=st.integers(0, 2**16))
def test_forward_rule_property(kernel, bf16, Tq, Tk, d_k, d_v, mask_kind, poison, seed):
    dtype = torch.bfloat16 if bf16 else torch.float32
    if not _runs(kernel, dtype) or (kernel == "small" and Tk > 64):
        kernel = "portable"
    g = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(2, 2, 1, Tq, Tk, d_k, d_v, dtype, seed)
    causal, kl, mask, window = _mask_args(mask_kind, 2, 2, Tq, Tk, g)
    allowed = allowed_mask(2, 2, Tq, Tk, causal=causal, key_lengths=kl, mask=mask, window=window)
    q, k, v = _poison(poison, q, k, v, allowed, g)
    out, lse = _forward(kernel, q, k, v, causal, kl, mask, d_k ** -0.5, window)
    check_rule(out, lse, q, k, v, allowed, d_k ** -0.5)


def test_public_function_nan_query_row():
    """mha.ops.flash.flash_attention (the op's own kernel choice): a NaN query row is NaN, lse
    NaN; the other rows are untouched; a NaN in the causal mask's hidden V row reaches no row
    but the last."""
    q, k, v = _inputs(1, 2, 2, 96, 96, 64, 64, torch.float32, seed=3)
    q[0, 1, 5, 7] = NAN
    v[0, 0, 95, 3] = NAN  # the last key: only the last row may attend it (causal)
    out, lse = flash.flash_attention(q, k, v, causal=True)
    assert out[0, 1, 5].isnan().all() and lse[0, 1, 5].isnan()
    others = torch.ones(2, 96, dtype=torch.bool)
    others[1, 5] = False
    others[0, 95] = False
    assert torch.isfinite(out[0][others]).all() and torch.isfinite(lse[0][others]).all()
    assert out[0, 0, 95, 3].isnan() and torch.isfinite(out[0, 0, 95, :3]).all()


# ------------------------------------------------------------------------------- decode

DECODE_OPS = ("flash_decode", "flash_decode_portable")


@pytest.fixture(scope="module")
def decode_ops():
    reason = decode.unavailable()
    if reason:
        pytest.skip(reason)
    return {name: getattr(torch.ops.mha, name) for name in DECODE_OPS}


# (B, h, h_kv, Tq, Tk, d_k, d_v): one split and several (Tk 2100: splits of <= 1024 keys)
DECODE_SHAPES = [(2, 4, 2, 1, 300, 64, 64), (1, 8, 2, 5, 2100, 32, 48), (2, 2, 1, 16, 70, 128, 16)]
DECODE_MASKS = ("none", "causal", "key_lengths", "bool")


@pytest.mark.parametrize("op", DECODE_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_kind", DECODE_MASKS)
@pytest.mark.parametrize("poison", POISON)
def test_decode_follows_the_rule(decode_ops, op, dtype, mask_kind, poison):
    shape = DECODE_SHAPES[(POISON.index(poison) + DECODE_MASKS.index(mask_kind)) % 3]
    B, h, h_kv, Tq, Tk, d_k, d_v = shape
    g = torch.Generator().manual_seed(_seed(shape, mask_kind, poison, op))
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, seed=int(torch.randint(9999, (1,), generator=g)))
    q = q.contiguous()
    causal, kl, mask, _ = _mask_args(mask_kind, B, h, Tq, Tk, g)
    allowed = allowed_mask(B, h, Tq, Tk, causal=causal, key_lengths=kl, mask=mask)
    q, k, v = _poison(poison, q, k, v, allowed, g)
    scale = d_k ** -0.5
    with torch.no_grad():
        out = decode_ops[op](q, k, v, kl, mask, scale, causal)
    check_rule(out, None, q, k, v, allowed, scale)
