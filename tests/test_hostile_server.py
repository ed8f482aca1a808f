"""``mha serve``'s HTTP server (:mod:`mha.llm.server`) against hostile clients: malformed
bodies and headers, lying Content-Lengths, clients that send nothing or leave early, more
clients than the batch holds, an engine that fails or stops. Each answer is JSON (never the
standard library's HTML error page), a refusal names its field, a worker never waits on a
silent client past the server's read timeout, and the page pool is whole again when idle.

In-process on a free port over tests/tiny_llama.py (vocabulary 101, context 64, eos 2) and
the word-level tokenizer of tests/test_server.py; the read timeout is 0.5 s.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

from mha.llm.server import TextStream, make_server  # noqa: E402
from mha.ops import decode  # noqa: E402
from test_server import (  # noqa: E402
    _tokenizer,
    concurrently,
    fail_forward_on,
    get,
    greedy,
    post,
    running,
    slow_steps,
    wait_idle,
)
from tiny_llama import CFG, eager_and_mha  # noqa: E402

pytestmark = pytest.mark.skipif(decode.unavailable() is not None,
                                reason=f"decode kernel unavailable: {decode.unavailable()}")

NUM_PAGES, PAGE_SIZE, MAX_SEQS = 64, 4, 4
TIMEOUT = 0.5  #: the server's read timeout in these tests (seconds)


@pytest.fixture(scope="module")
def models():
    return eager_and_mha()


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def server(models, tok):
    with running(models["mha"], tok, max_seqs=MAX_SEQS, request_timeout=TIMEOUT) as srv:
        yield srv


def raw(server, data: bytes, *, wait: float = 10.0, shut: bool = False) -> tuple[int, dict]:
    """Send ``data`` on a new connection; ``(status, parsed JSON body)`` of the first answer
    (the connection is read until the body is whole or closed). ``shut``: half-close after
    sending."""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=wait) as c:
        c.sendall(data)
        if shut:
            c.shutdown(socket.SHUT_WR)
        seen = b""
        while True:
            head, sep, body = seen.partition(b"\r\n\r\n")
            if sep:
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (h.partition(":") for h in lines[1:])}
                n = int(headers.get("content-length", -1))
                if 0 <= n <= len(body):
                    return int(lines[0].split()[1]), json.loads(body[:n])
            chunk = c.recv(65536)
            if not chunk:
                break
            seen += chunk
    head, _, body = seen.partition(b"\r\n\r\n")
    assert head, "the server closed the connection without an answer"
    return int(head.split()[1]), json.loads(body)


def request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = {"Host": "x", "Content-Length": str(len(body))} | (headers or {})
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items() if v is not None)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def settled(server, timeout: float = 20.0) -> dict:
    """/health once no request is open anywhere: none running or waiting in the scheduler,
    none in the engine's inbox or tickets (fails the test past ``timeout``)."""
    engine = server.engine
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        h = wait_idle(server, timeout)
        if not engine._tickets and engine._inbox.qsize() == 0:
            time.sleep(0.06)  # a handler looks at its client every 50 ms
            h = wait_idle(server, timeout)
            if not engine._tickets and engine._inbox.qsize() == 0:
                return h
        time.sleep(0.02)
    raise AssertionError(f"requests still open: {engine._tickets}")


def assert_error(status: int, out: dict, want: int, param: str | None = None) -> None:
    assert status == want, out
    err = out["error"]
    assert isinstance(err["message"], str) and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err


# ----------------------------------------------------------------------------- bodies
@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,  # nested past Python's recursion limit
    b'{"prompt": [5], "max_tokens": ' + b"9" * 5000 + b"}",  # past int's digit limit
    b'{"prompt": {"a": ' * 3000 + b"1" + b"}" * 3000,
    b"null", b"5", b'"text"', b"true", b"[]",
    b'{"prompt": [5]}\x00',
])
def test_a_body_that_is_no_json_object_is_a_400(server, body):
    server.log_lines.clear()
    status, out = raw(server, request("POST", "/v1/completions", body))
    assert_error(status, out, 400)
    assert "JSON object" in out["error"]["message"]
    assert not any("Traceback" in line or "error serving" in line for line in server.log_lines)


@pytest.mark.parametrize("value", [1e308, 10**100, -1, 0, True, "5", 5.0, None, [5], {}, -10**30])
def test_max_tokens_must_be_a_positive_int_within_the_context(server, value):
    if value is None:  # the default (16) runs
        status, out = post(server, "/v1/completions", {"prompt": [5], "max_tokens": value})
        assert status == 200 and out["usage"]["completion_tokens"] >= 1
        return
    status, out = post(server, "/v1/completions", {"prompt": [5], "max_tokens": value})
    assert_error(status, out, 400, "max_tokens")
    assert "max_tokens" in out["error"]["message"]


def test_max_tokens_past_the_context_names_it_and_the_context(server):
    status, out = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 63})
    assert_error(status, out, 400, "max_tokens")
    assert "64" in out["error"]["message"]
    status, out = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 62})
    assert status == 200, out  # exactly the context


@pytest.mark.parametrize("prompt", [
    "", [], [[5, 6]], [5, None], [5, "6"], [True], [False, 5], [-1], [5, -10**30],
    [CFG.vocab_size], [10**100], [2**63], [5.0], {"ids": [5]}, 5, True,
])
def test_a_bad_prompt_is_a_400_naming_it(server, prompt):
    status, out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert_error(status, out, 400, "prompt")


def test_a_very_long_text_prompt_is_refused_and_the_server_goes_on(server):
    text = "w5 " * 300_000  # ~900 kB, under the 1 MiB body bound; 300000 tokens > context
    status, out = post(server, "/v1/completions", {"prompt": text, "max_tokens": 2})
    assert_error(status, out, 400, "prompt")
    assert "300000" in out["error"]["message"]
    status, out = post(server, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 2})
    assert status == 200, out


@pytest.mark.parametrize("messages", [
    None, "hi", 5, {}, [], [None], ["hi"], [{"content": "w5"}], [{"role": "user"}],
    [{"role": "user", "content": None}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": ["w5"]}], [{"role": "user", "content": [{"type": "image"}]}],
    [{"role": "robot", "content": "w5"}], [{"role": 5, "content": "w5"}],
    [{"role": "user", "content": "\ud800"}],
])
def test_malformed_messages_are_a_400_naming_them(server, messages):
    body = {"max_tokens": 2} if messages is None else {"messages": messages, "max_tokens": 2}
    status, out = post(server, "/v1/chat/completions", body)
    assert_error(status, out, 400, "messages")


@pytest.mark.parametrize("stop", [5, "", [], ["w5"] * 100, ["w5", ""], [5], {"s": "w5"}, True])
def test_a_bad_stop_is_a_400_naming_it(server, stop):
    status, out = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 2,
                                                   "stop": stop})
    assert_error(status, out, 400, "stop")


@pytest.mark.parametrize("name,value,param", [
    ("stream", 1, "stream"), ("stream", "true", "stream"),
    ("stream_options", [], "stream_options"),
    ("stream_options", {"include_usage": 1}, "include_usage"),
    ("temperature", float("nan"), "temperature"), ("top_p", float("inf"), "top_p"),
])
def test_other_bad_fields_are_a_400_naming_them(server, name, value, param):
    status, out = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 2,
                                                   name: value})
    assert_error(status, out, 400, param)


# ----------------------------------------------------------------------------- headers
def test_a_transfer_encoding_is_refused(server):
    chunked = b"f\r\n" + b'{"prompt": [5]}' + b"\r\n0\r\n\r\n"
    status, out = raw(server, request("POST", "/v1/completions", chunked,
                                      {"Transfer-Encoding": "chunked", "Content-Length": None}))
    assert_error(status, out, 411)
    status, out = raw(server, request("POST", "/v1/completions", chunked,
                                      {"Transfer-Encoding": "chunked"}))
    assert_error(status, out, 400)
    assert "Transfer-Encoding" in out["error"]["message"]


@pytest.mark.parametrize("length,want", [("-5", 400), ("+5", 400), ("5.0", 400), ("²", 400),
                                         ("0x10", 400), ("99999999999999999999", 413),
                                         (None, 411), ("", 400)])
def test_a_bad_content_length_is_refused(server, length, want):
    status, out = raw(server, request("POST", "/v1/completions", b'{"prompt": [5]}',
                                      {"Content-Length": length}))
    assert_error(status, out, want)


def test_a_content_length_larger_than_the_body_does_not_hold_a_worker(server):
    """The client sends 15 of 1000 announced bytes and waits: the server gives up after its
    read timeout (a 408, the connection closed) and answers others meanwhile."""
    body = b'{"prompt": [5]}'
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as c:
        c.sendall(request("POST", "/v1/completions", body, {"Content-Length": "1000"}))
        status, out = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 2})
        assert status == 200, out
        answer = b""
        while chunk := c.recv(4096):  # (a server that never gives up: TimeoutError after 10 s)
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]


def test_a_content_length_smaller_than_the_body_is_a_400_or_answers_the_prefix(server):
    body = b'{"prompt": [5], "max_tokens": 2}'
    status, out = raw(server, request("POST", "/v1/completions", body,
                                      {"Content-Length": str(len(body) - 5)}))
    assert_error(status, out, 400)
    status, out = raw(server, request("POST", "/v1/completions", body + b"garbage",
                                      {"Content-Length": str(len(body))}))
    assert status == 200 and out["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("data,want", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n",
     431),
    (b"GET /health HTTP/9.9\r\n\r\n", 505),
    (request("BREW", "/v1/completions"), 501),
])
def test_malformed_requests_are_answered_in_json(server, data, want):
    status, out = raw(server, data)
    assert_error(status, out, want)


@pytest.mark.parametrize("method,path,want", [
    ("GET", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405),
    ("POST", "/health", 405), ("POST", "/v1/models", 405),
    ("PUT", "/v1/completions", 405), ("DELETE", "/health", 405), ("PATCH", "/nope", 404),
    ("GET", "/nope", 404), ("POST", "/nope", 404), ("GET", "/v1/completions/../health", 404),
])
def test_unknown_paths_and_methods_are_json_404_or_405(server, method, path, want):
    status, out = raw(server, request(method, path, b"{}"))
    assert_error(status, out, want)
    assert path in out["error"]["message"]


def test_query_strings_are_ignored(server):
    status, out = get(server, "/health?verbose=1")
    assert status == 200 and out["status"] == "ok"
    status, out = post(server, "/v1/completions?x=1", {"prompt": [5], "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] >= 1


def test_a_body_on_get_is_not_taken_for_the_next_request(server):
    """A GET carrying a body that looks like a request: the connection answers the GET and
    nothing else (the body is skipped, never parsed as a request)."""
    inner = request("POST", "/nope", b"")
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as c:
        c.sendall(request("GET", "/health", inner) + request("GET", "/v1/models"))
        seen = b""
        end = time.monotonic() + 5
        while b'"object": "list"' not in seen and time.monotonic() < end:
            c.settimeout(max(0.05, end - time.monotonic()))
            try:
                chunk = c.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            seen += chunk
    assert seen.count(b"HTTP/1.1 ") == seen.count(b"HTTP/1.1 200 OK") == 2, seen[:400]
    assert b'"object": "list"' in seen  # the second GET's answer


# ----------------------------------------------------------------------------- connections
def test_silent_clients_do_not_stop_the_server(server):
    """20 connections that send nothing, 10 that send half a header: others are answered at
    once, and the silent ones are closed after the read timeout (never answered as if the
    headers had ended)."""
    port = server.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
    half = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(10)]
    try:
        for c in half:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        status, out = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3})
        assert status == 200, out
        for c in idle + half:
            answer = c.recv(4096)  # closed, no answer or a 408 (never closed: TimeoutError)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:80]
    finally:
        for c in idle + half:
            c.close()


@pytest.mark.parametrize("part", ["header", "body"])
def test_a_client_that_trickles_its_request_is_dropped_at_the_deadline(server, part):
    """One byte every 0.1 s (each read well within the read timeout): the request as a whole
    gets the read timeout, then the connection closes (408 once the body has begun)."""
    body = b'{"prompt": [5], "max_tokens": 2}'
    data = request("POST", "/v1/completions", body)
    at = data.index(b"\r\n\r\n") + 4 if part == "body" else 10
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as c:
        c.sendall(data[:at])
        c.settimeout(0.1)
        answer, closed = b"", False
        for byte in data[at:at + 60]:  # 60 bytes take >= 6 s: 12x the deadline
            try:
                c.sendall(bytes([byte]))
                chunk = c.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
            answer += chunk
            if not chunk:
                closed = True
                break
    assert closed, "the server kept reading a request trickled past its deadline"
    if part == "body":
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    status, out = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 2})
    assert status == 200, out


def _send_and_leave(server, body: dict, after: bytes | None) -> None:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as c:
        c.sendall(request("POST", "/v1/completions", data,
                          {"Content-Type": "application/json"}))
        seen = b""
        while after is not None and after not in seen:
            seen += c.recv(4096)


@pytest.mark.parametrize("stream_,after", [(False, None), (True, None), (True, b"HTTP/1.1"),
                                           (True, b"data: "), (True, b"data: {"),
                                           (True, b"\n\ndata: ")])
def test_a_client_that_leaves_is_cancelled_and_its_pages_freed(server, monkeypatch, stream_,
                                                               after):
    s = server.engine.scheduler
    before = wait_idle(server)["forwards"]
    slow_steps(monkeypatch, server, 0.02)
    _send_and_leave(server, {"prompt": [5, 6, 7], "max_tokens": 50, "stream": stream_}, after)
    h = settled(server)
    assert h["free_pages"] == NUM_PAGES
    assert h["forwards"] - before < 45  # cancelled before its 50 tokens
    assert not s.finished and not s.cancelled and not server.engine._tickets


def test_fifty_clients_beyond_max_seqs_are_all_answered(server, models, tok):
    prompts = [[5 + i % 90, 6 + i % 7] for i in range(50)]
    want = {tuple(p): greedy(models["eager"], p, 4) for p in prompts}
    got: dict[int, tuple] = {}

    def client(i):
        got[i] = post(server, "/v1/completions", {"prompt": prompts[i], "max_tokens": 4})

    concurrently(50, client)
    for i, p in enumerate(prompts):
        status, out = got[i]
        assert status == 200, out
        assert out["choices"][0]["text"] == tok.decode(want[tuple(p)],
                                                       skip_special_tokens=True), i
    h = wait_idle(server)
    assert h["free_pages"] == NUM_PAGES and not server.engine._tickets


def test_cancellation_racing_completion_leaves_nothing_behind(server):
    """Clients that close as their answer completes (1 to 3 tokens: cancel and finish land
    in the same step or the next): the pool is whole and nothing is kept."""
    for m in (1, 2, 3):
        for after in (None, b"HTTP/1.1"):
            _send_and_leave(server, {"prompt": [5, 6], "max_tokens": m}, after)
    h = settled(server)
    s = server.engine.scheduler
    assert h["free_pages"] == NUM_PAGES
    assert not s.finished and not s.cancelled and not server.engine._tickets


# ----------------------------------------------------------------------------- engine
def test_a_forward_that_raises_fails_its_step_only_and_frees_pages(server, monkeypatch):
    fail_forward_on(monkeypatch, server, 2)
    got: dict[int, tuple] = {}
    concurrently(3, lambda i: got.__setitem__(i, post(
        server, "/v1/completions", {"prompt": [5 + i, 6], "max_tokens": 4})), timeout=30)
    assert sorted(st for st, _ in got.values()) in ([200, 200, 500], [200, 500, 500],
                                                    [500, 500, 500])
    assert wait_idle(server)["free_pages"] == NUM_PAGES
    status, out = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 2})
    assert status == 200, out


def test_a_refused_add_never_fails_other_requests(server, monkeypatch):
    """Scheduler.add raising something other than TypeError / ValueError for one request (a
    stand-in for a bug) answers that request 500; a request running meanwhile completes."""
    s = server.engine.scheduler
    add = s.add

    def add_or_raise(prompt, n, sampling=None):
        if prompt == [9, 9, 9]:
            raise RuntimeError("bad add")
        return add(prompt, n, sampling)

    monkeypatch.setattr(s, "add", add_or_raise)
    step = s.step
    monkeypatch.setattr(s, "step", lambda: (time.sleep(0.02), step())[1])
    got = {}
    t = threading.Thread(target=lambda: got.__setitem__("ok", post(
        server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 20})))
    t.start()
    time.sleep(0.1)
    status, out = post(server, "/v1/completions", {"prompt": [9, 9, 9], "max_tokens": 2})
    assert_error(status, out, 500)
    t.join(30)
    assert got["ok"][0] == 200 and got["ok"][1]["usage"]["completion_tokens"] >= 1


def test_stop_answers_waiting_and_later_requests_with_503(models, tok):
    """stop() while one request runs and others are queued or only submitted: every client
    gets a 503 (none hangs), including a request that arrives after it."""
    srv = make_server(models["mha"], tok, port=0, num_pages=16, page_size=4, max_seqs=1,
                      eos_token_id=None, request_timeout=TIMEOUT)
    srv.start()
    s = srv.engine.scheduler
    step = s.step
    s.step = lambda: (time.sleep(0.05), step())[1]
    got: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, post(
        srv, "/v1/completions", {"prompt": [5 + i], "max_tokens": 40}))) for i in range(3)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.3)
        srv.engine.stop(timeout=10)
        late = srv.engine.submit([5], 2)
        assert late.events.get(timeout=5)[:2] == ("error", 503)
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        assert sorted(st for st, _ in got.values()) == [503, 503, 503]
    finally:
        srv.shutdown()
        srv.server_close()


def test_take_misuse_is_refused_by_name(server):
    s = server.engine.scheduler
    for rid in (-1, 10**9, "0", 1.0, None):
        with pytest.raises((TypeError, ValueError), match="rid"):
            s.take(rid)


# ----------------------------------------------------------------------------- resources
def test_finished_and_cancelled_requests_are_forgotten(server):
    s = server.engine.scheduler
    for i in range(5):
        post(server, "/v1/completions", {"prompt": [5, 6 + i], "max_tokens": 2})
        _send_and_leave(server, {"prompt": [5, 6 + i], "max_tokens": 30, "stream": True},
                        b"data: ")
    settled(server)
    assert not s.finished and not s.cancelled and not s.waiting and not s.running
    assert not server.engine._tickets and server.engine._inbox.qsize() == 0
    assert wait_idle(server)["free_pages"] == NUM_PAGES


def test_request_timeout_is_refused_unless_positive(models, tok):
    for bad in (0, -1, float("nan"), "5", True):
        with pytest.raises(ValueError, match="request_timeout must be a positive number"):
            make_server(models["mha"], tok, port=0, num_pages=4, page_size=4,
                        request_timeout=bad)


def test_ctrl_c_answers_the_requests_in_flight_with_503(models, tok, capsys, monkeypatch):
    """``mha serve`` interrupted while a request runs and another waits (max_seqs 1): both
    clients get a 503, the command exits 0 without a traceback."""
    import mha.cli.serve
    from mha.cli import main
    from mha.llm.model import Loaded
    from mha.llm.server import Server

    monkeypatch.setattr(mha.cli.serve, "load_or_hint",
                        lambda *a: Loaded(model=models["mha"], tokenizer=tok,
                                          dtype=models["mha"].dtype, attn="mha"))
    got: dict[int, tuple] = {}
    serve_forever = Server.serve_forever

    def serve_then_interrupt(self, *a, **kw):
        t = threading.Thread(target=serve_forever, args=(self,), daemon=True)
        t.start()
        s = self.engine.scheduler
        step = s.step
        s.step = lambda: (time.sleep(0.05), step())[1]
        for i in range(2):
            threading.Thread(target=lambda i=i: got.__setitem__(i, post(
                self, "/v1/completions", {"prompt": [5 + i], "max_tokens": 40})),
                daemon=True).start()
        end = time.monotonic() + 10
        while len(s.running) + len(s.waiting) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        self.shutdown()
        t.join(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(Server, "serve_forever", serve_then_interrupt)
    code = main(["serve", "--port", "0", "--num-pages", "32", "--page-size", "4",
                 "--max-seqs", "1"])
    _, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    end = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    assert sorted(st for st, _ in got.values()) == [503, 503], got


@pytest.mark.parametrize("argv,expected", [
    (["--request-timeout", "0"], "--request-timeout must be a positive number, got 0"),
    (["--request-timeout", "-1"], "--request-timeout must be a positive number, got -1"),
    (["--request-timeout", "nan"], "--request-timeout must be a positive number, got nan"),
    (["--request-timeout", "x"], "--request-timeout must be a positive number, got 'x'"),
    (["--max-seqs", "1e3"], "--max-seqs must be a positive int"),
    (["--num-pages", str(10**12)], f"the page pool (--num-pages {10**12} x --page-size 16 "
                                   "tokens, K/V fp32) needs at least"),
    (["--num-pages", str(10**9), "--kv", "int8"], "lower --num-pages"),
    (["--page-size", str(10**8)], "lower --num-pages or --page-size"),  # the page at fault
    (["--max-seqs", str(10**9)], "the block table (--max-seqs 1000000000 rows"),
])
def test_a_bad_serve_option_is_one_line_and_exit_2(argv, expected, capsys, monkeypatch):
    import mha.cli.serve
    from mha.cli import main

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded for a refused command")

    monkeypatch.setattr(mha.cli.serve, "load_or_hint", no_load)
    code = main(["serve", "--port", "0", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("mha serve") and expected in err, err


def test_a_long_stop_string_costs_in_proportion_to_the_text():
    """A stop string of 200000 characters (a body under 1 MiB may carry four): what may begin
    it is looked for among the text's own lengths only (prefixes taken per token: at most the
    text's length + 1, not 200000)."""
    class Counting(str):
        taken = 0

        def __getitem__(self, key):
            Counting.taken += 1
            return str.__getitem__(self, key)

    stop = Counting("x" * 200_000)
    ts = TextStream(lambda toks: " w5" * len(toks), [stop])
    for n in range(1, 5):
        Counting.taken = 0
        assert ts.feed(5) == " w5"
        assert Counting.taken <= 3 * n + 1, Counting.taken


@pytest.mark.parametrize("kv,dtype,kv_dtype", [("fp32", "float32", None),
                                               ("bf16", "bfloat16", None),
                                               ("int8", "float32", "int8")])
def test_the_serve_pool_check_counts_what_the_pool_allocates(kv, dtype, kv_dtype):
    """``mha serve``'s size of the page pool, checked before the model loads, is what
    PagedKVCache allocates for SmolLM2's shape (K/V and int8's scales)."""
    import torch

    from mha.cli.serve import KV_SHAPE, pool_bytes
    from mha.paged import PagedKVCache

    layers, heads, d = KV_SHAPE
    c = PagedKVCache(6, 4, heads, d, max_seqs=2, max_len=24, num_layers=layers,
                     dtype=getattr(torch, dtype), kv_dtype=kv_dtype)
    held = sum(t.nbytes for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None)
    assert pool_bytes(6, 4, kv) == held


@pytest.mark.parametrize("page_size", [16, 100])
def test_the_serve_block_table_check_counts_what_the_cache_allocates(page_size):
    from mha.cli.serve import CONTEXT, table_bytes
    from mha.paged import PagedKVCache

    c = PagedKVCache(1, page_size, 1, 1, max_seqs=3, max_len=CONTEXT)
    assert table_bytes(3, page_size) == c.block_table.nbytes + c.lengths.nbytes


def test_the_serve_pool_shape_is_the_packaged_models():
    """``KV_SHAPE`` (kept as a constant: the pool is checked before the model loads) is the
    (layers, K/V heads, head dim) of the packaged SmolLM2's config."""
    pytest.importorskip("gguf", reason="the mha[llm] extra is not installed")
    from mha.cli.serve import CONTEXT, KV_SHAPE
    from mha.llm.model import ModelNotInstalled, convert

    try:
        config = json.loads((convert() / "config.json").read_text())
    except ModelNotInstalled as e:
        pytest.skip(str(e))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert KV_SHAPE == (config["num_hidden_layers"], config["num_key_value_heads"], head_dim)
    assert CONTEXT == config["max_position_embeddings"]


def _until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_connections_beyond_max_connections_get_a_503_without_a_thread(models, tok):
    """max_connections=3 held by silent clients: a fourth connection is answered 503 (JSON)
    at once, not left waiting behind them; once one silent client leaves, requests are
    served again."""
    with running(models["mha"], tok, max_seqs=2, request_timeout=30,
                 max_connections=3) as srv:
        port = srv.server_address[1]
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        try:
            _until(lambda: srv._connections == 3)
            threads = threading.active_count()
            status, out = post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
            assert status == 503 and "max_connections" in out["error"]["message"], out
            assert srv._connections == 3 and threading.active_count() == threads
            silent.pop().close()
            _until(lambda: srv._connections == 2)
            status, out = post(srv, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
            assert status == 200, out
        finally:
            for c in silent:
                c.close()


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_a_bad_max_connections_is_refused_naming_it(models, tok, bad):
    with pytest.raises(ValueError, match="max_connections must be a positive int"):
        make_server(models["mha"], tok, max_connections=bad)
