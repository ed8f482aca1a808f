"""Saving and loading with safetensors (no pickle)."""

from __future__ import annotations

import pytest
import torch

import mha
from mha import io


def test_round_trip(tmp_path):
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(24, 6, num_kv_heads=2, v_head_dim=5, kdim=10, vdim=7, bias=False)
    io.save(m, tmp_path / "attn.safetensors")
    back = io.load(tmp_path / "attn.safetensors")
    assert io.config(back) == io.config(m)
    x, kv_k, kv_v = torch.randn(2, 3, 24), torch.randn(2, 4, 10), torch.randn(2, 4, 7)
    assert torch.equal(back(x, kv_k, kv_v), m(x, kv_k, kv_v))


def test_refuses_foreign_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an mha.MultiHeadAttention file"):
        io.load(tmp_path / "other.safetensors")
