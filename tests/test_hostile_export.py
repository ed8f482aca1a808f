"""ONNX export (:mod:`mha.export`) of models a careless user builds: every graph written is run by
ONNX Runtime and judged against mha's own answer; what a graph cannot compute (dropout, a zero
scale ONNX's Attention operator refuses) is refused before any file is written, naming the
argument.

Shape legend: B batch, h / h_kv heads, Tq / Tk lengths (Tn new tokens, P cached ones), d head
dim, d_model width.
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha import export

pytest.importorskip("onnx", reason="the onnx extra: pip install 'mha[onnx]'")
ort = pytest.importorskip("onnxruntime", reason="the onnx extra: pip install 'mha[onnx]'")
pytest.importorskip("onnxscript", reason="the onnx extra: pip install 'mha[onnx]'")


def _run(path, *arrays):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), arrays, strict=True)}
    return [torch.from_numpy(o) for o in sess.run(None, feeds)]


class _Attend(torch.nn.Module):
    """A user's model calling mha.attention with fixed keyword arguments."""

    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        return mha.attention(q, k, v, **self.kwargs)  # (B, h, Tq, d)


def test_decode_step_keeps_the_modules_alibi(tmp_path):
    """DecodeStep of an ALiBi module, prefill then one step, gives what the module gives over
    the whole sequence (the slopes penalise query position minus key position), in eager and
    in the graph."""
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(32, 4, num_kv_heads=2, alibi=True).eval()
    step = export.DecodeStep(m)
    x = torch.randn(2, 5, 32)  # (B, T, d_model): a prompt of 3, then 2 new tokens
    empty = torch.zeros(2, 2, 0, 8)  # (B, h_kv, 0, d)
    with torch.no_grad():
        full = m(x, causal=True)  # (B, T, d_model)
        y0, past_k, past_v = step(x[:, :3], empty, empty)
        y1, _, _ = step(x[:, 3:], past_k, past_v)
    torch.testing.assert_close(torch.cat([y0, y1], 1), full, rtol=1e-5, atol=1e-5)
    path = export.onnx(step, (x[:, 3:].contiguous(), past_k, past_v), tmp_path / "step.onnx",
                       dynamic_shapes=({0: "B", 1: "Tn"}, {0: "B", 2: "P"}, {0: "B", 2: "P"}))
    y, _, _ = _run(path, x[:, 3:].contiguous(), past_k, past_v)
    torch.testing.assert_close(y, full[:, 3:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(dropout_p=0.5), dict(dropout_p=0.1, causal=True)])
def test_dropout_in_an_attention_call_is_refused(tmp_path, kwargs):
    """A call that drops weights (mha drops them whatever the training mode) has no graph:
    ONNX's Attention operator has no dropout, so the exporter would write one without it."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    with pytest.raises(ValueError, match=r"dropout_p=0\.(5|1)"):
        export.onnx(_Attend(**kwargs), (q, k, v), tmp_path / "a.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_zero_scale_is_refused_not_written_unloadable(tmp_path):
    """scale=0 (every key weighted alike) is mha's to compute, but ONNX's Attention operator
    takes only a scale > 0: ONNX Runtime refuses to load such a graph."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    with pytest.raises(ValueError, match=r"scale=0\.0.*> 0"):
        export.onnx(_Attend(scale=0.0), (q, k, v), tmp_path / "a.onnx")
    assert list(tmp_path.iterdir()) == []


def test_example_inputs_that_are_views_export(tmp_path):
    """An example input sliced from a bigger tensor (strides of the bigger one) exports with
    dynamic shapes as its contiguous copy would: the graph does not depend on strides."""
    torch.manual_seed(1)
    m = mha.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 9, 32)[:, :4]  # (B, T, d_model), a view with the strides of T = 9
    path = export.onnx(export.SelfAttention(m, causal=True), (x,), tmp_path / "a.onnx",
                       dynamic_shapes=({0: "B", 1: "T"},))
    x2 = torch.randn(3, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(_run(path, x2)[0], m(x2, causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs", [
    dict(causal=True), dict(causal=True, window=2), dict(key_lengths=torch.tensor([0, 7])),
    dict(key_lengths=torch.tensor([3, 7]), causal=True), dict(scale=0.3),
    dict(bias=torch.randn(1, 4, 5, 7)), dict(alibi_slopes=torch.rand(4)),
    dict(mask=torch.rand(2, 1, 5, 7) > 0.3),
], ids=["causal", "window", "empty-row", "lengths-causal", "scale", "bias", "alibi", "mask"])
def test_functional_calls_export_with_mhas_answer(tmp_path, kwargs):
    """GQA, Tq != Tk (bottom-right causal), a row with no key: the graph gives mha's answer."""
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    model = _Attend(**kwargs)
    path = export.onnx(model, (q, k, v), tmp_path / "a.onnx")
    with torch.no_grad():
        torch.testing.assert_close(_run(path, q, k, v)[0], model(q, k, v), rtol=1e-5, atol=1e-5)


_STEP_ARGS = dict(x=(2, 1, 32), past_k=(2, 2, 3, 8), past_v=(2, 2, 3, 8))  # h_kv 2, d 8


@pytest.mark.parametrize("name, shape, match", [
    ("x", (1, 32), r"x must have shape \(B, Tn, d_model\) = \(B, Tn, 32\)"),
    ("x", (2, 1, 31), r"x must have shape \(B, Tn, d_model\) = \(B, Tn, 32\)"),
    ("past_k", (2, 3, 8), r"past_k must have shape \(B, h_kv, P, d_k\) = \(2, 2, P, 8\)"),
    ("past_k", (2, 4, 3, 8), r"past_k must have shape \(B, h_kv, P, d_k\) = \(2, 2, P, 8\)"),
    ("past_k", (3, 2, 3, 8), r"past_k must have shape \(B, h_kv, P, d_k\) = \(2, 2, P, 8\)"),
    ("past_v", (2, 2, 4, 8), r"past_v must have shape \(B, h_kv, P, d_v\) = \(2, 2, 3, 8\)"),
])
def test_decode_step_names_the_input_of_the_wrong_shape(name, shape, match):
    m = mha.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    args = {n: torch.randn(*(shape if n == name else s)) for n, s in _STEP_ARGS.items()}
    with pytest.raises(ValueError, match=match):
        export.DecodeStep(m)(**args)


def test_decode_step_names_past_of_another_dtype():
    m = mha.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    args = {n: torch.randn(*s) for n, s in _STEP_ARGS.items()}
    args["past_v"] = args["past_v"].double()
    with pytest.raises(TypeError, match="past_v must be torch.float32 like x"):
        export.DecodeStep(m)(**args)


@pytest.mark.parametrize("module", [
    lambda: mha.MultiHeadAttention(32, 4, kdim=12, vdim=20), lambda: torch.nn.Linear(4, 4)])
def test_decode_step_refuses_what_is_not_a_self_attention_module(module):
    with pytest.raises((TypeError, ValueError), match="module"):
        export.DecodeStep(module())


def test_every_opset_accepted_is_the_one_written(tmp_path):
    """Each opset the options check accepts is either the opset of the file written (a graph
    ONNX Runtime loads, with mha's answer) or refused naming opset with no file: the exporter
    failed to convert to 26..28 and wrote an opset-18 graph with an Attention node, which no
    runtime loads."""
    import onnx

    torch.manual_seed(3)
    m = mha.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 5, 32)
    for opset in range(export.OPSET, export._max_opset() + 1):
        path = tmp_path / f"opset{opset}.onnx"
        try:
            export.onnx(export.SelfAttention(m, causal=True), (x,), path, opset=opset)
        except ValueError as e:
            assert str(e).startswith(f"opset: the exporter could not convert the graph to "
                                     f"opset {opset}"), e
            assert not path.exists()
            continue
        written = {i.domain: i.version for i in onnx.load(str(path)).opset_import}
        assert written[""] == opset, (opset, written)
        with torch.no_grad():
            torch.testing.assert_close(_run(path, x)[0], m(x, causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wrapper", ["self", "cross"])
@pytest.mark.parametrize("key_padding, keep, match", [
    (True, None, r"keep: the wrapper was built with key_padding=True"),
    (False, "bool", r"keep: the wrapper was built with key_padding=False"),
    (True, "short", r"keep must have shape \(B, Tk\) = \(2, 7\)"),
    (True, "int", r"keep must be a bool tensor"),
])
def test_wrappers_check_keep_against_key_padding(wrapper, key_padding, keep, match):
    """key_padding= said whether the graph takes ``keep``, but was never read: a wrapper built
    with key_padding=True exported without a keep input, and keep errors named ``mask``."""
    m = mha.MultiHeadAttention(32, 4, **({} if wrapper == "self" else dict(kdim=12))).eval()
    Tk = 7
    x = torch.randn(2, Tk if wrapper == "self" else 5, 32)
    keep = {None: None, "bool": torch.ones(2, Tk, dtype=torch.bool),
            "short": torch.ones(2, Tk - 1, dtype=torch.bool),
            "int": torch.ones(2, Tk, dtype=torch.int64)}[keep]
    with pytest.raises((TypeError, ValueError), match=match):
        if wrapper == "self":
            export.SelfAttention(m, key_padding=key_padding)(x, keep)
        else:
            export.CrossAttention(m, key_padding=key_padding)(x, torch.randn(2, Tk, 12),
                                                              keep=keep)


@pytest.mark.parametrize("wrapper", [export.SelfAttention, export.CrossAttention])
def test_wrappers_name_a_module_that_is_not_mhas(wrapper):
    with pytest.raises(TypeError, match="module must be a mha.MultiHeadAttention"):
        wrapper(torch.nn.Linear(32, 32))
