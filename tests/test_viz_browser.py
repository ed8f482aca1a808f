"""The attention page in a real browser (headless Chromium driven by Playwright).

A token is clicked (and hovered), the highlighted weights are read back from the page and
compared with the weights ``mha.attention`` returned inside all-MiniLM-L6-v2; a screenshot is
taken. Skips only when Chromium or Playwright's Python package is not installed (``make
test`` installs both). Set MHA_VIZ_DOCS_IMG=DIR to also copy the screenshot there (the README
picture docs/img/viewer.png is made that way).

Shape legend: L layers, h heads, T tokens; weights (L, h, T, T), rows are queries.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

if not CHROMIUM.exists():
    pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian: apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="Playwright's Python package is not installed "
                                      "(pip install playwright; its browser download is not used)")

from mha.viz import attention_maps, page  # noqa: E402
from test_viz import TEXT, capture_mha_weights, stacked  # noqa: E402

ATOL = 1e-6  # the page keeps page.DECIMALS decimals


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    """``(path, maps, returned)``: the page of MiniLM on TEXT run through mha."""
    tok, model = attention_maps.load()
    with capture_mha_weights() as seen:
        maps = attention_maps.run(tok, model, TEXT)
    returned = stacked(seen)
    tr, w = attention_maps.layer_trace(maps, model, 0)
    path = page.write(tmp_path_factory.mktemp("page") / "attention.html", maps, tr,
                      trace_max_diff=float(np.abs(w - returned[0]).max()))
    return path, maps, returned


@pytest.fixture(scope="module")
def browser_page(page_file):
    """A Chromium tab showing the page, with every request and console error recorded."""
    path = page_file[0]
    requests, errors = [], []
    with sync_api.sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), args=ARGS, headless=True,
            viewport={"width": 1400, "height": 1000})
        tab = ctx.new_page()
        tab.set_default_timeout(30_000)
        tab.on("request", lambda r: requests.append(r.url))
        tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(path.as_uri())
        tab.wait_for_selector(".tok")
        yield tab, requests, errors
        ctx.close()


def read_tokens(tab) -> tuple[np.ndarray, list[list[float]], list[str]]:
    """Per token: the weight shown, the per-head weights and the background colour."""
    rows = tab.eval_on_selector_all(".tok", """els => els.map(e => [e.dataset.weight,
        e.dataset.weights, getComputedStyle(e).backgroundColor])""")
    shown = np.array([float(w) for w, _, _ in rows])
    heads = [[float(x) for x in ws.split(",")] for _, ws, _ in rows]
    return shown, heads, [c for _, _, c in rows]


def alpha(css: str) -> float:
    """The alpha of a computed 'rgba(r, g, b, a)' ('rgb(...)' is opaque)."""
    parts = css[css.index("(") + 1:-1].split(",")
    return float(parts[3]) if len(parts) == 4 else 1.0


@pytest.mark.parametrize("layer, head, query", [(0, 2, 3), (2, 11, 8), (5, 0, 12)])
def test_clicked_token_shows_the_weights_mha_returned(browser_page, page_file, layer, head, query):
    tab, _, errors = browser_page
    _, maps, returned = page_file
    tab.select_option("#layer", str(layer))
    tab.select_option("#head", str(head))
    tab.locator(".tok").nth(query).click()
    assert tab.evaluate("document.body.dataset.query") == str(query)
    want = returned[layer, head, query]  # (T,) where token `query` attends
    shown, heads, colours = read_tokens(tab)
    np.testing.assert_allclose(shown, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.array(heads)[:, 0], want, atol=ATOL, rtol=0)
    # colour strength is proportional to the weight (the largest weight is full colour);
    # Chromium keeps colour alpha in 8 bits and prints the shortest decimal that maps to them
    a = np.array([alpha(c) for c in colours])
    np.testing.assert_allclose(a, want / want.max(), atol=1.5 / 255, rtol=0)
    # the side list: every key, largest weight first, with its number
    items = tab.eval_on_selector_all("#wlist li", "els => els.map(e => [+e.dataset.index, "
                                     "+e.dataset.weight, e.textContent])")
    assert sorted(i for i, _, _ in items) == list(range(len(maps.tokens)))
    np.testing.assert_allclose([w for _, w, _ in items], np.sort(want)[::-1], atol=ATOL, rtol=0)
    assert [i for i, _, _ in items][0] == int(np.argmax(want))
    assert maps.tokens[items[0][0]] in items[0][2] and f"{items[0][1]:.4f}" in items[0][2]
    assert errors == []
    tab.locator(".tok").nth(query).click()  # unpin for the next test


def test_all_heads_overlaid(browser_page, page_file, tmp_path):
    tab, _, errors = browser_page
    _, maps, returned = page_file
    layer, query = 1, maps.tokens.index("it")
    tab.select_option("#layer", str(layer))
    tab.select_option("#head", "all")
    tab.locator(".tok").nth(query).click()
    shown, heads, _ = read_tokens(tab)
    want = returned[layer, :, query]  # (h, T)
    np.testing.assert_allclose(np.array(heads).T, want, atol=ATOL, rtol=0)  # per head
    np.testing.assert_allclose(shown, want.mean(0), atol=ATOL, rtol=0)  # the overlay's mean
    h = returned.shape[1]
    assert tab.locator(".tok").nth(query).locator(".bars i").count() == h
    status = tab.text_content("#status")
    assert f'Query "it" (token {query}), layer {layer}, the mean of all {h} heads' in status
    shot = tmp_path / "viewer.png"
    tab.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("MHA_VIZ_DOCS_IMG"):
        shutil.copy(shot, Path(os.environ["MHA_VIZ_DOCS_IMG"]) / "viewer.png")
    assert errors == []
    tab.locator(".tok").nth(query).click()


def test_hover_previews_and_a_pin_holds(browser_page, page_file):
    tab, _, _ = browser_page
    _, _, returned = page_file
    tab.select_option("#layer", "3")
    tab.select_option("#head", "4")
    tab.locator(".tok").nth(5).hover()
    assert tab.evaluate("document.body.dataset.query") == "5"
    np.testing.assert_allclose(read_tokens(tab)[0], returned[3, 4, 5], atol=ATOL, rtol=0)
    tab.locator(".tok").nth(2).click()  # pin token 2; hovering elsewhere keeps it
    tab.locator(".tok").nth(7).hover()
    assert tab.evaluate("document.body.dataset.query") == "2"
    tab.keyboard.press("ArrowRight")  # the pin moves to token 3
    assert tab.evaluate("document.body.dataset.query") == "3"
    np.testing.assert_allclose(read_tokens(tab)[0], returned[3, 4, 3], atol=ATOL, rtol=0)
    tab.locator(".tok").nth(3).click()  # unpinned: the keyboard alone can pick a query too
    tab.locator(".tok").nth(9).focus()
    tab.keyboard.press("Enter")
    assert tab.evaluate("document.body.dataset.query") == "9"
    np.testing.assert_allclose(read_tokens(tab)[0], returned[3, 4, 9], atol=ATOL, rtol=0)
    tab.keyboard.press("Enter")


def test_page_shows_the_recorded_shape_table_and_loads_nothing(browser_page, page_file):
    tab, requests, errors = browser_page
    _, maps, _ = page_file
    T = len(maps.tokens)
    cells = tab.eval_on_selector_all("#shape-table tbody tr",
                                     "rows => rows.map(r => r.cells[4].textContent)")
    assert len(cells) == 11
    assert cells[0] == f"[1, {T}, 384]" and cells[7] == f"[1, 12, {T}, {T}]"
    assert all(u.startswith("file://") for u in requests), requests  # no network at all
    assert errors == []
