"""MultiHeadAttention.explain: each condition of the fused forward (mha.fused_verdicts), forced to
fail one at a time, and the verdict agreeing with the path the module takes."""

from __future__ import annotations

import pytest
import torch

import mha
import mha.module
from mha.ops import linear_choice
from mha.ops import self_attention as fused

NAMES = ("inputs", "layout", "options", "projections", "gradient", "shape", "tiles", "speed")
STATES = {"holds": True, "fails": False, "not checked": None}


def conditions(text: str) -> dict[str, tuple[bool | None, str]]:
    """The condition lines of ``explain``'s text: name -> (holds, words)."""
    lines = text.splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith("fused forward ("))
    out = {}
    for line in lines[start + 1:-1]:
        name, rest = line.split(maxsplit=1)
        state, words = rest.split(": ", 1)
        out[name] = (STATES[state], words)
    return out


@pytest.fixture
def anywhere(monkeypatch):
    """Every condition that rests on this CPU made to hold: the tiles present and the fused
    forward forced on (``MHA_LINEAR=native``), so each test forces one reason only."""
    monkeypatch.setattr(fused, "tiles", lambda dtype: None)
    monkeypatch.setattr(linear_choice, "forced", lambda: "native")


def explain(m, x, *args, grad=False, **kwargs) -> str:
    with torch.set_grad_enabled(grad):
        return m.explain(x, *args, **kwargs)


def test_every_condition_holds(anywhere):
    text = explain(mha.MultiHeadAttention(64, 4).eval(), torch.randn(2, 8, 64), causal=True)
    got = conditions(text)
    assert tuple(got) == NAMES
    assert all(holds for holds, _ in got.values()), text
    assert got["options"][1].endswith("(causal, served)")
    assert text.splitlines()[-1].startswith("forward: fused fp32 forward")


def _module(**kw):
    return mha.MultiHeadAttention(kw.pop("d_model", 64), kw.pop("h", 4), **kw).eval()


# (id, module, query shape, positional key/value, call kwargs, grad, {condition: (holds, words)})
CASES = [
    ("float64", lambda: _module().double(), (2, 8, 64), False, {}, False,
     {"inputs": (False, "got query torch.float64 on cpu"), "tiles": (None, "bf16 and fp32")}),
    ("cross-attention", lambda: _module(), (2, 8, 64), True, {}, False,
     {"layout": (False, "key / value given (cross-attention)")}),
    ("separate projections", lambda: _module(kdim=32, vdim=32), (2, 8, 64), True, {}, False,
     {"layout": (False, "separate Q, K, V projections (kdim=32, vdim=32, d_model=64)"),
      "projections": (None, "the packed [W^Q; W^K; W^V] only (see layout)")}),
    ("grouped heads", lambda: _module(num_kv_heads=2), (2, 8, 64), False, {}, False,
     {"layout": (False, "grouped key/value heads (h_kv=2, h=4)")}),
    ("value head dim", lambda: _module(v_head_dim=32), (2, 8, 64), False, {}, False,
     {"layout": (False, "value head dim 32 != query/key head dim 16")}),
    ("mask", lambda: _module(), (2, 8, 64), False,
     {"mask": torch.ones(8, 8, dtype=torch.bool)}, False,
     {"options": (False, "the fused forward has no mask (")}),
    ("window and key_lengths", lambda: _module(), (2, 8, 64), False,
     {"window": 4, "causal": True, "key_lengths": torch.tensor([8, 5])}, False,
     {"options": (False, "the fused forward has no key_lengths, window (")}),
    ("softcap", lambda: _module(softcap=30.0), (2, 8, 64), False, {}, False,
     {"options": (False, "the fused forward has no softcap (")}),
    ("dropout", lambda: _module(dropout=0.1).train(), (2, 8, 64), False, {}, False,
     {"options": (False, "the fused forward has no dropout_p (")}),
    ("gradient", lambda: _module(), (2, 8, 64), False, {}, True,
     {"gradient": (False, "in_proj.weight, in_proj.bias, out_proj.weight, out_proj.bias "
                          "require grad")}),
    ("long", lambda: _module(), (1, fused.MAX_T + 1, 64), False, {}, False,
     {"shape": (False, f"T={fused.MAX_T + 1} not in 1..{fused.MAX_T}")}),
    ("head dim", lambda: _module(d_model=96), (2, 8, 96), False, {}, False,
     {"shape": (False, "head dim d=24 not a multiple of 16")}),
    ("widths", lambda: _module(d_model=40, h=1, head_dim=16), (2, 8, 40), False, {}, False,
     {"shape": (False, "d_model=40 not a multiple of 16; N_out=40 not a multiple of 16")}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_reason_fails_alone(anywhere, case):
    _, make, shape, cross, kwargs, grad, expected = case
    m = make()
    x = torch.randn(*shape, dtype=m.out_proj.weight.dtype)
    kv = (torch.randn(shape[0], shape[1], m.kdim), torch.randn(shape[0], shape[1], m.vdim)) \
        if cross else ()
    text = explain(m, x, *kv, grad=grad, **kwargs)
    got = conditions(text)
    assert tuple(got) == NAMES
    for name, (holds, words) in got.items():
        want, phrase = expected.get(name, (True, ""))
        assert holds is want, (name, text)
        assert phrase in words, (name, text)
    assert text.splitlines()[-1].startswith("forward: step by step: "), text


def test_packed_projections_fail_alone(anywhere):
    """Projections packed by mha.llm.weights.pack_weights (bf16, like the query): only the
    projections condition fails, and the module runs step by step for that reason."""
    from mha.llm.weights import PackedLinear, pack_weights

    m = pack_weights(_module(bias=False).bfloat16(), "bf16")
    assert isinstance(m.in_proj, PackedLinear) and isinstance(m.out_proj, PackedLinear)
    text = explain(m, torch.randn(2, 8, 64).bfloat16())
    got = conditions(text)
    assert tuple(got) == NAMES
    assert [n for n, (holds, _) in got.items() if not holds] == ["projections"], text
    assert "in_proj is PackedLinear, out_proj is PackedLinear" in got["projections"][1]
    assert text.splitlines()[-1].startswith("forward: step by step: the projections are packed "
                                            "modules"), text


def test_missing_tiles(monkeypatch):
    monkeypatch.setattr(fused, "tiles", lambda dtype: "no bf16 tiles in this build (test)")
    monkeypatch.setattr(linear_choice, "forced", lambda: "native")
    text = explain(_module().bfloat16(), torch.randn(2, 8, 64).bfloat16())
    got = conditions(text)
    assert got["tiles"] == (False, "no bf16 tiles in this build (test)")
    assert [n for n, (holds, _) in got.items() if not holds] == ["tiles"]
    assert text.splitlines()[-1] == "forward: step by step: no bf16 tiles in this build (test)"


def test_forced_off(monkeypatch):
    monkeypatch.setattr(fused, "tiles", lambda dtype: None)
    monkeypatch.setattr(linear_choice, "forced", lambda: "torch")
    got = conditions(explain(_module(), torch.randn(2, 8, 64)))
    assert got["speed"] == (False, "forced off by MHA_LINEAR=torch")
    assert [n for n, (holds, _) in got.items() if not holds] == ["speed"]


@pytest.mark.parametrize("native_s, holds", [(2.0, False), (1.0, True)])
def test_measured_speed(monkeypatch, native_s, holds):
    """The measured tiles against torch's GEMM decide the last condition: 2x slower fails,
    parity holds (TILES_MARGIN 1.10)."""
    monkeypatch.setattr(fused, "tiles", lambda dtype: None)
    monkeypatch.setattr(linear_choice, "forced", lambda: None)
    measured = linear_choice.Measured.of(native_s, 1.0, (512, 192, 64), "test cpu")
    monkeypatch.setattr(fused, "_measured", lambda *a: measured)
    text = explain(_module(), torch.randn(2, 8, 64))
    got = conditions(text)
    assert got["speed"][0] is holds
    assert f"ran at {1.0 / native_s:.2f}x the speed of torch's fp32 GEMM" in got["speed"][1]
    assert "(M=512, N=192, K=64) on test cpu" in got["speed"][1]
    assert text.splitlines()[-1].startswith("forward: fused" if holds else
                                            "forward: step by step: the fp32 tiles measured")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs, grad", [({}, False), ({"causal": True}, False), ({}, True),
                                          ({"window": 3, "causal": True}, False)])
def test_verdict_is_the_path_taken(monkeypatch, dtype, kwargs, grad):
    """On this machine, unforced: the module runs the fused op exactly when every condition
    holds."""
    monkeypatch.setattr(linear_choice, "forced", lambda: None)
    m = _module().to(dtype)
    x = torch.randn(2, 8, 64, dtype=dtype)
    got = conditions(explain(m, x, grad=grad, **kwargs))
    calls = []
    real = mha.module.fused_forward
    monkeypatch.setattr(mha.module, "fused_forward",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.set_grad_enabled(grad):
        m(x, **kwargs)
    assert bool(calls) == all(holds for holds, _ in got.values())
