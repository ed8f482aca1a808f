"""The ``llm`` bench suite without running the model: its cases, llama.cpp's rows when the
package is absent, and the logit check that turns a wrong impl into an error row."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mha.bench import llm
from mha.bench.core import SUITES, Context, load_suite


def test_listed_and_importable():
    assert "llm" in SUITES and load_suite("llm") == (llm, None)


@pytest.mark.parametrize("quick, contexts", [(True, {128}), (False, {512, 2048, 8000})])
def test_cases_cover_contexts_dtypes_phases(quick, contexts):
    cases = [c for c in llm.all_cases(Context(quick=quick)) if c.params["phase"] != "serving"]
    got = {(c.params["phase"], c.params["context"], c.params["dtype"]) for c in cases}
    assert got == {(p, C, d) for p in ("prefill", "decode") for C in contexts
                   for d in ("fp32", "bf16")}
    for c in cases:
        if c.params["dtype"] == "fp32":
            kv = ["mha kv bf16", "mha kv int8"]
            packed = ["mha w bf16", "mha w bf16 kv bf16", "mha w bf16 kv int8", "mha w int8",
                      "mha w int8 kv int8"]
        else:
            kv, packed = ["mha kv int8"], ["mha w bf16", "mha w bf16 kv int8"]
        compiled = (["mha w bf16 kv bf16 compiled", "mha w int8 kv bf16 compiled"]
                    if c.params["dtype"] == "fp32" and c.params["phase"] == "decode" else [])
        assert [i.name for i in c.impls] == ["eager", "sdpa", "mha", *kv, *packed, *compiled]
        assert c.baseline == "sdpa"
        assert c.items == (c.params["context"] if c.params["phase"] == "prefill" else 1)


def test_llama_cpp_absent_is_a_skipped_row(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    cases = llm.all_cases(Context(quick=True))
    rows = llm.llama_cpp_rows(Context(quick=True), cases)
    assert len(rows) == 2 * (len(cases) - 1)  # none for the serving case
    assert {r.impl for r in rows} == {"llama.cpp fa=on", "llama.cpp fa=off"}
    assert all(r.status == "skipped" and "not installed" in r.reason for r in rows)


def test_logit_check_refuses_another_greedy_token_in_fp32():
    ref: dict = {}
    a = torch.tensor([[0.0, 1.0, 0.5]])
    assert "reference" in llm._compare(ref, "eager", a, "fp32")
    assert "equal" in llm._compare(ref, "mha", a + 1e-6, "fp32")
    b = torch.tensor([[0.0, 1.0, 1.5]])
    with pytest.raises(RuntimeError, match="greedy token differs from eager's"):
        llm._compare(ref, "mha", b, "fp32")
    assert "differs" in llm._compare(ref, "mha", b, "bf16")  # bf16: reported, not an error
    assert "differs" in llm._compare(ref, "mha kv int8", b, "fp32")  # int8 K/V: reported
    assert "differs" in llm._compare(ref, "mha w int8", b, "fp32")  # rounded weights: reported


@pytest.mark.parametrize("quick, requests, new", [(True, 4, 4), (False, 16, 32)])
def test_serving_case(quick, requests, new):
    (case,) = [c for c in llm.all_cases(Context(quick=quick)) if c.params["phase"] == "serving"]
    assert [i.name for i in case.impls] == ["sdpa one-by-one", "mha serving"]
    assert case.baseline == "sdpa one-by-one" and case.items == requests * new
    assert case.params["requests"] == requests and case.params["new_tokens"] == new

