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
as is; a float additive mask becomes ``mask == 0`` after checking it holds only 0 and large
negative values (a real additive bias is rejected, not rounded). Features mha does not have
(soft-capping, attention sinks, position bias, paged caches) raise
a ``NotImplementedError`` naming them instead of being ignored.

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

# Keyword arguments whose (non-None, non-False) values change the math in ways mha cannot do.
_UNSUPPORTED = {
    "softcap": "logit soft-capping (softcap)",
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "head_mask": "head masking",
    "cache": "a paged KV cache (continuous batching)",
}
# Plumbing that transformers passes down to every attention function; none changes the math.
_PLUMBING = frozenset({
    "position_ids", "output_attentions", "output_hidden_states", "use_cache", "cache_position",
    "past_key_values", "past_key_value", "return_dict", "num_items_in_batch",
    "output_router_logits", "max_length_q", "max_length_k", "seq_idx", "position_embeddings",
    "layer_idx", "token_type_ids", "encoder_hidden_states", "encoder_attention_mask",
    "cu_seq_lens_q", "cu_seq_lens_k",  # consumed by the packed path (_packed_forward)
})
_warned: set[str] = set()
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
    spec = _native_spec(batch_size, q_length, kv_length, int(q_offset), int(kv_offset),
                        mask_function, attention_mask, mu)
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
            4-D mask of the caller's, or None (then ``is_causal``, else ``module.is_causal``).
        dropout: on the attention weights; the layer passes 0 in eval mode.
        scaling: multiplies the scores (None: ``1/sqrt(d_k)``).

    Returns ``(out (B, Tq, h, d_v), weights (B, h, Tq, Tk) or None)``; weights are returned
    when ``output_attentions`` is requested (before dropout).
    """
    _check_kwargs(kwargs)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return _packed_forward(module, query, key, value, dropout, scaling, is_causal, kwargs)
    Tq, Tk = query.shape[2], key.shape[2]
    spec = _spec_for_call(module, attention_mask, Tq, Tk, is_causal)
    window = kwargs.get("sliding_window")
    if window is not None and attention_mask is None and Tk > window:
        raise NotImplementedError(
            f"sliding_window={window} with attention_mask=None and Tk={Tk} keys: mha has no "
            "sliding-window mask kind; build the mask with the model's own mask functions "
            "(they encode the window in it)")
    want_weights = _wants_weights(kwargs)
    res = attention(query, key, value, mask=spec.mask, causal=spec.causal,
                    key_lengths=spec.key_lengths, scale=scaling, dropout_p=float(dropout or 0.0),
                    return_weights=want_weights)
    out, weights = res if want_weights else (res, None)
    return out.transpose(1, 2).contiguous(), weights  # (B, h, Tq, d_v) -> (B, Tq, h, d_v)


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
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1),  # (N, h, d)
                           value[0].transpose(0, 1), cu_q.to(query.device),
                           cu_k.to(query.device), causal=bool(causal), scale=scaling,
                           dropout_p=float(dropout or 0.0))  # (N_q, h, d_v)
    return out.unsqueeze(0), None  # (1, N_q, h, d_v)


def _spec_for_call(module, attention_mask, Tq: int, Tk: int, is_causal) -> MaskSpec:
    """The masking of one call as a :class:`MaskSpec` (see the module docstring)."""
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and 1 < Tq < Tk:
            raise ValueError(
                f"attention_mask=None with a causal layer, Tq={Tq} queries and Tk={Tk} keys is "
                "ambiguous: transformers' sdpa aligns that causal mask top-left, mha aligns it "
                "bottom-right; pass the mask built by the model (mask_for_mha) instead")
        return MaskSpec(causal=bool(causal) and Tq > 1)
    spec = getattr(attention_mask, _SPEC_ATTR, None)
    if isinstance(spec, MaskSpec) and tuple(attention_mask.shape[-2:]) == (Tq, Tk):
        return spec
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor broadcastable to (B, 1, Tq, Tk) "
                        f"= (B, 1, {Tq}, {Tk}) or None, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D, broadcastable to (B, 1, Tq, Tk) = "
                         f"(B, 1, {Tq}, {Tk}), got shape {tuple(attention_mask.shape)}")
    return MaskSpec(mask=bool_mask(attention_mask))


def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A transformers mask as bool, True = may attend.

    Bool masks pass through. Float masks are additive (0 = attend, a large negative number
    such as ``finfo.min`` or -inf = masked); any other value is a bias mha cannot apply, so
    it raises rather than round it away.
    """
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool (True = may attend) or an additive float "
                        f"mask, got {mask.dtype}")
    allowed = mask == 0
    if not bool((allowed | (mask <= -1e4)).all()):
        bad = mask[~allowed & (mask > -1e4)]
        raise NotImplementedError(
            f"attention_mask holds an additive bias (values such as {bad[:3].tolist()}), not "
            "only 0 (attend) and large negative values (masked); mha applies masks, not biases")
    return allowed


def _check_kwargs(kwargs: dict) -> None:
    for name, what in _UNSUPPORTED.items():
        val = kwargs.get(name)
        if val is not None and val is not False:
            raise NotImplementedError(f"attn_implementation='mha' does not support {what}: "
                                      f"got {name}={_short(val)}; use attn_implementation='eager'")
    unknown = sorted(k for k, v in kwargs.items()
                     if v is not None and k not in _PLUMBING and k != "sliding_window"
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
