"""Small models built from mha, for decoding tests and benchmarks (random, seeded weights).

``TinyDecoder(vocab_size, d_model, n_layers, num_heads, num_kv_heads=None, max_len=1024)``:
a decoder-only transformer with greedy ``generate(idx, max_new_tokens, cache="mha")``.

``Llama.from_hf(model)`` / ``Llama.from_pretrained(path)`` / ``Llama.from_config(config)``: a
Llama-architecture decoder (RMSNorm, SwiGLU, RoPE through ``mha.rope.Rotary``) that runs real
weights (SmolLM2, Llama 2 / 3) on :class:`mha.MultiHeadAttention`, with greedy ``generate``.
"""

from mha.models.decoder import DecoderBlock, TinyDecoder
from mha.models.llama import Llama, llama_settings

__all__ = ["DecoderBlock", "Llama", "TinyDecoder", "llama_settings"]
