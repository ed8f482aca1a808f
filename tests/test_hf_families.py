"""The families inventory (``python -m mha.integrations.families``): it runs on the installed
transformers, classifies every family from the adapter's own tables, and the table in
``docs/huggingface.md`` is the one it generates.

The docs check compares against the installed transformers only when it is the version the
docs were generated from (another version has other families; the table then says so in its
first line): with any other version it is skipped with that reason, and the classification
tests still run.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import mha.integrations.families as fam  # noqa: E402
import mha.integrations.transformers as hf  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "huggingface.md"


@pytest.fixture(scope="module")
def scanned():
    return fam.scan()


def test_every_family_is_classified(scanned):
    families, others = scanned
    assert len(families) > 100 and others  # transformers 5 routes most families through it
    by_name = {f.name: f for f in families}
    for f in families:
        assert f.verdict in ("served", "not served", "unclassified"), f.name
    # the families tests/test_hf_variants.py runs, with the argument each needs
    assert {"softcap", "sliding_window"} <= by_name["gemma2"].kwargs
    assert "s_aux" in by_name["gpt_oss"].kwargs
    assert "position_bias" in by_name["t5"].kwargs and "position_bias" in by_name["mt5"].kwargs
    for name in ("gemma2", "gemma3", "gpt_oss", "t5", "mt5", "llama", "bert"):
        assert by_name[name].verdict == "served", name
    assert "gpt2" in by_name


def test_verdicts_follow_the_adapter_tables(scanned, monkeypatch):
    families, _ = scanned
    gemma2 = next(f for f in families if f.name == "gemma2")
    monkeypatch.delitem(hf.SERVED, "softcap")
    assert gemma2.verdict == "unclassified"
    monkeypatch.setattr(fam, "UNSUPPORTED", frozenset({"softcap"}))
    assert gemma2.verdict == "not served"


def test_attention_kwargs_reads_calls_and_eager_parameters():
    src = '''
from ...modeling_utils import ALL_ATTENTION_FUNCTIONS
def eager_attention_forward(module, query, key, value, attention_mask, scaling, tilt=None, **kw):
    pass
class A:
    def forward(self, q, k, v, m):
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface("x", eager_attention_forward)
        return attention_interface(self, q, k, v, attention_mask=m, dropout=0.0, wobble=1, **kw)
'''
    assert fam.attention_kwargs(src) == {"scaling", "tilt", "dropout", "wobble"}
    assert fam.attention_kwargs("def f():\n    return softmax(q @ k)\n") is None


def test_docs_table_is_current():
    text = DOCS.read_text(encoding="utf-8")
    body = text.split(fam.BEGIN, 1)[1].split(fam.END, 1)[0]
    stated = re.match(r"\ntransformers (\S+):", body)
    assert stated, "docs/huggingface.md: the families table lacks its version line"
    installed = importlib.metadata.version("transformers")
    if stated.group(1) != installed:
        pytest.skip(f"docs were generated with transformers {stated.group(1)}, "
                    f"{installed} is installed")
    assert fam.replace_between_markers(text, fam.current_table()) == text, (
        "docs/huggingface.md is stale: python -m mha.integrations.families "
        "--write docs/huggingface.md")


def test_cli_check_and_write(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{fam.BEGIN}\nold\n{fam.END}\nrest\n", encoding="utf-8")
    run = [sys.executable, "-m", "mha.integrations.families"]
    stale = subprocess.run([*run, "--check", str(doc)], capture_output=True, text=True)
    assert stale.returncode == 1 and "not current" in stale.stderr
    assert subprocess.run([*run, "--write", str(doc)]).returncode == 0
    assert subprocess.run([*run, "--check", str(doc)]).returncode == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith("rest\n") and "| served |" in text
    (tmp_path / "bare.md").write_text("no markers\n", encoding="utf-8")
    bad = subprocess.run([*run, "--check", str(tmp_path / "bare.md")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "markers" in bad.stderr and "Traceback" not in bad.stderr
