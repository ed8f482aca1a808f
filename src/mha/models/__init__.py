"""Small models built from mha, for decoding tests and benchmarks (random, seeded weights).

``TinyDecoder(vocab_size, d_model, n_layers, num_heads, num_kv_heads=None, max_len=1024)``:
a decoder-only transformer with greedy ``generate(idx, max_new_tokens, cache="mha")``.
"""

from mha.models.decoder import DecoderBlock, TinyDecoder

__all__ = ["DecoderBlock", "TinyDecoder"]
