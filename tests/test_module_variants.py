"""mha.MultiHeadAttention with score variants (softcap, sinks, ALiBi, a per-call bias, mask_mod /
score_mod): against a float64 per-head loop written out here, in every mode of the module
(plain, cross-attention, cached decoding, packed), plus state dicts and refusals.

Shape legend: B batch, T/Tq/Tk lengths, h/h_kv heads, d_k/d_v head dims, d_model width.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha import mods

from oracle import max_err

D_MODEL = 24


def loop_oracle(m: mha.MultiHeadAttention, x_q, x_kv, *, allowed=None, bias=None,
                mask_mod=None, score_mod=None, sinks=None):
    """Seed 000 with the variants written out, one head at a time, in float64.

    x_q ``(B, Tq, d_model)``, x_kv ``(B, Tk, kdim)``; ``allowed`` broadcastable to
    ``(B, Tq, Tk)``; ``bias`` broadcastable to ``(B, h, Tq, Tk)``; ``sinks`` ``(h,)`` (default
    the module's, detached). Query ``i`` sits at position ``i + Tk - Tq`` (bottom right) for
    ALiBi; mask_mod / score_mod get the raw indices ``i``, ``j`` as :func:`mha.attention` gives.
    Returns ``(Y (B, Tq, d_model), weights (B, h, Tq, Tk))`` float64.
    """
    W = {n: ([t.double() for t in w] if isinstance(w, list) else
             None if w is None else w.double()) for n, w in m.per_head_weights().items()}
    x_q, x_kv = x_q.double(), x_kv.double()
    B, Tq, _ = x_q.shape
    Tk = x_kv.shape[1]
    h, h_kv = len(W["W_q"]), len(W["W_k"])
    if sinks is None and m.sinks is not None:
        sinks = m.sinks.detach().double()
    slopes = None if m.alibi_slopes is None else m.alibi_slopes.double()
    bias = None if bias is None else bias.double().reshape(
        (1,) * (4 - bias.dim()) + tuple(bias.shape))  # -> (B|1, h|1, Tq|1, Tk|1)
    qi = torch.arange(Tq).view(Tq, 1)  # (Tq, 1)
    kj = torch.arange(Tk).view(1, Tk)  # (1, Tk)
    b_idx = torch.arange(B).view(B, 1, 1, 1)
    heads, weights = [], []
    for i in range(h):
        j = i // (h // h_kv)
        Q = x_q @ W["W_q"][i]  # (B, Tq, d_model) @ (d_model, d_k) -> (B, Tq, d_k)
        K = x_kv @ W["W_k"][j]  # (B, Tk, kdim) @ (kdim, d_k) -> (B, Tk, d_k)
        V = x_kv @ W["W_v"][j]  # (B, Tk, vdim) @ (vdim, d_v) -> (B, Tk, d_v)
        if W["b_q"] is not None:
            Q, K, V = Q + W["b_q"][i], K + W["b_k"][j], V + W["b_v"][j]
        s = Q @ K.transpose(1, 2) / math.sqrt(Q.shape[-1])  # (B, Tq, d_k) @ (B, d_k, Tk)
        # -> (B, Tq, Tk)
        if m.softcap is not None:
            s = m.softcap * torch.tanh(s / m.softcap)
        if bias is not None:
            s = s + bias[:, i if bias.shape[1] > 1 else 0]  # (B|1, Tq|1, Tk|1)
        if slopes is not None:
            s = s - slopes[i] * (qi + Tk - Tq - kj)  # (Tq, Tk): distance to the diagonal
        h_idx = torch.tensor(i).view(1, 1, 1, 1)
        idx = (b_idx, h_idx, qi.view(1, 1, Tq, 1), kj.view(1, 1, 1, Tk))
        if score_mod is not None:
            s = score_mod(s[:, None], *idx)[:, 0]  # (B, 1, Tq, Tk) -> (B, Tq, Tk)
        keep = torch.ones(B, Tq, Tk, dtype=torch.bool)
        if allowed is not None:
            keep = keep & allowed
        if mask_mod is not None:
            keep = keep & mask_mod(*idx).expand(B, 1, Tq, Tk)[:, 0]
        s = s.masked_fill(~keep, float("-inf"))
        if sinks is not None:  # one more logit per row, with no value
            col = sinks[i].view(1, 1, 1).expand(B, Tq, 1)  # (B, Tq, 1)
            A = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :Tk]  # (B, Tq, Tk)
        else:
            A = torch.softmax(s, dim=-1)  # (B, Tq, Tk)
        A = torch.where(keep.any(-1, keepdim=True), A, 0.0)  # rows with no key: zeros
        heads.append(A @ V)  # (B, Tq, Tk) @ (B, Tk, d_v) -> (B, Tq, d_v)
        weights.append(A)
    concat = torch.cat(heads, dim=-1)  # h x (B, Tq, d_v) -> (B, Tq, h*d_v)
    Y = concat @ W["W_o"]  # (B, Tq, h*d_v) @ (h*d_v, d_model) -> (B, Tq, d_model)
    if W["b_o"] is not None:
        Y = Y + W["b_o"]
    return Y, torch.stack(weights, dim=1)  # (B, h, Tq, Tk)


def make(h=4, h_kv=2, *, seed=0, cross=False, **options) -> mha.MultiHeadAttention:
    """A module with random weights and, with ``sinks``, random (not zero) sink logits."""
    torch.manual_seed(seed)
    kdim = 20 if cross else None
    m = mha.MultiHeadAttention(D_MODEL, h, num_kv_heads=h_kv, head_dim=8, v_head_dim=6,
                               kdim=kdim, vdim=kdim, **options)
    if m.sinks is not None:
        with torch.no_grad():
            m.sinks.copy_(torch.randn(h))
    return m


OPTIONS = {
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "alibi": dict(alibi=True),
    "alibi+sinks": dict(alibi=True, sinks=True),
    "all": dict(softcap=3.0, sinks=True, alibi=True),
}


# ----------------------------------------------------------------------------- plain / cross
@given(option=st.sampled_from(sorted(OPTIONS)), B=st.integers(1, 3), Tq=st.integers(1, 7),
       Tk=st.integers(1, 7), heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
       cross=st.booleans(), causal=st.booleans(),
       bias=st.sampled_from([None, (1, 1, 1, 1), (1, 0, 1, 0), (0, 0, 0, 0)]),
       backend=st.sampled_from([None, "math", "reference"]), seed=st.integers(0, 1000))
def test_module_with_variants_equals_loop(option, B, Tq, Tk, heads, cross, causal, bias,
                                          backend, seed):
    m = make(*heads, seed=seed, cross=cross, **OPTIONS[option])
    x = torch.randn(B, Tq, D_MODEL)
    kv = torch.randn(B, Tk, 20) if cross else x
    Tk = kv.shape[1]
    h = heads[0]
    score_bias = None
    if bias is not None:  # 1 = broadcast along that dim of (B, h, Tq, Tk)
        score_bias = torch.randn(*(1 if one else n for one, n in
                                   zip(bias, (B, h, Tq, Tk), strict=True)))
    kw = dict(key=kv, value=kv) if cross else {}
    y, w = m(x, **kw, causal=causal, bias=score_bias, need_weights=True, backend=backend)
    allowed = mha.masks.causal_mask(Tq, Tk) if causal else None
    ref_y, ref_w = loop_oracle(m, x, kv, allowed=allowed, bias=score_bias)
    assert max_err(y, ref_y) < 1e-4
    assert max_err(w, ref_w) < 1e-5


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_sinks_and_bias_gradients_equal_loop(option):
    """The sinks parameter (and a per-call bias) get the float64 loop's gradients."""
    m = make(seed=3, **OPTIONS[option]).double()
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    bias = torch.randn(1, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    y = m(x, causal=True, bias=bias)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    sinks = None if m.sinks is None else m.sinks.detach().clone().requires_grad_(True)
    ref_bias = bias.detach().clone().requires_grad_(True)
    ref, _ = loop_oracle(m, x, x, allowed=mha.masks.causal_mask(6, 6), bias=ref_bias,
                         sinks=sinks)
    (ref * g).sum().backward()
    assert max_err(y, ref) < 1e-10
    assert max_err(bias.grad, ref_bias.grad) < 1e-10
    if sinks is not None:
        assert m.sinks.grad.shape == (4,)
        assert max_err(m.sinks.grad, sinks.grad) < 1e-10
        assert m.sinks.grad.abs().max() > 0  # the sink is in the graph


def test_sinks_learn():
    """A few optimiser steps move the sinks (they are parameters, with the module's dtype)."""
    m = make(seed=4, sinks=True)
    before = m.sinks.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x = torch.randn(2, 5, D_MODEL)
    for _ in range(3):
        opt.zero_grad()
        m(x, causal=True).pow(2).mean().backward()
        opt.step()
    assert "sinks" in dict(m.named_parameters())
    assert not torch.equal(before, m.sinks.detach())


def _keep_even_keys(b, h, q_idx, kv_idx):
    return (kv_idx % 2 == 0) | (kv_idx == q_idx)


def _distance_penalty(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (h + 1) * (q_idx - kv_idx).abs()


@pytest.mark.parametrize("mask_mod,score_mod", [(_keep_even_keys, None),
                                                (None, _distance_penalty),
                                                (_keep_even_keys, _distance_penalty),
                                                (mods.sliding_window(3), None)])
@pytest.mark.parametrize("causal", [False, True])
def test_mask_mod_and_score_mod_pass_through(mask_mod, score_mod, causal):
    m = make(seed=5)
    x = torch.randn(2, 9, D_MODEL)
    y = m(x, causal=causal, mask_mod=mask_mod, score_mod=score_mod)
    allowed = mha.masks.causal_mask(9, 9) if causal else None
    ref, _ = loop_oracle(m, x, x, allowed=allowed, mask_mod=mask_mod, score_mod=score_mod)
    assert max_err(y, ref) < 1e-4


# ----------------------------------------------------------------------------- cached decoding
def _keep_recent_and_first(b, h, q_idx, kv_idx):
    """A custom mask in absolute positions: the first key and the 3 most recent."""
    return (kv_idx == 0) | ((kv_idx <= q_idx) & (kv_idx > q_idx - 3))


def _causal_by_hand(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


DECODE_CASES = {  # name -> (module options, call options)
    **{name: (opts, {}) for name, opts in OPTIONS.items()},
    "mask_mod": ({}, dict(mask_mod=_keep_recent_and_first)),
    "mask_mod builtin": ({}, dict(mask_mod=mods.sliding_window(2))),
    "score_mod": ({}, dict(mask_mod=_causal_by_hand, score_mod=_distance_penalty)),
}


def _decode(m, x, cache, chunks, call):
    """Feed ``x (B, T, d_model)`` through ``cache`` in chunks of the given sizes:
    ``(B, T, d_model)``, each chunk's output."""
    outs, t = [], 0
    for n in chunks:
        outs.append(m(x[:, t:t + n], cache=cache, **call(t, t + n)))
        t += n
    return torch.cat(outs, dim=1)  # chunks of (B, n, d_model) -> (B, T, d_model)


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
@pytest.mark.parametrize("chunks", [(1,) * 7, (4, 1, 1, 1), (3, 2, 2)])
def test_cached_decoding_equals_full_forward(case, chunks):
    """Prefill + steps through a KVCache give what one causal call over the sequence gives."""
    options, call_options = DECODE_CASES[case]
    m = make(seed=6, **options).eval()
    x = torch.randn(2, 7, D_MODEL)
    with torch.no_grad():
        full = m(x, causal=True, **call_options)
        stepped = _decode(m, x, m.new_cache(2, 10), chunks, lambda a, b: call_options)
    assert max_err(stepped, full) < 1e-5


def test_cached_decoding_with_a_bias_equals_full_forward():
    """A per-call bias in decode is the full bias's rows of the new tokens, keys so far."""
    m = make(seed=7, alibi=True, sinks=True).eval()
    x = torch.randn(2, 6, D_MODEL)
    bias = torch.randn(2, 4, 6, 6)  # (B, h, T, T)
    with torch.no_grad():
        full = m(x, causal=True, bias=bias)
        stepped = _decode(m, x, m.new_cache(2, 8), (3, 1, 2),
                          lambda a, b: dict(bias=bias[:, :, a:b, :b]))
    assert max_err(stepped, full) < 1e-5


RAGGED_CASES = {
    "alibi": ({"alibi": True}, {}),
    "alibi+sinks": ({"alibi": True, "sinks": True}, {}),
    "alibi+sinks+bias": ({"alibi": True, "sinks": True}, {"bias": True}),
    "sinks": ({"sinks": True}, {}),
    "mask_mod": ({}, {"mask_mod": _keep_recent_and_first}),
    "score_mod": ({}, {"mask_mod": _causal_by_hand, "score_mod": _distance_penalty}),
}


@pytest.mark.parametrize("case", sorted(RAGGED_CASES))
def test_ragged_cache_rows_each_equal_their_own_forward(case):
    """Rows of different lengths (a truncated row): each row's decoded outputs equal the full
    forward of that row's own sequence — ALiBi measured from the row's own positions, also
    with a sink (where a per-row offset would change the result)."""
    options, call_options = RAGGED_CASES[case]
    m = make(seed=8, **options).eval()
    torch.manual_seed(9)
    prompt = torch.randn(2, 5, D_MODEL)
    steps = torch.randn(2, 3, D_MODEL)
    keep = [3, 5]  # row 0 is cut back to 3 tokens after the prefill
    seqs = [torch.cat([prompt[b, :keep[b]], steps[b]]) for b in range(2)]  # (keep[b] + 3, d_model)
    biases = [torch.randn(1, 4, len(s), len(s)) for s in seqs] if call_options.pop(
        "bias", False) else None
    cache = m.new_cache(2, 10)
    with torch.no_grad():
        m(prompt, cache=cache)
        cache.truncate(torch.tensor(keep))
        outs = []
        for t in range(3):
            call = dict(call_options)
            if biases is not None:  # (B, h, 1, Tk): each row's bias row, padded at the end
                Tk = max(keep) + t + 1
                rows = [torch.nn.functional.pad(bi[0, :, keep[b] + t, :keep[b] + t + 1],
                                                (0, Tk - keep[b] - t - 1))  # (h, Tk)
                        for b, bi in enumerate(biases)]
                call["bias"] = torch.stack(rows)[:, :, None]  # B x (h, Tk) -> (B, h, 1, Tk)
            outs.append(m(steps[:, t:t + 1], cache=cache, **call))  # (B, 1, d_model)
        for b in range(2):
            call = dict(call_options)
            if biases is not None:
                call["bias"] = biases[b]
            full = m(seqs[b][None], causal=True, **call)  # (1, T_b, d_model)
            got = torch.cat([o[b] for o in outs])  # (3, d_model)
            assert max_err(got, full[0, -3:]) < 1e-5, f"row {b}"


def test_left_padded_cache_with_alibi_and_sinks():
    """Left padding (KVCache.mark_left_padding): ALiBi is relative, so a padded row decodes as
    its unpadded sequence does."""
    m = make(seed=10, alibi=True, sinks=True).eval()
    torch.manual_seed(11)
    x = torch.randn(1, 6, D_MODEL)
    junk = torch.randn(1, 2, D_MODEL)
    with torch.no_grad():
        full = m(x, causal=True)
        padded = torch.cat([torch.cat([junk, x[:, :4]], 1), torch.cat([x[:, :2], x[:, :4]], 1)])
        cache = m.new_cache(2, 10)
        cache.mark_left_padding(torch.tensor([2, 0]))
        m(padded, cache=cache)
        y = torch.cat([m(torch.cat([x[:, t:t + 1]] * 2), cache=cache) for t in (4, 5)], 1)
    assert max_err(y[0], full[0, 4:]) < 1e-5


# ----------------------------------------------------------------------------- packed
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("causal", [False, True])
def test_packed_equals_each_sequence_alone(option, causal):
    m = make(seed=12, **OPTIONS[option])
    lengths = [3, 1, 5]
    torch.manual_seed(13)
    seqs = [torch.randn(1, n, D_MODEL) for n in lengths]
    biases = [torch.randn(4, n, n) for n in lengths]
    cu = torch.tensor([0, 3, 4, 9])
    y = m(torch.cat(seqs, 1), cu_seqlens=cu, causal=causal, bias=biases)  # (1, 9, d_model)
    alone = torch.cat([m(s, causal=causal, bias=b[None]) for s, b in
                       zip(seqs, biases, strict=True)], 1)
    assert max_err(y, alone) < 1e-5


# ----------------------------------------------------------------------------- state, repr
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_state_dict_round_trip(option):
    a = make(seed=14, **OPTIONS[option])
    b = make(seed=15, **OPTIONS[option])
    keys = set(a.state_dict())
    assert ("sinks" in keys) == ("sinks" in OPTIONS[option])
    assert "alibi_slopes" not in keys  # derived from h, rebuilt by the constructor
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, D_MODEL)
    assert torch.equal(a(x, causal=True), b(x, causal=True))


def test_state_dict_with_and_without_sinks_do_not_mix():
    with_sinks, without = make(sinks=True), make()
    with pytest.raises(RuntimeError, match="sinks"):
        without.load_state_dict(with_sinks.state_dict())
    with pytest.raises(RuntimeError, match="sinks"):
        with_sinks.load_state_dict(without.state_dict())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_alibi_slopes_stay_float32_and_exact(dtype):
    m = make(h=6, h_kv=3, alibi=True, sinks=True).to(dtype)
    assert m.alibi_slopes.dtype == torch.float32
    assert torch.equal(m.alibi_slopes, mha.alibi_slopes(6))
    assert m.sinks.dtype == dtype and m.in_proj.weight.dtype == dtype


def test_meta_init_then_to_empty_rebuilds_the_slopes():
    """Meta-device construction + to_empty + load_state_dict (the low-memory loading
    pattern): the slopes, absent from the state dict, are rebuilt, not left uninitialised."""
    src = make(alibi=True, sinks=True)
    m = mha.MultiHeadAttention(D_MODEL, 4, num_kv_heads=2, head_dim=8, v_head_dim=6,
                               alibi=True, sinks=True, device="meta")
    m.to_empty(device="cpu")
    m.load_state_dict(src.state_dict())
    assert torch.equal(m.alibi_slopes, mha.alibi_slopes(4))
    x = torch.randn(2, 5, D_MODEL)
    assert torch.equal(m(x, causal=True), src(x, causal=True))


def test_repr_shows_the_options():
    text = repr(make(softcap=30.0, sinks=True, alibi=True))
    assert "softcap=30.0" in text and "sinks=True" in text and "alibi=True" in text
    plain = repr(make())
    assert "softcap" not in plain and "sinks" not in plain and "alibi" not in plain


# ----------------------------------------------------------------------------- refusals
CONSTRUCTOR_REFUSALS = [
    (dict(softcap=0.0), ValueError, "softcap must be > 0"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap must be a number"),
    (dict(softcap=torch.tensor(30.0)), TypeError, "softcap"),
    (dict(sinks=1), TypeError, "sinks must be a bool"),
    (dict(sinks=torch.zeros(4)), TypeError, "sinks must be a bool"),
    (dict(sinks=None), TypeError, "sinks must be a bool"),
    (dict(alibi="yes"), TypeError, "alibi must be a bool"),
    (dict(alibi=mha.alibi_slopes(4)), TypeError, "alibi must be a bool"),
]


@pytest.mark.parametrize("kwargs,exc,pattern", CONSTRUCTOR_REFUSALS,
                         ids=[str(c[0]) for c in CONSTRUCTOR_REFUSALS])
def test_constructor_refusals(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        mha.MultiHeadAttention(D_MODEL, 4, **kwargs)


def test_call_refusals():
    m = make(alibi=True, sinks=True)
    x = torch.randn(2, 5, D_MODEL)
    with pytest.raises(ValueError, match="bias"):
        m(x, bias=torch.randn(3, 4, 5, 5))
    with pytest.raises(TypeError, match="bias"):
        m(x, bias=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask_mod"):
        m(x, mask_mod="causal")
    with pytest.raises(TypeError, match="score_mod"):
        m(x, score_mod=1.0)
    with pytest.raises(ValueError, match="mask_mod and score_mod"):
        m(x[:1], cu_seqlens=torch.tensor([0, 5]), mask_mod=_causal_by_hand)
    with pytest.raises(TypeError, match="bias must be a list"):
        m(x[:1], cu_seqlens=torch.tensor([0, 5]), bias=torch.randn(4, 5, 5))
    cache = m.new_cache(2, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="bias"):
        m(x, cache=cache, bias=torch.randn(3, 4, 5, 5))
    assert cache.lengths.tolist() == [0, 0]  # the refused call appended nothing


def test_to_torch_refuses_variants():
    for options in OPTIONS.values():
        with pytest.raises(ValueError, match="MultiheadAttention has no") as e:
            mha.MultiHeadAttention(D_MODEL, 4, **options).to_torch()
        assert all(name in str(e.value) for name in options)
    assert isinstance(mha.MultiHeadAttention(D_MODEL, 4).to_torch(), torch.nn.MultiheadAttention)


def test_save_and_load_keep_the_variant_options(tmp_path):
    from mha import io

    torch.manual_seed(0)
    m = mha.MultiHeadAttention(32, 4, softcap=20.0, sinks=True, alibi=True)
    with torch.no_grad():
        m.sinks.normal_()
    io.save(m, tmp_path / "m.safetensors")
    back = io.load(tmp_path / "m.safetensors")
    assert (back.softcap, back.sinks is not None, back.alibi_slopes is not None) == (20.0, True, True)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(back(x, causal=True), m(x, causal=True))


def test_a_file_with_a_bad_softcap_is_refused_by_name(tmp_path):
    import json

    from safetensors.torch import save_file

    from mha import io

    m = mha.MultiHeadAttention(32, 4)
    cfg = {**io.config(m), "softcap": -1.0}
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "m.st"),
              metadata={"mha.MultiHeadAttention": json.dumps(cfg)})
    with pytest.raises(ValueError, match="softcap"):
        io.load(tmp_path / "m.st")
