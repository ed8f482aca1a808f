"""A small Llama with seeded random weights (nothing downloaded), shared by the HF cache tests:
its config, two prompts (plain and left padded; ids ``(B, P)`` and attention mask or None), and
the same weights under eager attention and under mha's."""

from __future__ import annotations

import copy

import torch
import transformers as tf

import mha.integrations.hf_cache as hc

CFG = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                     max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     initializer_range=0.2)
PROMPTS = {
    "plain": (torch.tensor([[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 13, 14]]), None),
    "left padded": (torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]),
                    torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])),
}


def eager_and_mha() -> dict:
    """``{"eager": model, "mha": model}``: one seeded set of weights, two attention
    implementations (mha's registered first), eval mode."""
    hc.register()
    torch.manual_seed(0)
    weights = tf.LlamaForCausalLM(copy.deepcopy(CFG)).state_dict()
    out = {}
    for impl in ("eager", "mha"):
        m = tf.LlamaForCausalLM(copy.deepcopy(CFG))
        m.load_state_dict(weights)
        m.set_attn_implementation(impl)
        out[impl] = m.eval()
    return out
