"""Saving and loading with safetensors (no pickle)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import mha
from mha import io


def test_round_trip(tmp_path):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(24, 6, num_kv_heads=2, v_head_dim=5, kdim=10, vdim=7, bias=False)
    io.save(m, tmp_path / "attn.safetensors")
    back = io.load(tmp_path / "attn.safetensors")
    assert io.config(back) == io.config(m)
    x, kv_k, kv_v = torch.randn(2, 3, 24), torch.randn(2, 4, 10), torch.randn(2, 4, 7)
    assert torch.equal(back(x, kv_k, kv_v), m(x, kv_k, kv_v))


def test_refuses_foreign_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an mha.MultiHeadAttention file"):
        io.load(tmp_path / "other.safetensors")


# ----------------------------------------------------------------------------- crafted files

def _good(bias=True):
    """A small module's tensors and config, to be mutated into hostile files."""
    torch.manual_seed(1)
    m = mha.MultiHeadAttention(16, 4, num_kv_heads=2, v_head_dim=3, bias=bias)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, io.config(m)


def _write(path, tensors, meta):
    from safetensors.torch import save_file

    text = meta if isinstance(meta, str) else json.dumps(meta)
    save_file(tensors, str(path), metadata={"mha.MultiHeadAttention": text})
    return path


def _cfg(**changes):
    return lambda t, c: (t, {**c, **changes})


def _drop_field(name):
    return lambda t, c: (t, {k: v for k, v in c.items() if k != name})


def _tensors(fn):
    return lambda t, c: (fn(dict(t)), c)


CRAFTED = [
    # (id, mutation of (tensors, config), pattern naming the field or tensor)
    ("40 GB d_model", _cfg(d_model=100_000, num_heads=1, head_dim=100_000, v_head_dim=100_000,
                           kdim=100_000, vdim=100_000), r"field 'd_model' must lie in \[1, 30\]"),
    ("huge num_heads", _cfg(num_heads=10**12), r"field 'num_heads' must lie in \[1, 30\]"),
    ("zero head_dim", _cfg(head_dim=0), r"field 'head_dim' must lie in \[1, 30\]"),
    ("negative kdim", _cfg(kdim=-16), r"field 'kdim' must lie in"),
    ("float size", _cfg(d_model=16.0), r"field 'd_model' must be a JSON integer, got 16.0"),
    ("string size", _cfg(vdim="16"), r"field 'vdim' must be a JSON integer, got \"16\""),
    ("bool size", _cfg(num_kv_heads=True), r"field 'num_kv_heads' must be a JSON integer, got true"),
    ("null size", _cfg(head_dim=None), r"field 'head_dim' must be a JSON integer, got null"),
    ("bias 'no'", _cfg(bias="no"), r"field 'bias' must be a JSON bool \(true or false\), got \"no\""),
    ("bias 0", _cfg(bias=0), r"field 'bias' must be a JSON bool"),
    ("dropout 1", _cfg(dropout=1.0), r"field 'dropout' must be a number in \[0, 1\), got 1.0"),
    ("dropout string", _cfg(dropout="0.1"), r"field 'dropout' must be a number in \[0, 1\)"),
    ("dropout NaN", _cfg(dropout=float("nan")), r"field 'dropout' must be a number in \[0, 1\), got NaN"),
    ("dropout true", _cfg(dropout=True), r"field 'dropout' must be a number"),
    ("unknown field", _cfg(activation="relu"), r"missing \[\], unknown \['activation'\]"),
    ("missing field", _drop_field("v_head_dim"), r"missing \['v_head_dim'\], unknown \[\]"),
    ("inconsistent heads", _cfg(num_kv_heads=3), r"describes no valid module .*num_heads=4 must be a multiple"),
    ("sizes not matching the tensors", _cfg(head_dim=2), r"tensor 'in_proj.weight' must have shape \(18, 16\).*got \(30, 16\)"),
    ("bias true, no bias tensors", lambda t, c: (_good(bias=False)[0], c),
     r"missing \['in_proj.bias', 'out_proj.bias'\], unknown \[\]"),
    ("bias false, bias tensors", _cfg(bias=False), r"missing \[\], unknown \['in_proj.bias', 'out_proj.bias'\]"),
    ("missing tensor", _tensors(lambda t: {k: v for k, v in t.items() if k != "out_proj.weight"}),
     r"missing \['out_proj.weight'\]"),
    ("extra tensor", _tensors(lambda t: {**t, "extra": torch.zeros(2)}), r"unknown \['extra'\]"),
    ("transposed weight", _tensors(lambda t: {**t, "out_proj.weight": t["out_proj.weight"].t().contiguous()}),
     r"tensor 'out_proj.weight' must have shape \(16, 12\)"),
    ("int tensor", _tensors(lambda t: {**t, "out_proj.bias": t["out_proj.bias"].to(torch.int32)}),
     r"tensor 'out_proj.bias' must be floating .*got I32"),
    ("empty tensor with a huge dim", lambda t, c: ({**t, "x": torch.zeros(10**9, 0)}, {**c, "d_model": 10**9}),
     r"field 'd_model' must lie in \[1, 30\]"),
]


@pytest.mark.parametrize("mutate, pattern", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_crafted_metadata_is_refused_before_any_module_is_built(tmp_path, monkeypatch, mutate, pattern):
    tensors, cfg = mutate(*_good())
    path = _write(tmp_path / "crafted.safetensors", tensors, cfg)
    built = []
    real = io.MultiHeadAttention

    def spy(*args, **kwargs):  # every module io builds; only meta ones may precede the refusal
        built.append(str(kwargs.get("device")))
        return real(*args, **kwargs)

    monkeypatch.setattr(io, "MultiHeadAttention", spy)
    with pytest.raises(ValueError, match=pattern) as info:
        io.load(path)
    assert str(path) in str(info.value)
    assert all(d == "meta" for d in built), built


@pytest.mark.parametrize("text, pattern", [
    ("{d_model: 16", r"metadata 'mha.MultiHeadAttention' is not valid JSON"),
    ("[16, 4]", r"must be a JSON object of the fields .* got list"),
    ("16", r"must be a JSON object"),
    ("[" * 100_000 + "]" * 100_000, r"is not valid JSON"),
], ids=["broken JSON", "a list", "a number", "deeply nested"])
def test_non_json_metadata_is_refused(tmp_path, text, pattern):
    path = _write(tmp_path / "m.safetensors", _good()[0], text)
    with pytest.raises(ValueError, match=pattern):
        io.load(path)


@pytest.mark.parametrize("damage", [
    lambda b: b[:-7], lambda b: b[:20], lambda b: b"", lambda b: b"not a safetensors file at all",
    lambda b: (10**9).to_bytes(8, "little") + b[8:],
], ids=["truncated data", "truncated header", "empty", "text", "header length lies"])
def test_damaged_files_are_refused(tmp_path, damage):
    good = tmp_path / "good.safetensors"
    io.save(mha.MultiHeadAttention(16, 4), good)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(ValueError, match=r"bad.safetensors: not a readable safetensors file"):
        io.load(bad)


def test_load_checks_its_dtype_argument_and_casts(tmp_path):
    path = tmp_path / "m.safetensors"
    m = mha.MultiHeadAttention(16, 4)
    io.save(m, path)
    with pytest.raises(TypeError, match=r"^dtype must be None or a floating dtype"):
        io.load(path, dtype=torch.int8)
    back = io.load(path, dtype=torch.float64)
    assert back.out_proj.weight.dtype == torch.float64
    assert torch.equal(back.out_proj.weight, m.out_proj.weight.double())


def test_a_file_that_fails_leaves_an_existing_module_alone(tmp_path):
    """load builds a new module; a refused file must not touch the state of modules around."""
    m = mha.MultiHeadAttention(16, 4)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    tensors, cfg = _good()
    path = _write(tmp_path / "x.safetensors", tensors, {**cfg, "bias": "yes"})
    with pytest.raises(ValueError):
        io.load(path)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("thing", [torch.nn.Linear(2, 2), {"w": torch.zeros(1)}])
def test_save_names_what_it_got(tmp_path, thing):
    with pytest.raises(TypeError, match=r"^m must be an mha.MultiHeadAttention"):
        io.save(thing, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("path", [None, 3, b"m.safetensors"], ids=["None", "int", "bytes"])
def test_paths_that_are_not_paths_are_named(path):
    with pytest.raises(TypeError, match=r"^path must be a str or os.PathLike"):
        io.load(path)
    with pytest.raises(TypeError, match=r"^path must be a str or os.PathLike"):
        io.save(mha.MultiHeadAttention(16, 4), path)


def test_directories_and_missing_places_are_named(tmp_path):
    m = mha.MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"is a directory, not a safetensors file"):
        io.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        io.load(tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match=r"is a directory; give a file name"):
        io.save(m, tmp_path)
    with pytest.raises(ValueError, match=r"its directory .*missing.* does not exist"):
        io.save(m, tmp_path / "missing" / "m.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_takes_no_files_is_an_os_error_naming_the_file():
    proc = "/proc/mha-test.safetensors"  # /proc takes no new files, not even from root
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc on this system")
    with pytest.raises(OSError, match=r"mha-test.safetensors: cannot be written"):
        io.save(mha.MultiHeadAttention(16, 4), proc)


def test_round_trip_keeps_rope(tmp_path):
    torch.manual_seed(0)
    rope = mha.rope.Rotary(8, theta=500.0, interleaved=True,
                           scaling={"rope_type": "linear", "factor": 4.0})
    m = mha.MultiHeadAttention(24, 2, rope=rope).eval()
    io.save(m, tmp_path / "rope.safetensors")
    back = io.load(tmp_path / "rope.safetensors").eval()
    assert back.rope == rope
    x = torch.randn(2, 5, 24)
    with torch.no_grad():
        assert torch.equal(back(x, causal=True), m(x, causal=True))
    assert json.loads(json.dumps(io.config(m)))["rope"] == {
        "dim": 8, "theta": 500.0, "interleaved": True,
        "scaling": {"rope_type": "linear", "factor": 4.0}}
    plain = mha.MultiHeadAttention(24, 2)
    assert io.config(plain)["rope"] is None


@pytest.mark.parametrize("rope, pattern", [
    ("yes", r"field 'rope' must be null or a JSON object"),
    ({"dim": 4, "theta": 10.0}, r"field 'rope' must hold exactly .*missing \['interleaved', 'scaling'\]"),
    ({"dim": 4, "theta": 10.0, "interleaved": False, "scaling": None, "x": 1}, r"unknown \['x'\]"),
    ({"dim": 4.0, "theta": 10.0, "interleaved": False, "scaling": None}, r"field 'rope'.*dim"),
    ({"dim": True, "theta": 10.0, "interleaved": False, "scaling": None}, r"field 'rope'.*dim"),
    ({"dim": 4, "theta": -1.0, "interleaved": False, "scaling": None}, r"field 'rope'.*theta"),
    ({"dim": 4, "theta": "1", "interleaved": False, "scaling": None}, r"field 'rope'.*theta"),
    ({"dim": 4, "theta": True, "interleaved": False, "scaling": None}, r"field 'rope'.*theta"),
    ({"dim": 4, "theta": 10.0, "interleaved": 1, "scaling": None}, r"field 'rope'.*interleaved"),
    ({"dim": 4, "theta": 10.0, "interleaved": False, "scaling": {"rope_type": "yarn"}},
     r"field 'rope'.*rope_type"),
    ({"dim": 4, "theta": 10.0, "interleaved": False, "scaling": {"rope_type": "linear",
                                                                 "factor": True}},
     r"field 'rope'.*factor"),
    ({"dim": 40, "theta": 10.0, "interleaved": False, "scaling": None},
     r"describes no valid module .*exceeds head_dim"),
])
def test_crafted_rope_metadata_is_refused(tmp_path, rope, pattern):
    tensors, cfg = _good()
    path = _write(tmp_path / "rope.safetensors", tensors, {**cfg, "rope": rope})
    with pytest.raises(ValueError, match=pattern) as info:
        io.load(path)
    assert str(path) in str(info.value)
