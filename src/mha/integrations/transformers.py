"""``attn_implementation="mha"`` for Hugging Face transformers (optional extra ``mha[hf]``).

Shape legend: B batch, h query heads, h_kv key/value heads, Tq query length, Tk key length
(cache included), d_k/d_v head dims.

Recipe::

    import mha.integrations.transformers as t
    t.register()
    model = AutoModel.from_pretrained(path, attn_implementation="mha")

:func:`register` adds two entries under the name ``"mha"``:

* to ``AttentionInterface``: :func:`attention_forward`, which every attention layer of a
  model calls with q ``(B, h, Tq, d_k)``, k/v ``(B, h_kv, Tk, d)`` (the layer's KV cache is
  already updated) and the mask the model built; it runs :func:`mha.attention`, so dispatch
  picks the backend (``flash_cpu`` where it serves, else ``sdpa``/``math``).
* to ``AttentionMaskInterface``: :func:`mask_for_mha`, which the model calls once per forward
  to build that mask. It returns the complete bool mask ``(B, 1, Tq, Tk)`` (True = may
  attend, what transformers' own sdpa masks say) and attaches the same masking in mha's
  native form (a :class:`mha.MaskSpec`: ``causal`` + ``key_lengths`` for right padding, or
  a ``(B, 1, 1, Tk)`` key mask for left padding) whenever transformers' mask is plain causal
  or bidirectional and its causal diagonal is bottom-right aligned, as mha's is. Other masks
  (sliding windows, packed sequences, custom mask functions, static caches) travel as the
  dense bool tensor, which is exact for any of them.

Masks from elsewhere (a 4-D mask passed by the caller) are converted at the boundary: bool
as is; a float additive mask is split into the pairs it masks (-inf or at most half of the
dtype's most negative value) and, if any other value is not 0, an additive ``bias`` for the
rest; a row of such a mask that keeps no pair but holds finite values gets eager's and SDPA's
answer, the softmax of the mask alone (uniform over its ``finfo.min`` entries), not mha's
zeros for a row that attends nothing. The score variants that models pass to their attention function reach
:func:`mha.attention` as its own arguments (table :data:`SERVED`): ``softcap`` (Gemma 2),
``s_aux`` attention sinks (gpt-oss) as ``sinks``, ``position_bias`` (T5 family) as ``bias``;
``head_mask`` (transformers 4's per-head multiplier of the probabilities) scales each head's
output. What mha does not have (a paged cache) raises a ``NotImplementedError`` naming it
instead of being ignored.

K/V from :func:`mha.integrations.hf_cache.MhaCache`: int8 storage arrives as the int8 views
themselves (tagged with their :class:`mha.KVCache`): up to 16 queries run ``flash_decode`` with
the scales in place, longer calls dequantize the attended positions; K/V stored in another
float dtype than the queries' (bf16 K/V, fp32 model) make the call run in the K/V's dtype, the
output cast back.

Packed sequences (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: one row,
``position_ids`` restarting per sequence, ``cu_seq_lens_q/k`` passed down to attention) run
through :func:`mha.varlen_attention`, so no token sees another sequence and nothing is padded.

Importing this module does not import transformers; :func:`register` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from mha.functional import attention
from mha.masks import MaskSpec
from mha.varlen import varlen_attention

NAME = "mha"

# Keyword arguments that change the math and how mha serves each (the families table in
# docs/huggingface.md is derived from this, see mha.integrations.families).
SERVED = {
    "scaling": "scale",
    "dropout": "dropout_p",
    "is_causal": "causal (when attention_mask is None)",
    "sliding_window": "the window in the mask the model builds",
    "softcap": "softcap",
    "s_aux": "sinks",
    "sinks": "sinks",
    "position_bias": "bias",
    "head_mask": "each head's output scaled (probabilities times head_mask)",
    "cu_seq_lens_q": "mha.varlen_attention",
    "cu_seq_lens_k": "mha.varlen_attention",
}
# Keyword arguments whose (non-None, non-False) values change the math in ways mha cannot do.
_UNSUPPORTED = {
    "cache": "a paged KV cache (continuous batching)",
    # DeepSeek-V3.2-style sparse attention: for implementations other than eager/sdpa the
    # model passes the indexer's top-k keys here instead of folding them into the mask
    "indices": "sparse attention over selected keys (indices)",
    "block_indices": "sparse attention over selected key blocks (block_indices)",
}
# Plumbing that transformers passes down to every attention function; none changes the math.
PLUMBING = frozenset({
    "position_ids", "output_attentions", "output_hidden_states", "use_cache", "cache_position",
    "past_key_values", "past_key_value", "return_dict", "num_items_in_batch",
    "output_router_logits", "max_length_q", "max_length_k", "seq_idx", "position_embeddings",
    "layer_idx", "token_type_ids", "encoder_hidden_states", "encoder_attention_mask",
    "deterministic",  # flash-attn's deterministic backward (ModernBERT)
})
UNSUPPORTED = frozenset(_UNSUPPORTED)
_warned: set[str] = set()
_KV_ATTR = "_mha_kvcache"  # attribute of an int8 MhaCache's K/V views: their KVCache
_SPEC_ATTR = "_mha_masks"  # attribute of the bool mask tensor holding the native MaskSpec


def register(name: str = NAME) -> None:
    """Register mha as ``attn_implementation=name`` (default ``"mha"``). Idempotent."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("mha.integrations.transformers needs transformers: "
                          "pip install 'mha[hf]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_for_mha)


def is_registered(name: str = NAME) -> bool:
    """True when ``name`` is registered with transformers (False if transformers is absent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    return (AttentionInterface._global_mapping.get(name) is attention_forward
            and AttentionMaskInterface._global_mapping.get(name) is mask_for_mha)


# ----------------------------------------------------------------------------- the mask
def mask_for_mha(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                 use_vmap: bool = False, device: torch.device | str = "cpu",
                 **kwargs) -> torch.Tensor:
    """transformers' mask hook: the bool mask ``(B, 1, Tq, Tk)`` with mha's spec attached.

    Arguments are transformers' (``attention_mask`` is the 2-D ``(B, past + Tq)`` padding mask,
    True/1 = real token; ``mask_function(b, h, q_idx, kv_idx)`` the pattern, in absolute
    positions ``q_offset + i`` and ``kv_offset + j``). Never returns None, so the attention
    function never has to guess whether a missing mask meant "causal".
    """
    from transformers import masking_utils as mu

    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    # While torch.compile traces (a static cache's step), the offsets and the padding mask are
    # tensors whose values the trace cannot read: the exact dense mask is built in the graph.
    spec = None if torch.compiler.is_compiling() else _native_spec(
        batch_size, q_length, kv_length, int(q_offset), int(kv_offset), mask_function,
        attention_mask, mu)
    if spec is None:
        dense = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                             q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                             attention_mask=attention_mask, allow_is_causal_skip=False,
                             allow_is_bidirectional_skip=False, use_vmap=use_vmap,
                             device=device)  # (B, 1, Tq, Tk) bool
        spec = MaskSpec(mask=dense)
        full = dense
    else:
        m = spec.materialize(batch_size, 1, q_length, kv_length, device)
        if m is None:
            m = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        full = m.expand(batch_size, 1, q_length, kv_length)  # (B, 1, Tq, Tk), a view
    setattr(full, _SPEC_ATTR, spec)
    return full


def _native_spec(B: int, Tq: int, Tk: int, q_offset: int, kv_offset: int, mask_function,
                 attention_mask, mu) -> MaskSpec | None:
    """The mask as mha's causal / key_lengths / key mask, or None when it is not of that form."""
    if mask_function is mu.causal_mask_function:
        # transformers: key j (absolute kv_offset + j) is visible to query i (absolute
        # q_offset + i) iff j <= i + q_offset - kv_offset; mha: iff j <= i + Tk - Tq.
        if q_offset - kv_offset != Tk - Tq:
            return None
        causal = True
    elif mask_function is mu.bidirectional_mask_function:
        causal = False
    else:
        return None
    if attention_mask is None:
        return MaskSpec(causal=causal)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B:
        return None
    am = attention_mask.to(torch.bool)
    missing = kv_offset + Tk - am.shape[1]
    if missing > 0:  # keys beyond the 2-D mask are padding, as transformers pads them
        am = torch.nn.functional.pad(am, (0, missing))
    real = am[:, kv_offset:kv_offset + Tk]  # (B, Tk), True = real key
    if bool(real.all()):
        return MaskSpec(causal=causal)
    n = real.sum(dim=1)  # (B,)
    prefix = torch.arange(Tk, device=real.device)[None, :] < n[:, None]  # (B, Tk)
    if torch.equal(real, prefix):  # right padding: the real keys come first
        return MaskSpec(causal=causal, key_lengths=n)
    return MaskSpec(causal=causal, mask=real[:, None, None, :])  # (B, 1, 1, Tk)


# ------------------------------------------------------------------------ the attention
def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    """transformers' attention hook, served by :func:`mha.attention`.

    Args:
        query: ``(B, h, Tq, d_k)``; key ``(B, h_kv, Tk, d_k)``; value ``(B, h_kv, Tk, d_v)``
            (GQA: K/V keep their ``h_kv`` heads, nothing is repeated).
        attention_mask: what the model's mask hook built (normally :func:`mask_for_mha`), a
            4-D mask of the caller's (bool, or float additive: its finite nonzero values
            become a bias), or None (then ``is_causal``, else ``module.is_causal``).
        dropout: on the attention weights; the layer passes 0 in eval mode.
        scaling: multiplies the scores (None: ``1/sqrt(d_k)``).
        softcap: ``softcap * tanh(s / softcap)`` on the scaled scores (Gemma 2).
        s_aux: ``(h,)`` attention sinks (gpt-oss): ``exp(s_aux[h])`` joins each row's
            denominator, with no value.
        position_bias: float, broadcastable to ``(B, h, Tq, Tk)``, added to the scores (T5).
        head_mask: ``(h,)`` or 4-D broadcastable to ``(B, h, Tq, 1)``: multiplies the
            attention probabilities of each head (of each query row), transformers 4's rule;
            that is the head's output times the same factor.

    Returns ``(out (B, Tq, h, d_v), weights (B, h, Tq, Tk) or None)``; weights are returned
    when ``output_attentions`` is requested (before dropout; without the sink; times
    ``head_mask``).
    """
    _check_kwargs(kwargs)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return _packed_forward(module, query, key, value, dropout, scaling, is_causal, kwargs)
    B, h, Tq, _ = query.shape
    Tk = key.shape[2]
    spec, mask_bias = _spec_for_call(module, attention_mask, Tq, Tk, is_causal)
    window = kwargs.get("sliding_window")
    if window is not None and attention_mask is None and Tk > window:
        raise NotImplementedError(
            f"sliding_window={window} with attention_mask=None and Tk={Tk} keys: mha has no "
            "sliding-window mask kind; build the mask with the model's own mask functions "
            "(they encode the window in it)")
    head_mask = _head_scale(kwargs.get("head_mask"), B, h, Tq)
    variants = _variants(kwargs, mask_bias)
    want_weights = _wants_weights(kwargs)
    out_dtype = query.dtype
    kv = _int8_cache(key, value)
    if kv is not None and kv.reads_int8_in_place(Tq) and not want_weights and not dropout:
        out = _decode().flash_decode(query, key, value, k_scale=kv.k_scale[:, :, :Tk],
                                     v_scale=kv.v_scale[:, :, :Tk], mask=spec.mask,
                                     causal=spec.causal, key_lengths=spec.key_lengths,
                                     scale=scaling, **variants)  # (B, h, Tq, d_v)
        res = (out, None) if want_weights else out
    else:
        if kv is not None:  # a prompt (Tq > 16), or a float16 / float64 cache: dequantize
            key, value = kv.keys()[:, :, :Tk], kv.values()[:, :, :Tk]  # (B, h_kv, Tk, d)
        elif key.dtype != query.dtype and key.dtype.is_floating_point:
            query = query.to(key.dtype)  # K/V stored in their own dtype (bf16 K/V, fp32 model)
        res = attention(query, key, value, mask=spec.mask, causal=spec.causal,
                        key_lengths=spec.key_lengths, scale=scaling,
                        dropout_p=float(dropout or 0.0), return_weights=want_weights,
                        **variants)
    out, weights = res if want_weights else (res, None)
    if attention_mask is not None and attention_mask.is_floating_point():  # a caller's mask
        out, weights = _rows_of_the_mask_alone(attention_mask, spec.mask, value, out, weights)
    out = out.to(out_dtype)  # (B, h, Tq, d_v), the model's dtype
    if head_mask is not None:  # (., ., Tq or 1, 1) broadcasts over d_v and over Tk
        out = out * head_mask.to(out.dtype)  # (B, h, Tq, d_v)
        weights = None if weights is None else weights * head_mask.to(weights.dtype)
    return out.transpose(1, 2).contiguous(), weights  # (B, h, Tq, d_v) -> (B, Tq, h, d_v)


def _rows_of_the_mask_alone(add: torch.Tensor, keep: torch.Tensor, value: torch.Tensor,
                            out: torch.Tensor, weights: torch.Tensor | None):
    """The rows of a float mask ``add`` that keep no pair but hold finite values (all about
    ``finfo.min``): eager and SDPA add that to every score, the scores vanish in the sum, and
    the row's weights are ``softmax(add_row)``, uniform over its ``finfo.min`` entries. Those
    rows of ``out (B, h, Tq, d_v)`` (and of ``weights (B, h, Tq, Tk)``) are replaced by what
    that gives; mha, told the row keeps nothing, returned zeros. ``value (B, h_kv, Tk, d_v)``
    (int8 cache views are read through their cache)."""
    alone = ~keep.any(dim=-1, keepdim=True) & add.isfinite().any(dim=-1, keepdim=True)
    if not bool(alone.any()):  # (., ., Tq, 1)
        return out, weights
    kv = getattr(value, _KV_ATTR, None)
    Tk = add.shape[-1]
    v = kv.values()[:, :, :Tk] if kv is not None else value  # (B, h_kv, Tk, d_v)
    h = out.shape[1]
    v = v.to(torch.float32).repeat_interleave(h // v.shape[1], 1)  # (B, h, Tk, d_v)
    w = torch.softmax(add.to(torch.float32), dim=-1)  # (., ., Tq, Tk): the scores vanished
    w = torch.where(alone, w, 0.0)  # only the rows that keep nothing; NaN-free elsewhere
    fill = (w @ v).to(out.dtype)  # (., ., Tq, Tk) @ (B, h, Tk, d_v) -> (B, h, Tq, d_v)
    out = torch.where(alone, fill, out)  # (B, h, Tq, d_v)
    if weights is not None:
        weights = torch.where(alone, w.to(weights.dtype), weights)  # (B, h, Tq, Tk)
    return out, weights


def _decode():
    from mha.ops import decode

    return decode


def _int8_cache(key: torch.Tensor, value: torch.Tensor):
    """The int8 :class:`mha.KVCache` that ``key`` / ``value`` are views of (an
    :func:`mha.integrations.hf_cache.MhaCache` with ``kv_dtype="int8"``), else None."""
    if key.dtype != torch.int8:
        return None
    kv = getattr(key, _KV_ATTR, None)
    if kv is None or getattr(value, _KV_ATTR, None) is not kv:
        raise TypeError("attn_implementation='mha' got int8 key/value that are not the views "
                        "of an int8 MhaCache (mha.integrations.hf_cache): their scales are "
                        "unknown")
    return kv


def _variants(kwargs: dict, mask_bias: torch.Tensor | None) -> dict:
    """The score variants of one call as :func:`mha.attention`'s keyword arguments (only those
    that are on, so a plain call is the plain call)."""
    out = {}
    softcap = kwargs.get("softcap")
    if softcap is not None:
        out["softcap"] = float(softcap)
    sinks = kwargs.get("s_aux")
    sinks = kwargs.get("sinks") if sinks is None else sinks
    if sinks is not None:
        out["sinks"] = sinks
    bias = kwargs.get("position_bias")
    if bias is not None and not bias.requires_grad and not bool(bias.any()):
        bias = None  # T5's layers without a relative bias pass zeros: adding them is a no-op
    if mask_bias is not None:
        bias = mask_bias if bias is None else bias + mask_bias  # broadcast (., ., Tq, Tk)
    if bias is not None:
        out["bias"] = bias
    return out


def _head_scale(head_mask, B: int, h: int, Tq: int) -> torch.Tensor | None:
    """``head_mask`` as a 4-D factor broadcastable to ``(B, h, Tq, 1)``, or None."""
    if head_mask is None:
        return None
    if not isinstance(head_mask, torch.Tensor) or not head_mask.is_floating_point():
        raise TypeError(f"head_mask must be a float tensor of shape (h,) = ({h},) or "
                        f"broadcastable to (B, h, Tq, 1) = ({B}, {h}, {Tq}, 1), got "
                        f"{_short(head_mask)} {getattr(head_mask, 'dtype', '')}".rstrip())
    if head_mask.dim() == 1 and head_mask.shape[0] == h:
        return head_mask.view(1, h, 1, 1)  # (h,) -> (1, h, 1, 1)
    ok = head_mask.dim() == 4 and all(
        n in (1, want) for n, want in zip(head_mask.shape, (B, h, Tq, 1), strict=True))
    if not ok:
        raise ValueError(f"head_mask must have shape (h,) = ({h},) or be broadcastable to "
                         f"(B, h, Tq, 1) = ({B}, {h}, {Tq}, 1) (one factor per head and query "
                         f"row, the same for every key), got {tuple(head_mask.shape)}")
    return head_mask


def _packed_forward(module, query, key, value, dropout, scaling, is_causal, kwargs):
    """Packed sequences (``DataCollatorWithFlattening``'s ``cu_seq_lens_q/k``): one row of
    ``S`` sequences end to end, served by :func:`mha.varlen_attention`. The offsets define the
    masking (as in transformers' flash-attention path), so ``attention_mask`` is not used."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    cu_k = cu_q if cu_k is None else cu_k
    cu_q = cu_k if cu_q is None else cu_q
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q/k: packed sequences come as one row (B = 1), got "
                         f"query {tuple(query.shape)} (B, h, Tq, d_k)")
    if _wants_weights(kwargs):
        raise NotImplementedError("attn_implementation='mha' returns no attention weights for "
                                  "packed sequences (cu_seq_lens_q/k); use unpacked batches")
    on = sorted(k for k in ("softcap", "s_aux", "sinks", "position_bias", "head_mask")
                if kwargs.get(k) is not None)
    if on:
        raise NotImplementedError(f"attn_implementation='mha' does not combine packed sequences "
                                  f"(cu_seq_lens_q/k) with {', '.join(on)}; use unpacked batches")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),  # (N, h, d)
                           value[0].transpose(0, 1), cu_q.to(query.device),
                           cu_k.to(query.device), causal=bool(causal), scale=scaling,
                           dropout_p=float(dropout or 0.0))  # (N_q, h, d_v)
    return out.unsqueeze(0), None  # (1, N_q, h, d_v)


def _spec_for_call(module, attention_mask, Tq: int, Tk: int,
                   is_causal) -> tuple[MaskSpec, torch.Tensor | None]:
    """The masking of one call as a :class:`MaskSpec` (see the module docstring), and the
    additive bias a float mask carries besides its masking (None when it carries none)."""
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and 1 < Tq < Tk:
            raise ValueError(
                f"attention_mask=None with a causal layer, Tq={Tq} queries and Tk={Tk} keys is "
                "ambiguous: transformers' sdpa aligns that causal mask top-left, mha aligns it "
                "bottom-right; pass the mask built by the model (mask_for_mha) instead")
        return MaskSpec(causal=bool(causal) and Tq > 1), None
    spec = getattr(attention_mask, _SPEC_ATTR, None)
    if isinstance(spec, MaskSpec) and tuple(attention_mask.shape[-2:]) == (Tq, Tk):
        return spec, None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor broadcastable to (B, 1, Tq, Tk) "
                        f"= (B, 1, {Tq}, {Tk}) or None, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D, broadcastable to (B, 1, Tq, Tk) = "
                         f"(B, 1, {Tq}, {Tk}), got shape {tuple(attention_mask.shape)}")
    keep, bias = split_mask(attention_mask)
    return MaskSpec(mask=keep), bias


def split_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A transformers mask as ``(keep, bias)``: bool keep (True = may attend) and the additive
    bias on the kept pairs, or None when the mask is pure masking.

    Bool masks are all keep. A float mask is additive: -inf, or a value at most half of the
    dtype's most negative one (``finfo.min``, what transformers writes, plus any bias),
    masks the pair; 0 keeps it; any other value is a bias added to the score (the bias at
    masked pairs is never read), NaN included, so a NaN in the mask makes its row NaN, as in
    eager and SDPA. A row that keeps no pair but holds finite values is the softmax of the
    mask alone in eager and SDPA (:func:`attention_forward` gives it that).
    """
    if mask.dtype == torch.bool:
        return mask, None
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool (True = may attend) or an additive float "
                        f"mask, got {mask.dtype}")
    keep = ~(mask <= torch.finfo(mask.dtype).min / 2)  # -inf and ~finfo.min: masked; NaN kept
    if bool((mask[keep] == 0).all()):
        return keep, None
    return keep, mask


def _check_kwargs(kwargs: dict) -> None:
    for name, what in _UNSUPPORTED.items():
        val = kwargs.get(name)
        if val is not None and val is not False:
            raise NotImplementedError(f"attn_implementation='mha' does not support {what}: "
                                      f"got {name}={_short(val)}; use attn_implementation='eager'")
    unknown = sorted(k for k, v in kwargs.items()
                     if v is not None and k not in PLUMBING and k not in SERVED
                     and k not in _UNSUPPORTED)
    for k in unknown:
        if k not in _warned:
            _warned.add(k)
            warnings.warn(f"attn_implementation='mha': ignoring keyword argument {k!r} that "
                          "transformers passed to the attention function", stacklevel=3)


def _short(val) -> str:
    return f"tensor{tuple(val.shape)}" if isinstance(val, torch.Tensor) else repr(val)


def _wants_weights(kwargs: dict) -> bool:
    """True when the caller asked for attention weights (``output_attentions``)."""
    if kwargs.get("output_attentions"):
        return True
    try:  # transformers records outputs through hooks; ask its active collector
        from transformers.utils.output_capturing import _active_collector
        collected = _active_collector.get()
    except Exception:  # noqa: BLE001 - private API; absent means "not requested"
        return False
    return isinstance(collected, dict) and ("attentions" in collected
                                            or "cross_attentions" in collected)
