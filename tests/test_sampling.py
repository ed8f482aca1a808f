"""mha.sampling: the parameters' checks, the filters against transformers' warpers, the
drawn frequencies against the exact filtered distribution, temperature 0 == greedy bitwise,
and seeded tokens through mha.models.Llama.generate, transformers' generate (mha's sampler as
its logits processor) and the continuous-batching Scheduler (alone == batched == preempted).

Shape legend: R rows, V vocabulary, B batch, P prompt tokens, N new tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from mha.sampling import (
    GREEDY,
    Sampler,
    SamplingParams,
    filter_without_temperature,
    filtered,
    next_tokens,
    reference_filtered,
)

# ----------------------------------------------------------------------------- the parameters
BAD = [  # (field, value, error, words of the message)
    ("temperature", -0.5, ValueError, "temperature must lie in [0.0, inf)"),
    ("temperature", float("nan"), ValueError, "temperature"),
    ("temperature", float("inf"), ValueError, "temperature"),
    ("temperature", True, TypeError, "temperature must be a number, got bool"),
    ("temperature", "0.7", TypeError, "temperature must be a number, got str"),
    ("temperature", None, TypeError, "temperature"),
    ("top_k", -1, ValueError, "top_k must be an int >= 0"),
    ("top_k", 2.0, TypeError, "top_k"),
    ("top_k", True, TypeError, "top_k"),
    ("top_p", 0.0, ValueError, "top_p must lie in (0.0, 1.0]"),
    ("top_p", 1.0001, ValueError, "top_p"),
    ("top_p", float("nan"), ValueError, "top_p"),
    ("top_p", -0.1, ValueError, "top_p"),
    ("top_p", False, TypeError, "top_p"),
    ("min_p", 1.5, ValueError, "min_p must lie in [0.0, 1.0]"),
    ("min_p", float("-inf"), ValueError, "min_p"),
    ("min_p", "x", TypeError, "min_p"),
    ("seed", -1, ValueError, "seed must be an int in [0, 2**64)"),
    ("seed", 2**64, ValueError, "seed"),
    ("seed", 1.0, TypeError, "seed"),
    ("seed", True, TypeError, "seed"),
]


@pytest.mark.parametrize("name,value,error,words", BAD)
def test_a_bad_field_is_refused_naming_it(name, value, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")
                       .replace(")", r"\)").replace("]", r"\]").replace("*", r"\*")):
        SamplingParams(**{name: value})


def test_off_values_are_normalised_and_greedy_is_temperature_zero():
    p = SamplingParams(temperature=0.5, top_k=0, min_p=0.0, seed=2**64 - 1)
    assert p.top_k is None and p.min_p is None and not p.greedy
    assert SamplingParams(temperature=0, top_k=3).greedy and GREEDY.greedy
    assert SamplingParams(temperature=1).with_seed().seed is not None
    assert GREEDY.generator() is None
    assert "seed 7" in SamplingParams(temperature=1, seed=7).describe()


def test_next_tokens_refuses_bad_inputs_naming_them():
    p = SamplingParams(temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="logits must be a floating tensor"):
        next_tokens(torch.zeros(4, dtype=torch.long)[None], [p], [p.generator()])
    with pytest.raises(ValueError, match="one entry per row"):
        next_tokens(torch.zeros(2, 4), [p], [p.generator()])
    with pytest.raises(ValueError, match=r"generators\[0\] is None"):
        next_tokens(torch.zeros(1, 4), [p], [None])
    with pytest.raises(TypeError, match=r"params\[1\] must be a mha.sampling.SamplingParams, "
                                        r"got dict"):
        next_tokens(torch.zeros(2, 4), [GREEDY, {"temperature": 0.0}], [None, None])
    with pytest.raises(TypeError, match=r"generators\[1\] must be a torch.Generator or None, "
                                        r"got int"):
        next_tokens(torch.zeros(2, 4), [p, p], [p.generator(), 7])
    with pytest.raises(TypeError, match="params must be a list"):
        next_tokens(torch.zeros(1, 4), iter([p]), [p.generator()])


def test_next_tokens_refuses_a_bad_row_before_any_generator_draws():
    p = SamplingParams(temperature=1.0, seed=0)
    g = p.generator()
    state = g.get_state()
    with pytest.raises(ValueError, match=r"generators\[1\] is None"):
        next_tokens(torch.zeros(2, 4), [p, p], [g, None])
    assert torch.equal(g.get_state(), state)
    with pytest.raises(TypeError, match="sampling must be"):
        Sampler.for_batch({"temperature": 1.0}, 1)
    with pytest.raises(ValueError, match="B=2"):
        Sampler.for_batch([p], 2)


# ----------------------------------------------------------------------------- greedy, NaN
def test_temperature_zero_is_the_argmax_bitwise_and_reads_no_generator():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first
    gens = [torch.Generator().manual_seed(5) for _ in range(6)]
    states = [x.get_state() for x in gens]
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.5, seed=5)] * 6
    assert torch.equal(next_tokens(logits, params, gens), logits.argmax(-1))
    assert all(torch.equal(x.get_state(), s) for x, s in zip(gens, states, strict=True))


def test_a_row_that_is_no_distribution_gets_the_argmax_as_greedy_does():
    """NaN, +inf, all -inf: the greedy path's argmax (NaN first), whatever the parameters;
    the other rows are sampled as usual."""
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    logits[0, 3] = logits[0, 6] = float("nan")
    logits[1, 8] = float("inf")
    logits[2] = -float("inf")
    p = SamplingParams(temperature=1.5, top_p=0.9, seed=3)
    got = next_tokens(logits, [p] * 4, [p.generator(i) for i in range(4)])
    assert got[:3].tolist() == [3, 8, 0] == logits[:3].argmax(-1).tolist()
    assert 0 <= int(got[3]) < 10


# ----------------------------------------------------------------------------- transformers
SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, None, 1.0, None), (0.7, None, 1.0, None), (1.3, 20, 1.0, None),
    (1.0, None, 0.9, None), (0.6, None, 0.5, None), (0.8, 40, 0.95, None),
    (1.0, 1, 1.0, None), (1.1, None, 1e-6, None), (0.9, None, 1.0, 0.05),
    (1.2, 50, 0.8, 0.1),
]


def _warpers(t, k, p, m):
    """transformers' warpers for these settings, in the order its generate builds them."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    out = [lp.TemperatureLogitsWarper(t)]
    if k:
        out.append(lp.TopKLogitsWarper(k))
    if p < 1:
        out.append(lp.TopPLogitsWarper(p))
    if m:
        out.append(lp.MinPLogitsWarper(m))
    return out


@pytest.mark.parametrize("t,k,p,m", SETTINGS)
@pytest.mark.parametrize("fn", [filtered, reference_filtered], ids=["filtered", "reference"])
@pytest.mark.parametrize("scale", [3.0, 0.3])  # peaked rows; flat rows (top-p keeps many)
def test_the_filters_match_transformers_warpers(t, k, p, m, fn, scale):
    """Random logits (R=8, V=1000; two rows with -inf logits, one with ties at the k-th
    when top-p is off):
    the same kept tokens and the same renormalised distribution as transformers'
    TemperatureLogitsWarper -> TopK -> TopP -> MinP."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(8, 1000, generator=g) * scale  # (R, V)
    logits[1, :300] = -float("inf")
    logits[2, ::2] = -float("inf")
    if k and p == 1:  # (top-p cutting among tied tokens keeps an arbitrary few of them)
        top = logits[3].topk(k + 2).values
        logits[3][logits[3] >= top[-1]] = top[k - 1]  # k + 2 tokens tied at the k-th
    theirs = logits.clone()
    for w in _warpers(t, k, p, m):
        theirs = w(None, theirs)
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    ours = torch.stack([fn(row, params) for row in logits])  # (R, V)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- frequencies
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -2.0])  # (V=8,)
DRAWS = 20000


def exact(logits: torch.Tensor, t: float, k, p: float, m) -> torch.Tensor:
    """The filtered distribution in float64, written plainly (descending order): the oracle
    of the frequency tests."""
    x = logits.double() / t
    order = torch.argsort(x, descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[order[:k or len(x)]] = True  # (no ties in LOGITS)
    x = x.masked_fill(~keep, -math.inf)
    if p < 1:
        probs = x.softmax(-1)[order]  # descending
        before = probs.cumsum(0) - probs  # the mass of the more likely tokens
        keep_p = torch.zeros_like(keep)
        keep_p[order[before < p]] = True  # a token stays while the mass before it is < p
        x = x.masked_fill(~keep_p, -math.inf)
    if m:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < m * probs.max(), -math.inf)
    return x.softmax(-1)


def frequencies(params: SamplingParams) -> torch.Tensor:
    g = params.generator()
    rows = LOGITS.expand(DRAWS, -1)  # (DRAWS, V)
    got = next_tokens(rows, [params] * DRAWS, [g] * DRAWS)  # one stream, DRAWS draws
    return torch.bincount(got, minlength=len(LOGITS)).double() / DRAWS


def close_to(freq: torch.Tensor, want: torch.Tensor) -> bool:
    """Within 4.5 standard deviations of a multinomial count per token (a false alarm has
    odds of about 1e-5 per token), and never a token of probability 0."""
    sd = (want * (1 - want) / DRAWS).sqrt()
    return bool(((freq - want).abs() <= 4.5 * sd + 1e-12).all())


FREQ_SETTINGS = [(1.0, None, 1.0, None), (0.5, None, 1.0, None), (2.0, None, 1.0, None),
                 (1.0, 3, 1.0, None), (1.0, None, 0.6, None), (0.8, None, 0.75, None),
                 (1.0, None, 1.0, 0.3), (1.5, 5, 0.9, 0.2)]


@pytest.mark.parametrize("t,k,p,m", FREQ_SETTINGS)
def test_drawn_frequencies_follow_the_filtered_distribution(t, k, p, m):
    want = exact(LOGITS, t, k, p, m)
    freq = frequencies(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1234))
    assert close_to(freq, want), (freq.tolist(), want.tolist())
    assert torch.equal(freq > 0, want > 0)  # the kept set, exactly (every kept p > 1e-3)


@pytest.mark.parametrize("wrong", [
    dict(t=1.1),   # a temperature 10 % off
    dict(k=4),     # top-k off by one
    dict(p=0.85),  # top-p that keeps one token more than p=0.6 at t=1
])
def test_the_frequency_check_catches_a_wrong_distribution(wrong):
    """The check above can fail: draws under slightly other settings are refused."""
    right = dict(t=1.0, k=3 if "k" in wrong else None, p=0.6 if "p" in wrong else 1.0)
    drawn = {**right, **wrong}
    assert not torch.equal(exact(LOGITS, **right, m=None), exact(LOGITS, **drawn, m=None))
    freq = frequencies(SamplingParams(temperature=drawn["t"], top_k=drawn["k"],
                                      top_p=drawn["p"], seed=1234))
    assert not close_to(freq, exact(LOGITS, **right, m=None))


def test_top_p_keeps_the_token_that_crosses_p():
    """transformers' rule: drop while the cumulative mass (ascending) is <= 1 - p, so the
    token whose mass crosses p stays (p just above the top token's mass keeps two)."""
    probs = LOGITS.softmax(-1)
    top = float(probs.max())
    kept = torch.isfinite(filtered(LOGITS, SamplingParams(temperature=1, top_p=top + 1e-3)))
    assert int(kept.sum()) == 2
    kept = torch.isfinite(filtered(LOGITS, SamplingParams(temperature=1, top_p=top - 1e-3)))
    assert int(kept.sum()) == 1


# ----------------------------------------------------------------------------- Llama.generate
@pytest.fixture(scope="module")
def pair():
    """The tiny seeded Llama of tests/tiny_llama.py: transformers' (mha attention) and
    mha.models.Llama from the same weights."""
    pytest.importorskip("transformers")
    from mha.models import Llama
    from tiny_llama import eager_and_mha

    hf = eager_and_mha()["mha"]
    return hf, Llama.from_hf(hf).eval()


IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 13, 14]])  # (B, P)
HOT = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=21)


def test_generate_at_temperature_zero_is_greedy_bitwise(pair):
    _, ll = pair
    greedy = ll.generate(IDS, 12)
    for s in (None, GREEDY, SamplingParams(temperature=0, top_p=0.3, seed=4), [GREEDY] * 2):
        assert torch.equal(ll.generate(IDS, 12, sampling=s), greedy)


def test_generate_with_a_seed_is_reproducible_and_row_i_draws_from_seed_plus_i(pair):
    _, ll = pair
    a = ll.generate(IDS, 16, sampling=HOT)  # (B, P + N)
    assert torch.equal(a, ll.generate(IDS, 16, sampling=HOT))
    assert not torch.equal(a, ll.generate(IDS, 16))  # sampled: not the greedy tokens
    other = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=22)
    assert not torch.equal(a, ll.generate(IDS, 16, sampling=other))
    # row 0 alone, row 1 alone from seed + 1: the batch's rows
    assert torch.equal(ll.generate(IDS[:1], 16, sampling=HOT)[0], a[0])
    assert torch.equal(ll.generate(IDS[1:], 16, sampling=other)[0], a[1])
    # one SamplingParams per row: each from its own seed
    mixed = ll.generate(IDS, 16, sampling=[GREEDY, HOT])
    assert torch.equal(mixed[0], ll.generate(IDS, 16)[0])
    assert torch.equal(mixed[1], ll.generate(IDS[1:], 16, sampling=HOT)[0])


def test_generate_refuses_bad_sampling_before_anything_runs(pair):
    _, ll = pair
    calls = []
    handle = ll.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(TypeError, match="sampling must be"):
            ll.generate(IDS, 4, sampling=0.7)
        with pytest.raises(ValueError, match="one per row"):
            ll.generate(IDS, 4, sampling=[HOT])
    finally:
        handle.remove()
    assert not calls


def test_transformers_generate_with_the_sampler_equals_llama_generate(pair):
    """The same seed, the same tokens on both paths (their logits agree to float rounding)."""
    from mha.llm.generation import _as_processors

    hf, ll = pair
    for seed in range(4):
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=seed)
        ids = IDS[:1]
        theirs = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=16, do_sample=False, top_p=None, top_k=None,
                             temperature=None, pad_token_id=2,
                             logits_processor=_as_processors(Sampler.one_row(params)))
        ours = ll.generate(ids, 16, eos_token_id=2, sampling=params)
        assert theirs[0].tolist() == ours[0].tolist()


# ----------------------------------------------------------------------------- the Scheduler
def _run(model, requests, **kw):
    """``requests``: (prompt, N, sampling); returns each one's new tokens, in order."""
    from mha.llm.serving import Scheduler

    options = dict(num_pages=64, page_size=4, max_seqs=8, max_len=64, prefill_chunk=64)
    s = Scheduler(model, **{**options, **kw})
    rids = [s.add(p, n, sampling) for p, n, sampling in requests]
    out = s.run()
    return [out[r] for r in rids], s


PROMPTS = [[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22],
           [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


def test_scheduler_tokens_with_a_seed_do_not_depend_on_the_batch(pair):
    """A seeded request alone, batched with others (sampled and greedy), with chunked
    prefill, and preempted and recomputed: the same tokens; a greedy request stays greedy."""
    hf, ll = pair
    n = 10
    alone, _ = _run(hf, [(PROMPTS[0], n, HOT)])
    assert alone[0] == ll.generate(torch.tensor(PROMPTS[:1]), n, sampling=HOT)[0, 6:].tolist()
    greedy_alone, _ = _run(hf, [(PROMPTS[1], n, None)])
    others = [(PROMPTS[1], n, None),
              (PROMPTS[2], n, SamplingParams(temperature=0.8, seed=5)),
              (PROMPTS[3], n, SamplingParams(temperature=1.3, top_k=10, seed=6))]
    batched, _ = _run(hf, [(PROMPTS[0], n, HOT), *others])
    assert batched[0] == alone[0] and batched[1] == greedy_alone[0]
    chunked, _ = _run(hf, [*others, (PROMPTS[0], n, HOT)], prefill_chunk=2)
    assert chunked[3] == alone[0] and chunked[:3] == batched[1:]
    # 7 pages of 4 tokens: the four requests cannot all grow; the last admitted is preempted
    tight, s = _run(hf, [*others, (PROMPTS[0], n, HOT)], num_pages=9, prefill_chunk=4)
    assert s.preemptions > 0
    assert tight[3] == alone[0] and tight[:3] == batched[1:]


def test_scheduler_without_a_seed_draws_one_per_request(pair):
    from mha.llm.serving import Scheduler

    hf, _ = pair
    s = Scheduler(hf, num_pages=32, page_size=4, max_len=64)
    a = s.add(PROMPTS[0], 8, SamplingParams(temperature=1.0))
    b = s.add(PROMPTS[0], 8, SamplingParams(temperature=1.0))
    seeds = [r.sampling.seed for r in s.waiting]
    assert None not in seeds and seeds[0] != seeds[1]
    out = s.run()
    again, _ = _run(hf, [(PROMPTS[0], 8, SamplingParams(temperature=1.0, seed=seeds[0]))])
    assert out[a] == again[0] and out[b] != out[a]  # (two draws of 8 tokens from 101)


def test_scheduler_refuses_bad_sampling_with_nothing_queued(pair):
    from mha.llm.serving import Scheduler

    hf, _ = pair
    s = Scheduler(hf, num_pages=8, page_size=4, max_len=64)
    with pytest.raises(TypeError, match="sampling must be"):
        s.add([5, 6], 3, {"temperature": 1.0})
    assert not s.waiting and s._next_rid == 0


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_step_interrupted_after_its_draws_resumes_to_the_same_tokens(pair, fail_at,
                                                                       monkeypatch):
    """Ctrl-C once the step's tokens are drawn but before the requests take them: every
    running request waits again and its generator is back where it was, so the resumed run
    draws each token once (the same tokens as a run never interrupted)."""
    import mha.llm.serving as serving

    _, ll = pair
    requests = [(PROMPTS[0], 8, HOT), (PROMPTS[1], 8, SamplingParams(temperature=0.8, seed=5)),
                (PROMPTS[2], 8, None)]
    want, _ = _run(ll, requests)
    s = serving.Scheduler(ll, num_pages=64, page_size=4, max_seqs=8, max_len=64)
    rids = [s.add(p, n, sampling) for p, n, sampling in requests]
    draw, calls = serving.next_tokens, []

    def interrupted(*args, **kwargs):
        tokens = draw(*args, **kwargs)  # the generators have moved on
        calls.append(1)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return tokens

    monkeypatch.setattr(serving, "next_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.run()
    monkeypatch.undo()
    assert s.cache.free_pages == 64 and sorted(s.interrupted) == rids
    got = s.run()
    assert [got[r] for r in rids] == want


@pytest.mark.parametrize("fields, refused", [
    (dict(top_k=5), "top_k"), (dict(top_p=0.9), "top_p"), (dict(min_p=0.1), "min_p"),
    (dict(top_k=0, min_p=0.0, top_p=1.0), None),  # every filter off: nothing to refuse
])
def test_a_filter_without_temperature_is_refused_in_the_callers_words(fields, refused):
    names = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
             "min_p": "--min-p"}
    got = filter_without_temperature(SamplingParams(**fields), temperature_given=False,
                                     names=names)
    if refused is None:
        assert got is None
        return
    field, message = got
    assert field == refused
    assert message.startswith(f"{names[refused]} samples only with --temperature > 0")
    assert filter_without_temperature(SamplingParams(temperature=0.7, **fields),
                                      temperature_given=True, names=names) is None


def test_an_interrupted_chat_turn_leaves_the_generator_as_before(monkeypatch):
    """Chat.say interrupted after its draws (Ctrl-C mid-reply): the conversation's generator
    goes back to before the turn, so the retried turn draws what it would have drawn."""
    from mha.llm.generation import Chat

    chat = Chat.__new__(Chat)  # the turn's bookkeeping only: no model loaded
    chat.sampling = SamplingParams(temperature=1.0, seed=9).with_seed()
    chat.generator = chat.sampling.generator()
    chat.max_new_tokens, chat.kv, chat.messages = 4, None, []
    chat.loaded = type("Loaded", (), {"tokenizer": None})()
    draws = []

    def run(loaded, ids, n, *, on_text, kv, sampling, generator):
        draws.append(torch.rand(3, generator=generator))
        if len(draws) == 1:
            raise KeyboardInterrupt
        return type("Result", (), {"text": "ok"})()

    chat._run = run
    monkeypatch.setattr("mha.llm.generation.chat_ids",
                        lambda tok, messages: torch.zeros(1, 1, dtype=torch.long))  # (1, P)
    with pytest.raises(KeyboardInterrupt):
        chat.say("hi")
    assert chat.messages == []
    chat.say("hi")
    assert torch.equal(draws[0], draws[1])
