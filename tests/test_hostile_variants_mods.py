"""Bad mask / score functions and bad plan arguments: a clear error naming the argument (and,
for a function, the block and index range it was called on); no plan is cached after a refusal.

Shape legend: B batch, h heads, Tq / Tk lengths, d head dim.
"""

from __future__ import annotations

import pytest
import torch

import mha
from mha import blockplan, mods
from mha.mods import ModError


def _qkv(Tq=20, Tk=20):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, Tq, 16, generator=g), torch.randn(1, 2, Tk, 16, generator=g),
            torch.randn(1, 2, Tk, 16, generator=g))


@pytest.mark.parametrize("backend", ["blocksparse", "reference"])
def test_a_mask_function_returning_non_bool_is_refused(backend):
    q, k, v = _qkv()
    with pytest.raises(ModError, match=r"mask_mod must return a bool tensor .* got torch.int64 "
                                       r"on query block 0.*q_idx 0\.\.19"):
        mha.attention(q, k, v, mask_mod=lambda b, h, qi, kj: kj - qi, backend=backend)
    with pytest.raises(ModError, match="mask_mod must return a bool tensor .* got bool"):
        mha.attention(q, k, v, mask_mod=lambda b, h, qi, kj: True, backend=backend)


def test_a_mask_function_that_raises_names_the_block_and_indices():
    q, k, v = _qkv(40, 40)

    def bad(b, h, qi, kj):
        if int(qi.max()) >= 32:
            raise ZeroDivisionError("boom")
        return kj <= qi

    with pytest.raises(ModError, match=r"mask_mod raised ZeroDivisionError on query block 2, "
                                       r"key blocks 0\.\.0 \(q_idx 32\.\.39, kv_idx 0\.\.39\): "
                                       r"boom") as e:
        mha.block_plan(bad, 1, 2, 40, 40, block_q=16, block_k=64)
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_a_failure_while_walking_names_the_partial_blocks():
    built = {"done": False}

    def later(b, h, qi, kj):  # fine while the plan is built, raises when it is walked
        if built["done"]:
            raise RuntimeError("changed its mind")
        return kj <= qi

    plan = mha.block_plan(later, 1, 1, 8, 8, block_q=4, block_k=4)
    built["done"] = True
    with pytest.raises(ModError, match=r"query block 0, partial key blocks \[0\] "
                                       r"\(q_idx 0\.\.3, kv_idx 0\.\.3\): changed its mind"):
        plan.materialize()


def test_a_refused_plan_is_not_cached():
    flaky = {"raise": True}

    def fn(b, h, qi, kj):
        if flaky["raise"]:
            raise ValueError("not yet")
        return kj <= qi

    before = len(blockplan._CACHE)
    with pytest.raises(ModError):
        mha.block_plan(fn, 1, 1, 8, 8)
    assert len(blockplan._CACHE) == before
    flaky["raise"] = False
    assert mha.block_plan(fn, 1, 1, 8, 8).counts["partial"] == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_q=0), "block_q must be a positive int, got 0"),
    (dict(block_k=-3), "block_k must be a positive int, got -3"),
    (dict(block_q=2.5), "block_q must be a positive int, got float"),
    (dict(block_k=True), "block_k must be a positive int, got bool"),
])
def test_bad_block_sizes(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        mha.block_plan(mods.causal(), 1, 1, 8, 8, **kwargs)


def test_bad_sizes_and_a_missing_function():
    with pytest.raises(ValueError, match="Tq must be an int >= 0, got -1"):
        mha.block_plan(mods.causal(), 1, 1, -1, 8)
    with pytest.raises(TypeError, match="mask_mod must be a callable"):
        mha.block_plan(None, 1, 1, 8, 8)


@pytest.mark.parametrize("backend", ["blocksparse", "reference"])
def test_a_score_function_changing_the_shape_is_refused(backend):
    q, k, v = _qkv()
    with pytest.raises(ModError, match=r"score_mod must return the score's shape"):
        mha.attention(q, k, v, score_mod=lambda s, b, h, qi, kj: s.sum(-1), backend=backend)
    with pytest.raises(ModError, match=r"score_mod must return a floating tensor, got torch.bool"):
        mha.attention(q, k, v, score_mod=lambda s, b, h, qi, kj: s > 0, backend=backend)
    with pytest.raises(ModError, match=r"score_mod raised KeyError"):
        mha.attention(q, k, v, score_mod=lambda s, b, h, qi, kj: {}["x"], backend=backend)


def test_arguments_that_are_not_callables():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"mask_mod must be a callable \(b, h, q_idx, kv_idx\)"):
        mha.attention(q, k, v, mask_mod=torch.ones(20, 20, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"score_mod must be a callable \(score, b, h"):
        mha.attention(q, k, v, score_mod=2.0)
    with pytest.raises(TypeError, match="and_masks: each mask_mod must be a callable"):
        mods.and_masks(mods.causal(), 3)
    with pytest.raises(ValueError, match="or_masks: pass at least one mask_mod"):
        mods.or_masks()


def test_the_native_backends_refuse_when_forced():
    q, k, v = _qkv()
    with pytest.raises(mha.BackendError, match="score_mod not supported; .a score_mod is an "
                                               "arbitrary Python function"):
        mha.attention(q, k, v, mask_mod=mods.causal(), score_mod=lambda s, *i: s,
                      backend="flash_cpu")
    with pytest.raises(mha.BackendError, match="mask kind 'mask_mod' not supported"):
        mha.attention(q[:, :, :1], k, v, mask_mod=mods.causal(), backend="flash_decode")
    with pytest.raises(mha.BackendError, match="score_mod not supported"):
        mha.attention(q[:, :, :1], k, v, score_mod=lambda s, *i: s, backend="flash_decode")


@pytest.mark.parametrize("make, match", [
    (lambda: mods.document(), "document: pass exactly one of cu_seqlens"),
    (lambda: mods.document(cu_seqlens=[0, 5], doc_ids=[0, 0]), "exactly one"),
    (lambda: mods.document(cu_seqlens=[1, 5]), "cu_seqlens must be 1-D, start at 0"),
    (lambda: mods.document(cu_seqlens=[0, 5, 3]), "never decrease"),
    (lambda: mods.document(cu_seqlens=[0.0, 5.0]), "cu_seqlens must be an integer tensor"),
    (lambda: mods.document(doc_ids=torch.zeros(2, 2, 2, dtype=torch.long)), "doc_ids must have"),
    (lambda: mods.prefix_lm(-1), "prefix_lengths must be an int >= 0"),
    (lambda: mods.prefix_lm([2, -1]), "prefix_lengths must be >= 0"),
    (lambda: mods.prefix_lm([[1, 2]]), r"prefix_lengths must have shape \(B,\)"),
    (lambda: mods.sliding_window(0), "sliding_window: w must be a positive int"),
    (lambda: mods.chunked(1.5), "chunked: size must be a positive int"),
])
def test_bad_builtin_parameters(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_builtins_whose_tables_do_not_fit_the_sizes():
    with pytest.raises(ValueError, match=r"document: the document ids cover shape \(10,\), "
                                         r"expected \(Tk,\) = \(12,\)"):
        mha.block_plan(mods.document(cu_seqlens=[0, 4, 10]), 1, 1, 12, 12)
    with pytest.raises(ValueError, match=r"prefix_lm: prefix_lengths must have shape \(B,\) = "
                                         r"\(3,\), got \(2,\)"):
        mha.block_plan(mods.prefix_lm([1, 2]), 3, 1, 12, 12)


def test_score_mod_with_a_score_variant_is_refused_with_the_reason():
    """No backend applies a score_mod together with softcap / sinks / bias / ALiBi yet: the
    call is refused by name (no silently dropped term), and explain says why."""
    q = torch.randn(1, 2, 4, 8)
    plus_one = lambda s, b, h, i, j: s + 1.0  # noqa: E731
    with pytest.raises(mha.BackendError, match="score_mod together with softcap"):
        mha.attention(q, q, q, score_mod=plus_one, softcap=5.0)
    verdicts = str(mha.explain(q, q, q, score_mod=plus_one, sinks=torch.zeros(2)))
    assert "score_mod together with sinks" in verdicts


def test_a_block_plan_too_large_to_hold_is_refused_at_once():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(ValueError, match=r"would hold 61035156250000 blocks \(a byte each\)"):
        mha.block_plan(causal, 1, 1, 10**9, 10**9)  # (10^9 / 128)^2 block states
    plan = mha.block_plan(causal, 1, 1, 256, 256)  # a plan of a few blocks still builds
    assert plan.Tq == 256
