"""Bridges from mha to other libraries. Each lives in its own module and imports its library
only when used, so ``import mha`` never imports them:

* :mod:`mha.integrations.transformers` — ``attn_implementation="mha"`` in Hugging Face
  transformers (``register()``).
* :mod:`mha.integrations.minilm` — the shipped MiniLM encoder (``load_minilm``, ``encode``),
  built on the former.
"""
