"""The ``variants`` benchmark suite (mha.bench.variants): the cases it lists, its masks against
mha's mask functions, a quick run end to end at a tiny shape with every output checked against
the fp64 reference, and the targets computed from the rows (reported, not asserted)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mha import mods
from mha.bench import core
from mha.bench import variants as vb
from mha.bench.core import Context, Row

IMPLS = ["mha", "flex compiled", "torch sdpa", "eager torch"]
TINY = vb.Shape(1, 2, 128, 16, window=32)
FAST = dict(repeat=3, min_time=0.0, sample_time=0.0, max_case_time=2.0, settle=0.0,
            measure_memory=False)


def test_the_suite_is_listed_and_lists_its_cases():
    assert "variants" in core.SUITES
    mod, why = core.load_suite("variants")
    assert mod is vb and why is None
    full = {c.name: c for c in vb.all_cases(Context())}
    for s in vb.grid(quick=False):
        for dtype in ("fp32", "bf16"):
            for v in vb.VARIANTS:
                for mode in ("", "train "):
                    c = full[f"{mode}{s.label} {dtype} {v.name}"]
                    assert [i.name for i in c.impls] == IMPLS and c.baseline == "torch sdpa"
                    assert c.params["variant"] == v.name and c.params["train"] == (mode != "")
        for v in vb.DOC_SCALING:  # the scaling rows: fp32 forward only
            assert f"{s.label} fp32 {v.name}" in full
            assert f"train {s.label} fp32 {v.name}" not in full
    assert {s.label for s in vb.grid(quick=False)} == {"1x8x4096x64", "1x32x2048x128"}
    quick = vb.all_cases(Context(quick=True))
    assert {(c.params["B"], c.params["h"], c.params["T"], c.params["d"]) for c in quick} == {
        (1, 8, 1024, 64)}
    assert len(quick) == len(full) // 2


@pytest.mark.parametrize("shape", [TINY, vb.Shape(1, 1, 96, 8, window=17)], ids=lambda s: s.label)
@pytest.mark.parametrize("v", vb.VARIANTS + vb.DOC_SCALING, ids=lambda v: v.name)
def test_masks_are_mhas_and_kept_pairs_count_them(shape, v):
    """The suite's own mask formulas (for FlexAttention, SDPA, eager and the oracle) equal the
    mha.mods function mha receives, and kept_pairs (the FLOPs) counts them."""
    i = torch.arange(shape.T)
    fn = vb.mask_fn(shape, v)
    kw = vb.mha_kwargs(shape, v, dict(sinks=None, slopes=None, bias=None))
    if fn is None:
        assert "mask_mod" not in kw and "causal" not in kw
        assert vb.kept_pairs(shape, v) == shape.T * shape.T
        return
    mine = fn(i[:, None], i[None, :])  # (T, T)
    if v.mask == "causal":
        assert kw == {"causal": True}
        theirs = torch.ones(shape.T, shape.T, dtype=torch.bool).tril()
    else:
        mod = mods.bind(kw["mask_mod"], 1, shape.T, shape.T)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)  # b, h
        theirs = mod(zero, zero, i.view(1, 1, -1, 1), i.view(1, 1, 1, -1))[0, 0]  # (T, T)
    assert torch.equal(mine, theirs)
    assert vb.kept_pairs(shape, v) == int(mine.sum())


@settings(max_examples=50, deadline=None)
@given(T=st.integers(1, 5000), n=st.integers(1, 32))
def test_document_lengths_cover_the_sequence(T, n):
    if n > T:
        return
    lengths = vb.doc_lengths(T, n)
    assert len(lengths) == n and sum(lengths) == T and min(lengths) >= 1
    assert vb.doc_lengths(T, n) == lengths  # seeded


@pytest.fixture(scope="module")
def tiny_rows():
    ctx = Context(quick=True, **FAST)
    rows = []
    for c in vb.all_cases(ctx, shapes=[TINY]):
        rows += core.measure(c, ctx, vb.SUITE)
    return rows


def test_quick_run_end_to_end_every_output_checked(tiny_rows):
    assert {r.impl for r in tiny_rows} == set(IMPLS)
    for r in tiny_rows:
        p = r.params
        if r.impl == "flex compiled":  # quick skips compiling; no backward on the CPU
            assert r.status == "skipped" and ("--quick" in r.reason or "backward" in r.reason)
        elif r.impl == "torch sdpa" and p["variant"].startswith("softcap"):
            assert r.status == "skipped" and "softcap" in r.reason
        else:
            assert r.status == "ok", (r.case, r.impl, r.reason)
            assert r.seconds > 0 and r.gflops > 0
            assert r.check.startswith("max |grad - fp64 reference|" if p["train"]
                                      else "max |out - fp64 reference|"), r.check
        if r.impl == "mha":
            assert r.note.startswith("dispatch chose ")


def test_targets_are_computed_from_the_rows(tiny_rows):
    out = vb.targets(tiny_rows)
    assert out and {r.suite for r in out} == {vb.TARGET_SUITE}
    by = {(r.case, r.impl): r for r in tiny_rows}
    per_case = [t for t in out if t.case != "all cases: the worst"]
    labels = {t.impl for t in per_case}
    assert labels == {"mha vs torch sdpa >= 3x", "mha vs torch sdpa >= 2x",
                      "mha <= 15 % over plain", "mha document ~ sum len^2"}
    for t in per_case:
        mine = by[(t.case, "mha")]
        assert t.seconds == mine.seconds
        if t.impl.startswith("mha vs torch sdpa"):
            assert t.ratio == pytest.approx(by[(t.case, "torch sdpa")].seconds / mine.seconds)
        assert t.note.startswith("met" if t.ratio >= t.params["goal"] else "MISSED")
    for label in labels:
        mine = [t for t in per_case if t.impl == label]
        worst = next(t for t in out if t.case == "all cases: the worst" and t.impl == label)
        assert worst.ratio == min(t.ratio for t in mine) and worst.params["of"] == len(mine)


def _row(variant: str, impl: str, seconds: float, *, train=False, kept=100, docs=None) -> Row:
    params = dict(B=1, h=2, T=10, d=4, dtype="fp32", variant=variant, train=train, kept=kept,
                  causal=variant in ("plain causal", "sliding window 512"))
    if docs:
        params.update(docs=docs, sum_len2=kept)
    return Row(suite=vb.SUITE, case=f"{'train ' if train else ''}{variant}", impl=impl,
               seconds=seconds, params=params)


def test_target_ratios_on_known_times():
    rows = [_row("plain", "mha", 1.0), _row("plain causal", "mha", 0.6, kept=55),
            _row("softcap 50", "mha", 1.1), _row("softcap 50", "flex compiled", 2.0),
            _row("alibi", "mha", 1.0), _row("alibi", "torch sdpa", 3.3),
            _row("sliding window 512", "mha", 0.3, kept=22),
            _row("document 2", "mha", 0.5, kept=50, docs=2),
            _row("document 8", "mha", 0.15, kept=14, docs=8),
            _row("sinks", "mha", 2.0, train=True), _row("sinks", "torch sdpa", 5.0, train=True)]
    got = {(t.case, t.impl): t for t in vb.targets(rows)}
    flex = got[("softcap 50", "mha vs flex compiled >= 2x")]
    assert flex.ratio == pytest.approx(2.0 / 1.1) and flex.note.startswith("MISSED")
    assert got[("alibi", "mha vs torch sdpa >= 3x")].note.startswith("met")
    over = got[("softcap 50", "mha <= 15 % over plain")]
    assert over.ratio == pytest.approx(1 / 1.1) and over.note.startswith("met")  # +10 %
    window = got[("sliding window 512", "mha <= 15 % over plain")]  # per kept pair vs causal
    assert window.ratio == pytest.approx(0.6 * 22 / 55 / 0.3) and window.note.startswith("MISSED")
    doc = got[("document 8", "mha document ~ sum len^2")]
    assert doc.ratio == pytest.approx(0.5 * 14 / 50 / 0.15) and doc.note.startswith("met")
    assert got[("train sinks", "mha vs torch sdpa >= 2x")].ratio == pytest.approx(2.5)
    assert ("train sinks", "mha <= 15 % over plain") not in got  # no plain training row given
    worst = got[("all cases: the worst", "mha <= 15 % over plain")]
    document8 = 1.0 * 14 / 100 / 0.15  # plain's time per kept pair / document 8's
    assert worst.ratio == pytest.approx(min(over.ratio, window.ratio, document8))
