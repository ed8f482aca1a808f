"""mha.models.Llama on the paged K/V cache: :meth:`Llama.forward_paged` (one packed step, each
layer writing into a :class:`mha.PagedKVCache` and attending through it) against the same
model's :class:`mha.KVCache` forward, and :class:`mha.llm.serving.Scheduler` /
``mha serve --impl mha`` serving it, on small seeded Llamas (tests/tiny_llama.py's config:
vocabulary 101, context 64, eos 2; nothing downloaded).

Shape legend: N packed tokens of a step, P prompt tokens, V vocabulary.

The paged and cached forwards run the same weights, projections, RoPE and MLP; the attention
kernels and the GEMMs' row counts (a packed step against one sequence's chunk) differ, so their
fp32 logits (magnitude up to ~6) differ by rounding: judged against the same model's cached
forward in float64, the paged forward's error is at most twice the fp32 cached forward's (as
flash-attention's tests judge a kernel), and the two differ by at most ``ATOL`` (measured worst
1.04e-5 on these schedules, the cached fp32 forward's own error against float64 up to ~8e-6).
"""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers", reason="transformers not installed "
                                   "(pip install 'mha[hf]')")

import torch  # noqa: E402

from mha.llm.serving import Scheduler  # noqa: E402
from mha.models.llama import Llama  # noqa: E402
from mha.ops import decode  # noqa: E402
from mha.paged import PagedKVCache  # noqa: E402
from tiny_llama import CFG  # noqa: E402

pytestmark = pytest.mark.skipif(decode.unavailable() is not None,
                                reason=f"decode kernel unavailable: {decode.unavailable()}")

ATOL = 2e-5  #: fp32 logits, paged forward vs KVCache forward
PAGE = 4  #: tokens per page: every sequence below spans several pages
HEADS = {"GQA": 2, "MHA": 4, "MQA": 1}  #: K/V heads of the 4 query heads


def _llama(kv_heads: int = 2, seed: int = 0) -> Llama:
    """tests/tiny_llama.py's config with ``kv_heads`` K/V heads, seeded (initializer_range 0.2:
    logits far from ties), as mha.models.Llama."""
    cfg = copy.deepcopy(CFG)
    cfg.num_key_value_heads = kv_heads
    torch.manual_seed(seed)
    return Llama.from_hf(transformers.LlamaForCausalLM(cfg).eval())


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist()  # (n,), no pad / eos


# ------------------------------------------------------------------ the paged forward
#: steps of (sequence, tokens it adds); every sequence's tokens are ``_tokens(40, seq)``
SCHEDULES = {
    "prefill": [[(0, 11), (1, 6), (2, 1)]],
    "chunked prefill": [[(0, 4), (1, 7)], [(0, 4), (1, 7)], [(0, 3), (1, 2)]],
    "decode": [[(0, 5), (1, 9), (2, 2)]] + [[(0, 1), (1, 1), (2, 1)]] * 6,
    "mixed": [[(1, 6)], [(0, 4), (1, 1)], [(1, 1), (0, 4), (2, 3)], [(2, 1), (0, 1), (1, 1)],
              [(0, 1), (2, 8), (1, 1)], [(2, 1), (1, 1), (0, 1)]],
}


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_paged_logits_equal_the_kv_cache_forward(heads, schedule):
    """Every token's logits of every packed step equal those of the same model fed each
    sequence's same chunks through its own KVCaches (fp32; and float64, the oracle)."""
    m = _llama(HEADS[heads])
    m64 = copy.deepcopy(m).double()
    seqs = {s for step in SCHEDULES[schedule] for s, _ in step}
    tokens = {s: _tokens(40, s) for s in seqs}
    caches = {s: m.new_caches(1, 40) for s in seqs}
    caches64 = {s: m64.new_caches(1, 40) for s in seqs}
    cache = PagedKVCache(32, PAGE, HEADS[heads], m.settings.head_dim, max_seqs=4, max_len=40,
                         num_layers=m.settings.num_layers)
    slot = {s: cache.add_sequence() for s in sorted(seqs)}
    done = dict.fromkeys(seqs, 0)
    worst = err_paged = err_cached = 0.0
    for step in SCHEDULES[schedule]:
        ids, pos, cu = [], [], [0]
        for s, n in step:
            ids += tokens[s][done[s]:done[s] + n]
            pos += range(done[s], done[s] + n)
            cu.append(cu[-1] + n)
        cache.extend([slot[s] for s, _ in step], [n for _, n in step])
        got = m.forward_paged(torch.tensor([ids]), torch.tensor(pos), cache,
                              [slot[s] for s, _ in step], cu)  # (1, N, V)
        assert got.shape == (1, cu[-1], CFG.vocab_size)
        for i, (s, n) in enumerate(step):
            chunk = torch.tensor([tokens[s][done[s]:done[s] + n]])  # (1, n)
            with torch.no_grad():
                want, exact = m(chunk, caches[s]), m64(chunk, caches64[s])  # (1, n, V) each
            mine = got[0, cu[i]:cu[i + 1]]  # (n, V)
            worst = max(worst, (mine - want[0]).abs().max().item())
            err_paged = max(err_paged, (mine.double() - exact[0]).abs().max().item())
            err_cached = max(err_cached, (want[0].double() - exact[0]).abs().max().item())
            done[s] += n
    assert worst <= ATOL
    assert err_paged <= 2 * err_cached


def test_rows_keep_only_the_asked_tokens_logits(llama):
    cache = PagedKVCache(16, PAGE, 2, llama.settings.head_dim, max_seqs=2, max_len=32,
                         num_layers=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.extend([a, b], [5, 3])
    ids, pos = torch.tensor([_tokens(8, 1)]), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    full = llama.forward_paged(ids, pos, cache, [a, b], [0, 5, 8])  # (1, 8, V)
    cache.free(a), cache.free(b)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.extend([a, b], [5, 3])
    rows = llama.forward_paged(ids, pos, cache, [a, b], [0, 5, 8],
                               rows=torch.tensor([4, 7]))  # (1, 2, V)
    assert rows.shape == (1, 2, CFG.vocab_size)
    assert torch.allclose(rows[0], full[0, [4, 7]], rtol=0, atol=ATOL)  # LM head GEMM of 2 rows


@pytest.mark.parametrize("change,err,match", [
    (dict(ids=torch.tensor([[5, 6, 7, 8]] * 2)), ValueError, r"ids must be \(1, N\)"),
    (dict(ids=torch.tensor([[5, 6, 7, CFG.vocab_size]])), ValueError, r"ids must be token ids"),
    (dict(positions=torch.tensor([[0, 1, 2, 3]])), ValueError, r"positions must be a tensor "
                                                               r"\(N,\) = \(4,\)"),
    (dict(positions=[0, 1, 2, 3]), ValueError, "positions must be a tensor"),
    (dict(cache="pages"), TypeError, "cache must be a mha.PagedKVCache"),
    (dict(cache=dict(num_kv_heads=4)), ValueError, r"cache must hold .*\(2, 2, 16, 16, "),
    (dict(cache=dict(num_layers=3)), ValueError, "cache must hold"),
    (dict(cache=dict(dtype=torch.bfloat16)), ValueError, "cache must hold"),
    (dict(rows=torch.tensor([4])), ValueError, r"rows must be .*\[0, 4\)"),
    (dict(rows=torch.tensor([-1])), ValueError, r"rows must be"),
    (dict(rows=torch.tensor([[3]])), ValueError, r"rows must be"),
    (dict(rows=torch.tensor([0.5])), TypeError, r"rows must be"),
])
def test_a_refused_paged_forward_names_the_argument_and_writes_nothing(llama, change, err,
                                                                        match):
    spec = dict(num_kv_heads=2, num_layers=2, dtype=torch.float32)
    if isinstance(change.get("cache"), dict):
        spec.update(change.pop("cache"))
    cache = PagedKVCache(8, PAGE, spec["num_kv_heads"], 16, max_seqs=2, max_len=16,
                         num_layers=spec["num_layers"], dtype=spec["dtype"])
    s = cache.add_sequence()
    cache.extend([s], [4])
    before = cache.k.clone(), cache.v.clone()
    call = dict(ids=torch.tensor([[5, 6, 7, 8]]), positions=torch.arange(4), cache=cache)
    call.update(change)
    with pytest.raises(err, match=match):
        llama.forward_paged(call["ids"], call["positions"], call["cache"], [s], [0, 4],
                            rows=call.get("rows"))
    assert torch.equal(cache.k, before[0]) and torch.equal(cache.v, before[1])


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_the_module_paged_mode_without_rope_equals_its_cached_mode(softcap):
    """MultiHeadAttention.forward_paged on its own: no rope (positions None), a softcap; two
    sequences, a prefill step then a mixed one, against each sequence's KVCache call."""
    from mha import MultiHeadAttention

    torch.manual_seed(3)
    mod = MultiHeadAttention(32, 4, num_kv_heads=2, softcap=softcap).eval()
    x = torch.randn(1, 9, 32)  # (1, T, d_model): sequence 0 is x[:, :6], sequence 1 x[:, 6:]
    cache = PagedKVCache(8, PAGE, 2, 8, max_seqs=2, max_len=16)
    a, b = cache.add_sequence(), cache.add_sequence()
    kv = {a: mod.new_cache(1, 16), b: mod.new_cache(1, 16)}
    for step in ([(a, x[:, 0:5]), (b, x[:, 6:8])], [(b, x[:, 8:9]), (a, x[:, 5:6])]):
        cache.extend([s for s, _ in step], [t.shape[1] for _, t in step])
        cu = [0]
        for _, t in step:
            cu.append(cu[-1] + t.shape[1])
        with torch.no_grad():
            got = mod.forward_paged(torch.cat([t for _, t in step], 1), cache, 0,
                                    [s for s, _ in step], cu)  # (1, N, d_model)
            want = torch.cat([mod(t, cache=kv[s]) for s, t in step], 1)  # (1, N, d_model)
        assert (got - want).abs().max().item() <= 1e-5


def test_the_module_paged_mode_refuses_positions_that_do_not_fit_its_rope(llama):
    attn = llama.layers[0].self_attn
    cache = PagedKVCache(8, PAGE, 2, 16, max_seqs=2, max_len=16)
    s = cache.add_sequence()
    cache.extend([s], [2])
    x = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match=r"positions must be given \(N,\) with rope"):
        attn.forward_paged(x, cache, 0, [s], [0, 2])
    with pytest.raises(ValueError, match=r"query must be \(1, N, d_model\) = \(1, N, 64\)"):
        attn.forward_paged(torch.randn(2, 1, 64), cache, 0, [s], [0, 2], torch.arange(2))
    assert int(cache.lengths[s]) == 2 and not cache.k.any()  # nothing written


# ------------------------------------------------------------------ the scheduler
PROMPTS = [_tokens(n, 10 + n) for n in (3, 9, 17, 5, 30, 12, 1, 22)]
NEW = 10


def _generate(m: Llama, prompts, n: int = NEW, eos=None) -> list[list[int]]:
    """Llama.generate's greedy tokens per prompt (one by one), cut after eos (as the
    scheduler stops there, the eos kept)."""
    out = []
    for p in prompts:
        new = m.generate(torch.tensor([p]), n, eos_token_id=eos)[0, len(p):].tolist()
        out.append(new[:new.index(eos) + 1] if eos in new else new)
    return out


@pytest.fixture(scope="module")
def want(llama):
    return _generate(llama, PROMPTS)


def _scheduler(model, **kw) -> Scheduler:
    return Scheduler(model, **{"num_pages": 64, "page_size": PAGE, "max_seqs": 8,
                               "max_len": 48, "prefill_chunk": 8, **kw})


def test_batched_requests_equal_generate(llama, want):
    s = _scheduler(llama)
    rids = [s.add(p, NEW) for p in PROMPTS]
    got = s.run()
    assert [got[r] for r in rids] == want
    assert s.preemptions == 0 and s.cache.free_pages == 64 and not s.cache.sequences
    assert s.forwards == 4 + NEW - 1  # the 30-token prompt in 4 chunks of 8, then decode


def test_one_by_one_requests_equal_generate(llama, want):
    s = _scheduler(llama, max_seqs=1)
    for p, w in zip(PROMPTS, want, strict=True):
        rid = s.add(p, NEW)
        assert s.run()[rid] == w


def test_preempted_requests_recompute_to_the_same_tokens(llama, want):
    """13 pages of 4 tokens for 8 requests: they grow into new pages and the last admitted are
    preempted (freed, recomputed later) many times."""
    s = _scheduler(llama, num_pages=13)
    rids = [s.add(p, NEW) for p in PROMPTS]
    got = s.run()
    assert s.preemptions > 0
    assert [got[r] for r in rids] == want
    assert s.cache.free_pages == 13


def test_sampled_requests_equal_sampled_generate_batched_and_preempted(llama):
    """Each request's own seeded generator: the Scheduler over the Llama draws what
    Llama.generate draws for that prompt alone, batched and after preemption."""
    from mha.sampling import SamplingParams

    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=40 + i)
              for i in range(len(PROMPTS))]
    alone = [llama.generate(torch.tensor([p]), NEW, sampling=sp)[0, len(p):].tolist()
             for p, sp in zip(PROMPTS, params, strict=True)]
    for kw in ({}, {"num_pages": 13}):
        s = _scheduler(llama, **kw)
        rids = [s.add(p, NEW, sp) for p, sp in zip(PROMPTS, params, strict=True)]
        got = s.run()
        assert [got[r] for r in rids] == alone
        assert ("num_pages" in kw) == (s.preemptions > 0)


@pytest.mark.parametrize("after", [0, 1, 3, 6])
def test_a_cancelled_request_leaves_the_others_tokens_unchanged(llama, want, after):
    s = _scheduler(llama)
    rids = [s.add(p, NEW) for p in PROMPTS]
    for _ in range(after):
        s.step()
    gone = rids[4]  # the 30-token prompt: in prefill for 4 steps, then decoding
    got = s.cancel(gone)
    assert got == want[4][:len(got)] and len(got) == max(0, after - 3)
    out = s.run()
    assert out == {r: w for r, w in zip(rids, want, strict=True) if r != gone}
    assert s.cache.free_pages == 64 and not s.cache.sequences


def test_requests_stop_at_eos_as_generate(llama, want):
    eos = want[1][3]  # a token the second prompt generates
    s = _scheduler(llama, eos_token_id=eos)
    rids = [s.add(p, NEW) for p in PROMPTS]
    got = s.run()
    assert [got[r] for r in rids] == _generate(llama, PROMPTS, eos=eos)
    assert len(got[rids[1]]) == want[1].index(eos) + 1 < NEW


@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_a_step_interrupted_in_its_forward_resumes_to_the_same_tokens(llama, want, fail_at,
                                                                      monkeypatch):
    s = _scheduler(llama)
    rids = [s.add(p, NEW) for p in PROMPTS]
    forward, calls = llama.forward_paged, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    monkeypatch.setattr(llama, "forward_paged", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.run()
    monkeypatch.undo()
    assert s.cache.free_pages == 64
    got = s.run()
    assert [got[r] for r in rids] == want


def test_a_request_past_the_llama_context_is_refused(llama):
    s = _scheduler(llama, max_len=200)
    with pytest.raises(ValueError, match="64"):
        s.add(_tokens(60, 1), 5)  # 65 positions, the context is 64
    assert not s.waiting
    with pytest.raises(ValueError, match=r"prompt must hold token ids in \[0, 101\)"):
        s.add([5, CFG.vocab_size], 2)


@pytest.mark.parametrize("model", [torch.nn.Linear(4, 4), "SmolLM2", None])
def test_a_model_it_cannot_serve_is_refused_naming_it(model):
    with pytest.raises(TypeError, match=r"^model must be a transformers causal LM .* or an "
                                        r"mha.models.Llama"):
        Scheduler(model, num_pages=8, max_len=32)


# ------------------------------------------------------------------ the server, mha serve
@pytest.fixture(scope="module")
def served():
    """A server over mha.models.Llama holding tiny_llama's eager weights; ``(server, the
    transformers model, tokenizer)``."""
    from test_server import _tokenizer, running
    from tiny_llama import eager_and_mha

    eager = eager_and_mha()["eager"]
    tok = _tokenizer()
    with running(Llama.from_hf(eager), tok, max_seqs=8) as srv:
        yield srv, eager, tok


def test_the_server_over_llama_answers_concurrent_clients_as_greedy_generate(served):

    from test_server import PROMPTS as ASKED
    from test_server import concurrently, greedy, post

    srv, eager, tok = served
    want = [greedy(eager, p, 10) for p in ASKED]  # transformers' generate, eos kept
    got: dict[int, tuple] = {}

    def client(i):
        got[i] = post(srv, "/v1/completions", {"prompt": ASKED[i], "max_tokens": 10})

    concurrently(len(ASKED), client)
    for i, w in enumerate(want):
        status, out = got[i]
        assert status == 200, out
        assert out["choices"][0]["text"] == tok.decode(w, skip_special_tokens=True), i
        assert out["usage"]["completion_tokens"] == len(w)


def test_make_server_refuses_a_model_it_cannot_serve_naming_it():
    from mha.llm.server import make_server

    with pytest.raises(TypeError, match="^loaded_model must be a transformers causal LM"):
        make_server(torch.nn.Linear(4, 4), None, port=0)


def test_serve_impl_mha_serves_the_llama(served, capsys, monkeypatch):
    """``mha serve --impl mha --port 0`` (the tiny Llama in place of SmolLM2's): it says
    which model serves, answers as greedy generate, and Ctrl-C stops it (exit 0)."""
    import threading

    import mha.cli.serve
    from mha.cli import main
    from mha.llm.model import Loaded
    from mha.llm.server import Server
    from test_server import PROMPTS as ASKED
    from test_server import greedy, post

    srv, eager, tok = served
    loads = []

    def load_native(dtype, weights="fp32"):
        loads.append((dtype, weights))
        return Loaded(model=srv.engine.scheduler.model, tokenizer=tok, dtype=torch.float32,
                      attn="mha", weights=weights, impl="mha")

    def no_load(*a, **kw):
        raise AssertionError("--impl mha loaded transformers' model")

    monkeypatch.setattr(mha.cli.serve, "load_native_or_hint", load_native)
    monkeypatch.setattr(mha.cli.serve, "load_or_hint", no_load)
    seen = {}
    serve_forever = Server.serve_forever

    def serve_then_interrupt(self, *a, **kw):
        t = threading.Thread(target=serve_forever, args=(self,), daemon=True)
        t.start()
        seen["answer"] = post(self, "/v1/completions", {"prompt": ASKED[2], "max_tokens": 6})
        seen["runner"] = type(self.engine.scheduler.runner).__name__
        self.shutdown()
        t.join(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(Server, "serve_forever", serve_then_interrupt)
    code = main(["serve", "--impl", "mha", "--port", "0", "--num-pages", "16",
                 "--page-size", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert loads == [("fp32", "bf16")] and seen["runner"] == "LlamaRunner"  # the defaults
    assert "(mha.models.Llama) on http://127.0.0.1:" in out
    status, answer = seen["answer"]
    assert status == 200 and answer["choices"][0]["text"] == tok.decode(
        greedy(eager, ASKED[2], 6), skip_special_tokens=True)


@pytest.mark.parametrize("argv,expected", [
    (["--impl", "onnx"], "--impl: invalid choice: 'onnx'"),
])
def test_a_bad_serve_impl_is_one_line_and_exit_2(argv, expected, capsys, monkeypatch):
    import mha.cli.serve
    from mha.cli import main

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded for a refused command")

    monkeypatch.setattr(mha.cli.serve, "load_or_hint", no_load)
    monkeypatch.setattr(mha.cli.serve, "load_native_or_hint", no_load)
    code = main(["serve", "--port", "0", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert expected in err, err
