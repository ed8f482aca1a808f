"""mha.trace and `mha shapes`: the recorded shapes are the ones the run produced, for GQA/MQA
K/V heads, d_v != d_k and cross-attention lengths (Tq != Tk).

Shape legend: B batch, Tq/Tk query/key lengths, d_model width, h/h_kv heads, d_k/d_v head dims.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mha
from mha.cli import main
from mha.trace import active, recording  # mha.trace itself is the function

STEPS = ("input", "project Q", "project K", "project V", "split heads Q", "split heads K",
         "split heads V", "attention weights", "heads", "concat heads", "output")


def expected_shapes(B, Tq, Tk, d_model, h, h_kv, d_k, d_v, *,
                    cross=False) -> dict[str, tuple[int, ...]]:
    """Seed 004's flow, written out by hand for a configuration (cross-attention also records
    the key/value input, here of width d_model)."""
    kv_input = {"key/value input": (B, Tk, d_model)} if cross else {}
    return {
        "input": (B, Tq, d_model),
        **kv_input,
        "project Q": (B, Tq, h * d_k),
        "project K": (B, Tk, h_kv * d_k),
        "project V": (B, Tk, h_kv * d_v),
        "split heads Q": (B, h, Tq, d_k),
        "split heads K": (B, h_kv, Tk, d_k),
        "split heads V": (B, h_kv, Tk, d_v),
        "attention weights": (B, h, Tq, Tk),
        "heads": (B, h, Tq, d_v),
        "concat heads": (B, Tq, h * d_v),
        "output": (B, Tq, d_model),
    }


def legend_shape(legend: str, letters: dict[str, int]) -> tuple[int, ...]:
    """Evaluate a legend such as "(B, Tk, h_kv*d_v)" with the configuration's letters."""
    dims = legend.strip("()").split(",")
    out = []
    for d in dims:
        value = 1
        for factor in d.strip().split("*"):
            value *= letters[factor.strip()]
        out.append(value)
    return tuple(out)


def run_trace(B, Tq, Tk, d_model, h, h_kv, d_k, d_v, *, causal=False):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(d_model, h, num_kv_heads=h_kv, head_dim=d_k, v_head_dim=d_v)
    x = torch.randn(B, Tq, d_model)
    kv = None if Tk is None else torch.randn(B, Tk, d_model)
    return m, x, kv, mha.trace(m, x, kv, kv, causal=causal)


CONFIGS = [  # (B, Tq, Tk or None for self-attention, d_model, h, h_kv, d_k, d_v)
    (32, 20, None, 512, 8, 8, 64, 64),  # the seeds' configuration
    (2, 3, None, 24, 6, 2, 4, 4),  # GQA
    (2, 3, None, 24, 6, 1, 4, 4),  # MQA
    (1, 4, None, 16, 4, 4, 4, 7),  # d_v != d_k
    (2, 3, 9, 16, 4, 4, 4, 4),  # cross-attention, Tq < Tk
    (3, 6, 2, 20, 4, 2, 3, 5),  # everything at once, Tq > Tk
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "B{}-Tq{}-Tk{}-d{}-h{}-hkv{}-dk{}-dv{}".format(*c))
def test_recorded_shapes_match_configuration(cfg):
    B, Tq, Tk, d_model, h, h_kv, d_k, d_v = cfg
    _, _, _, tr = run_trace(*cfg)
    Tk_ = Tq if Tk is None else Tk
    want = expected_shapes(B, Tq, Tk_, d_model, h, h_kv, d_k, d_v, cross=Tk is not None)
    assert [s.step for s in tr] == list(want)
    assert {s.step: s.shape for s in tr} == want
    letters = dict(B=B, Tq=Tq, Tk=Tk_, d_model=d_model, kdim=d_model, h=h, h_kv=h_kv, d_k=d_k,
                   d_v=d_v)
    for s in tr:  # the symbolic column says the same thing as the recorded one
        assert legend_shape(s.legend, letters) == s.shape, s
        assert s.dtype == "float32"
    assert tr.backend in mha.backends.ORDER


@given(B=st.integers(1, 3), Tq=st.integers(1, 6), Tk=st.one_of(st.none(), st.integers(1, 6)),
       h_kv=st.integers(1, 3), group=st.integers(1, 3), d_k=st.integers(1, 6),
       d_v=st.integers(1, 6), d_model=st.integers(1, 12), causal=st.booleans())
def test_recorded_shapes_property(B, Tq, Tk, h_kv, group, d_k, d_v, d_model, causal):
    h = h_kv * group
    m, x, kv, tr = run_trace(B, Tq, Tk, d_model, h, h_kv, d_k, d_v, causal=causal)
    Tk_ = Tq if Tk is None else Tk
    assert {s.step: s.shape for s in tr} == expected_shapes(B, Tq, Tk_, d_model, h, h_kv, d_k, d_v,
                                                            cross=Tk is not None)
    # ...and they are the shapes of what the module actually returns
    y, w = m(x, kv, kv, causal=causal, need_weights=True)
    shapes = {s.step: s.shape for s in tr}
    assert shapes["output"] == tuple(y.shape)
    assert shapes["attention weights"] == tuple(w.shape)


def test_trace_restores_state_and_nests():
    assert not active()
    m = mha.MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    with recording() as outer:
        inner = mha.trace(m, x)
        assert active()
    assert not active()
    assert len(inner) == len(STEPS) and len(outer) == 0  # steps go to the innermost trace
    m(x)  # no trace active: nothing is recorded anywhere
    assert len(inner) == len(STEPS)


def test_trace_does_not_change_the_result():
    torch.manual_seed(1)
    m = mha.MultiHeadAttention(16, 4, num_kv_heads=2, v_head_dim=6)
    x, mem = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    with torch.no_grad():
        want_y, want_w = m(x, mem, mem, need_weights=True)
        plain = m(x, mem, mem)
        with recording() as tr:
            got_y, got_w = m(x, mem, mem, need_weights=True)
            got_plain = m(x, mem, mem)
    # Recording asks for the weights, so it runs a backend that returns them: bit-identical to
    # an untraced need_weights=True run, and equal to a plain run up to fp32 rounding (a plain
    # run may pick a faster backend that returns no weights).
    torch.testing.assert_close(got_y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
    torch.testing.assert_close(got_plain, plain, rtol=1e-5, atol=1e-6)
    assert len(tr) == 2 * (len(STEPS) + 1)  # cross-attention also records the K/V input


def test_to_json_parses():
    _, _, _, tr = run_trace(2, 3, 5, 24, 6, 2, 4, 5)
    data = json.loads(tr.to_json())
    assert data["backend"] == tr.backend
    assert [d["step"] for d in data["steps"]] == list(expected_shapes(2, 3, 5, 24, 6, 2, 4, 5,
                                                                      cross=True))
    for d, s in zip(data["steps"], tr, strict=True):
        assert d["shape"] == list(s.shape)
        assert d["legend"] == s.legend and d["formula"] == s.formula


SHAPES_ARGS = ["shapes", "--batch", "2", "--seq", "3", "--kv-seq", "7", "--d-model", "24",
               "--heads", "6", "--kv-heads", "3", "--d-k", "5", "--d-v", "9"]


def test_cli_json(capsys):
    assert main([*SHAPES_ARGS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    got = {d["step"]: tuple(d["shape"]) for d in data["steps"]}
    assert got == expected_shapes(2, 3, 7, 24, 6, 3, 5, 9, cross=True)
    assert data["backend"] in mha.backends.ORDER


def test_cli_json_causal_self_attention(capsys):
    assert main(["shapes", "-B", "1", "-T", "4", "--d-model", "12", "--heads", "3",
                 "--causal", "--json"]) == 0
    got = {d["step"]: tuple(d["shape"]) for d in json.loads(capsys.readouterr().out)["steps"]}
    assert got == expected_shapes(1, 4, 4, 12, 3, 3, 4, 4)


def test_cli_table(capsys):
    assert main(SHAPES_ARGS) == 0
    out = capsys.readouterr().out
    # every recorded shape appears as a row of the table (rich may wrap long cells, so the
    # check strips the box drawing and whitespace)
    flat = re.sub(r"[\s│┃┆]", "", out)
    for shape in expected_shapes(2, 3, 7, 24, 6, 3, 5, 9, cross=True).values():
        assert str(list(shape)).replace(" ", "") in flat
    assert re.search(r"attention backend used for the trace: (\w+)", out).group(1) in mha.backends.ORDER


@pytest.mark.parametrize("argv, message", [
    (["--d-model", "10", "--heads", "3"], "d_model=10 must be divisible by num_heads=3"),
    (["--heads", "8", "--kv-heads", "3"], "num_heads=8 must be a multiple of num_kv_heads=3"),
    (["--batch", "0"], "--batch must be a positive int, got 0"),
    (["--kv-seq", "-1"], "--kv-seq must be a positive int, got -1"),
])
def test_cli_rejects_impossible_configurations(capsys, argv, message):
    assert main(["shapes", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err


def test_trace_names_a_module_that_is_not_one():
    with pytest.raises(TypeError, match="module must be an mha module to run"):
        mha.trace("x", torch.randn(1, 3, 8))
