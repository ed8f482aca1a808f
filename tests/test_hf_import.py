"""transformers stays optional: importing mha (and its integration modules, and building the
CLI parser) never imports it.

Runs in a fresh interpreter, so whatever this test process already imported cannot hide an
import. Needs no extra installed.
"""

from __future__ import annotations

import json
import subprocess
import sys

MODULES = ["mha", "mha.integrations", "mha.integrations.transformers",
           "mha.integrations.minilm", "mha.cli.encode"]

PROBE = """
import importlib, json, sys
heavy = ("transformers", "sentence_transformers", "tokenizers")
seen = {}
for name in MODULES_HERE:
    importlib.import_module(name)
    seen[name] = sorted(m for m in heavy if m in sys.modules)
from mha.cli import build_parser
build_parser()
seen["mha.cli.build_parser()"] = sorted(m for m in heavy if m in sys.modules)
print(json.dumps(seen))
""".replace("MODULES_HERE", repr(MODULES))


def test_importing_mha_never_imports_transformers():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert list(seen) == [*MODULES, "mha.cli.build_parser()"]
    for step, heavy in seen.items():
        assert heavy == [], f"{step} imported {heavy}"
