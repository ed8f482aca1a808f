"""``MultiHeadAttention.from_torch`` against the ``torch.nn.MultiheadAttention`` modules a user
may hand it: every one it takes computes torch's function (judged against torch's own forward,
batch_first or not), and what mha cannot represent is refused naming the option.

Shape legend: B batch, Tq / Tk lengths, E embed_dim (d_model), kdim / vdim key / value widths.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mha


def _torch_out(t: nn.MultiheadAttention, q, k, v) -> torch.Tensor:
    """torch's output for batch-first inputs, whatever the module's batch_first."""
    if t.batch_first:
        return t(q, k, v, need_weights=False)[0]  # (B, Tq, E)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # (B, T, E) -> (T, B, E)
    return t(q, k, v, need_weights=False)[0].transpose(0, 1)  # (Tq, B, E) -> (B, Tq, E)


def _inputs(t: nn.MultiheadAttention):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 4, t.embed_dim, generator=g), torch.randn(2, 6, t.kdim, generator=g),
            torch.randn(2, 6, t.vdim, generator=g))  # (B, Tq, E), (B, Tk, kdim), (B, Tk, vdim)


def _randomized(t: nn.MultiheadAttention) -> nn.MultiheadAttention:
    """Every parameter random (torch initialises the biases to zeros, which hides a lost one)."""
    with torch.no_grad():
        for p in t.parameters():
            p.normal_()
    return t.eval()


@pytest.mark.parametrize("drop", ["in_proj_bias", "out_proj.bias"])
@pytest.mark.parametrize("kdim", [None, 12])
def test_a_module_with_one_of_its_biases_removed_converts_to_its_function(drop, kdim):
    """torch's forward takes in_proj_bias and out_proj.bias separately, either may be None (a
    checkpoint without one); the converted module computes what torch computes."""
    torch.manual_seed(0)
    t = _randomized(nn.MultiheadAttention(32, 4, batch_first=True, kdim=kdim, vdim=kdim))
    if drop == "in_proj_bias":
        t.in_proj_bias = None
    else:
        t.out_proj.bias = None
    m = mha.MultiHeadAttention.from_torch(t).eval()
    q, k, v = _inputs(t)
    with torch.no_grad():
        torch.testing.assert_close(m(q, k, v), _torch_out(t, q, k, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs", [dict(), dict(bias=False), dict(kdim=12, vdim=20),
                                    dict(kdim=12, vdim=20, bias=False), dict(batch_first=False)])
def test_from_torch_and_back_compute_torchs_function(kwargs):
    torch.manual_seed(0)
    t = _randomized(nn.MultiheadAttention(32, 4, **{"batch_first": True, **kwargs}))
    m = mha.MultiHeadAttention.from_torch(t).eval()
    q, k, v = _inputs(t)
    with torch.no_grad():
        want = _torch_out(t, q, k, v)
        torch.testing.assert_close(m(q, k, v), want, rtol=1e-4, atol=1e-4)
        back = m.to_torch().eval()
        torch.testing.assert_close(_torch_out(back, q, k, v), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
def test_options_without_an_equivalent_are_named(option):
    t = nn.MultiheadAttention(32, 4, batch_first=True, **{option: True})
    with pytest.raises(ValueError, match=rf"from_torch: the module has {option}=True") as e:
        mha.MultiHeadAttention.from_torch(t)
    other = {"add_bias_kv", "add_zero_attn"} - {option}
    assert other.pop() not in str(e.value)  # only the option that is set


def _without(m: mha.MultiHeadAttention, name: str) -> mha.MultiHeadAttention:
    """``m`` with the bias of projection ``name`` removed (a checkpoint without that bias)."""
    getattr(m, name).bias = None
    return m


@pytest.mark.parametrize("drop", ["in_proj", "out_proj", "k_proj"])
def test_to_torch_of_a_module_with_one_bias_removed_computes_its_function(drop):
    torch.manual_seed(0)
    kw = dict(kdim=12, vdim=20) if drop == "k_proj" else {}
    m = mha.MultiHeadAttention(32, 4, **kw).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    m = _without(m, drop)
    t = m.to_torch().eval()
    q, k, v = _inputs(t)
    with torch.no_grad():
        torch.testing.assert_close(_torch_out(t, q, k, v), m(q, k, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drop", ["in_proj", "out_proj"])
def test_io_save_of_a_module_with_one_bias_removed_is_refused(tmp_path, drop):
    """The file stores one bias flag: such a module was written as a file load refuses."""
    from mha import io

    m = _without(mha.MultiHeadAttention(32, 4), drop)
    with pytest.raises(ValueError, match=rf"m: {drop}.bias is None while"):
        io.save(m, tmp_path / "m.safetensors")
    assert not list(tmp_path.iterdir())
