"""NaN / Inf in the backward of flash_cpu (the rule in :mod:`mha.ops.flash`).

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.
A pair (i, j) that row i may not attend (causal, window, key_lengths, bool mask) contributes
exactly 0 to dq, dk, dv, even where K_j or V_j hold NaN / Inf (dP = dO V^T is NaN there; dS
must be 0, not 0 * NaN); rows whose output is NaN give NaN gradients from each key they see.
The judge is a float64 reference that computes every pair's contribution separately and
selects masked pairs away (never multiplies them by 0): NaN where it is NaN, non-finite where
it is +-Inf, and within tests/oracle.py's budget where it is finite. The backward gets the
reference's own out and lse, so it is judged apart from the forward.
"""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import qkv
from mha.masks import MaskSpec
from mha.ops import flash

from oracle import FLOOR, max_err

NAN, INF = float("nan"), float("inf")
B, H, H_KV, TQ, TK, D_K, D_V = 2, 4, 2, 140, 130, 32, 24
SCALE = 0.25


@pytest.fixture(scope="module", autouse=True)
def built():
    assert flash.unavailable() is None, flash.unavailable()
    assert flash.load_backward() is None  # a build failure fails these tests


def rule_reference(q, k, v, go, allowed, scale, dt):
    """``(out, lse, (dq, dk, dv))`` of sum(out * go), computed in ``dt`` pair by pair: every
    sum over keys or rows runs over ``(..., Tq, Tk, d)`` products with masked pairs selected to
    0, so a masked NaN / Inf never reaches a result. A row whose lse is NaN or +inf (a visible
    score is NaN or +inf) has P = NaN at every visible pair, as ``torch.softmax`` gives."""
    h, h_kv = q.shape[1], k.shape[1]
    q, k, v, go = (t.to(dt) for t in (q, k, v, go))
    kk = k.repeat_interleave(h // h_kv, 1)  # (B, h, Tk, d_k)
    vv = v.repeat_interleave(h // h_kv, 1)  # (B, h, Tk, d_v)
    a = allowed.expand(q.shape[0], h, q.shape[2], k.shape[2])  # (B, h, Tq, Tk)
    s = torch.einsum("bhqd,bhkd->bhqk", q, kk) * scale  # (B, h, Tq, Tk)
    lse = s.masked_fill(~a, -INF).logsumexp(-1)  # (B, h, Tq); NaN if a visible S is NaN
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), NAN)
    p = torch.where(a, p, 0.0)  # (B, h, Tq, Tk)
    a5 = a[..., None]  # (B, h, Tq, Tk, 1)
    out = torch.where(a5, p[..., None] * vv[:, :, None], 0.0).sum(-2)  # (B, h, Tq, d_v)
    delta = (go * out).sum(-1)  # (B, h, Tq)
    dp = torch.einsum("bhqd,bhkd->bhqk", go, vv)  # (B, h, Tq, Tk)
    ds = torch.where(a, p * (dp - delta[..., None]), 0.0)  # (B, h, Tq, Tk)
    dq = torch.where(a5, ds[..., None] * kk[:, :, None], 0.0).sum(-2) * scale  # (B, h, Tq, d_k)
    dk = torch.where(a5, ds[..., None] * q[:, :, :, None], 0.0).sum(-3) * scale  # (B, h, Tk, d_k)
    dv = torch.where(a5, p[..., None] * go[:, :, :, None], 0.0).sum(-3)  # (B, h, Tk, d_v)
    fold = lambda t: t.unflatten(1, (h_kv, h // h_kv)).sum(2)  # noqa: E731  (B, h_kv, Tk, d)
    return out, lse, (dq, fold(dk), fold(dv))


def _assert_rule(got, want, low, dtype, what):
    """NaN where want is NaN, non-finite where it is +-Inf, finite and within budget elsewhere."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), \
        f"{what}: NaN at {int((torch.isnan(got) != torch.isnan(want)).sum())} wrong places"
    assert not torch.isfinite(got[torch.isinf(want)]).any(), f"{what}: finite where +-Inf"
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all(), f"{what}: non-finite where the reference is finite"
    both = fin & torch.isfinite(low)
    budget = 2 * max_err(low[both], want[both]) + FLOOR[dtype] * max(
        1.0, want[fin].abs().max().item() if fin.any() else 0.0)
    assert max_err(got[fin], want[fin]) <= budget, f"{what}: error > {budget:.3e}"


def _paths():
    bf16 = ["bf16", "fp32"] if "avx512bf16" in flash.isa().split(",") else ["fp32"]
    bf16 += ["amx"] if any(i.startswith("amx") for i in flash.isa().split(",")) else []
    return ([("fused", torch.float32), ("torch", torch.float32), ("torch", torch.bfloat16)]
            + [(m, torch.bfloat16) for m in bf16])


def _backward(path, go, q, k, v, out, lse, spec: MaskSpec):
    args = (go, None, q, k, v, out, lse, spec.key_lengths, spec.mask, spec.causal, SCALE)
    if path == "fused":
        return torch.ops.mha.flash_attention_bwd_fused(*args, spec.window or 0)[:3]
    if path == "torch":
        chunk = flash._CHUNK_ELEMENTS
        flash._CHUNK_ELEMENTS = 4000  # a few rows per chunk
        try:
            return flash.flash_attention_bwd_torch(*args, spec.window or 0)[:3]
        finally:
            flash._CHUNK_ELEMENTS = chunk
    return torch.ops.mha._flash_attention_bwd_fused_math(*args, path, spec.window or 0)


def _poison(q, k, v, case):
    """Copies of q, k, v with NaN / Inf planted for ``case``."""
    q, k, v = q.clone(), k.clone(), v.clone()
    if case == "kv_seen_by_some_rows":  # keys inside partially masked blocks
        k[0, 0, 70, 3] = NAN
        k[1, 1, 33] = NAN
        v[0, 1, 100, 5] = NAN
        v[1, 0, 64] = -INF
        v[0, 0, 129] = INF
    elif case == "kv_past_key_lengths":  # key_lengths[1] = 90: never seen by any row
        k[1, :, 95:] = NAN
        v[1, :, 90:] = INF
    elif case == "q_rows":  # a row that sees keys, one that sees none (Tq > Tk: row 5)
        q[0, 1, 120] = NAN
        q[1, 2, 5, 7] = INF
        q[1, 3, 77, 0] = NAN
    return q, k, v


SPECS = {
    "window": lambda: MaskSpec(True, torch.tensor([TK, 90]), None, 37),
    "mask": lambda: MaskSpec(True, torch.tensor([TK, 90]),
                             torch.rand(B, 1, TQ, TK, generator=torch.Generator().manual_seed(1))
                             > 0.3, None),
    "no_causal": lambda: MaskSpec(False, torch.tensor([100, 90]), None, None),
}


@pytest.mark.parametrize("path,dtype", _paths())
@pytest.mark.parametrize("case", ["kv_seen_by_some_rows", "kv_past_key_lengths", "q_rows"])
@pytest.mark.parametrize("masks", sorted(SPECS))
def test_backward_follows_the_nan_rule(path, dtype, case, masks):
    spec = SPECS[masks]()
    q, k, v = _poison(*qkv(B, H, H_KV, TQ, TK, D_K, D_V, dtype, "bthd", seed=7), case)
    go = torch.randn(B, H, TQ, D_V, generator=torch.Generator().manual_seed(8)).to(dtype)
    allowed = spec.dense(B, H, TQ, TK)  # (B, H, TQ, TK)
    out, lse, want = rule_reference(q, k, v, go, allowed, SCALE, torch.float64)
    _, _, low = rule_reference(q, k, v, go, allowed, SCALE, dtype)
    got = _backward(path, go, q, k, v, out.to(dtype), lse.float(), spec)
    for name, a, w, lo in zip("qkv", got, want, low, strict=True):
        assert a.dtype == dtype
        _assert_rule(a.double(), w, lo.double(), dtype, f"d{name}")
    if case != "q_rows":  # the planted values do reach some gradient: the case tests something
        assert any(torch.isnan(w).any() for w in want) or case == "kv_past_key_lengths"


def test_rows_with_nan_output_get_nan_gradients_and_others_stay_exact():
    """A NaN in V at key 150 makes the outputs of rows 150..179 (window 30) NaN, so their dq
    and the dk of every key they see (121..179) are NaN; every other gradient, and all of dv
    (which does not read V), equals the clean inputs' bit for bit."""
    q, k, v = qkv(1, 2, 1, 200, 200, 32, 32, torch.float32, "bthd", seed=2)
    go = torch.randn(1, 2, 200, 32)
    v_bad = v.clone()
    v_bad[0, 0, 150, 4] = NAN
    spec = MaskSpec(True, None, None, 30)
    allowed = spec.dense(1, 2, 200, 200)
    for path in ("fused", "torch"):
        out, lse, _ = rule_reference(q, k, v_bad, go, allowed, SCALE, torch.float64)
        dq, dk, dv = _backward(path, go, q, k, v_bad, out.float(), lse.float(), spec)
        clean_out, clean_lse, _ = rule_reference(q, k, v, go, allowed, SCALE, torch.float64)
        dq0, dk0, dv0 = _backward(path, go, q, k, v, clean_out.float(), clean_lse.float(), spec)
        bad = torch.zeros(200, dtype=torch.bool)
        assert torch.isnan(dq[:, :, 150:180]).all() and torch.isnan(dk[:, :, 121:180]).all()
        bad[150:180] = True
        assert torch.equal(dq[:, :, ~bad], dq0[:, :, ~bad])
        bad[121:150] = True
        assert torch.equal(dk[:, :, ~bad], dk0[:, :, ~bad])
        assert torch.equal(dv, dv0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_through_nan_keys_left_of_the_window(dtype):
    """End to end through autograd: NaN / Inf in K and V far left of every window of the late
    rows leave those rows' dq, and the dk, dv of keys only they see, as with clean inputs."""
    T, w = 700, 40
    q, k, v = qkv(1, 2, 1, T, T, 32, 32, dtype, "bthd", seed=4)
    go = torch.randn(1, 2, T, 32).to(dtype)

    def grads(k_in, v_in):
        ins = [t.detach().clone().requires_grad_() for t in (q, k_in, v_in)]
        out = flash.flash_attention(*ins, causal=True, window=w)[0]
        return torch.autograd.grad((out * go).sum(), ins)

    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, :256] = NAN
    v_bad[:, :, :256] = INF
    bad, clean = grads(k_bad, v_bad), grads(k, v)
    first = 256 + 128 + w + 48  # rows the forward's key blocks with a NaN cannot reach
    assert torch.equal(bad[0][:, :, first:], clean[0][:, :, first:])
    for a, b in zip(bad[1:], clean[1:], strict=True):
        assert torch.equal(a[:, :, first:], b[:, :, first:])
