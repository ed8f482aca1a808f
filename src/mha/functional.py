"""``mha.attention``: scaled dot-product attention over heads, validated, then dispatched.

Shape legend: B batch, h query heads, h_kv key/value heads (h_kv divides h: GQA/MQA),
Tq query length, Tk key length, d_k query/key head dim, d_v value head dim.
"""

from __future__ import annotations

import inspect
import math

import torch

from mha import backends, dispatch, trace
from mha.backends.base import AttentionCall
from mha.checks import (
    check_alibi_slopes,
    check_bias,
    check_bool,
    check_key_lengths,
    check_mask,
    check_scalar,
    check_sinks,
    check_softcap,
    check_window,
    qkv_sizes,
)
from mha.masks import MaskSpec
from mha.mods import check_mod
from mha.scores import NO_SCORES, ScoreSpec
from mha.symbolic import size_below

INT64_MAX = 2 ** 63 - 1


def make_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None,
              causal: bool = False, key_lengths=None, scale: float | None = None,
              dropout_p: float = 0.0, return_weights: bool = False,
              window: int | None = None,
              # score variants (mha.scores)
              softcap: float | None = None, sinks=None, bias=None, alibi_slopes=None,
              # mask / score functions of indices (mha.mods)
              mask_mod=None, score_mod=None, return_lse: bool = False) -> AttentionCall:
    """Validate the arguments of :func:`attention` and bundle them into one call."""
    return _make_call(q, k, v, mask, causal, key_lengths, scale, dropout_p, return_weights,
                      window, softcap, sinks, bias, alibi_slopes, mask_mod, score_mod, return_lse)


def _make_call(q, k, v, mask, causal, key_lengths, scale, dropout_p, return_weights, window,
               softcap, sinks, bias, alibi_slopes, mask_mod, score_mod,
               return_lse) -> AttentionCall:
    """:func:`make_call` with its arguments in order (``attention`` calls it per call: 17
    keyword arguments cost more to pass than 17 in order)."""
    sizes = qkv_sizes(q, k, v)  # validated q, k, v: (B, h, Tq, d_k, h_kv, Tk, d_v)
    B, h, Tq, d_k, _, Tk, _ = sizes
    # (a bool, or a float in range, passes without the helper's call: the common case)
    if causal is not True and causal is not False:
        causal = check_bool("causal", causal)
    if return_weights is not True and return_weights is not False:
        return_weights = check_bool("return_weights", return_weights)
    if return_lse is not True and return_lse is not False:
        return_lse = check_bool("return_lse", return_lse)
    if return_weights and return_lse:
        raise ValueError("return_weights and return_lse: pass one of them (the log-sum-exp of "
                         "a row is log(sum_j exp(s_ij)); the weights are exp(s_ij - lse_i))")
    m = None if mask is None else check_mask(mask, B, h, Tq, Tk, q.device)
    kl = None if key_lengths is None else check_key_lengths(key_lengths, B, Tk, q.device)
    scale = 1.0 / math.sqrt(d_k) if scale is None else check_scalar("scale", scale, low=0.0)
    if dropout_p.__class__ is not float or not 0.0 <= dropout_p < 1.0:  # NaN: not in range
        dropout_p = check_scalar("dropout_p", dropout_p, low=0.0, high=1.0, high_open=True)
    if window is not None:  # a window past Tk keys is every key: clamped, so any int fits int64
        window = check_window(window, causal)
        # under torch.export a dynamic Tk is not compared (a guard would narrow its range):
        # a window >= Tk hides no key in every backend, so only int64 bounds it there
        window = max(Tk, 1) if size_below(Tk, window, unsettled=False) else min(window, INT64_MAX)
    # score variants (mha.scores)
    if softcap is None and sinks is None and bias is None and alibi_slopes is None:
        scores = NO_SCORES
    else:
        scores = ScoreSpec(
            softcap=None if softcap is None else check_softcap(softcap),
            sinks=None if sinks is None else check_sinks(sinks, h, q.device),
            bias=None if bias is None else check_bias(bias, B, h, Tq, Tk, q.device),
            alibi_slopes=None if alibi_slopes is None else check_alibi_slopes(
                alibi_slopes, B, h, q.device))
    if mask_mod is not None or score_mod is not None:
        # mask / score functions of indices (mha.mods): called lazily, when a plan is built
        mask_mod = check_mod("mask_mod", mask_mod)
        score_mod = check_mod("score_mod", score_mod)
        _check_mods_exportable(mask_mod, score_mod)
    if m is None and kl is None and window is None and mask_mod is None:
        masks = _CAUSAL if causal else _NO_MASKS  # immutable: one each, shared by every call
    else:
        masks = MaskSpec(causal, kl, m, window, mask_mod)
    return AttentionCall(q, k, v, masks, scale, dropout_p, return_weights, scores,
                         score_mod=score_mod, return_lse=return_lse, sizes=sizes)


_NO_MASKS, _CAUSAL = MaskSpec(), MaskSpec(causal=True)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None,
              causal: bool = False, key_lengths=None, scale: float | None = None,
              dropout_p: float = 0.0, return_weights: bool = False, backend: str | None = None,
              window: int | None = None,
              # score variants (mha.scores)
              softcap: float | None = None, sinks=None, bias=None, alibi_slopes=None,
              # mask / score functions of indices (mha.mods)
              mask_mod=None, score_mod=None, return_lse: bool = False):
    """``softmax(q k^T * scale) v`` for every head, as the seeds write it.

    Args:
        q: ``(B, h, Tq, d_k)`` queries.
        k: ``(B, h_kv, Tk, d_k)`` keys; ``h_kv`` divides ``h`` (query head ``i`` reads K/V
            head ``i // (h // h_kv)``; h_kv = 1 is multi-query attention). K/V are not repeated.
        v: ``(B, h_kv, Tk, d_v)`` values; ``d_v`` may differ from ``d_k``.
        mask: bool, broadcastable to ``(B, h, Tq, Tk)``, **True = may attend**.
        causal: query ``i`` sees keys ``j <= i + Tk - Tq`` — aligned to the bottom right, so
            the last query sees every key. For Tq=2, Tk=5 (rows are queries)::

                1 1 1 1 0
                1 1 1 1 1

        key_lengths: ``(B,)`` integers, the number of real keys per batch row (padding last).
        window: with ``causal``, sliding-window attention: each query sees only the ``window``
            most recent keys up to its diagonal (``j > i + Tk - Tq - window``), as Mistral's
            and Qwen2's local layers do. See :mod:`mha.masks`.
        scale: multiplies the scores; None means ``1 / sqrt(d_k)``.
        dropout_p: dropout on the attention weights (training); 0 means none.
        return_weights: also return the softmax weights ``(B, h, Tq, Tk)`` (before dropout).
        return_lse: also return the log-sum-exp ``(B, h, Tq)`` float32 of each row: the log of
            its softmax denominator, ``log(sum_j exp(s_ij) + exp(sink))`` over the keys it may
            attend, ``-inf`` for a row that sees none (and has no sink); differentiable. What
            merging results over disjoint key sets needs (ring attention, split-K decoding):
            ``out = sum_s exp(lse_s - lse) out_s``. Served by backends whose capabilities say
            ``lse`` (flash_cpu, math, reference); not together with ``return_weights``.
        backend: force one of ``mha.backends.ORDER``; None picks the first capable one.
        softcap: a finite float > 0: the scaled scores become ``softcap * tanh(s / softcap)``,
            before the bias and the masks (Gemma 2's logit soft-capping).
        sinks: ``(h,)`` float, one attention-sink logit per query head (gpt-oss): each row's
            softmax denominator gains ``exp(sinks[hq])``, a key with no value. The returned
            weights exclude the sink (a row sums to less than 1). Differentiable.
        bias: float, broadcastable to ``(B, h, Tq, Tk)`` (e.g. T5's ``(1, h, Tq, Tk)`` position
            bias or a ``(h, 1, Tk)`` one), added to the scores after the softcap. Read through
            its broadcast view, never expanded; its gradient comes back in its own shape.
            A bias is not a mask: pass masked pairs in ``mask`` (a masked pair's bias is never
            read, even when it is NaN or -inf).
        alibi_slopes: ``(h,)`` or ``(B, h)`` float (ALiBi, BLOOM / MPT;
            :func:`mha.alibi_slopes` gives the paper's slopes): the scores lose
            ``slope * (i + Tk - Tq - j)``, the distance to query ``i``'s bottom-right diagonal
            (signed: keys after it gain). Per row this differs from BLOOM's ``slope * j`` by a
            constant, so the softmax is BLOOM's under any mask (not with a sink). Slopes that
            require grad get their gradient (sdpa, math, reference); the native kernels read
            them as constants and refuse such a call, so dispatch passes it on.
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend), called with
            broadcastable index tensors; see :mod:`mha.mods` (built-ins: ``causal``,
            ``sliding_window``, ``document``, ``prefix_lm``, ``chunked``). Served through a
            cached block plan (:func:`mha.block_plan`) by the ``blocksparse`` backend (and
            ``reference``): empty blocks are skipped, full blocks never call it.
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` of the same shape, applied to
            the scaled scores before masking (``blocksparse``, ``reference``).

    Order of operations for query ``i``, key ``j``: ``s = scale * q_i . k_j``, the softcap, ``+
    bias``, the ALiBi term, then the masks (mask AND causal AND key_lengths AND window), then
    the softmax with the sink in its denominator (:mod:`mha.scores`).

    All masks combine with AND. Query rows that may attend no key return zeros (and zero
    weights), with finite gradients — with or without a sink.

    Sizes: d_k must be >= 1 (a ValueError otherwise: with no dimension to sum over, the scores
    and the default scale are undefined). Every other size may be 0 and gives the correctly
    shaped, possibly empty, result on every backend: ``d_v = 0`` is an empty output
    ``(B, h, Tq, 0)`` (with ``return_weights``, the weights are still the softmax).
    Scalars: ``causal`` / ``return_weights`` are bools, ``scale`` / ``dropout_p`` finite real
    numbers, ``window`` an int; numpy scalars of those kinds are accepted, tensors are not.

    Returns:
        ``out (B, h, Tq, d_v)``, or ``(out, weights)`` when ``return_weights``, or ``(out,
        lse)`` when ``return_lse``.
    """
    call = _make_call(q, k, v, mask, causal, key_lengths, scale, dropout_p, return_weights,
                      window, softcap, sinks, bias, alibi_slopes, mask_mod, score_mod, return_lse)
    if call.Tq == 0 or call.Tk == 0 or call.B == 0 or (
            call.d_v == 0 and not call.return_weights and not call.return_lse):
        out, second = _empty(call)
    else:
        chosen = dispatch.choose(call, backend)
        trace.set_backend(chosen.name)
        out, second = chosen.forward(call)  # second: the weights, or the lse (return_lse)
    return (out, second) if call.return_weights or call.return_lse else out


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> dispatch.Explanation:
    """Every backend's verdict on ``attention(q, k, v, **kwargs)``, with reasons in words.

    ``print(mha.explain(q, k, v, causal=True))`` shows which backend would run and why the
    others would not. ``backend`` is accepted (every backend's verdict is shown, the forced
    one's included) but must name a backend, as in :func:`attention` (ValueError otherwise);
    an argument :func:`attention` does not take is refused naming it (TypeError).
    """
    backend = kwargs.pop("backend", None)
    if backend is not None:
        backends.get(backend)  # an unknown name: the ValueError attention() raises
    unknown = sorted(set(kwargs) - _EXPLAINED)
    if unknown:
        raise TypeError(f"explain: unknown argument(s) {unknown}; it takes attention()'s "
                        f"keyword arguments ({', '.join(sorted(_EXPLAINED | {'backend'}))})")
    return dispatch.verdicts(make_call(q, k, v, **kwargs))


#: the keyword arguments of attention() that explain() passes on to make_call
_EXPLAINED = frozenset(inspect.signature(make_call).parameters) - {"q", "k", "v"}


def _check_mods_exportable(mask_mod, score_mod) -> None:
    """Under ``torch.export``, refuse ``mask_mod`` / ``score_mod``: their block plans are
    computed in Python from the function's values (which blocks are empty, full, partial), and
    a traced program has no values, only shapes."""
    if (mask_mod is None and score_mod is None) or not torch.compiler.is_exporting():
        return
    name = "mask_mod" if mask_mod is not None else "score_mod"
    instead = ("causal= / window= / key_lengths= / a bool mask tensor" if name == "mask_mod"
               else "a float bias= tensor (or alibi_slopes=, softcap=)")
    raise ValueError(f"{name}: torch.export cannot carry a {name}: its block plan is computed "
                     f"in Python from the function's values, which a traced program does not "
                     f"have; pass it as {instead} instead")


def _empty(call: AttentionCall):
    """Empty sequences or batch: correctly shaped zeros, still attached to the graph."""
    out = call.q.new_zeros(call.B, call.h, call.Tq, call.d_v)  # (B, h, Tq, d_v)
    if call.needs_grad:
        attached = [t.sum() for t in (call.q, call.k, call.v, *call.scores.grad_tensors())]
        out = out + 0.0 * sum(attached)
    if call.return_lse:  # no key: the sink alone, or -inf
        lse = call.q.new_full((call.B, call.h, call.Tq), float("-inf"), dtype=torch.float32)
        if call.scores.sinks is not None:
            lse = lse.logaddexp(call.scores.sinks.float().view(1, -1, 1))  # (B, h, Tq)
        return out, lse
    weights = call.q.new_zeros(call.B, call.h, call.Tq, call.Tk) if call.return_weights else None
    return out, weights
