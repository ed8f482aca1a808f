"""Refusals of :class:`mha.llm.serving.Scheduler` at its boundary, on a small seeded Llama
(tests/tiny_llama.py: vocabulary 101, context 64): a request the model cannot run is refused
when it is added, naming the argument, and leaves the scheduler as it was; a step with nothing
to do runs no forward; a step interrupted in its forward leaves a scheduler that resumes to the
same tokens.

Shape legend: P prompt tokens, V vocabulary.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mha.llm.serving import Scheduler  # noqa: E402
from mha.ops import decode  # noqa: E402
from tiny_llama import CFG, eager_and_mha  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return eager_and_mha()["mha"]


def _scheduler(model, **kw):
    return Scheduler(model, num_pages=16, page_size=4, max_seqs=4,
                     **{"max_len": 32, **kw})


@pytest.mark.parametrize("prompt,err,match", [
    ([5, CFG.vocab_size], ValueError, r"prompt.*\[0, 101\).*101 at position 1"),
    ([5, -1], ValueError, r"prompt.*\[0, 101\).*-1 at position 1"),
    (torch.tensor([5, 10**6]), ValueError, r"prompt.*\[0, 101\)"),
    ([5.7, 3], TypeError, "prompt must be"),
    (torch.tensor([5.0, 3.0]), TypeError, "prompt must be"),
    ([True, 3], TypeError, "prompt must be"),
    (["5", 3], TypeError, "prompt must be"),
    ("hello", TypeError, "prompt must be"),
    ([], ValueError, "prompt must hold at least one token"),
    (torch.tensor([], dtype=torch.long), ValueError, "prompt must hold at least one token"),
    (torch.tensor([[5, 6], [7, 8]]), ValueError, r"prompt must be .*\(P,\).*\(2, 2\)"),
])
def test_a_prompt_of_other_than_token_ids_is_refused_when_added(model, prompt, err, match):
    """Before: ids past the vocabulary were queued, and the step that ran them raised torch's
    'index out of range in self' from the embedding, with the request admitted and its pages
    taken; float ids were truncated (5.7 ran as 5), bools and digit strings ran as ids."""
    s = _scheduler(model)
    free = s.cache.free_pages
    with pytest.raises(err, match=match):
        s.add(prompt, 3)
    assert not s.waiting and not s.running and s.cache.free_pages == free


def test_token_ids_of_any_integer_kind_are_taken(model):
    s = _scheduler(model)
    for prompt in ([5, 6, 7], torch.tensor([5, 6, 7]), np.array([5, 6, 7], dtype=np.int32),
                   (np.int64(5), 6, 7)):
        s.add(prompt, 2)
    assert [r.prompt for r in s.waiting] == [[5, 6, 7]] * 4
    assert all(type(t) is int for r in s.waiting for t in r.prompt)


def test_a_request_past_the_model_context_is_refused(model):
    """max_len may exceed the model's context (max_position_embeddings = 64); a request that
    would run past it is refused as mha.llm.generation refuses one (before: it ran, with
    positions the model was not built for)."""
    s = _scheduler(model, max_len=200)
    with pytest.raises(ValueError, match=r"60 tokens.*10 new.*70 > the model's context of 64"):
        s.add([5] * 60, 10)
    assert not s.waiting
    s.add([5] * 60, 4)  # exactly the context
    assert len(s.waiting) == 1


@pytest.mark.parametrize("eos,err", [("2", TypeError), (2.0, TypeError), (-1, ValueError),
                                     (True, TypeError)])
def test_eos_token_id_must_be_a_token_id(model, eos, err):
    """Before: eos_token_id="2" was taken and never matched a token."""
    with pytest.raises(err, match="eos_token_id"):
        _scheduler(model, eos_token_id=eos)


def test_a_step_with_nothing_to_do_runs_no_forward(model):
    """Before: step() on an empty scheduler ran the model on a (1, 0) float tensor and raised
    torch's 'Expected tensor for argument #1 'indices' to have one of the following scalar
    types'."""
    s = _scheduler(model)
    s.step()
    assert s.forwards == 0 and s.run() == {}


@pytest.mark.skipif(decode.unavailable() is not None,
                    reason=f"decode kernel unavailable: {decode.unavailable()}")
def test_a_refused_request_leaves_the_others_running(model):
    s = _scheduler(model)
    rid = s.add([5, 6, 7], 3)
    with pytest.raises(ValueError, match="prompt"):
        s.add([5, 999], 3)
    out = s.run()
    assert list(out) == [rid] and len(out[rid]) == 3


@pytest.mark.skipif(decode.unavailable() is not None,
                    reason=f"decode kernel unavailable: {decode.unavailable()}")
@pytest.mark.parametrize("fail_at", [1, 2, 3, 4, 6])
def test_a_step_interrupted_in_its_forward_resumes_to_the_same_tokens(model, fail_at,
                                                                      monkeypatch):
    """A forward that raises (Ctrl-C, an error in a layer) after the step extended the cache:
    before, the cache kept the extension while the requests did not advance, and the next
    run() returned other tokens (3 of 5 steps tried) with no error."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]

    def scheduler():
        s = _scheduler(model, prefill_chunk=3)
        for p in prompts:
            s.add(p, 5)
        return s

    want = scheduler().run()
    s = scheduler()
    forward, calls = model.forward, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.run()
    monkeypatch.undo()
    assert s.cache.free_pages == s.cache.num_pages  # every page back in the pool
    assert s.run() == want


def test_a_request_larger_than_the_page_pool_is_refused(model):
    """Before: it was queued, every run() raised PagePoolExhausted with it admitted, and the
    requests behind it never ran."""
    s = Scheduler(model, num_pages=2, page_size=4, max_seqs=2, max_len=32)
    with pytest.raises(ValueError, match=r"need 3 pages of 4 tokens, more than the pool's "
                                         r"num_pages=2"):
        s.add(list(range(5, 15)), 3)  # 10 + 3 - 1 = 12 tokens held
    assert not s.waiting
    s.add(list(range(5, 11)), 3)  # 6 + 3 - 1 = 8 tokens: the whole pool
    assert len(s.waiting) == 1


@pytest.mark.parametrize("eos", [CFG.vocab_size, 10**6])
def test_eos_token_id_outside_the_vocabulary_is_refused(model, eos):
    """Before: an id >= V was taken and could never stop a request."""
    with pytest.raises(ValueError, match=r"eos_token_id.*\[0, 101\)"):
        _scheduler(model, eos_token_id=eos)
    assert _scheduler(model, eos_token_id=CFG.vocab_size - 1).eos_token_id == 100


# ------------------------------------------------------------------------------ cancel

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


def _with(model, prompts, **kw):
    s = _scheduler(model, prefill_chunk=3, **kw)
    return s, [s.add(p, 5) for p in prompts]


@pytest.mark.skipif(decode.unavailable() is not None,
                    reason=f"decode kernel unavailable: {decode.unavailable()}")
@pytest.mark.parametrize("gone,after,n", [(1, 0, 0), (1, 1, 1), (1, 4, 4), (0, 1, 0),
                                           (0, 2, 0), (0, 4, 2)])
def test_a_cancelled_request_leaves_the_others_tokens_unchanged(model, gone, after, n):
    """Cancel request ``gone`` after ``after`` steps (0: still waiting; request 0's prompt of
    7 tokens is in prefill for 2 steps of 3 tokens, request 1's of 3 for one): the others give
    the tokens of a run without it, every page returns to the pool, and cancel returns the
    ``n`` tokens the request generated by then."""
    alone, _ = _with(model, [p for i, p in enumerate(PROMPTS) if i != gone])
    want = list(alone.run().values())
    full, _ = _with(model, PROMPTS)
    reference = full.run()[gone]
    s, rids = _with(model, PROMPTS)
    for _ in range(after):
        s.step()
    assert any(r.rid == gone for r in s.running) == (after > 0)
    got = s.cancel(gone)
    assert got == reference[:n] and len(got) == n
    assert all(r.rid != gone for r in s.waiting + s.running)
    out = s.run()
    assert out == dict(zip([r for r in rids if r != gone], want, strict=True))
    assert s.cache.free_pages == s.cache.num_pages and not s.cache.sequences
    assert s.cancel(gone) == got and list(s.cancelled) == [gone]  # twice: a no-op


@pytest.mark.skipif(decode.unavailable() is not None,
                    reason=f"decode kernel unavailable: {decode.unavailable()}")
def test_cancelling_a_finished_request_is_a_no_op(model):
    s, (a, b, c) = _with(model, PROMPTS)
    out = s.run()
    assert s.cancel(b) == out[b] and b in s.finished and not s.cancelled
    assert s.run() == out


@pytest.mark.parametrize("rid,err,match", [(3, ValueError, r"rid=3 .*0 … 2"),
                                           (-1, ValueError, "rid=-1"),
                                           (True, TypeError, "rid must be"),
                                           ("1", TypeError, "rid must be"),
                                           (1.0, TypeError, "rid must be")])
def test_cancelling_an_unknown_request_is_refused(model, rid, err, match):
    s, _ = _with(model, PROMPTS)
    s.step()
    before = ([r.rid for r in s.waiting], [r.rid for r in s.running], s.cache.free_pages)
    with pytest.raises(err, match=match):
        s.cancel(rid)
    assert ([r.rid for r in s.waiting], [r.rid for r in s.running],
            s.cache.free_pages) == before and not s.cancelled


def test_cancelling_on_an_empty_scheduler_is_refused(model):
    with pytest.raises(ValueError, match=r"rid=0 .*none was added"):
        _scheduler(model).cancel(0)


# ------------------------------------------------------------------------------ take

@pytest.mark.skipif(decode.unavailable() is not None,
                    reason=f"decode kernel unavailable: {decode.unavailable()}")
def test_take_hands_over_a_finished_request_once_and_forgets_it(model):
    """A long-running caller takes each result once, so finished and cancelled requests do not
    accumulate; step() returns the token each request generated in it."""
    s, (a, b, c) = _with(model, PROMPTS)
    reference = _with(model, PROMPTS)[0].run()
    streamed: dict[int, list[int]] = {a: [], b: [], c: []}
    s.step()
    with pytest.raises(ValueError, match=f"rid={a} is still running"):
        s.take(a)
    s.cancel(c)
    assert s.take(c).rid == c and not s.cancelled
    while s.waiting or s.running:
        for rid, tok in s.step().items():
            streamed[rid].append(tok)
    got = s.take(b)
    assert got.output == reference[b] and b not in s.finished
    assert streamed[b] == reference[b][1:]  # the first came in the step before the loop
    with pytest.raises(ValueError, match=f"rid={b} was taken already"):
        s.take(b)
    assert list(s.finished) == [a] and s.run() == {a: reference[a]}


@pytest.mark.parametrize("rid,err,match", [(3, ValueError, r"rid=3 .*0 … 2"),
                                           (True, TypeError, "rid must be")])
def test_taking_an_unknown_or_waiting_request_is_refused(model, rid, err, match):
    s, _ = _with(model, PROMPTS)
    with pytest.raises(err, match=match):
        s.take(rid)
    with pytest.raises(ValueError, match="rid=0 is still waiting"):
        s.take(0)
    assert len(s.waiting) == 3
