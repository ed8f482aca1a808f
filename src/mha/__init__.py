"""mha — multi-head attention, exact to the seeds' math, fast on the CPU, easy to look inside.

Shape legend used throughout: B batch, h query heads, h_kv key/value heads, Tq/Tk query/key
lengths, d_k query/key head dim, d_v value head dim, d_model model width.

Public API:
    attention(q, k, v, *, mask, causal, key_lengths, scale, dropout_p, return_weights, backend,
              window, softcap, sinks, bias, alibi_slopes, mask_mod, score_mod)
    alibi_slopes(n_heads)                the ALiBi paper's per-head slopes
    explain(q, k, v, **kwargs)           every backend's verdict, in words
    use_backend(name)                    a context forcing every call without backend= to one
    mods, block_plan(mask_mod, B, h, Tq, Tk)   mask / score functions of indices, block plans
    varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, ...)   packed sequences
    flash_decode(q, k, v, ...)           a few queries against a long K/V cache (inference)
    MultiHeadAttention(d_model, num_heads, ...)
    rope.Rotary(dim, theta, ...)         rotary position embeddings (the module's rope=)
    trace(module, x)                     shapes recorded from a real run
    reference                            the seeds' per-head loop (the test oracle)
"""

from __future__ import annotations

from mha import io, mods, reference, rope
from mha.blockplan import BlockPlan, block_plan
from mha.cache import KVCache
from mha.dispatch import BackendError, use_backend
from mha.functional import attention, explain
from mha.masks import MaskSpec, causal_mask
from mha.module import MultiHeadAttention
from mha.ops.decode import flash_decode
from mha.paged import PagedKVCache, PagePoolExhausted
from mha.scores import ScoreSpec, alibi_slopes
from mha.trace import trace
from mha.varlen import varlen_attention

__version__ = "0.1.0"

__all__ = ["attention", "explain", "varlen_attention", "MultiHeadAttention", "MaskSpec", "causal_mask", "trace",
           "reference", "io", "mods", "rope", "block_plan", "BlockPlan", "BackendError", "KVCache", "flash_decode",
           "PagedKVCache", "PagePoolExhausted",
           "ScoreSpec", "alibi_slopes", "use_backend", "__version__"]
