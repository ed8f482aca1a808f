"""The head-count experiment (``mha experiment heads``): a tiny sweep through the same code path
as ``--quick`` and the full run, and gradients through mha's attention.

Shape legend: B batch, T sequence length, d_model model width, h heads, d_k = d_model / h.
"""

from __future__ import annotations

import json

import pytest
import torch

import mha
from mha.backends import ORDER
from mha.cli import main
from mha.experiments import heads, report
from mha.experiments.model import ModelConfig, TinyTransformer
from mha.experiments.tasks import IGNORE, LagTask, MarkovTask, RecallTask

RECORD_FIELDS = {"task", "num_heads", "head_dim", "d_model", "n_layers", "seed", "steps",
                 "batch", "time_s", "params", "backend", "metrics"}
METRIC_FIELDS = {"init_loss", "init_acc", "final_loss", "final_acc", "eval_curve", "train_curve"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``mha experiment heads --tiny`` once, through the CLI (the path --quick also takes)."""
    out = tmp_path_factory.mktemp("heads")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "200")  # rich wraps at the terminal width
        from io import StringIO

        buf = StringIO()
        mp.setattr("sys.stdout", buf)
        code = main(["experiment", "heads", "--tiny", "--out", str(out)])
    return code, out, buf.getvalue()


def test_tiny_sweep_writes_table_json_and_plot(tiny_run):
    code, out, printed = tiny_run
    cfg = heads.PRESETS["tiny"]
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    # one record per (task, h, seed), with the documented fields
    expected = {(t, h, s) for t in cfg.tasks for h in cfg.head_counts() for s in range(cfg.seeds)}
    assert sorted((r["task"], r["num_heads"], r["seed"]) for r in runs) == sorted(expected)
    for r in runs:
        assert RECORD_FIELDS <= r.keys()
        assert METRIC_FIELDS <= r["metrics"].keys()
        assert r["head_dim"] * r["num_heads"] == r["d_model"] == cfg.d_model
        assert r["steps"] == cfg.steps and r["backend"] in ORDER
    assert results["config"]["preset"] == "tiny" and results["config"]["steps"] == cfg.steps
    # the attention (and whole model) parameter count does not depend on h
    for task in cfg.tasks:
        per_task = [r["params"] for r in runs if r["task"] == task]
        assert len({p["total"] for p in per_task}) == 1
        assert {p["attention"] for p in per_task} == {
            cfg.n_layers * (4 * cfg.d_model ** 2 + 4 * cfg.d_model)}
    # the table was printed, and the Markdown table and plot were written
    for task in cfg.tasks:
        assert f"{task} — " in printed
    assert "head_dim d_k" in printed and "backend=" in printed
    md = (out / "table.md").read_text()
    assert md.count("| 1 | 16 |") == len(cfg.tasks) and md.count("| 4 | 4 |") == len(cfg.tasks)
    png = (out / "heads.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_tiny_sweep_learns(tiny_run):
    """Training must lower the held-out loss; on the Markov text it must beat the uniform guess
    (which needs a working backward pass through the whole model)."""
    _, out, _ = tiny_run
    results = json.loads((out / "results.json").read_text())
    for r in results["runs"]:
        m = r["metrics"]
        assert m["final_loss"] < m["init_loss"] - 0.05, r["task"]
        if r["task"] == "markov":
            assert m["final_loss"] < results["tasks"]["markov"]["chance_loss"] - 0.05


def test_sweep_hands_back_the_callers_thread_count():
    """The sweep trains on ``cfg.threads`` torch threads and restores the caller's count after
    (``mha experiment heads`` run in-process leaves later code on the count it had)."""
    from dataclasses import replace

    from threads import with_threads

    cfg = replace(heads.PRESETS["tiny"], heads=(1,), tasks=("lags",), steps=2, warmup=1,
                  eval_size=8, eval_points=1, threads=1)
    seen = with_threads(2, lambda: (heads.run_sweep(cfg), torch.get_num_threads()))
    assert seen[0]["environment"]["threads"] == 1  # the sweep's own count
    assert seen[1] == 2  # the caller's, back after the sweep


def test_markdown_regenerates_between_markers(tiny_run, tmp_path):
    _, out, _ = tiny_run
    results = report.load(out / "results.json")
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{report.BEGIN}\nstale\n{report.END}\noutro\n")
    report.write_markdown(results, doc)
    text = doc.read_text()
    assert "stale" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert report.markdown(results) in text
    begin, end = report.markers("long")
    doc.write_text(f"{report.BEGIN}\nkeep\n{report.END}\n{begin}\nold\n{end}\n")
    report.write_markdown(results, doc, section="long")
    assert "keep" in doc.read_text() and "old" not in doc.read_text()


@pytest.mark.parametrize("num_heads", [1, 4, 16])
def test_gradients_reach_every_attention_parameter(num_heads):
    """Every attention weight (W_Q, W_K, W_V, W_O per head) and the Q, V, O biases get a
    non-zero gradient; the K bias gets none, as softmax ignores a shift shared by all keys."""
    torch.manual_seed(0)
    d = 16
    task = LagTask(lags=(1, 2, 4), seq_len=10)
    model = TinyTransformer(ModelConfig(d, num_heads, 2, task.n_inputs, task.n_classes, 10,
                                        n_slots=task.n_slots))
    x, y = task.batch(8, torch.Generator().manual_seed(0))  # (B, T), (B, T, S)
    loss, _, _ = heads.loss_and_acc(model(x), y)
    loss.backward()
    d_k = d // num_heads
    for attn in model.attention_modules():
        (wq, _), (wk, _), (wv, _) = attn.projection_weights()
        gW = attn.in_proj.weight.grad  # (3 d_model, d_model): [W^Q; W^K; W^V]
        gb = attn.in_proj.bias.grad  # (3 d_model,)
        assert gW is not None and torch.isfinite(gW).all()
        for part in range(3):  # Q, K, V
            for i in range(num_heads):
                rows = slice(part * d + i * d_k, part * d + (i + 1) * d_k)
                assert gW[rows].abs().sum() > 0, (part, i)
        assert gb[:d].abs().sum() > 0 and gb[2 * d:].abs().sum() > 0
        assert gb[d:2 * d].abs().max() < 1e-6 * gb[2 * d:].abs().max()  # b^K: shift-invariant
        assert attn.out_proj.weight.grad.abs().sum(dim=0).min() > 0  # every input column of W_O
        assert attn.out_proj.bias.grad.abs().sum() > 0


@pytest.mark.parametrize("num_heads", [1, 8, 64])
def test_mha_backward_matches_torch(num_heads):
    """The gradients that training uses (through whichever backend dispatch picks for this
    head dim) equal torch.nn.MultiheadAttention's, same weights; d_model as in the sweep."""
    torch.manual_seed(1)
    B, T, d = 3, 7, 64
    ours = mha.MultiHeadAttention(d, num_heads)
    theirs = ours.to_torch()
    x = torch.randn(B, T, d, requires_grad=True)  # (B, T, d_model)
    x2 = x.detach().clone().requires_grad_(True)
    ours(x, causal=True).square().sum().backward()
    masked = torch.ones(T, T, dtype=torch.bool).triu(1)  # torch's polarity: True = masked
    theirs(x2, x2, x2, attn_mask=masked, need_weights=False)[0].square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.in_proj.weight.grad, theirs.in_proj_weight.grad,
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.out_proj.weight.grad, theirs.out_proj.weight.grad,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("task", [LagTask(), RecallTask(), MarkovTask()])
def test_tasks_make_valid_batches(task):
    x, y = task.batch(5, torch.Generator().manual_seed(0))
    assert x.shape == (5, task.seq_len) and y.shape == (5, task.seq_len, task.n_slots)
    assert 0 <= x.min() and x.max() < task.n_inputs
    scored = y[y != IGNORE]
    assert scored.numel() > 0 and 0 <= scored.min() and scored.max() < task.n_classes


def test_lag_targets_read_the_lagged_tokens():
    task = LagTask(lags=(1, 3), vocab=4, seq_len=8)
    x, y = task.batch(4, torch.Generator().manual_seed(2))
    t = 5
    assert torch.equal(y[:, t, 0], x[:, t - 1]) and torch.equal(y[:, t, 1], x[:, t - 3])
    assert (y[:, :3] == IGNORE).all() and (y[:, 3:] != IGNORE).all()


def test_recall_answers_are_the_queried_values():
    task = RecallTask(n_keys=6, n_values=5, n_pairs=4, n_queries=3)
    x, y = task.batch(6, torch.Generator().manual_seed(3))
    for b in range(6):
        pairs = {int(tok) // 5: int(tok) % 5 for tok in x[b, :4]}
        assert len(pairs) == 4  # distinct keys
        for j in range(3):
            key = int(x[b, 4 + j]) - 6 * 5
            assert y[b, 4 + j, 0] == pairs[key]
    assert (y[:, :4] == IGNORE).all()


def test_markov_entropy_is_below_chance_and_matched_by_the_source():
    task = MarkovTask(vocab=6, seq_len=200)
    H = task.entropy()
    assert 0 < H < task.chance_loss()
    # the empirical log-loss of the true model on long samples approaches the entropy
    x, y = task.batch(64, torch.Generator().manual_seed(4))
    ctx = x[:, :-1] * 6 + x[:, 1:]  # (B, T-1): context (x_{t-1}, x_t) for target y[:, t]
    p = task._table[ctx, y[:, 1:, 0]]
    assert abs(-p.log().mean().item() - H) < 0.1


def test_config_rejects_heads_that_do_not_divide_d_model():
    with pytest.raises(ValueError, match="divide d_model=16"):
        heads.preset("tiny", heads=(3,)).validate()
