"""The mha command: demo and shapes run for real and report recorded shapes."""

from __future__ import annotations

import json
import re

import torch

from mha.cli import main


def test_demo_runs_and_agrees(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps tables to the terminal width
    assert main(["demo", "--batch", "4", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "all paths agree" in out
    assert "[4, 8, 20, 64]" in out  # (B, h, T, d_k) recorded from the run
    assert "whole module, x (4, 20, 512)" in out  # timed against torch.nn.MultiheadAttention
    assert "torch.nn.MultiheadAttention │" in out and "mha.MultiHeadAttention      │" in out


def test_shapes_json_gqa_dv_cross(capsys):
    assert main(["shapes", "--batch", "2", "--seq", "3", "--kv-seq", "5", "--d-model", "32",
                 "--heads", "4", "--kv-heads", "2", "--d-v", "6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    shapes = {s["step"]: s["shape"] for s in data["steps"]}
    assert shapes["split heads Q"] == [2, 4, 3, 8]
    assert shapes["split heads K"] == [2, 2, 5, 8]
    assert shapes["split heads V"] == [2, 2, 5, 6]
    assert shapes["attention weights"] == [2, 4, 3, 5]
    assert shapes["concat heads"] == [2, 3, 24]
    assert shapes["output"] == [2, 3, 32]


def test_build_names_every_extension_and_the_tiles(capsys):
    import mha.ops.decode
    import mha.ops.flash

    assert main(["build"]) == 0
    out = capsys.readouterr().out
    for name in ("mha_flash:", "mha_flash_bwd:", "mha_decode:", "mha_linear:", "mha_gemv:"):
        assert name in out
    picked = mha.ops.flash.kernels()
    assert f"float32 -> {picked['float32']}, bfloat16 -> {picked['bfloat16']}" in out
    assert f"  bfloat16 choice: {mha.ops.flash.bf16_said()}\n" in out
    (said,) = [ln.removeprefix("  bfloat16 choice: ") for ln in out.splitlines()
               if ln.startswith("  bfloat16 choice: ")]
    how = re.search(r"forced by MHA_FLASH_BF16=\S|not measured \(\w+|nothing to measure"
                    r"|: measured \d|measured only \d", said)
    assert how, said  # measured, forced, not measured (and why), or nothing to choose
    if "measured" in how.group() and "not measured" not in how.group():  # the two rates
        assert re.search(r"avx512bf16 \S+ ms, avx512f \S+ ms a forward of "
                         r"\(B=\d+, h=\d+, T=\d+, d=\d+\) on ", said), said
    from mha.cli.build import BACKWARD_WORDS

    math = torch.ops.mha.flash_attention_bwd_bf16_math()
    assert f"backward, bfloat16 inputs: {BACKWARD_WORDS[math]}\n" in out
    assert f"decode, bfloat16 q.k: {mha.ops.decode.bf16_qk()}" in out
