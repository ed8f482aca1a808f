"""An HTTP server over :class:`mha.llm.serving.Scheduler`: completions (greedy, or sampled) for
many clients at once (continuous batching), an OpenAI-compatible subset in JSON.

Endpoints: ``POST /v1/completions`` (``prompt``: a string or token ids, ``max_tokens``,
``stream``, ``stop``, and the sampling fields below), ``POST /v1/chat/completions``
(``messages`` through the tokenizer's chat template, as ``mha chat``), ``GET /v1/models``,
``GET /health``. ``stream: true`` answers
Server-Sent Events, one chunk per generated token as the engine produces it, then
``data: [DONE]``.

Threads: :class:`Engine` owns the scheduler, and only its thread calls it: it takes requests
and cancellations from an inbox, runs :meth:`Scheduler.step` while work exists and hands each
request's tokens to that request's own queue (:class:`Ticket`). Each HTTP connection has a
thread (``ThreadingHTTPServer``) that validates the body, tokenizes, submits and waits on its
ticket. A request that arrives while others run joins the running batch at the next step.

Sampling (:mod:`mha.sampling`): ``temperature`` (default 0: greedy, unlike OpenAI's 1),
``top_p``, ``seed`` (without one, a random seed per request), and the extensions ``top_k`` and
``min_p``; the same seed and fields give the same tokens, whatever else the server runs. A
filter (``top_p`` < 1, ``top_k``, ``min_p``) without ``temperature`` is refused: it would do
nothing at this server's default, greedy (OpenAI's default temperature is 1).

Refused with 400 and an OpenAI-style error naming the field (``{"error": {"message", "type",
"param"}}``): a body that is not a JSON object, a missing or mistyped field, a sampling field
out of its range (``temperature`` < 0, ``top_p`` outside (0, 1], ...), what the server does not
do (``n`` or ``best_of`` other than 1, ``logprobs``, penalties, ``logit_bias``, ``echo``,
``suffix``) and a
request the page pool can never hold or past the model's context (refused when added, never
queued for ever). Fields the server does not know are ignored (clients send many). An error
inside a forward answers 500 to the requests of that step; the engine serves the others. An
error elsewhere in the engine answers 500 to every open request; if the scheduler then cannot
drop them, the engine stops and later requests are answered 503. A client that disconnects before its answer cancels its request, so its pages return to the pool.

Every answer is JSON, the standard library's own errors too (a malformed request line or
header, an unknown method): 404 for an unknown path, 405 for a known one with another method
(query strings are ignored). A request's line, headers and body must come within
``request_timeout`` (a client that sends nothing, trickles bytes, or less body than its
Content-Length is dropped: 408 once the body began). After
:meth:`Engine.stop`, every open request and every later one gets a 503.
"""

from __future__ import annotations

import collections
import contextlib
import http.server
import json
import math
import queue
import re
import select
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mha.llm.serving import Scheduler
from mha.llm.step_runners import runner_for
from mha.sampling import GREEDY as GREEDY_SAMPLING
from mha.sampling import SamplingParams, filter_without_temperature

MAX_BODY = 1 << 20  #: bytes of a request body at most (413 past it)
#: The method each endpoint takes (another method there: 405; another path: 404).
ROUTES = {"/health": "GET", "/v1/models": "GET", "/v1/completions": "POST",
          "/v1/chat/completions": "POST"}

#: Fields the server refuses unless they hold one of these values (one choice, no logprobs).
GREEDY = {"n": (None, 1), "best_of": (None, 1),
          "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
          "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "suffix": (None, ""),
          "logit_bias": (None, {})}


class BadRequest(Exception):
    """A client's mistake: answered with ``status`` and the message, naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


# ----------------------------------------------------------------------------- engine
@dataclass
class Ticket:
    """One request's side of the engine: what it asked for, and the queue of its events:
    ``("token", id)`` per generated token, then ``("end", finish_reason)``, or
    ``("error", status, message)`` (refused when added, or its step failed)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY_SAMPLING
    events: queue.Queue = field(default_factory=queue.Queue)
    rid: int | None = None  #: set by the engine thread when the scheduler takes it


class Engine:
    """The thread that owns ``scheduler``: every scheduler call happens on it.

    :meth:`submit` and :meth:`cancel` may be called from any thread; :attr:`stats` is a
    snapshot (a new dict after each step) that any thread may read."""

    def __init__(self, scheduler: Scheduler, *, threads: int | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.scheduler = scheduler
        self.threads = threads
        self._log = log or (lambda line: None)
        self._inbox: queue.Queue = queue.Queue()
        self._tickets: dict[int, Ticket] = {}
        self._stop = threading.Event()
        self._closed = False  #: set once the engine takes no more requests (under _lock)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="mha-serve-engine", daemon=True)
        self.stats = self._snapshot()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step; requests still open or submitted later get a 503
        error event."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # (never started: nothing else closes the inbox)
            self._close()

    def submit(self, prompt: list[int], max_tokens: int,
               sampling: SamplingParams = GREEDY_SAMPLING) -> Ticket:
        ticket = Ticket(prompt, max_tokens, sampling)
        with self._lock:
            if self._closed:
                ticket.events.put(("error", 503, "the server is shutting down"))
            else:
                self._inbox.put(("add", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        self._inbox.put(("cancel", ticket))

    # -- engine thread only
    def _loop(self) -> None:
        if self.threads is not None:  # torch's thread count is set per calling thread
            import torch

            torch.set_num_threads(self.threads)
        s = self.scheduler
        while not self._stop.is_set():
            try:
                self._drain(wait=not (s.waiting or s.running))
                if self._stop.is_set():
                    break
                self._step()
            except Exception as e:  # noqa: BLE001 - a bug here must not stop the engine
                self._log(f"engine error: {type(e).__name__}: {e}")
                if not self._fail_all(f"internal error in the engine ({type(e).__name__})"):
                    # the scheduler cannot drop its requests: stop serving (503s) rather than
                    # step them with no one to answer
                    self._log("engine stopped: the scheduler could not drop its requests")
                    break
        self._close()

    def _close(self) -> None:
        """Take no more requests; every open or submitted one gets a 503."""
        with self._lock:
            self._closed = True
        for ticket in self._tickets.values():
            ticket.events.put(("error", 503, "the server is shutting down"))
        self._tickets.clear()
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg is not None and msg[0] == "add":
                msg[1].events.put(("error", 503, "the server is shutting down"))

    def _fail_all(self, message: str) -> bool:
        """Every open request ends with a 500 and leaves the scheduler (its pages freed).
        False when the scheduler raised dropping one (each request is answered all the same)."""
        s = self.scheduler
        dropped = True
        for rid, ticket in list(self._tickets.items()):
            try:
                with contextlib.suppress(ValueError):
                    s.cancel(rid)
                    s.take(rid)
            except Exception as e:  # noqa: BLE001 - the answer below must still be sent
                self._log(f"engine error dropping request {rid}: {type(e).__name__}: {e}")
                dropped = False
            ticket.events.put(("error", 500, message))
        self._tickets.clear()
        return dropped

    def _drain(self, wait: bool) -> None:
        """Take every request and cancellation in the inbox (``wait``: for one first, up to a
        second, when there is no work)."""
        try:
            msg = self._inbox.get(timeout=1.0) if wait else self._inbox.get_nowait()
            while True:
                self._handle(msg)
                msg = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, msg) -> None:
        if msg is None:
            return
        kind, ticket = msg
        s = self.scheduler
        if kind == "add":
            try:
                ticket.rid = s.add(ticket.prompt, ticket.max_tokens, ticket.sampling)
            except (TypeError, ValueError) as e:
                text = str(e).replace("max_new_tokens", "max_tokens")
                ticket.events.put(("error", 400, text))
                return
            except Exception as e:  # noqa: BLE001 - a bug refuses this request, not the others
                self._log(f"error adding a request: {type(e).__name__}: {e}")
                ticket.events.put(("error", 500, f"internal error ({type(e).__name__})"))
                return
            self._tickets[ticket.rid] = ticket
        elif kind == "cancel" and ticket.rid in self._tickets:
            s.cancel(ticket.rid)
            s.take(ticket.rid)
            del self._tickets[ticket.rid]

    def _step(self) -> None:
        s = self.scheduler
        if not (s.waiting or s.running):
            self.stats = self._snapshot()
            return
        try:
            new = s.step()
        except Exception as e:  # noqa: BLE001 - the step's requests fail; the others go on
            if not s.interrupted:  # not in the forward: no request to blame (see _loop)
                raise
            self._log(f"error in a forward: {type(e).__name__}: {e}")
            for rid in s.interrupted:
                s.cancel(rid)
                s.take(rid)
                self._tickets.pop(rid).events.put(("error", 500, "the model failed on this "
                                                   f"request's step ({type(e).__name__})"))
            self.stats = self._snapshot()
            return
        for rid, tok in new.items():
            self._tickets[rid].events.put(("token", tok))
        for rid in list(s.finished):
            req = s.take(rid)
            eos = bool(req.output) and req.output[-1] in s.eos_token_ids
            self._tickets.pop(rid).events.put(("end", "stop" if eos else "length"))
        self.stats = self._snapshot()

    def _snapshot(self) -> dict:
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting),
                "free_pages": s.cache.free_pages, "num_pages": s.cache.num_pages,
                "page_size": s.cache.page_size, "forwards": s.forwards,
                "preemptions": s.preemptions}


# ----------------------------------------------------------------------------- text
class TextStream:
    """Generated tokens -> text pieces: the text decoded so far, less what is held back (an
    incomplete UTF-8 character, or an end that may begin a stop string); ``stopped`` once a
    stop string appears (the text ends before it).

    Decoding is incremental, not all tokens per token (quadratic in the answer's length):
    each :meth:`feed` decodes the tokens since the last complete piece together with the ones
    of that piece (the tokenizer's context: a leading space, a merged byte sequence), and
    appends what the newer tokens added once it ends in a complete character. ``decode`` must
    therefore decode any run of tokens as a tokenizer does (``tokenizer.decode``)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self._decode, self._stop = decode, stop
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False
        self._text = ""  #: the complete text decoded so far
        self._prefix = self._read = 0  #: tokens[_prefix:_read]: the last piece's tokens

    def _window(self) -> tuple[str, str]:
        """(the last piece's text, the text of the last piece and every later token), both
        decoded from ``tokens[_prefix:]``'s start."""
        return (self._decode(self.tokens[self._prefix:self._read]),
                self._decode(self.tokens[self._prefix:]))

    def _decoded(self) -> str:
        """The text so far, complete characters only."""
        before, now = self._window()
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._text += now[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        return self._text

    def feed(self, token: int) -> str:
        """The new text that is safe to send after ``token``."""
        self.tokens.append(token)
        text = self._decoded()
        for s in self._stop:
            at = text.find(s, max(0, len(self.sent) - len(s) + 1))
            if at >= 0:
                text, self.stopped = text[:at], True
        if not self.stopped:
            text = text.rstrip("\ufffd")
            # (k <= len(text): a long stop string costs no more than the text)
            hold = max((k for s in self._stop for k in range(1, min(len(s), len(text) + 1))
                        if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        return self._advance(text)

    def finish(self) -> str:
        """What was held back, at the end (no stop string followed)."""
        if self.stopped:
            return ""
        before, now = self._window()
        return self._advance(self._text + now[len(before):])

    def _advance(self, text: str) -> str:
        piece = text[len(self.sent):] if text.startswith(self.sent) else ""
        if len(text) > len(self.sent):
            self.sent = text
        return piece


# ----------------------------------------------------------------------------- requests
def _field(body: dict, name: str, kind, default, what: str):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise BadRequest(f"{name} must be {what}, got {json.dumps(value)[:80]}", name)
    return value


def _greedy(value, allowed) -> bool:
    """``value`` is one of ``allowed`` (None and bools by identity: JSON's false is no 0)."""
    return any(value is a if a is None or isinstance(a, bool)
               else not isinstance(value, bool) and value == a for a in allowed)


def _check_greedy(body: dict) -> None:
    for name, allowed in GREEDY.items():
        if name in body and not _greedy(body[name], allowed):
            raise BadRequest(f"{name}={json.dumps(body[name])[:80]} is not supported: this "
                             "server answers one choice, without logprobs or penalties; "
                             f"leave {name} out", name)


#: The request's sampling fields and SamplingParams' names for them (top_k, min_p: extensions).
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "min_p": "min_p", "seed": "seed"}


def _sampling(body: dict) -> SamplingParams:
    """The request's :class:`SamplingParams` (a JSON null is the default); a field of the wrong
    type or out of range is a 400 naming it."""
    given = {name: body[name] for name in SAMPLING if body.get(name) is not None}
    for name, value in given.items():  # one field at a time, so the error names it
        try:
            SamplingParams(**{SAMPLING[name]: value})
        except (TypeError, ValueError) as e:
            raise BadRequest(str(e), name) from None
    params = SamplingParams(**{SAMPLING[n]: v for n, v in given.items()})
    # (OpenAI's default temperature is 1, this server's 0: a filter alone would do nothing)
    refused = filter_without_temperature(params, temperature_given="temperature" in given,
                                         names={field: name for name, field in SAMPLING.items()})
    if refused:
        raise BadRequest(refused[1], refused[0])
    return params


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or not 1 <= len(stop) <= 4
            or not all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop must be a non-empty string or a list of 1 to 4 of them", "stop")
    return stop


@dataclass
class Job:
    """A checked request: its prompt's token ids and how to answer it."""

    chat: bool
    prompt: list[int]
    max_tokens: int
    stream: bool
    stop: list[str]
    include_usage: bool
    sampling: SamplingParams = GREEDY_SAMPLING


class Server(http.server.ThreadingHTTPServer):
    """``ThreadingHTTPServer`` serving ``engine`` (see the module docstring).

    Args:
        address: ``(host, port)``; port 0 picks a free one (:attr:`url` tells which).
        engine: the :class:`Engine`, started by :meth:`start`.
        tokenizer: a transformers tokenizer (text prompts, chat template, the answers' text);
            None serves token-id prompts only (answers have empty text).
        model_name: what ``/v1/models`` lists and answers carry.
        log: where one line per request and per error goes (None: nowhere).
        debug: also log the traceback of a 500.
        request_timeout: seconds a socket read or write may wait (a client that sends
            nothing, or less body than its Content-Length, is dropped after it: 408 when a
            body was announced).
        max_connections: connections served at once, one thread each; a connection beyond
            them is answered 503 at once and closed, without a thread (silent clients would
            otherwise each hold a thread up to ``request_timeout``).
    """

    allow_reuse_address = True
    request_queue_size = 128  #: connections the kernel holds before accept (the base: 5)

    def __init__(self, address, engine: Engine, *, tokenizer=None, model_name: str = "mha",
                 log: Callable[[str], None] | None = None, debug: bool = False,
                 request_timeout: float = 30.0, max_connections: int = 256) -> None:
        self.request_timeout = _check_timeout(request_timeout)
        self.max_connections = _check_connections(max_connections)
        self._connections = 0  #: connections with a thread now
        #: the connections' threads (ended ones dropped as new ones come); joined by close
        self._connection_threads: list[threading.Thread] = []
        self._connections_lock = threading.Lock()
        self._refused: collections.deque = collections.deque()  #: (close at, socket) past the cap
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.log, self.debug = log, debug
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not for concurrent use
        #: handlers reading a request -> the time its bytes must have come by
        self._reading: dict[Handler, float] = {}
        self._reading_lock = threading.Lock()
        self._closing = threading.Event()
        self._serving = False  #: serve_forever began, or start() will begin it
        self._http: threading.Thread | None = None  #: start()'s serve_forever thread
        #: drops requests past their deadline; joined by server_close()
        self._reaper: threading.Thread | None = None
        super().__init__(address, Handler)  # (a failed bind calls server_close)
        self._reaper = threading.Thread(target=self._reap, name="mha-serve-deadlines",
                                        daemon=True)
        self._reaper.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> threading.Thread:
        """Start the engine and serve in a background thread (returned)."""
        self.engine.start()
        self._serving = True
        self._http = threading.Thread(target=self.serve_forever, name="mha-serve-http",
                                      daemon=True)
        self._http.start()
        return self._http

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._serving = True
        super().serve_forever(poll_interval)

    def close(self) -> None:
        """Stop serving, stop the engine, close the socket (also for a server never started:
        socketserver's shutdown() would wait for a serve_forever that never runs). The
        server's threads have ended when it returns (see :meth:`server_close`), the engine's
        unless its step outlasts the 30 s it is given."""
        if self._serving:
            self.shutdown()
        if self._http is not None and self._http is not threading.current_thread():
            self._http.join()  # (shutdown() returns before the thread lets go of the server)
        self.engine.stop(timeout=30)
        self.server_close()

    def server_close(self) -> None:
        """Close the listening socket, end the deadline thread and the connections' threads,
        waiting for them (connections waiting for a request are shut for reading, so kept-alive
        idle ones end at once; one still answering ends when its answer is written or its
        socket times out, waited for up to ``request_timeout``). Stop the engine first
        (:meth:`close` does): its open requests then get their 503.

        A server thread must not outlive this: the thread holds the server (its target is a
        bound method, a handler holds ``server``), hence the engine and the model's tensors,
        until it ends. Left running, it can drop the last reference while the interpreter
        finalizes; freeing a tensor there releases and re-takes the GIL inside torch's C++
        destructors, where CPython ends the thread (pthread_exit), and the unwind through a
        noexcept frame aborts the process ("terminate called without an active exception",
        exit 134)."""
        with self._reading_lock:  # (a handler that starts reading later is shut at once)
            self._closing.set()
            for h in self._reading:
                with contextlib.suppress(OSError):
                    h.connection.shutdown(socket.SHUT_RD)
        super().server_close()
        if self._reaper is not None:  # (None: the bind failed)
            self._reaper.join()
        with self._connections_lock:
            threads = list(self._connection_threads)
        end = time.monotonic() + self.request_timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))

    def process_request(self, request, client_address) -> None:
        """A thread for the connection, or, with ``max_connections`` served already, a 503
        written on the socket (small: the kernel's buffer takes it) and the socket closed."""
        with self._connections_lock:
            full = self._connections >= self.max_connections
            self._connections += not full
        if not full:
            # (daemon: a server never closed does not hold the interpreter's exit)
            t = threading.Thread(target=self.process_request_thread,
                                 args=(request, client_address), name="mha-serve-connection",
                                 daemon=True)
            with self._connections_lock:  # (started here: server_close joins started ones)
                self._connection_threads = [*filter(threading.Thread.is_alive,
                                                    self._connection_threads), t]
                t.start()
            return
        try:
            request.settimeout(1.0)
            request.sendall(FULL)
            request.shutdown(socket.SHUT_WR)
        except OSError:
            request.close()
            return
        # closed by _reap a second later: closing now, with the client's request unread,
        # would reset the connection and could discard the 503 before the client reads it
        with self._reading_lock:
            self._refused.append((time.monotonic() + 1.0, request))
            while len(self._refused) > REFUSED_HELD:
                self._refused.popleft()[1].close()

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._connections_lock:
                self._connections -= 1

    def reading(self, handler: Handler, started: bool) -> None:
        """``handler`` starts (``request_timeout`` from now) or ends reading a request."""
        with self._reading_lock:
            if started and self._closing.is_set():  # (server_close shut the others)
                with contextlib.suppress(OSError):
                    handler.connection.shutdown(socket.SHUT_RD)
            elif started:
                self._reading[handler] = time.monotonic() + self.request_timeout
            else:
                self._reading.pop(handler, None)

    def _reap(self) -> None:
        """Shut the reading side of connections whose request did not come whole by its
        deadline (a client trickling bytes resets a socket timeout at each one): the blocked
        read returns, and the handler can still answer."""
        while not self._closing.wait(min(0.1, self.request_timeout / 4)):
            now = time.monotonic()
            with self._reading_lock:  # (a handler that ends reading meanwhile is not late)
                for h in [h for h, end in self._reading.items() if end <= now]:
                    del self._reading[h]
                    h.late = True
                    with contextlib.suppress(OSError):
                        h.connection.shutdown(socket.SHUT_RD)
                while self._refused and self._refused[0][0] <= now:
                    self._refused.popleft()[1].close()
        with self._reading_lock:
            while self._refused:
                self._refused.popleft()[1].close()

    def handle_error(self, request, client_address) -> None:
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            return  # the client left
        self.write_log(f"error serving {client_address[0]}: {type(e).__name__}: {e}")
        if self.debug:
            self.write_log(traceback.format_exc())

    def write_log(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    # -- text
    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        from mha.llm.generation import chat_ids

        with self.tokenizer_lock:
            return chat_ids(self.tokenizer, messages)[0].tolist()  # (1, P) -> (P,)

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        with self.tokenizer_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)


def _check_connections(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_connections must be a positive int, got {value!r}")
    return value


def _full_response() -> bytes:
    body = json.dumps({"error": {"message": "too many connections: the server serves "
                                 "max_connections at once; retry later",
                                 "type": "server_error", "param": None,
                                 "code": None}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
            % len(body)) + body


FULL = _full_response()  #: the answer to a connection beyond max_connections
REFUSED_HELD = 1024  #: refused sockets held open (for their 503 to be read) at most


def _check_timeout(value) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)):
        raise ValueError(f"request_timeout must be a positive number of seconds, got {value!r}")
    return float(value)


class Handler(http.server.BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"
    server_version = "mha-serve"

    late = False  #: the request did not come whole within request_timeout

    def setup(self) -> None:
        self.timeout = self.server.request_timeout  # (the base applies it to the socket)
        super().setup()

    def handle_one_request(self) -> None:
        """One request, whose line, headers and body must come within ``request_timeout``
        (waiting for it on a kept-alive connection included)."""
        self.server.reading(self, True)
        try:
            super().handle_one_request()
        finally:
            self.server.reading(self, False)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """The base's errors (a malformed request line or header, an unknown method) as JSON
        rather than HTML; the connection closes after them."""
        self.close_connection = True
        if self.request_version in ("", "HTTP/0.9"):  # unparsed: answer with a status line
            self.request_version = "HTTP/1.0"
        text = message or self.responses.get(code, ("error",))[0]
        try:
            self._send_error(code, text)
        except OSError:
            pass

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        self.server.write_log(f"{self.address_string()} {format % args}")

    # -- answers
    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str, param: str | None = None,
                    headers: dict | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send_json(status, {"error": {"message": message, "type": kind, "param": param,
                                           "code": None}}, headers)

    def _event(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    # -- routes
    def _route(self) -> str | None:
        """The endpoint of this request (its path without a query string), or None once a
        404 / 405 is sent (the connection then closes: a body may be unread)."""
        path = urlsplit(self.path).path
        if self.late:  # the headers were cut at the deadline (they seemed to end there)
            self.close_connection = True
            self._send_error(408, "the request did not come whole within "
                             f"{self.server.request_timeout:g} s")
            return None
        if ROUTES.get(path) == self.command:
            return path
        self.close_connection = True
        if path not in ROUTES:
            self._send_error(404, f"no such endpoint: {self.command} {self.path}")
        else:
            self._send_error(405, f"{self.command} is not allowed on {self.path} (it takes "
                             f"{ROUTES[path]})", headers={"Allow": ROUTES[path]})
        return None

    def do_PUT(self) -> None:  # noqa: N802 - the base's name
        self._route()

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT  # noqa: N815 - the base's names

    def do_GET(self) -> None:  # noqa: N802 - the base's name
        path = self._route()
        if path is None:
            return
        if self.headers.get("Content-Length", "0").strip() not in ("", "0"):
            self._skip_body()
        if path == "/health":
            self._send_json(200, {"status": "ok", **self.server.engine.stats})
        else:
            self._send_json(200, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "created": 0,
                 "owned_by": "mha"}]})

    def _skip_body(self) -> None:
        """Read and drop a body a GET carried, so it is never taken for the next request
        (one that cannot be read whole: the connection closes after the answer)."""
        try:
            n = self._length()
            if len(self.rfile.read(n)) == n:
                return
        except (BadRequest, OSError):
            pass
        finally:
            self.server.reading(self, False)
        self.close_connection = True

    def do_POST(self) -> None:  # noqa: N802 - the base's name
        path = self._route()
        if path is None:
            return
        try:
            job = self._job(self._body(), chat=path == "/v1/chat/completions")
        except BadRequest as e:
            self.close_connection = True  # the body may be unread
            self._send_error(e.status, str(e), e.param)
            return
        try:
            self._answer(job)
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug answers 500; the server goes on
            self.close_connection = True
            self.server.write_log(f"500 {self.path}: {type(e).__name__}: {e}")
            if self.server.debug:
                self.server.write_log(traceback.format_exc())
            try:
                self._send_error(500, f"internal error ({type(e).__name__})")
            except OSError:
                pass

    def _length(self) -> int:
        length = self.headers.get("Content-Length")
        if length is not None and self.headers.get("Transfer-Encoding") is not None:
            raise BadRequest("a body with both Content-Length and Transfer-Encoding is "
                             "ambiguous: send it with a Content-Length only")
        if length is None or not re.fullmatch(r"[0-9]+", length.strip()):
            raise BadRequest("the body needs a Content-Length header (a byte count), got "
                             f"{length!r}", status=411 if length is None else 400)
        n = int(length)
        if n > MAX_BODY:
            raise BadRequest(f"the body is {n} bytes, more than {MAX_BODY}", status=413)
        return n

    def _body(self) -> dict:
        n = self._length()
        try:
            raw = self.rfile.read(n)
        except TimeoutError:
            raw = None
        finally:  # the answer may take long: no deadline on it
            self.server.reading(self, False)
        if raw is None or self.late:
            raise BadRequest(f"the body was not received: Content-Length said {n} bytes and "
                             f"they did not come within {self.server.request_timeout:g} s",
                             status=408)
        if len(raw) < n:
            raise BadRequest(f"the body ended after {len(raw)} of its {n} bytes")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"the body must be a JSON object: {e}") from None
        except (RecursionError, ValueError) as e:  # nested too deep; an int of many digits
            raise BadRequest(f"the body must be a JSON object that Python's json reads: "
                             f"{type(e).__name__}: {str(e)[:120]}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"the body must be a JSON object, got a {type(body).__name__}")
        return body

    def _job(self, body: dict, *, chat: bool) -> Job:
        from mha.checks import check_text

        _check_greedy(body)
        sampling = _sampling(body)
        name = "max_completion_tokens" if chat and "max_completion_tokens" in body else \
            "max_tokens"
        max_tokens = _field(body, name, int, 256 if chat else 16, "a positive int")
        if max_tokens < 1:
            raise BadRequest(f"{name} must be a positive int, got {max_tokens}", name)
        stream = _field(body, "stream", bool, False, "true or false")
        options = _field(body, "stream_options", dict, {}, "an object")
        usage = _field(options, "include_usage", bool, False, "true or false")
        tok = self.server.tokenizer
        try:
            if chat:
                if tok is None:
                    raise BadRequest("this server has no tokenizer: use /v1/completions with "
                                     "token ids", "messages")
                prompt = self.server.encode_chat(_messages(body))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    if tok is None:
                        raise BadRequest("this server has no tokenizer: prompt must be token "
                                         "ids", "prompt")
                    prompt = self.server.encode(check_text("prompt", prompt))
                elif not (isinstance(prompt, list) and prompt and all(
                        isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
                    raise BadRequest("prompt must be a string or a non-empty list of token "
                                     f"ids, got {json.dumps(prompt)[:80]}", "prompt")
        except (TypeError, ValueError) as e:  # check_text, the chat template
            raise BadRequest(str(e), "messages" if chat else "prompt") from None
        if not prompt:
            raise BadRequest("the prompt has no tokens", "messages" if chat else "prompt")
        context = self.server.engine.scheduler.cache.max_len
        if len(prompt) >= context:  # refused whatever max_tokens is: the prompt's fault
            raise BadRequest(f"the prompt has {len(prompt)} tokens: the model's context of "
                             f"{context} leaves no room for a new token",
                             "messages" if chat else "prompt")
        return Job(chat, prompt, max_tokens, stream, _stop_strings(body), usage, sampling)

    def _answer(self, job: Job) -> None:
        engine = self.server.engine
        ticket = engine.submit(job.prompt, job.max_tokens, job.sampling)
        self._looked = time.monotonic()
        try:
            self._reply(job, ticket)
        finally:  # the answer is complete, or the client left, or writing to it failed
            engine.cancel(ticket)  # (a no-op for a request that finished)

    def _reply(self, job: Job, ticket: Ticket) -> None:
        text = TextStream(self.server.decode, job.stop)
        cid = None
        started = False
        while True:
            event = self._next(ticket)
            if event is None:  # the client left
                return
            if event[0] == "error":
                if started:  # the stream is open: say it there, then end it
                    self._event({"error": {"message": event[2], "type": "server_error"}})
                    self._event("[DONE]")
                    return
                param = (None if event[1] != 400 else "max_tokens" if "max_tokens" in event[2]
                         else "messages" if job.chat else "prompt")
                self._send_error(event[1], event[2], param)
                return
            cid = cid or f"{'chatcmpl' if job.chat else 'cmpl'}-{ticket.rid}"
            if event[0] == "token":
                piece = text.feed(event[1])
                if text.stopped:  # (the request is cancelled when the answer is sent)
                    reason = "stop"
                elif job.stream:
                    if not started:
                        self._start_stream(job, cid)
                        started = True
                    self._event(self._chunk(job, cid, piece, None))
                    continue
                else:
                    continue
            else:
                reason = event[1]
                piece = text.finish()
            break
        usage = {"prompt_tokens": len(job.prompt), "completion_tokens": len(text.tokens),
                 "total_tokens": len(job.prompt) + len(text.tokens)}
        if job.stream:
            if not started:
                self._start_stream(job, cid)
            if piece:
                self._event(self._chunk(job, cid, piece, None))
            self._event(self._chunk(job, cid, "", reason))
            if job.include_usage:
                self._event({**self._chunk(job, cid, "", None), "choices": [], "usage": usage})
            self._event("[DONE]")
            return
        choice = ({"index": 0, "message": {"role": "assistant", "content": text.sent},
                   "logprobs": None, "finish_reason": reason} if job.chat else
                  {"index": 0, "text": text.sent, "logprobs": None, "finish_reason": reason})
        self._send_json(200, {"id": cid, "object": "chat.completion" if job.chat
                              else "text_completion", "created": int(time.time()),
                              "model": self.server.model_name, "choices": [choice],
                              "usage": usage})

    def _next(self, ticket: Ticket):
        """The ticket's next event, or None once the client has closed its connection (looked
        at every 50 ms, also while tokens keep coming)."""
        while True:
            now = time.monotonic()
            if now - self._looked >= 0.05:
                self._looked = now
                if self._client_gone():
                    return None
            try:
                return ticket.events.get(timeout=0.05)
            except queue.Empty:
                pass

    def _client_gone(self) -> bool:
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _start_stream(self, job: Job, cid: str) -> None:
        self.close_connection = True  # the stream ends when the connection closes
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        if job.chat:
            self._event(self._chunk(job, cid, None, None))

    def _chunk(self, job: Job, cid: str, piece: str | None, reason: str | None) -> dict:
        if job.chat:  # piece None: the first chunk, naming the role
            delta = ({"role": "assistant", "content": ""} if piece is None
                     else {"content": piece} if piece or reason is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
        return {"id": cid, "object": "chat.completion.chunk" if job.chat
                else "text_completion", "created": int(time.time()),
                "model": self.server.model_name, "choices": [choice]}


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects, got "
                         f"{json.dumps(messages)[:80]}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object {{role, content}}", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be 'system', 'user' or 'assistant', "
                             f"got {json.dumps(role)[:40]}", "messages")
        if isinstance(content, list):  # OpenAI's content parts: text ones only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}].content parts must be text parts "
                                 "{type: 'text', text}", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string, got "
                             f"{json.dumps(content)[:40]}", "messages")
        out.append({"role": role, "content": content})
    return out


def make_server(loaded_model, tokenizer, *, host: str = "127.0.0.1", port: int = 0,
                num_pages: int = 256, page_size: int = 16, max_seqs: int = 16,
                prefill_chunk: int = 64, kv_dtype=None,
                eos_token_id: int | list[int] | None = None,
                threads: int | None = None, model_name: str = "mha",
                log: Callable[[str], None] | None = None, debug: bool = False,
                request_timeout: float = 30.0, max_connections: int = 256) -> Server:
    """A :class:`Server` on ``(host, port)`` over a new :class:`Scheduler` of ``loaded_model``
    (a transformers causal LM or an :class:`mha.models.Llama`; its context is each request's
    limit). ``eos_token_id``: a request stops at this id or at any of a list of them (None:
    at ``max_tokens`` only), as :class:`Scheduler` takes it. Call ``.start()``."""
    _check_timeout(request_timeout)  # (before the scheduler's pages are allocated)
    _check_connections(max_connections)
    context = runner_for(loaded_model, "loaded_model").context  # refuses another kind
    if context is None:
        raise ValueError("loaded_model must declare its context (config.max_position_embeddings"
                         "): it is each request's limit")
    scheduler = Scheduler(loaded_model, num_pages=num_pages, page_size=page_size,
                          max_seqs=max_seqs, max_len=context, prefill_chunk=prefill_chunk,
                          kv_dtype=kv_dtype, eos_token_id=eos_token_id)
    engine = Engine(scheduler, threads=threads, log=log)
    return Server((host, port), engine, tokenizer=tokenizer, model_name=model_name, log=log,
                  debug=debug, request_timeout=request_timeout,
                  max_connections=max_connections)


__all__ = ["Engine", "Server", "TextStream", "Ticket", "make_server"]
