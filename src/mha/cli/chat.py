"""``mha chat``: a conversation with SmolLM2-135M-Instruct through mha.

Reads one message per line from stdin (a terminal shows a ``>`` prompt; ``/exit`` or end of
input quits, ``/reset`` forgets the conversation), streams each reply through the chat
template as it is decoded, and prints a status line (tokens, prefill and decode tok/s) on
stderr. A message that no longer fits the context is refused with one line on stderr
(the conversation is kept). Options as ``mha generate`` (``--impl mha``: the model built
from mha's own modules, with the same refusals; ``--temperature`` > 0 samples, one seeded
generator through the whole conversation).
"""

from __future__ import annotations

import argparse
import sys

from mha.cli.generate import (
    add_llm_options,
    check_native,
    check_new_tokens,
    load_native_or_hint,
    load_or_hint,
    status,
    weights_of,
)
from mha.cli.options import UsageError, sampling_of


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with SmolLM2-135M through mha (streaming, tok/s)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llm_options(p, 256)
    p.add_argument("--system", default=None, help="a system message (default: the template's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mha.llm.generation import Chat, check_kv

    if sys.stdin is None or sys.stdin.closed:  # `mha chat <&-`: nothing to read, ever
        raise UsageError("stdin is closed: mha chat reads one message per line from it "
                         "(mha generate \"...\" answers a single prompt)")
    check_new_tokens(args)
    sampling = sampling_of(args)
    if args.impl == "mha":
        check_native(args)
        load_native_or_hint(args.dtype, weights_of(args))
    else:
        try:
            check_kv(args.kv, args.attn)
        except ValueError as e:
            raise UsageError(str(e).replace("kv=", "--kv ").replace("attn=", "--attn ")) from e
        load_or_hint(args.dtype, args.attn, weights_of(args))
    chat = Chat(dtype=args.dtype, attn=args.attn, kv=args.kv, weights=weights_of(args),
                max_new_tokens=args.max_new_tokens, system=args.system, impl=args.impl,
                sampling=sampling)
    tty = sys.stdin.isatty()

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    while True:
        if tty:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            chat.messages = chat.messages[:1] if args.system else []
            continue
        try:
            res = chat.say(line, on_text=show)
        except ValueError as e:  # the conversation no longer fits: refused, history kept
            print(f"{args.prog}: {e} (/reset starts a new conversation)", file=sys.stderr,
                  flush=True)
            continue
        print(flush=True)
        status(res)
