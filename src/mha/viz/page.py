"""One self-contained HTML page: hover or click a token to see where it attends.

Shape legend: L layers, h heads, T tokens; the page embeds ``maps.weights`` ``(L, h, T, T)``
as JSON (rows are queries) next to the seed-004 shape table recorded from the model's layer.
Everything is inline (data, style, script): the page works from a file with no network.
"""

from __future__ import annotations

import base64
import html
import json
import re
from importlib import resources
from pathlib import Path

import numpy as np

from mha.trace import Trace
from mha.viz.attention_maps import AttentionMaps

DECIMALS = 7  # weights are written rounded to this many decimals (float32 keeps ~7 digits)


PACK_ABOVE = 1_000_000  # weights (L*h*T*T values) beyond this are packed, not JSON lists


def page_data(maps: AttentionMaps) -> dict:
    """What the page's script reads: the tokens and the weights ``(L, h, T, T)``.

    Up to :data:`PACK_ABOVE` values, ``"weights"`` are nested lists (``DECIMALS`` decimals).
    Larger maps (SmolLM2: 30 x 9 heads at 200 tokens are 10.8 M values, ~100 MB as JSON) are
    ``"packed"``: float16 little-endian, base64, with their ``"shape"``; when every weight
    above the diagonal is exactly 0 (a causal model) only the lower triangle of each map is
    stored (``"causal": true``, row ``i`` holding ``i + 1`` values), halving it again. float16
    keeps ~3 significant digits, enough for colours (the page says so)."""
    w = maps.weights
    L, h, T, _ = w.shape
    if w.size <= PACK_ABOVE:
        return {"tokens": list(maps.tokens),
                "weights": np.round(w.astype(np.float64), DECIMALS).tolist()}
    upper = np.triu(np.ones((T, T), dtype=bool), 1)  # (T, T): j > i
    causal = not bool(w[..., upper].any())
    vals = w[..., ~upper] if causal else w.reshape(L, h, T * T)  # (L, h, T(T+1)/2 or T*T)
    raw = vals.astype("<f2").tobytes()
    return {"tokens": list(maps.tokens), "shape": [L, h, T, T], "causal": causal,
            "packed": base64.b64encode(raw).decode("ascii")}


def unpack(data: dict) -> np.ndarray:
    """The weights ``(L, h, T, T)`` float32 of a :func:`page_data` dict (either encoding)."""
    if "weights" in data:
        return np.asarray(data["weights"], dtype=np.float32)
    L, h, T, _ = data["shape"]
    vals = np.frombuffer(base64.b64decode(data["packed"]), dtype="<f2").astype(np.float32)
    if not data["causal"]:
        return vals.reshape(L, h, T, T)
    out = np.zeros((L, h, T, T), dtype=np.float32)
    lower = ~np.triu(np.ones((T, T), dtype=bool), 1)  # (T, T): j <= i, row-major like packing
    out[..., lower] = vals.reshape(L, h, -1)
    return out


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


def render(maps: AttentionMaps, trace: Trace | None, *, trace_layer: int = 0,
           trace_max_diff: float | None = None, no_trace: str = "") -> str:
    """The page as a string. ``trace`` is the shape table's run (see
    :func:`mha.viz.attention_maps.layer_trace`), or None with ``no_trace`` saying why there is
    none; ``trace_max_diff`` is the largest difference between that run's weights and the
    model's own for that layer, shown under the table."""
    L, h, T, _ = maps.weights.shape
    through = ("mha" if maps.attn_implementation == "mha"
               else f"attn_implementation={maps.attn_implementation!r} (not mha)")
    title = f"Attention in {maps.model}, run through {through}"
    gqa = ("" if maps.kv_heads in (None, h) else
           f" sharing {maps.kv_heads} K/V heads (GQA: each K/V head serves {h // maps.kv_heads} "
           f"query heads)")
    meta = (f"Text: <q>{html.escape(maps.text)}</q> &mdash; {T} tokens, {L} layers &times; "
            f"{h} heads{gqa}, d_model {maps.d_model}, d_k {maps.d_model // h}. "
            f"attn_implementation=<code>{html.escape(maps.attn_implementation)}</code>"
            + (f", mha backend <code>{html.escape(maps.mha_backend)}</code>"
               if maps.mha_backend else "")
            + ".")
    if trace is None:
        table = f'<p class="hint" id="no-trace">{html.escape(no_trace)}</p>'
    else:
        caption = (f"Seed 004's flow, shapes recorded by mha.trace from layer {trace_layer} of "
                   f"the model (its weights loaded into mha.MultiHeadAttention) on this text's "
                   f"hidden states; B=1, T={T}. Attention backend: {trace.backend}.")
        table = shape_table_html(trace, caption=caption)
    if trace is not None and trace_max_diff is not None:
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
