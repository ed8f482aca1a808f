"""Several end-of-sequence ids in serving: :class:`mha.llm.serving.Scheduler` and
:func:`mha.llm.server.make_server` take ``eos_token_id`` as an id or a list (Llama-3-style
configs list several) and stop a request at any of them; ``mha serve`` passes every eos id the
model declares (:func:`mha.llm.model.eos_token_ids`). On tests/tiny_llama.py's seeded Llama
(vocabulary 101, eos 2) and test_server.py's word-level tokenizer.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import torch  # noqa: E402

import mha.llm.serving as serving  # noqa: E402
from mha.llm.model import Loaded, eos_token_ids  # noqa: E402
from mha.llm.serving import Scheduler  # noqa: E402
from mha.ops import decode  # noqa: E402
from tiny_llama import CFG, eager_and_mha  # noqa: E402

pytestmark = pytest.mark.skipif(decode.unavailable() is not None,
                                reason=f"decode kernel unavailable: {decode.unavailable()}")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24], [30, 31]]
NEW = 12


@pytest.fixture(scope="module")
def model():
    return eager_and_mha()["mha"]


def _greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # (1, P + NEW)
    return out[0, len(prompt):].tolist()


def _cut(tokens: list[int], eos) -> list[int]:
    """``tokens`` up to and with the first of ``eos`` (as the scheduler stops)."""
    return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


@pytest.fixture(scope="module")
def want(model):
    return [_greedy(model, p) for p in PROMPTS]


def _scheduler(model, **kw) -> Scheduler:
    return Scheduler(model, **{"num_pages": 64, "page_size": 4, "max_seqs": 8, "max_len": 48,
                               "prefill_chunk": 8, **kw})


@pytest.mark.parametrize("as_type", [list, tuple])
def test_requests_stop_at_any_of_the_eos_ids(model, want, as_type):
    eos = [want[1][2], want[3][4]]  # tokens that the second and the fourth prompt generate
    cut = [_cut(w, eos) for w in want]
    assert len(cut[1]) <= 3 and len(cut[3]) <= 5  # both ids stop a request
    s = _scheduler(model, eos_token_id=as_type(eos))
    assert s.eos_token_id == eos and s.eos_token_ids == frozenset(eos)
    rids = [s.add(p, NEW) for p in PROMPTS]
    got = s.run()
    assert [got[r] for r in rids] == cut


def test_one_id_is_kept_as_an_int(model, want):
    s = _scheduler(model, eos_token_id=want[1][2])
    assert s.eos_token_id == want[1][2] and s.eos_token_ids == {want[1][2]}
    assert _scheduler(model).eos_token_ids == frozenset()


@pytest.mark.parametrize("eos, err, match", [
    ([], ValueError, "eos_token_id must be a token id or a non-empty list"),
    ([2, CFG.vocab_size], ValueError, rf"eos_token_id\[1\] must be a token id of the model's "
                                      rf"vocabulary \[0, {CFG.vocab_size}\), got {CFG.vocab_size}"),
    ([2, -1], ValueError, r"eos_token_id\[1\] must be a token id"),
    ([2, "3"], TypeError, r"eos_token_id\[1\] must be a token id"),
    ([True], TypeError, r"eos_token_id\[0\] must be a token id"),
    ({2}, TypeError, "eos_token_id must be a token id"),
])
def test_a_bad_eos_list_is_refused_naming_it_before_the_pool(model, monkeypatch, eos, err,
                                                            match):
    made = []
    monkeypatch.setattr(serving, "PagedKVCache", lambda *a, **kw: made.append(1))
    with pytest.raises(err, match=match):
        _scheduler(model, eos_token_id=eos)
    assert not made  # refused before the page pool was allocated


def test_the_server_ends_with_stop_at_the_second_id(model, want):
    from mha.llm.server import make_server
    from test_server import _tokenizer, post

    tok = _tokenizer()
    eos = [CFG.eos_token_id, want[0][3]]
    srv = make_server(model, tok, port=0, num_pages=64, page_size=4, prefill_chunk=8,
                      eos_token_id=eos, model_name="tiny")
    srv.start()
    try:
        status, out = post(srv, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": NEW})
    finally:
        srv.close()
    cut = _cut(want[0], eos)
    assert status == 200 and len(cut) < NEW
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(cut)


# ------------------------------------------------------------------ the model's eos ids
def _loaded(tok_eos, config_eos, gen_eos, impl="transformers"):
    tok = SimpleNamespace(eos_token_id=tok_eos)
    if impl == "mha":
        model = SimpleNamespace(settings=SimpleNamespace(eos_token_id=config_eos))
        return Loaded(model=model, tokenizer=tok, dtype=torch.float32, attn="mha", impl="mha",
                      generation_eos=gen_eos)
    model = SimpleNamespace(config=SimpleNamespace(eos_token_id=config_eos),
                            generation_config=SimpleNamespace(eos_token_id=gen_eos))
    return Loaded(model=model, tokenizer=tok, dtype=torch.float32, attn="mha")


@pytest.mark.parametrize("impl", ["transformers", "mha"])
@pytest.mark.parametrize("ids, want", [
    ((2, 2, 2), 2),  # SmolLM2: one id everywhere
    ((128009, [128001, 128008, 128009], None), [128009, 128001, 128008]),  # Llama-3.1-style
    ((2, None, [2, 7]), [2, 7]),
    ((None, 5, None), 5),
    ((None, None, None), None),
])
def test_eos_token_ids_lists_every_declared_id_once(impl, ids, want):
    assert eos_token_ids(_loaded(*ids, impl=impl)) == want


def test_mha_serve_passes_every_eos_id(model, monkeypatch, capsys):
    import mha.cli.serve
    import mha.llm.server
    from mha.cli import main
    from test_server import _tokenizer

    m = copy.deepcopy(model)
    m.config.eos_token_id = [CFG.eos_token_id, 7]
    m.generation_config.eos_token_id = [9, CFG.eos_token_id]
    monkeypatch.setattr(mha.cli.serve, "load_or_hint",
                        lambda *a: Loaded(model=m, tokenizer=_tokenizer(),
                                          dtype=torch.float32, attn="mha"))
    seen = {}

    def record(*a, **kw):
        seen.update(kw)
        raise OSError("recorded")  # the command ends here (as a port taken while loading)

    monkeypatch.setattr(mha.llm.server, "make_server", record)
    assert main(["serve", "--port", "0", "--num-pages", "16", "--page-size", "4"]) == 2
    assert seen["eos_token_id"] == [CFG.eos_token_id, 7, 9]
    assert "recorded" in capsys.readouterr().err


def test_generate_with_impl_mha_stops_at_every_eos_id_as_serve(model):
    """``run_native`` (``mha generate --impl mha``, ``mha chat --impl mha``) stops at every eos
    id the model declares, as ``mha serve`` does (:func:`eos_token_ids`): here an id that only
    the generation config lists, which the reply reaches on its third token."""
    from mha.llm.native import run_native
    from mha.models.llama import Llama
    from test_server import _tokenizer

    llama = Llama.from_hf(copy.deepcopy(model)).eval()
    ids = torch.tensor([PROMPTS[1]])  # (1, P)
    alone = llama.generate(ids, NEW)[0, ids.shape[1]:].tolist()  # no eos: NEW tokens
    stop = alone[2]
    assert stop not in alone[:2] and stop != CFG.eos_token_id and CFG.eos_token_id not in alone
    loaded = Loaded(model=llama, tokenizer=_tokenizer(), dtype=torch.float32, attn="mha",
                    impl="mha", generation_eos=[CFG.eos_token_id, stop])
    assert run_native(loaded, ids, NEW).tokens == alone[:3]
    assert run_native(loaded, ids, NEW, stop_at_eos=False).tokens == alone
