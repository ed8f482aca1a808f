"""Saving and loading modules with safetensors: weights plus the constructor arguments as
metadata. Nothing is ever unpickled, so loading an untrusted file cannot run code."""

from __future__ import annotations

import json
from pathlib import Path

from mha.module import MultiHeadAttention

_CONFIG_KEY = "mha.MultiHeadAttention"


def config(m: MultiHeadAttention) -> dict:
    """The constructor arguments that rebuild ``m`` (derived from the module, not stored)."""
    return dict(d_model=m.d_model, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                head_dim=m.head_dim, v_head_dim=m.v_head_dim, kdim=m.kdim, vdim=m.vdim,
                bias=m.out_proj.bias is not None, dropout=m.dropout)


def save(m: MultiHeadAttention, path: str | Path) -> None:
    """Write ``m``'s weights and configuration to a ``.safetensors`` file."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in m.state_dict().items()}
    save_file(tensors, str(path), metadata={_CONFIG_KEY: json.dumps(config(m))})


def load(path: str | Path, *, device=None, dtype=None) -> MultiHeadAttention:
    """Rebuild the module saved by :func:`save` (ValueError if the file holds something else)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if _CONFIG_KEY not in meta:
        raise ValueError(f"{path}: not an mha.MultiHeadAttention file (no '{_CONFIG_KEY}' "
                         f"metadata; found keys {sorted(meta)})")
    m = MultiHeadAttention(**json.loads(meta[_CONFIG_KEY]), device=device, dtype=dtype)
    state = load_file(str(path), device=str(device or "cpu"))
    m.load_state_dict({k: v.to(dtype) if dtype else v for k, v in state.items()})
    return m
