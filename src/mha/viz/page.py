"""One self-contained HTML page: hover or click a token to see where it attends.

Shape legend: L layers, h heads, T tokens; the page embeds ``maps.weights`` ``(L, h, T, T)``
as JSON (rows are queries) next to the seed-004 shape table recorded from the model's layer.
Everything is inline (data, style, script): the page works from a file with no network.
"""

from __future__ import annotations

import html
import json
import re
from importlib import resources
from pathlib import Path

import numpy as np

from mha.trace import Trace
from mha.viz.attention_maps import AttentionMaps

DECIMALS = 7  # weights are written rounded to this many decimals (float32 keeps ~7 digits)


def page_data(maps: AttentionMaps) -> dict:
    """What the page's script reads: tokens and the weights ``(L, h, T, T)`` as nested lists."""
    return {"tokens": list(maps.tokens),
            "weights": np.round(maps.weights.astype(np.float64), DECIMALS).tolist()}


def shape_table_html(trace: Trace, *, caption: str) -> str:
    """The recorded steps as an HTML table (step, formula, seeds' letters, recorded shape)."""
    rows = []
    for i, s in enumerate(trace, 1):
        cells = (str(i), s.step, s.formula, s.legend, str(list(s.shape)))
        rows.append("<tr>" + "".join(
            f'<td class="shape">{html.escape(c)}</td>' if k >= 3 else f"<td>{html.escape(c)}</td>"
            for k, c in enumerate(cells)) + "</tr>")
    head = "".join(f"<th>{c}</th>" for c in ("#", "step", "formula", "shape (seeds' letters)",
                                              "recorded shape"))
    return (f'<table id="shape-table"><caption>{html.escape(caption)}</caption>\n'
            f"<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody></table>")


def _script_json(obj) -> str:
    """JSON safe inside a <script> element (no '</script>' or '<!--' can appear)."""
    return json.dumps(obj, separators=(",", ":")).replace("<", "\\u003c")


def render(maps: AttentionMaps, trace: Trace, *, trace_layer: int = 0,
           trace_max_diff: float | None = None) -> str:
    """The page as a string. ``trace`` is the shape table's run (see
    :func:`mha.viz.attention_maps.layer_trace`); ``trace_max_diff`` is the largest difference
    between that run's weights and the model's own for that layer, shown under the table."""
    L, h, T, _ = maps.weights.shape
    through = ("mha" if maps.attn_implementation == "mha"
               else f"attn_implementation={maps.attn_implementation!r} (not mha)")
    title = f"Attention in {maps.model}, run through {through}"
    meta = (f"Text: <q>{html.escape(maps.text)}</q> &mdash; {T} tokens, {L} layers &times; "
            f"{h} heads, d_model {maps.d_model}, d_k {maps.d_model // h}. "
            f"attn_implementation=<code>{html.escape(maps.attn_implementation)}</code>"
            + (f", mha backend <code>{html.escape(maps.mha_backend)}</code>"
               if maps.mha_backend else "")
            + ".")
    caption = (f"Seed 004's flow, shapes recorded by mha.trace from layer {trace_layer} of the "
               f"model (its weights loaded into mha.MultiHeadAttention) on this text's hidden "
               f"states; B=1, T={T}. Attention backend: {trace.backend}.")
    table = shape_table_html(trace, caption=caption)
    if trace_max_diff is not None:
        table += (f'\n<p class="hint" id="trace-check">Attention weights of this run vs the '
                  f"model's layer {trace_layer}: max |difference| = {trace_max_diff:.2e}.</p>")
    parts = {"TITLE": html.escape(title), "META": meta, "SHAPE_TABLE": table,
             "DATA": _script_json(page_data(maps))}
    template = resources.files("mha.viz").joinpath("page_template.html").read_text("utf-8")
    # One pass, so a marker inside the user's text is never expanded.
    return re.sub(r"__MHA_(TITLE|META|SHAPE_TABLE|DATA)__", lambda m: parts[m.group(1)], template)


def write(path: str | Path, maps: AttentionMaps, trace: Trace, **kwargs) -> Path:
    """Write :func:`render`'s page to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(maps, trace, **kwargs), encoding="utf-8")
    return path
