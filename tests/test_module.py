"""mha.MultiHeadAttention: the fused module against the seed-000 per-head loop and against
torch.nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import mha
from mha.masks import causal_mask

from oracle import max_err


@given(B=st.integers(1, 3), Tq=st.integers(1, 7), Tk=st.integers(1, 7),
       heads=st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3)]), d_k=st.sampled_from([8, 16]),
       d_v=st.sampled_from([8, 12]), cross=st.booleans(), causal=st.booleans(),
       bias=st.booleans(), seed=st.integers(0, 1000))
def test_fused_module_equals_per_head_loop(B, Tq, Tk, heads, d_k, d_v, cross, causal, bias, seed):
    torch.manual_seed(seed)
    h, h_kv = heads
    kdim = 20 if cross else None
    m = mha.MultiHeadAttention(24, h, num_kv_heads=h_kv, head_dim=d_k, v_head_dim=d_v,
                               kdim=kdim, vdim=kdim, bias=bias)
    x = torch.randn(B, Tq, 24)
    kv = torch.randn(B, Tk, 20) if cross else x
    if not cross:
        Tk = Tq
    y, w = m(x, kv if cross else None, kv if cross else None, causal=causal, need_weights=True)
    allowed = causal_mask(Tq, Tk) if causal else None
    ref_y, ref_w = mha.reference.multi_head_attention(x, kv, allowed=allowed, upcast=True,
                                                      **m.per_head_weights())
    assert y.shape == (B, Tq, 24) and w.shape == (B, h, Tq, Tk)
    assert max_err(y, ref_y) < 1e-5
    assert max_err(w, ref_w) < 1e-5


def test_seed_004_configuration_shapes():
    m = mha.MultiHeadAttention(512, 8)
    x = torch.randn(32, 20, 512)
    tr = mha.trace(m, x)
    shapes = {s.step: s.shape for s in tr}
    assert shapes["split heads Q"] == (32, 8, 20, 64)
    assert shapes["attention weights"] == (32, 8, 20, 20)
    assert shapes["concat heads"] == (32, 20, 512)
    assert shapes["output"] == (32, 20, 512)
    assert m.head_dim == 64 and m.per_head_weights()["W_q"][0].shape == (512, 64)


def test_per_head_weights_round_trip():
    torch.manual_seed(0)
    a = mha.MultiHeadAttention(16, 4, num_kv_heads=2, v_head_dim=6)
    b = mha.MultiHeadAttention(16, 4, num_kv_heads=2, v_head_dim=6)
    b.load_per_head_weights(a.per_head_weights())
    x = torch.randn(2, 5, 16)
    assert torch.equal(a(x), b(x))
    w = a.per_head_weights()
    assert len(w["W_q"]) == 4 and len(w["W_k"]) == 2 and w["W_v"][0].shape == (16, 6)
    assert w["W_o"].shape == (4 * 6, 16)


def test_loading_independent_per_head_matrices():
    """Seed 000: W_i^Q, W_i^K, W_i^V are independent per head; load them and compute."""
    torch.manual_seed(1)
    h, d_model, d_k = 4, 16, 4
    weights = dict(W_q=[torch.randn(d_model, d_k) for _ in range(h)],
                   W_k=[torch.randn(d_model, d_k) for _ in range(h)],
                   W_v=[torch.randn(d_model, d_k) for _ in range(h)],
                   W_o=torch.randn(h * d_k, d_model), b_q=None, b_k=None, b_v=None, b_o=None)
    m = mha.MultiHeadAttention(d_model, h, bias=False)
    m.load_per_head_weights(weights)
    x = torch.randn(3, 7, d_model)
    ref, _ = mha.reference.multi_head_attention(x, x, upcast=True, **weights)
    assert max_err(m(x), ref) < 1e-4


@pytest.mark.parametrize("kdim", [None, 12])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_and_to_torch(kdim, bias):
    torch.manual_seed(2)
    t = nn.MultiheadAttention(32, 4, bias=bias, kdim=kdim, vdim=kdim, batch_first=True)
    m = mha.MultiHeadAttention.from_torch(t)
    assert m.packed == (kdim is None)
    x = torch.randn(2, 5, 32)
    kv = torch.randn(2, 7, kdim or 32)
    want, want_w = t(x, kv, kv, average_attn_weights=False)
    got, got_w = m(x, kv, kv, need_weights=True)
    assert max_err(got, want) < 1e-5
    assert max_err(got_w, want_w) < 1e-6  # per-head weights equal torch's unaveraged weights
    back = m.to_torch()
    assert max_err(back(x, kv, kv)[0], want) < 1e-6


def test_to_torch_rejects_what_torch_cannot_express():
    with pytest.raises(ValueError, match="num_kv_heads == num_heads"):
        mha.MultiHeadAttention(16, 4, num_kv_heads=2).to_torch()


def test_masks_match_torch_key_padding():
    torch.manual_seed(3)
    t = nn.MultiheadAttention(16, 2, batch_first=True)
    m = mha.MultiHeadAttention.from_torch(t)
    x = torch.randn(2, 6, 16)
    lengths = torch.tensor([6, 3])
    pad = torch.arange(6)[None] >= lengths[:, None]  # torch: True = ignore
    want = t(x, x, x, key_padding_mask=pad, need_weights=False)[0]
    assert max_err(m(x, key_lengths=lengths), want) < 1e-5
    assert max_err(m(x, mask=~pad[:, None, None, :]), want) < 1e-5


def test_training_step_updates_every_projection():
    torch.manual_seed(4)
    m = mha.MultiHeadAttention(16, 4, num_kv_heads=2, dropout=0.1).train()
    x = torch.randn(2, 5, 16)
    m(x, causal=True).square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_module_close_to_fp64():
    torch.manual_seed(5)
    m = mha.MultiHeadAttention(64, 4)
    x = torch.randn(2, 9, 64)
    ref, _ = mha.reference.multi_head_attention(x, x, upcast=True, **m.per_head_weights())
    y = m.to(torch.bfloat16)(x.bfloat16(), causal=False)
    assert y.dtype == torch.bfloat16
    assert max_err(y, ref) < 0.05


def test_empty_sequence_module():
    m = mha.MultiHeadAttention(16, 4)
    assert m(torch.randn(2, 0, 16)).shape == (2, 0, 16)


@pytest.mark.parametrize(("native_s", "torch_s", "side"), [(1.0, 2.0, "the native tiles"),
                                                           (2.0, 1.0, "torch's GEMM")])
def test_explain_names_each_projections_gemm_and_the_backend(tmp_path, monkeypatch, native_s,
                                                             torch_s, side):
    """explain(): one line per GEMM with the (injected) measurement behind it, then the attention
    backends' verdicts for the same call; the projections the native op cannot take say why."""
    from mha.ops import linear, linear_choice

    if linear.load() is not None:
        pytest.skip(f"the native projections did not build: {linear.load()}")
    monkeypatch.setattr(linear_choice, "path", lambda: tmp_path / linear_choice.FILE)
    monkeypatch.setattr(linear_choice, "forced", lambda: None)
    monkeypatch.setattr(linear_choice, "_memo", {})
    monkeypatch.setattr(linear_choice, "measure", lambda shape: (native_s, torch_s))
    monkeypatch.setattr(linear_choice, "measure_bf16", lambda shape: (3.0, 1.0))
    monkeypatch.setattr(linear_choice, "measure_bf16_tiles", lambda shape: (3.0, 1.0))
    m = mha.MultiHeadAttention(512, 8)
    x = torch.randn(32, 20, 512)
    text = m.explain(x, causal=True)
    lines = text.splitlines()
    assert lines[0] == "projections:" and lines[3] == "attention:"
    assert lines[1].startswith(f"  Q, K, V (one GEMM): {side}: measured 2.00x faster")
    assert "(M=512, N=2048, K=512)" in lines[1] and "(M=512, N=512, K=512)" in lines[2]
    assert lines[2].startswith(f"  W_O: {side}")
    chosen = mha.explain(*(t.transpose(1, 2) for t in torch.randn(3, 32, 20, 8, 64)),
                         causal=True).chosen
    assert f"{chosen} " in text and "chosen" in text
    cross = mha.MultiHeadAttention(512, 8, kdim=256, vdim=256).bfloat16()
    text = cross.explain(x.bfloat16(), torch.randn(32, 7, 256).bfloat16())
    assert [ln.split(":")[0] for ln in text.splitlines()[1:5]] == ["  Q", "  K", "  V", "  W_O"]
    ours = "the native bf16 tiles" if linear.bf16_tiles() else "an fp32 GEMM on upcast inputs"
    assert text.count(f"torch's bf16 GEMM: measured 3.00x faster than {ours}") == 4
    with pytest.raises(ValueError, match="query"):
        m.explain(torch.randn(2, 3, 100))
