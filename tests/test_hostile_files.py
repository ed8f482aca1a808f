"""Crafted files against the loaders: ``mha.programs.load`` (torch.export archives).

Each crafted archive is a small exported program rewritten by a zip writer: nothing of it may
be unpickled or run, nothing may be read past what the zip's directory honestly declares, and
the refusal is a ValueError naming the file and the entry or field at fault.
"""

from __future__ import annotations

import pickle
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import mha
from mha import programs

_UNPICKLED: list[bool] = []


def _mark():
    _UNPICKLED.append(True)
    return ((), {})


class _Payload:
    def __reduce__(self):
        return (_mark, ())


EVIL = pickle.dumps(_Payload(), protocol=2)


class _SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = mha.MultiHeadAttention(32, 4)

    def forward(self, x):
        return self.attn(x)  # (B, T, d_model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    ep = torch.export.export(_SelfAttention().eval(), (torch.randn(2, 8, 32),))
    return programs.save(ep, tmp_path_factory.mktemp("program") / "sa.pt2")


def _rewrite(src: Path, out: Path, *, first=(), change=None, last=(),
             compression=zipfile.ZIP_STORED) -> Path:
    """Copy the archive ``src`` to ``out``: entries ``first`` (relative name, bytes) before
    its own, each own entry through ``change(rel, data) -> data or None (dropped)``, then
    ``last``."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(out, "w", compression=compression) as w:
        root = z.namelist()[0].split("/", 1)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Duplicate name": what the tests build
            for rel, data in first:
                w.writestr(f"{root}/{rel}", data)
            for info in z.infolist():
                rel = info.filename.split("/", 1)[1]
                data = z.read(info.filename)
                data = change(rel, data) if change else data
                if data is not None:
                    w.writestr(f"{root}/{rel}", data)
            for rel, data in last:
                w.writestr(f"{root}/{rel}", data)
    return out


def _refused(path: Path, *match: str) -> None:
    _UNPICKLED.clear()
    with pytest.raises(ValueError) as e:
        programs.load(path)
    text = str(e.value)
    assert str(path) in text, text
    for m in match:
        assert m in text, f"{m!r} not in {text!r}"
    assert _UNPICKLED == [], "a pickle of the file was run"


def test_the_untouched_archive_loads(saved, tmp_path):
    ep = programs.load(_rewrite(saved, tmp_path / "copy.pt2"))
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(ep.module()(x), programs.load(saved).module()(x))


@pytest.mark.parametrize("name", ["data/sample_inputs/model.pt", "data/sample_inputs/MODEL.pt"])
def test_a_second_copy_of_an_entry_is_refused(saved, tmp_path, name):
    """A name present twice (also in another case) is refused before any entry is read: the
    checks would read one copy (zipfile: the last) and torch.export.load another (miniz: the
    first, case-insensitive); the payload is never unpickled."""
    path = _rewrite(saved, tmp_path / "dup.pt2", first=[(name, EVIL)])
    _refused(path, "more than once", "sample_inputs/model.pt")


def test_a_zip_bomb_is_refused_before_it_is_inflated(saved, tmp_path):
    """64 MiB of JSON text deflated to ~64 KiB: refused from the zip's directory, nothing of
    it inflated."""
    bomb = b'{"a": "' + b" " * (64 << 20) + b'"}'
    path = _rewrite(saved, tmp_path / "bomb.pt2", last=[("models/other.json", bomb)],
                    compression=zipfile.ZIP_DEFLATED)
    del bomb
    _refused(path, "models/other.json", "declares 67,108,873 bytes", "zip bomb")


def test_many_entries_inflating_too_much_in_all_are_refused(saved, tmp_path):
    """64 entries of 1 MiB each (each within the per-entry bound) deflated to ~1 KiB: the
    archive's declared total against its own size refuses it before any entry is inflated."""
    filler = b" " * (1 << 20)
    path = _rewrite(saved, tmp_path / "bombs.pt2", compression=zipfile.ZIP_DEFLATED,
                    last=[(f"extra/filler_{i}", filler) for i in range(64)])
    assert path.stat().st_size * programs.MAX_RATIO < 64 << 20
    _refused(path, "declare", "bytes in all", "zip bomb")


def _patch_central(path: Path, out: Path, rel: str, *, field: int, value: int) -> Path:
    """``path`` with the 4-byte ``field`` offset of ``rel``'s central-directory record set
    to ``value`` (20: compressed size, 24: uncompressed size)."""
    data = bytearray(path.read_bytes())
    at = 0
    while True:
        at = data.index(b"PK\x01\x02", at)
        n = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + n].decode().endswith(rel):
            struct.pack_into("<I", data, at + field, value)
            break
        at += 4
    out.write_bytes(bytes(data))
    return out


def test_declared_sizes_past_the_file_are_refused(saved, tmp_path):
    path = _patch_central(saved, tmp_path / "big.pt2", "models/model.json", field=24,
                          value=2**32 - 1)
    _refused(path, "models/model.json", "declares 4,294,967,295 bytes")
    path = _patch_central(saved, tmp_path / "long.pt2", "data/weights/weight_0", field=20,
                          value=2**32 - 1)
    _refused(path, "compressed bytes", "more than the file's")


def test_damaged_entries_name_the_file(saved, tmp_path):
    data = bytearray(saved.read_bytes())
    at = data.index(b'"graph_module"')
    data[at + 2] ^= 0x20  # one byte of models/model.json: its CRC does not match
    (tmp_path / "crc.pt2").write_bytes(bytes(data))
    _refused(tmp_path / "crc.pt2", "models/model.json", "damaged")
    path = _rewrite(saved, tmp_path / "json.pt2",
                    change=lambda rel, d: b"{not json" if rel == "models/model.json" else d)
    _refused(path, "torch.export.load cannot read it")
    path = _rewrite(saved, tmp_path / "none.pt2",
                    change=lambda rel, d: None if rel == "models/model.json" else d)
    _refused(path, "torch.export.load cannot read it")
    (tmp_path / "half.pt2").write_bytes(saved.read_bytes()[:saved.stat().st_size // 2])
    _refused(tmp_path / "half.pt2", "not a zip file")


def test_names_that_climb_out_are_read_in_memory_only(saved, tmp_path):
    """Held: torch.export.load reads entries by name from memory and extracts nothing, so an
    ``extra/../../`` name writes no file (it is kept as an extra file's name)."""
    target = tmp_path / "escaped"
    rel = "extra/" + "../" * 12 + str(target).lstrip("/")
    programs.load(_rewrite(saved, tmp_path / "climb.pt2", last=[(rel, b"x")]))
    assert not target.exists()


# ----------------------------------------------------------------------------- mha.export.onnx
@pytest.mark.parametrize("kwargs, err, match", [
    # an opset outside what the exporter and onnx's converter take, or not an int, is refused
    # naming opset, before anything is traced or written
    (dict(opset=0), ValueError, r"opset must lie in \[23, \d+\] .*got 0"),
    (dict(opset=-1), ValueError, r"opset must lie in \[23, "),
    (dict(opset=10**9), ValueError, r"opset must lie in \[23, \d+\].*got 1000000000"),
    (dict(opset=17), ValueError, r"opset must lie in \[23, .*the Attention operator"),
    (dict(opset=True), TypeError, "opset must be an int, got bool"),
    (dict(opset=1.5), TypeError, "opset must be an int, got float"),
    (dict(opset="23"), TypeError, "opset must be an int, got str"),
    # names: a list of non-empty str, one per input / output, each once
    (dict(input_names="x"), TypeError, "input_names must be a list of str, got str"),
    (dict(input_names=["a", "b", "c"]), ValueError, "input_names: 3 names for 1 input"),
    (dict(output_names=["y", 2]), TypeError, r"output_names\[1\] must be a non-empty str"),
    (dict(output_names=["y", "y"]), ValueError, "output_names: 'y' is given twice"),
    # dynamic_shapes: one entry per input, naming dimensions that input has
    (dict(dynamic_shapes=({5: "B"},)), ValueError,
     r"dynamic_shapes\[0\] names dimension 5 of an input with 3 dimensions"),
    (dict(dynamic_shapes=({0: "B"}, {0: "B"})), ValueError,
     "dynamic_shapes: 2 entries for 1 input"),
])
def test_onnx_options_are_checked_before_exporting(tmp_path, kwargs, err, match):
    pytest.importorskip("onnxscript", reason="onnxscript not installed (pip install 'mha[onnx]')")
    from mha import export

    m = mha.MultiHeadAttention(16, 2).eval()
    with pytest.raises(err, match=match):
        export.onnx(m, (torch.randn(1, 3, 16),), tmp_path / "a.onnx", **kwargs)
    assert list(tmp_path.iterdir()) == []


_PEAK = """
import resource, sys
from mha import programs
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    programs.load(sys.argv[1])
except ValueError as e:
    print("refused:", e)
print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_a_big_file_that_is_no_zip_is_refused_without_reading_it(tmp_path):
    """A wrong path to a big file (a data set, a disk image): refused from the zip's end
    record, not read whole into memory first (the peak memory of a fresh interpreter grows by
    less than a quarter of the file)."""
    import os
    import subprocess
    import sys

    big = tmp_path / "not_a_program.bin"
    with open(big, "wb") as f:
        f.truncate(512 << 20)  # sparse: no disk used, 512 MiB to read
    env = {**os.environ, "PYTHONPATH": str(Path(programs.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", _PEAK, str(big)], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout
    assert f"refused: path: {big} is not a torch.export archive (not a zip file)" in out, out
    grew = int(out.split("grew_kib")[1])
    assert grew < (128 << 10), f"peak memory grew by {grew} KiB"


def test_an_archive_torch_cannot_read_names_the_cause_without_a_logged_traceback(
        saved, tmp_path, capfd):
    """Weights cut short: torch.export.load logs the real error with its traceback as a
    warning, then raises "check the warnings above"; the refusal carries the cause itself."""
    def cut(rel, data):
        return data[:len(data) // 2] if rel.startswith("data/weights/") and \
            not rel.endswith(".json") else data

    path = _rewrite(saved, tmp_path / "cut.pt2", change=cut)
    capfd.readouterr()
    _refused(path, "torch.export.load cannot read it", "out of bounds for storage")
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("mark", [b"big", b"little-endian", b""])
def test_a_byteorder_other_than_this_machines_is_refused(saved, tmp_path, mark):
    """torch.export.load ignores the byteorder entry and reads the raw tensor bytes in this
    machine's order: an archive that declares another order would load with every weight's
    bytes taken the wrong way round."""
    import sys

    with zipfile.ZipFile(saved) as z:
        assert any(n.endswith("/byteorder") for n in z.namelist())
    path = _rewrite(saved, tmp_path / "order.pt2",
                    change=lambda rel, data: mark if rel == "byteorder" else data)
    _refused(path, "byteorder", sys.byteorder)
    same = _rewrite(saved, tmp_path / "same.pt2", change=lambda rel, data: (
        sys.byteorder.encode() if rel == "byteorder" else data))
    programs.load(same)  # the machine's own order still loads
