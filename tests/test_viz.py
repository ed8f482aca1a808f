"""mha viz: the attention maps of all-MiniLM-L6-v2 run through mha, and what is drawn from them.

The real model runs with attn_implementation="mha"; a spy on the ``mha.attention`` call inside
the transformers integration keeps the weights mha returned, and every output (the arrays
handed to matplotlib, the page's data, the CLI's page) is compared with those.

Shape legend: L layers, h heads, T tokens; weights are (L, h, T, T), rows are queries.
"""

from __future__ import annotations

import contextlib
import json
import re

import numpy as np
import pytest
import torch

import mha
from mha.cli import main
from mha.viz import attention_maps, figures, page

TEXT = "The cat sat on the mat because it was tired."
DATA_RE = re.compile(r'<script type="application/json" id="mha-data">(.*?)</script>', re.S)


@contextlib.contextmanager
def capture_mha_weights():
    """Inside the block, keep the weights every ``mha.attention`` call of the transformers
    integration returns: a list of ``(B, h, Tq, Tk)`` tensors, one per attention layer run."""
    import mha.integrations.transformers as integration

    real = integration.attention
    seen: list[torch.Tensor] = []

    def spy(*args, **kwargs):
        res = real(*args, **kwargs)
        if kwargs.get("return_weights"):
            seen.append(res[1].detach().clone())
        return res

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(integration, "attention", spy)
        yield seen


def stacked(seen: list[torch.Tensor]) -> np.ndarray:
    """L x (1, h, T, T) -> (L, h, T, T)."""
    return torch.stack([w[0] for w in seen]).float().numpy()


def page_json(html_text: str) -> dict:
    return json.loads(DATA_RE.search(html_text).group(1))


@pytest.fixture(scope="module")
def mha_run():
    """``(maps, model, returned)``: MiniLM on TEXT through mha, and the weights mha returned."""
    tok, model = attention_maps.load()  # attn_implementation="mha"
    with capture_mha_weights() as seen:
        maps = attention_maps.run(tok, model, TEXT)
    return maps, model, stacked(seen)


# ----------------------------------------------------------------------------- the data
def test_maps_are_what_mha_returned(mha_run):
    maps, model, returned = mha_run
    L, h = model.config.num_hidden_layers, model.config.num_attention_heads
    T = len(maps.tokens)
    assert (L, h) == (6, 12) and maps.d_model == 384 and maps.model == "all-MiniLM-L6-v2"
    assert returned.shape == (L, h, T, T), "mha.attention must run once per layer, with weights"
    np.testing.assert_array_equal(maps.weights, returned)
    assert maps.attn_implementation == "mha"
    assert maps.mha_backend in mha.backends.ORDER
    assert maps.tokens[0] == "[CLS]" and maps.tokens[-1] == "[SEP]" and "cat" in maps.tokens
    np.testing.assert_allclose(maps.weights.sum(-1), 1.0, atol=1e-5)


def test_eager_comparison_is_labelled_and_agrees(mha_run):
    maps, model, returned = mha_run
    tok, eager = attention_maps.load(attn_implementation="eager")
    with capture_mha_weights() as seen:
        ref = attention_maps.run(tok, eager, TEXT)
    assert seen == [] and ref.mha_backend is None and ref.attn_implementation == "eager"
    np.testing.assert_allclose(ref.weights, returned, atol=1e-5, rtol=0)
    tr, _ = attention_maps.layer_trace(ref, eager, 0)
    assert "run through attn_implementation=&#x27;eager&#x27; (not mha)" in page.render(ref, tr)


def test_stats_on_known_patterns():
    T = 5
    uniform = np.full((1, 1, T, T), 1.0 / T)
    diagonal = np.eye(T)[None, None]
    first = np.zeros((1, 1, T, T))
    first[..., 0] = 1.0  # every query looks at token 0
    np.testing.assert_allclose(attention_maps.head_entropy(uniform), np.log2(T))
    np.testing.assert_allclose(attention_maps.head_entropy(diagonal), 0.0, atol=1e-12)
    np.testing.assert_allclose(attention_maps.mean_distance(diagonal), 0.0)
    np.testing.assert_allclose(attention_maps.mean_distance(first), np.arange(T).mean())
    # uniform: mean over i of the mean |i - j| over j
    want = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :]).mean()
    np.testing.assert_allclose(attention_maps.mean_distance(uniform), want)


def test_layer_trace_records_the_models_layer(mha_run):
    maps, model, returned = mha_run
    T = len(maps.tokens)
    tr, w = attention_maps.layer_trace(maps, model, 0)
    shapes = {s.step: s.shape for s in tr}
    assert shapes["input"] == (1, T, 384)
    assert shapes["split heads K"] == (1, 12, T, 32)
    assert shapes["attention weights"] == (1, 12, T, T)
    assert shapes["output"] == (1, T, 384)
    # the mha module holding layer 0's weights, fed layer 0's input, attends as the model did
    np.testing.assert_allclose(w, returned[0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"layer must lie in \[0, 6\), got 6"):
        attention_maps.layer_trace(maps, model, 6)
    with pytest.raises(ValueError, match="the shape table needs a BERT-style model"):
        attention_maps.attention_module(torch.nn.Linear(2, 2), 0)


# ----------------------------------------------------------------------------- the PNGs
@pytest.fixture
def drawn(monkeypatch):
    """Record every array handed to ``Axes.imshow`` and every figure saved."""
    from matplotlib.axes import Axes

    images, figs = [], []
    real_imshow, real_save = Axes.imshow, figures._save

    def imshow(self, X, *args, **kwargs):
        images.append(np.array(X))
        return real_imshow(self, X, *args, **kwargs)

    def save(fig, path, dpi):
        figs.append(fig)
        return real_save(fig, path, dpi)

    monkeypatch.setattr(Axes, "imshow", imshow)
    monkeypatch.setattr(figures, "_save", save)
    return images, figs


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_grid_plots_the_weights_mha_returned(mha_run, tmp_path, drawn):
    maps, _, returned = mha_run
    images, figs = drawn
    L, h, T, _ = returned.shape
    path = figures.attention_grid(maps, tmp_path / "grid.png")
    assert len(images) == L * h
    for k, img in enumerate(images):  # row-major: layer, then head
        np.testing.assert_array_equal(img, returned[k // h, k % h])
    axes = figs[0].axes
    assert [t.get_text() for t in axes[0].get_yticklabels()] == maps.tokens  # layer 0, head 0
    assert [t.get_text() for t in axes[(L - 1) * h].get_xticklabels()] == maps.tokens
    width, height = _png_size(path)
    assert width > 1000 and height > 500


def test_head_stats_plot_the_statistics_of_mha_weights(mha_run, tmp_path, drawn):
    maps, _, returned = mha_run
    images, _ = drawn
    path = figures.head_stats(maps, tmp_path / "stats.png")
    assert len(images) == 2
    np.testing.assert_allclose(images[0], attention_maps.head_entropy(returned))
    np.testing.assert_allclose(images[1], attention_maps.mean_distance(returned))
    assert images[0].shape == (6, 12)
    _png_size(path)


# ----------------------------------------------------------------------------- the page
def test_page_holds_the_weights_mha_returned(mha_run, tmp_path):
    maps, model, returned = mha_run
    tr, w = attention_maps.layer_trace(maps, model, 0)
    path = page.write(tmp_path / "a.html", maps, tr, trace_max_diff=float(np.abs(w - returned[0]).max()))
    text = path.read_text("utf-8")
    data = page_json(text)
    assert data["tokens"] == maps.tokens
    np.testing.assert_allclose(np.array(data["weights"]), returned, atol=10.0 ** -page.DECIMALS,
                               rtol=0)
    T = len(maps.tokens)
    for shape in ([1, T, 384], [1, 12, T, 32], [1, 12, T, T]):
        assert f"<td class=\"shape\">{shape}</td>" in text
    assert "attn_implementation=<code>mha</code>" in text
    assert f"mha backend <code>{maps.mha_backend}</code>" in text


def _tiny_maps(tokens: list[str]) -> attention_maps.AttentionMaps:
    rng = np.random.default_rng(0)
    L, h, T = 2, 3, len(tokens)
    w = rng.random((L, h, T, T)).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    return attention_maps.AttentionMaps(tokens=tokens, weights=w, text=" ".join(tokens),
                                        model="tiny", attn_implementation="mha",
                                        mha_backend="math", d_model=12)


def test_page_is_self_contained_and_escapes_tokens(tmp_path):
    tokens = ["[CLS]", "</script><script>alert(1)</script>", "<!--", "__MHA_DATA__", "a&b", "[SEP]"]
    maps = _tiny_maps(tokens)
    m = mha.MultiHeadAttention(12, 3)
    tr = mha.trace(m, torch.randn(1, len(tokens), 12))
    text = page.render(maps, tr)
    data = page_json(text)
    assert data["tokens"] == tokens  # survived the trip through the page intact
    np.testing.assert_allclose(np.array(data["weights"]), maps.weights, atol=1e-7, rtol=0)
    assert text.count("</script>") == 2  # the data block and the page's own script
    assert "<script>alert(1)" not in text  # the title escapes the text, the data escapes "<"
    for remote in ("http://", "https://", "//cdn", "<link", " src=", "@import", "url("):
        assert remote not in text, f"the page must not load anything ({remote!r} found)"
    assert "__MHA_" not in text.replace("__MHA_DATA__", "")  # every marker was filled


# ----------------------------------------------------------------------------- the command
def test_cli_viz_writes_pngs_and_page_from_mha(tmp_path, capsys):
    out = tmp_path / "viz"
    with capture_mha_weights() as seen:
        assert main(["viz", "Attention is all you need.", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "attn_implementation='mha'" in printed
    for name in ("attention_grid.png", "head_stats.png", "attention.html"):
        assert (out / name).stat().st_size > 1000, name
        assert str(out / name) in printed
    data = page_json((out / "attention.html").read_text("utf-8"))
    np.testing.assert_allclose(np.array(data["weights"]), stacked(seen), atol=1e-7, rtol=0)
    assert data["tokens"][:3] == ["[CLS]", "attention", "is"]


def test_cli_viz_any_local_bert_dir(tmp_path, capsys):
    """--model: a small random BERT saved locally (MiniLM's tokenizer files), 2 layers x 4 heads."""
    import shutil

    from transformers import BertConfig, BertModel

    from mha.integrations.minilm import minilm_dir

    model_dir = tmp_path / "tiny-bert"
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(model_dir)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir() / name, model_dir / name)
    out = tmp_path / "out"
    with capture_mha_weights() as seen:
        assert main(["viz", "a b c", "--model", str(model_dir), "--out", str(out),
                     "--trace-layer", "1"]) == 0
    assert "tiny-bert: 5 tokens, 2 layers x 4 heads" in capsys.readouterr().out
    data = page_json((out / "attention.html").read_text("utf-8"))
    assert np.array(data["weights"]).shape == (2, 4, 5, 5)
    np.testing.assert_allclose(np.array(data["weights"]), stacked(seen), atol=1e-7, rtol=0)


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model"], "--model must be a local model directory"),
    (["--max-tokens", "2"], "--max-tokens must be at least 3, got 2"),
    (["   "], "text must be a non-empty string"),
])
def test_cli_viz_errors(tmp_path, capsys, argv, message):
    assert main(["viz", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
