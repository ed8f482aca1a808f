"""ONNX export (mha.export): the graph ONNX Runtime runs gives mha's outputs.

Shape legend: B batch, T / Tq / Tk lengths, P cached positions, d_model width.
Every graph is exported at one size and run by ONNX Runtime at another (dynamic axes), and
compared with mha's own output in float32 (rtol / atol 1e-5: the same formula, other kernels).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import mha
from mha import export

onnx = pytest.importorskip("onnx", reason="the onnx extra: pip install 'mha[onnx]'")
ort = pytest.importorskip("onnxruntime", reason="the onnx extra: pip install 'mha[onnx]'")
pytest.importorskip("onnxscript", reason="the onnx extra: pip install 'mha[onnx]'")


def _run(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(o) for o in sess.run(None, {k: v.numpy() for k, v in feeds.items()})]


def _ops(path):
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_gqa_key_padding(tmp_path, causal):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(64, 8, num_kv_heads=2, v_head_dim=12).eval()  # d_v != d_k
    x, keep = torch.randn(2, 9, 64), torch.ones(2, 9, dtype=torch.bool)
    path = export.onnx(export.SelfAttention(m, causal=causal, key_padding=True), (x, keep),
                       tmp_path / "sa.onnx", input_names=["x", "keep"], output_names=["y"],
                       dynamic_shapes=({0: "B", 1: "T"}, {0: "B", 1: "T"}))
    assert "Attention" in _ops(path)  # the opset-23 operator, not a decomposition
    x2, keep2 = torch.randn(3, 13, 64), torch.ones(3, 13, dtype=torch.bool)
    keep2[1, 7:] = False  # padding
    (y,) = _run(path, {"x": x2, "keep": keep2})
    with torch.no_grad():
        _close(y, m(x2, mask=keep2[:, None, None, :], causal=causal), f"causal={causal}")
    assert sorted(os.listdir(tmp_path)) == ["sa.onnx"]  # no temporary file left


def test_cross_attention(tmp_path):
    torch.manual_seed(1)
    m = mha.MultiHeadAttention(32, 4, kdim=24, vdim=20).eval()
    x, mem, val = torch.randn(2, 5, 32), torch.randn(2, 7, 24), torch.randn(2, 7, 20)
    keep = torch.ones(2, 7, dtype=torch.bool)
    path = export.onnx(export.CrossAttention(m, key_padding=True), (x, mem, val, keep),
                       tmp_path / "ca.onnx", input_names=["x", "memory", "value", "keep"],
                       dynamic_shapes=({0: "B", 1: "Tq"}, {0: "B", 1: "Tk"}, {0: "B", 1: "Tk"},
                                       {0: "B", 1: "Tk"}))
    x2, mem2, val2 = torch.randn(1, 3, 32), torch.randn(1, 11, 24), torch.randn(1, 11, 20)
    keep2 = torch.ones(1, 11, dtype=torch.bool)
    keep2[0, 8:] = False
    (y,) = _run(path, {"x": x2, "memory": mem2, "value": val2, "keep": keep2})
    with torch.no_grad():
        _close(y, m(x2, mem2, val2, mask=keep2[:, None, None, :]), "cross-attention")


def test_decode_step_with_cache_inputs_and_outputs(tmp_path):
    """ONNX Runtime decodes step by step from the past K/V it returned, with the same outputs
    and the same K/V as mha's own KVCache decoding."""
    torch.manual_seed(2)
    m = mha.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    B, d = 2, 32
    path = export.onnx(export.DecodeStep(m), (torch.randn(B, 1, d), torch.randn(B, 2, 3, 8),
                                              torch.randn(B, 2, 3, 8)),
                       tmp_path / "step.onnx", input_names=["x", "past_k", "past_v"],
                       output_names=["y", "present_k", "present_v"],
                       dynamic_shapes=({0: "B", 1: "Tn"}, {0: "B", 2: "P"}, {0: "B", 2: "P"}))
    prompt, steps = torch.randn(B, 4, d), [torch.randn(B, 1, d) for _ in range(3)]
    cache = m.new_cache(B, 16)
    with torch.no_grad():
        m(prompt, cache=cache)
        past_k, past_v = cache.keys().clone(), cache.values().clone()
        for t, x in enumerate(steps):
            want = m(x, cache=cache)
            y, past_k, past_v = _run(path, {"x": x, "past_k": past_k, "past_v": past_v})
            _close(y, want, f"step {t}")
            _close(past_k, cache.keys(), f"present_k {t}")
            _close(past_v, cache.values(), f"present_v {t}")


def test_a_small_decoder(tmp_path):
    from mha.models.decoder import TinyDecoder

    model = TinyDecoder(vocab_size=50, d_model=32, n_layers=2, num_heads=4, num_kv_heads=2,
                        max_len=64).eval()
    idx = torch.randint(0, 50, (2, 8))
    path = export.onnx(model, (idx,), tmp_path / "dec.onnx", input_names=["idx"],
                       dynamic_shapes=({0: "B", 1: "T"},))
    idx2 = torch.randint(0, 50, (3, 12))
    (logits,) = _run(path, {"idx": idx2})
    with torch.no_grad():
        _close(logits, model(idx2), "TinyDecoder logits")


class _Causal(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_module(tmp_path, causal):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(32, 4, alibi=True).eval()
    model = _Causal(m) if causal else m
    path = export.onnx(model, (torch.randn(2, 6, 32),), tmp_path / "alibi.onnx",
                       input_names=["x"], dynamic_shapes=({0: "B", 1: "T"},))
    x = torch.randn(3, 11, 32)
    (y,) = _run(path, {"x": x})
    with torch.no_grad():
        _close(y, model(x), f"alibi causal={causal}")


def test_refusals_leave_no_file(tmp_path):
    m = mha.MultiHeadAttention(16, 2, dropout=0.1)  # training mode with dropout
    with pytest.raises(ValueError, match="model.eval"):
        export.onnx(export.SelfAttention(m), (torch.randn(1, 3, 16),), tmp_path / "a.onnx")

    class Capped(torch.nn.Module):  # a score variant no graph operator computes
        def forward(self, q):
            return mha.attention(q, q, q, softcap=30.0)

    with pytest.raises(ValueError, match="softcap"):
        export.onnx(Capped(), (torch.randn(1, 2, 3, 8),), tmp_path / "b.onnx")
    with pytest.raises(TypeError, match="args must be a tuple"):
        export.onnx(m.eval(), torch.randn(1, 3, 16), tmp_path / "c.onnx")
    with pytest.raises(ValueError, match="does not exist"):
        export.onnx(m.eval(), (torch.randn(1, 3, 16),), tmp_path / "missing" / "d.onnx")
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        export.onnx(m.eval(), (torch.randn(1, 3, 16),), None)
    with pytest.raises(ValueError, match="is a directory; give the name of the file"):
        export.onnx(m.eval(), (torch.randn(1, 3, 16),), tmp_path)
    # example inputs mha refuses: its own error, not the exporter's wrapper around it
    with pytest.raises(ValueError, match=r"query must have shape \(B, Tq, d_model\) with d_model=16"):
        export.onnx(m.eval(), (torch.randn(1, 3, 7),), tmp_path / "e.onnx")
    with pytest.raises(ValueError, match=r"query must be a torch.Tensor"):
        export.onnx(m.eval(), ("not a tensor",), tmp_path / "f.onnx")
    assert os.listdir(tmp_path) == []


def test_missing_exporter_gives_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(ImportError, match=r"pip install 'mha\[onnx\]'"):
        export.onnx(mha.MultiHeadAttention(16, 2).eval(), (torch.randn(1, 3, 16),),
                    tmp_path / "e.onnx")
