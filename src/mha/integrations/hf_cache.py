"""mha's preallocated K/V cache as a Hugging Face ``Cache`` (optional extra ``mha[hf]``).

Shape legend: B batch, h query heads, h_kv key/value heads, T_max capacity, Tn new tokens of
one forward, Tq queries (= Tn), Tk keys seen by attention (cache included), d head dim.

Recipe::

    from mha.integrations.hf_cache import MhaCache, register
    register()                                    # attn_implementation="mha" + its mask hook
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="mha")
    cache = MhaCache(model.config, max_cache_len=prompt_len + max_new_tokens)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=..., do_sample=False)

Why preallocated: transformers' default ``DynamicCache`` grows each layer's K/V with
``torch.cat`` on every step, so a step copies the whole history (at an 8k context, SmolLM2's
30 layers hold ~370 MB of fp32 K/V: each new token would copy all of it). :class:`MhaCache`
gives each layer an :class:`mha.KVCache`: storage ``(B, h_kv, T_max, d)`` allocated once, the
new tokens written in place, and attention handed views ``(B, h_kv, Tk, d)`` of it (no copy).

The mask hook (:func:`mask_for_cache`, registered under ``"mha"`` by :func:`register`): when
transformers asks for a plain causal mask with no padding and allows skipping it
(``allow_is_causal_skip``, the same contract as its own sdpa mask), and the queries are either
one decode token (``Tq = 1``: it sees every key) or a fresh prompt (``Tq = Tk``: causal, which
the attention applies itself), it returns None, so no ``(Tq, Tk)`` tensor is built. Every
other case (padding, chunked prefill with ``1 < Tq < Tk``, sliding windows, extra mask
functions) is served by :func:`mha.integrations.transformers.mask_for_mha` as before.

K/V storage (``kv_dtype``): the model's dtype (default), ``"fp32"``, ``"bf16"`` or ``"int8"``.

* A float storage dtype other than the model's (bf16 K/V under an fp32 model) is written
  rounded to it; attention then runs in the storage dtype: the queries are rounded to it too
  and the output is cast back (the kernels accumulate in fp32). Nothing is converted per step
  but the new tokens' K/V and the ``(B, h, Tq, d)`` queries.
* ``"int8"``: each layer's :class:`mha.KVCache` stores K/V as int8 with one float32 scale per
  token and K/V head (``kv_dtype="int8"``, quantized on append). The views handed to attention
  are the int8 storage itself, tagged with their :class:`mha.KVCache`
  (:func:`kv_cache_of`), so the ``"mha"`` attention function reads them in place: a decode
  step (``Tq <= 16``) is ``flash_decode`` with the scales (dequantized inside its loops, never
  materialized); a longer forward (a prompt, a chunk of prompt) dequantizes the ``Tk``
  positions it attends (``O(Tk d)`` per layer, amortized over its ``Tq > 16`` queries) and
  runs :func:`mha.attention`. int8 K/V therefore need ``attn_implementation="mha"``: with a
  config, :func:`MhaCache` refuses any other implementation. The error bound is in
  :class:`mha.KVCache`'s docstring and docs/llm.md.

``static=True`` (for ``torch.compile`` generation): each layer hands attention its whole
storage ``(B, h_kv, T_max, d)`` and keeps the length in a tensor advanced in place (no host
read in a step), so a decode step traces to one graph; transformers then builds the mask over
``T_max`` inside the step (it never skips the mask of a compileable cache). No int8 there.

Refusals leave the cache as it was: an append that does not fit raises ValueError naming the
capacity before any layer is written (every layer has the same capacity and length, so the
first layer refuses), and K/V of the wrong dtype raise TypeError.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mha.cache import KVCache
from mha.checks import check_int
from mha.integrations import transformers as hf_attn

#: ``kv_dtype`` names -> storage (a torch float dtype, or "int8"); None: the model's dtype
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
             "int8": "int8"}
KV_ATTR = hf_attn._KV_ATTR  # attribute of the int8 views naming the KVCache they come from


def check_kv_dtype(kv_dtype) -> torch.dtype | str | None:
    """``kv_dtype`` as storage: None (the model's dtype), a float torch dtype, or "int8".
    Accepts the names of :data:`KV_DTYPES` and torch.float32/bfloat16/float16/int8; anything
    else raises ValueError naming the choices."""
    if kv_dtype is None:
        return None
    if isinstance(kv_dtype, str) and kv_dtype in KV_DTYPES:
        return KV_DTYPES[kv_dtype]
    if kv_dtype is torch.int8:
        return "int8"
    if kv_dtype in (torch.float32, torch.bfloat16, torch.float16):
        return kv_dtype
    raise ValueError(f"kv_dtype must be None (the model's dtype) or one of "
                     f"{', '.join(KV_DTYPES)} (or torch.float32 / bfloat16 / float16 / int8), "
                     f"got {kv_dtype!r}")


def kv_cache_of(t: torch.Tensor) -> KVCache | None:
    """The int8 :class:`mha.KVCache` whose storage the view ``t`` is (None for any other
    tensor): how the attention function finds the scales of int8 K/V."""
    return getattr(t, KV_ATTR, None)


def _cache_utils():
    try:
        from transformers import cache_utils
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("mha.integrations.hf_cache needs transformers: "
                          "pip install 'mha[hf]'") from e
    return cache_utils


def _layer_class():
    """The layer class, defined on first use so importing this module does not import
    transformers."""
    global _MhaLayer
    if _MhaLayer is not None:
        return _MhaLayer
    cu = _cache_utils()

    class MhaCacheLayer(cu.CacheLayerMixin):
        """One decoder layer's K/V: an :class:`mha.KVCache` allocated on the first update
        (from the first K/V's batch, heads, head dims and device) with ``T_max`` positions.

        ``keys`` / ``values`` (transformers' attributes) are the views of the cached tokens,
        ``(B, h_kv, Tk, d)``; the storage itself is ``kv.k`` / ``kv.v``.
        """

        is_compileable = False
        is_croppable = True
        is_sliding = False

        def __init__(self, max_cache_len: int, kv_dtype: torch.dtype | str | None = None
                     ) -> None:
            super().__init__()
            self.max_cache_len = max_cache_len
            self.kv_dtype = kv_dtype  # checked: None, a float dtype, or "int8"
            self.kv: KVCache | None = None

        def __repr__(self) -> str:
            return f"MhaCacheLayer({self.kv!r})" if self.kv is not None else \
                f"MhaCacheLayer(T_max={self.max_cache_len}, not allocated)"

        def lazy_initialization(self, key_states: torch.Tensor,
                                value_states: torch.Tensor) -> None:
            B, h_kv, _, d_k = key_states.shape  # (B, h_kv, Tn, d_k)
            self.device = key_states.device
            self.batch_size = B
            int8 = self.kv_dtype == "int8"
            dtype = key_states.dtype if self.kv_dtype is None or int8 else self.kv_dtype
            self.kv = KVCache(B, h_kv, self.max_cache_len, d_k, value_states.shape[-1],
                              dtype=dtype, device=key_states.device,
                              kv_dtype="int8" if int8 else None)
            self._sync()
            self.is_initialized = True

        def _sync(self) -> None:
            kv = self.kv
            if kv.kv_dtype != "int8":
                self.keys, self.values = kv.keys(), kv.values()  # (B, h_kv, Tk, d) views
                return
            Tk = kv.max_length
            self.keys, self.values = kv.k[:, :, :Tk], kv.v[:, :, :Tk]  # (B, h_kv, Tk, d) int8
            setattr(self.keys, KV_ATTR, kv)
            setattr(self.values, KV_ATTR, kv)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
            """Write ``key_states (B, h_kv, Tn, d_k)`` / ``value_states (B, h_kv, Tn, d_v)`` in
            place after the cached tokens; return views of everything cached,
            ``(B, h_kv, Tk, d_k)`` and ``(B, h_kv, Tk, d_v)``."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if key_states.dtype != self.kv.dtype and self.kv_dtype not in (None, "int8"):
                # a float storage dtype of its own (bf16 K/V, fp32 model): round the new tokens
                key_states = key_states.to(self.kv.dtype)  # (B, h_kv, Tn, d_k)
                value_states = value_states.to(self.kv.dtype)  # (B, h_kv, Tn, d_v)
            self.kv.append(key_states, value_states)  # refuses (unchanged) when it cannot fit
            self._sync()
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            """``(kv_length, kv_offset)`` of the next forward's mask: the views attention will
            see hold the cached tokens plus the ``query_length`` new ones."""
            return self.get_seq_length() + query_length, 0

        def get_seq_length(self) -> int:
            return 0 if self.kv is None else self.kv.max_length

        def get_max_length(self) -> int:
            return self.max_cache_len

        def reset(self) -> None:
            if self.kv is not None:
                self.kv.reset()
                self._sync()

        def crop(self, tokens_to_remove: int) -> None:
            """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative
            count; a non-negative one is the length to keep, as in its legacy path)."""
            if self.kv is None:
                return
            keep = self.get_seq_length() + tokens_to_remove if tokens_to_remove < 0 \
                else min(tokens_to_remove, self.get_seq_length())
            self.kv.truncate(max(keep, 0))
            self._sync()

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            if self.kv is not None:
                self.kv.reorder(beam_idx.to(self.kv.device))
                self._sync()

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._rebuild(lambda t: t.repeat_interleave(repeats, dim=0))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._rebuild(lambda t: t[indices])

        def _rebuild(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
            """A new batch (the rows chosen by ``rows``): new storage, the cached tokens
            copied once (generation setup, not a decoding step)."""
            if self.kv is None:
                return
            old = self.kv
            k, v = rows(old.k), rows(old.v)  # (B', h_kv, T_max, d)
            self.kv = KVCache(k.shape[0], k.shape[1], old.capacity, k.shape[3], v.shape[3],
                              dtype=old.dtype, device=old.device, kv_dtype=old.kv_dtype)
            self.kv.k.copy_(k)
            self.kv.v.copy_(v)
            if old.kv_dtype == "int8":
                self.kv.k_scale.copy_(rows(old.k_scale))  # (B', h_kv, T_max)
                self.kv.v_scale.copy_(rows(old.v_scale))
            self.kv.lengths.copy_(rows(old.lengths))
            self.kv.starts.copy_(rows(old.starts))
            self.batch_size = k.shape[0]
            self._sync()

        def offload(self) -> None:  # the storage stays where it is (CPU)
            return None

        def prefetch(self) -> None:
            return None

    _MhaLayer = MhaCacheLayer
    return MhaCacheLayer


_MhaLayer = None
_MhaStaticLayer = None


def _static_layer_class():
    """The compileable layer (``MhaCache(..., static=True)``), defined on first use."""
    global _MhaStaticLayer
    if _MhaStaticLayer is not None:
        return _MhaStaticLayer

    class MhaStaticCacheLayer(_layer_class()):
        """A layer with static shapes for ``torch.compile``: attention is handed the whole
        storage ``(B, h_kv, T_max, d)`` every step, and the cached length lives in the
        :class:`mha.KVCache`'s ``lengths`` tensor, advanced in place; nothing reads a host
        value, so a decode step traces to one graph. The keys past the length are hidden by the
        mask transformers builds for a compileable cache (it never skips it), ``(B, 1, Tq,
        T_max)`` from the cache positions, inside the graph.

        All rows share one length (transformers pads with the mask, not with the cache)."""

        is_compileable = True

        def lazy_initialization(self, key_states: torch.Tensor,
                                value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            if not torch.compiler.is_compiling():  # fixed addresses: no recompile per step
                for t in (self.kv.k, self.kv.v, self.kv.lengths):
                    torch._dynamo.mark_static_address(t)

        def _sync(self) -> None:
            self.keys, self.values = self.kv.k, self.kv.v  # (B, h_kv, T_max, d), the storage

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
            """Write ``key_states (B, h_kv, Tn, d_k)`` / ``value_states`` at positions
            ``length .. length + Tn - 1`` (a tensor index, no host read) and return the whole
            storage ``(B, h_kv, T_max, d_k)`` / ``(B, h_kv, T_max, d_v)``."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            kv = self.kv
            Tn = key_states.shape[-2]
            pos = kv.lengths[0] + torch.arange(Tn, device=kv.device)  # (Tn,)
            kv.k.index_copy_(2, pos, key_states.to(kv.dtype))  # (B, h_kv, T_max, d_k)
            kv.v.index_copy_(2, pos, value_states.to(kv.dtype))  # (B, h_kv, T_max, d_v)
            kv.lengths.add_(Tn)
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.max_cache_len, 0  # the mask spans the whole storage

        def get_seq_length(self):
            """The cached length as a 0-d tensor (transformers' static layers do the same:
            an int would be a host read, and a new graph per value, under compile)."""
            return 0 if self.kv is None else self.kv.lengths[0]

        def crop(self, tokens_to_remove: int) -> None:
            if self.kv is None:
                return
            if tokens_to_remove >= 0:
                keep = torch.clamp(self.kv.lengths, max=tokens_to_remove)
            else:
                keep = torch.clamp(self.kv.lengths + tokens_to_remove, min=0)
            self.kv.lengths.copy_(keep)  # in place: the static address stays

        def reset(self) -> None:
            if self.kv is not None:
                self.kv.lengths.zero_()
                self.kv.starts.zero_()

    _MhaStaticLayer = MhaStaticCacheLayer
    return MhaStaticCacheLayer


def MhaCache(config=None, *, max_cache_len: int, num_layers: int | None = None,  # noqa: N802
             kv_dtype: torch.dtype | str | None = None, static: bool = False):
    """A transformers ``Cache`` whose layers are :class:`mha.KVCache` (see the module docstring).

    Args:
        config: the model's config (its ``num_hidden_layers`` sets the layer count), or None
            with ``num_layers``.
        max_cache_len: ``T_max``, the positions each row can hold (prompt + new tokens).
        num_layers: the layer count when no config is given.
        kv_dtype: the K/V storage (see the module docstring): None (the dtype of the first
            K/V, the model's), "fp32", "bf16", "fp16", "int8", or the torch dtype.
        static: static shapes for ``torch.compile`` (``is_compileable``): attention gets the
            whole ``T_max`` storage and transformers' mask every step, the length stays a
            tensor (see "Static cache and torch.compile" in docs/llm.md). Not with int8 K/V.

    Returns an instance of :class:`MhaCacheStore` (a ``transformers.Cache`` subclass, built on
    first use so that importing this module does not import transformers).
    """
    return _cache_class()(config, max_cache_len=max_cache_len, num_layers=num_layers,
                          kv_dtype=kv_dtype, static=static)


_MhaCacheClass = None


def _cache_class():
    global _MhaCacheClass
    if _MhaCacheClass is not None:
        return _MhaCacheClass
    cu = _cache_utils()
    layer_cls = _layer_class()

    class MhaCacheStore(cu.Cache):
        """Per-layer preallocated K/V (:class:`mha.KVCache`), written in place.

        Updated in place: each layer's storage (new tokens written at each row's end) and
        lengths; :meth:`crop`, :meth:`reset` change only the lengths.
        """

        def __init__(self, config=None, *, max_cache_len: int, num_layers: int | None = None,
                     kv_dtype: torch.dtype | str | None = None, static: bool = False) -> None:
            if config is not None:
                num_layers = config.get_text_config().num_hidden_layers
                limit = getattr(config.get_text_config(), "max_position_embeddings", None)
            else:
                limit = None
            if num_layers is None:
                raise TypeError("MhaCache needs the model's config or num_layers")
            num_layers = check_int("num_layers", num_layers, low=1, what="a positive int")
            max_cache_len = check_int("max_cache_len", max_cache_len, low=1,
                                      what="a positive int")
            if limit is not None and max_cache_len > limit:
                raise ValueError(f"max_cache_len={max_cache_len} exceeds the model's context "
                                 f"(max_position_embeddings={limit})")
            kv_dtype = check_kv_dtype(kv_dtype)
            impl = getattr(config, "_attn_implementation", None) if config is not None else None
            if kv_dtype == "int8" and impl is not None and impl != hf_attn.NAME:
                raise ValueError(f"kv_dtype='int8' needs attn_implementation='{hf_attn.NAME}' "
                                 f"(only mha's attention reads int8 K/V), the model has "
                                 f"{impl!r}")
            if static and kv_dtype == "int8":
                raise ValueError("static=True (torch.compile) does not take kv_dtype='int8': "
                                 "the int8 scales reach attention through a Python attribute "
                                 "of the K/V views, which tracing does not carry")
            cls = _static_layer_class() if static else layer_cls
            super().__init__(layers=[cls(max_cache_len, kv_dtype) for _ in range(num_layers)])
            self.max_cache_len = max_cache_len
            self.kv_dtype = kv_dtype
            self.static = bool(static)

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            # the capacity check reads the length on the host: eager calls only (the static
            # cache's compiled steps index past T_max at worst, which index_copy_ refuses)
            if layer_idx == 0 and not torch.compiler.is_compiling():
                self._check_fits(key_states.shape[-2])
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

        def _check_fits(self, Tn: int) -> None:
            """Refuse a forward whose ``Tn`` new tokens do not fit, before any layer is
            written (so the cache stays as it was)."""
            have = int(self.get_seq_length())
            if have + Tn > self.max_cache_len:
                raise ValueError(f"MhaCache is full: {have} cached + {Tn} new token(s) exceed "
                                 f"max_cache_len={self.max_cache_len}; the cache is unchanged "
                                 "(make it larger, or crop/reset it)")

        def __repr__(self) -> str:
            kv = "" if self.kv_dtype is None else \
                f", kv_dtype={str(self.kv_dtype).replace('torch.', '')}"
            return (f"MhaCache(layers={len(self.layers)}, max_cache_len={self.max_cache_len}"
                    f"{kv}, length={self.get_seq_length()})")

    _MhaCacheClass = MhaCacheStore
    return MhaCacheStore


def is_mha_cache(obj) -> bool:
    """True when ``obj`` is a cache made by :func:`MhaCache`."""
    return _MhaCacheClass is not None and isinstance(obj, _MhaCacheClass)


# ------------------------------------------------------------------------------ the mask
def mask_for_cache(batch_size: int, q_length: int, kv_length: int, q_offset=0,
                   kv_offset: int = 0, mask_function: Callable | None = None,
                   attention_mask: torch.Tensor | None = None,
                   allow_is_causal_skip: bool = False, **kwargs):
    """transformers' mask hook for ``"mha"``: None where the attention applies causality by
    itself, else :func:`mha.integrations.transformers.mask_for_mha`'s mask.

    None is returned only when all of these hold: transformers allows skipping the mask
    (``allow_is_causal_skip``), the pattern is its plain causal function, every key is real
    (no padding in ``attention_mask``), and either ``Tq = 1`` (one decode token sees all
    ``Tk`` keys) or ``Tq = Tk`` from position 0 (a fresh prompt: causal). The attention
    function then reads ``attention_mask=None`` as "causal when ``Tq > 1``".
    """
    from transformers import masking_utils as mu

    if torch.compiler.is_compiling():  # the checks below read tensor values: dense mask
        return hf_attn.mask_for_mha(batch_size, q_length, kv_length, q_offset, kv_offset,
                                    mask_function, attention_mask, **kwargs)
    plain = mask_function is None or mask_function is mu.causal_mask_function
    no_padding = attention_mask is None or (attention_mask.dim() == 2
                                            and bool(attention_mask.all()))
    fresh = q_length == kv_length and int(q_offset) == 0 and int(kv_offset) == 0
    if allow_is_causal_skip and plain and no_padding and (q_length == 1 or fresh):
        return None
    return hf_attn.mask_for_mha(batch_size, q_length, kv_length, q_offset, kv_offset,
                                mask_function, attention_mask, **kwargs)


def register(name: str = hf_attn.NAME) -> None:
    """Register ``attn_implementation=name`` (:func:`mha.integrations.transformers.register`)
    with :func:`mask_for_cache` as its mask hook. Idempotent."""
    hf_attn.register(name)
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(name, mask_for_cache)


__all__ = ["KV_DTYPES", "MhaCache", "check_kv_dtype", "is_mha_cache", "kv_cache_of",
           "mask_for_cache", "register"]
