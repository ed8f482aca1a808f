"""``mha.MultiHeadAttention``: the seeds' module, (B, T, d_model) in and out.

Shape legend: B batch, Tq/Tk query/key lengths, d_model model width, h query heads,
h_kv key/value heads (h_kv divides h), d_k query/key head dim, d_v value head dim,
kdim/vdim the widths of the key/value inputs (d_model unless cross-attending other widths).

Score variants (:mod:`mha.scores`) are options of the module: ``softcap`` (a float), ``sinks``
(a learned ``(h,)`` parameter) and ``alibi`` (fixed ``(h,)`` slopes, derived from h); a score
``bias`` and the index functions ``mask_mod`` / ``score_mod`` (:mod:`mha.mods`) are per call.
Every mode (plain, cached, packed) passes them to :func:`mha.attention` /
:func:`mha.varlen_attention`; the cached mode keeps them aligned to the cache positions. The
paged mode (:meth:`MultiHeadAttention.forward_paged`: one packed step of continuous batching
over a :class:`mha.PagedKVCache`) passes the module's softcap, sinks and ALiBi slopes to
:meth:`mha.PagedKVCache.attend_varlen`. Rotary position embeddings (``rope``, :mod:`mha.rope`)
turn the query and key heads after the projections, at positions each mode defines (given /
``0..T-1``, the cache's, per sequence, each token's own in the paged mode).

The fast path projects Q, K and V with one GEMM (packed weight) for self-attention, splits the
heads (views of the GEMM's output), calls :func:`mha.attention`, merges the heads (a view:
the attention kernels write their output as ``(B, Tq, h, d_v)`` in memory) and applies W_O.
Each projection runs on whichever GEMM was measured faster on this CPU for its shape class —
mha.linear's native tiles or torch's (:mod:`mha.ops.linear_choice`);
:meth:`MultiHeadAttention.explain` says which, and why. The seed-000 view — one
independent ``W_i^Q, W_i^K, W_i^V`` of shape ``(d_model, d_k)`` per head — is available through
:meth:`MultiHeadAttention.per_head_weights` and :func:`mha.reference.multi_head_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mha import interop, trace
from mha.checks import (
    check_bias,
    check_bool,
    check_cu_seqlens,
    check_device,
    check_float_dtype,
    check_int,
    check_same,
    check_scalar,
    check_softcap,
    check_tensor,
)
from mha.functional import attention
from mha.functional import explain as explain_attention
from mha.fused_verdicts import UNSERVED_HELP, fused_conditions, unserved
from mha.linear import describe, linear
from mha.mods import check_mod
from mha.ops.self_attention import DTYPES as FUSED_DTYPES
from mha.ops.self_attention import Panels, why_not_fused
from mha.ops.self_attention import describe as describe_fused
from mha.ops.self_attention import self_attention as fused_forward
from mha.ops.self_attention import tiles as fused_tiles
from mha.paged import check_step
from mha.rope import Rotary, as_rotary, check_positions
from mha.scores import alibi_slopes
from mha.varlen import varlen_attention


class StateDictMismatch(ValueError, RuntimeError):
    """A state dict whose tensors do not fit the module (a ValueError; also the RuntimeError
    that ``nn.Module.load_state_dict`` raises, for callers that catch that)."""


def _apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A projection of ``x (..., in)`` -> ``(..., out)``: an ``nn.Linear`` through
    :func:`mha.linear.linear` (the native tiles or torch's GEMM); any other module (a packed
    projection, :class:`mha.llm.weights.PackedLinear`, holding its weight in its kernel's
    layout) is called."""
    if isinstance(layer, nn.Linear):
        return linear(x, layer.weight, layer.bias)
    return layer(x)


def _state_dict_mismatches(module: nn.Module, state_dict, prefix: str,
                           assign: bool = False) -> list[str]:
    """The entries of ``state_dict`` under ``prefix`` that ``nn.Module.load_state_dict`` would
    refuse for ``module``'s parameters and persistent buffers (not a tensor, another shape, no
    data to copy: meta or not dense), and those
    :meth:`MultiHeadAttention.load_per_head_weights` refuses too (bool or complex). With
    ``assign`` (the entries replace the tensors, keeping their own dtype and device): integer
    entries, and entries that would leave the module's tensors of several dtypes or devices."""
    own = dict(module.named_parameters())
    own.update((name, b) for name, b in module.named_buffers() if b is not None
               and name.rsplit(".", 1)[-1] not in _non_persistent(module, name))
    wrong = []
    after = {}  # name -> the tensor it holds after an assign
    for name, t in own.items():
        key = prefix + name
        after[key] = t
        if key not in state_dict:
            continue  # missing keys: nn.Module's own rule (strict or not)
        got = state_dict[key]
        if not isinstance(got, torch.Tensor):
            wrong.append(f"{key} must be a tensor, got {type(got).__name__}")
        elif got.shape != t.shape:
            wrong.append(f"{key} must have shape {tuple(t.shape)}, got {tuple(got.shape)}")
        elif got.dtype.is_complex or got.dtype == torch.bool:
            wrong.append(f"{key} must be a real tensor (floating or integer), got {got.dtype}")
        elif got.layout != torch.strided:
            wrong.append(f"{key} must be a dense (strided) tensor, got layout {got.layout}")
        elif assign and not got.dtype.is_floating_point:
            wrong.append(f"{key} must be floating with assign=True (which keeps the entry's "
                         f"dtype), got {got.dtype}")
        elif got.is_meta and not (assign or t.is_meta):
            wrong.append(f"{key} is a meta tensor: it holds no data to copy")
        else:
            after[key] = got
    if assign and not wrong:
        for what in ("dtype", "device"):
            kinds = {getattr(t, what) for t in after.values()}
            if len(kinds) > 1:
                got = ", ".join(f"{k} {getattr(t, what)}" for k, t in after.items())
                wrong.append(f"with assign=True (which keeps each entry's {what}) the module's "
                             f"tensors must keep one {what}, got {got}; cast the entries first "
                             "or load without assign")
    return wrong


def _non_persistent(module: nn.Module, name: str) -> set[str]:
    """The non-persistent buffer names of the submodule that owns buffer ``name``."""
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    return owner._non_persistent_buffers_set


class MultiHeadAttention(nn.Module):
    """Multi-head attention: ``Concat(head_1..head_h) W_O`` with
    ``head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i``.

    Args:
        d_model: model width (input and output).
        num_heads: h, the number of query heads.
        num_kv_heads: h_kv, key/value heads (GQA; 1 = MQA). Default h.
        head_dim: d_k. Default ``d_model // num_heads`` (then d_model must divide evenly).
        v_head_dim: d_v. Default d_k.
        kdim, vdim: widths of the key and value inputs. Default d_model.
        bias: biases on the four projections.
        dropout: dropout on the attention weights while training.
        softcap: None (off) or a finite float > 0: scores become ``softcap * tanh(s / softcap)``
            (Gemma 2).
        sinks: a learned attention-sink logit per query head (gpt-oss): the parameter
            ``sinks`` ``(h,)``, initialised to zeros, in each row's softmax denominator.
        alibi: ALiBi (BLOOM, MPT): the buffer ``alibi_slopes`` ``(h,)`` float32 of
            :func:`mha.alibi_slopes`; scores lose ``slope * (query position - key position)``
            (self-attention and decoding; cross-attention aligns the last query with the
            last key, as :func:`mha.attention`). Derived from h, so not in the state dict,
            and kept float32 under ``.to(dtype)``.
        rope: rotary position embeddings on the query and key heads after the projections
            (Llama, Qwen, Mistral, Phi ...): None (off), True (``mha.rope.Rotary(head_dim)``,
            theta 10000, halves) or a :class:`mha.rope.Rotary` (theta, partial ``dim``,
            ``interleaved``, linear / llama3 ``scaling``). Self-attention only. The positions
            are ``0 .. T-1`` in a plain call (or ``forward(positions=...)``), each row's cache
            length onwards with ``cache=``, and restart at 0 in each sequence with
            ``cu_seqlens=``. No parameters (nothing in the state dict).

    Sizes are positive ints, ``bias`` a bool, ``dropout`` a number in [0, 1), ``dtype`` None or
    floating (numpy scalars of those kinds are accepted); anything else is refused before a
    parameter exists, with an error naming the argument (``softcap`` a finite number > 0 or
    None, ``sinks`` / ``alibi`` bools).

    Parameters: ``in_proj`` (packed ``[W^Q; W^K; W^V]``, when kdim == vdim == d_model) or
    ``q_proj``/``k_proj``/``v_proj``; ``out_proj`` (W_O); and ``sinks`` ``(h,)`` with
    ``sinks=True``. Like ``nn.Linear``, weights are
    stored ``(out_features, in_features)``; the seeds' ``W`` of ``X W`` is their transpose.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, v_head_dim: int | None = None,
                 kdim: int | None = None, vdim: int | None = None, bias: bool = True,
                 dropout: float = 0.0, softcap: float | None = None, sinks: bool = False,
                 alibi: bool = False, rope: Rotary | bool | None = None, device=None,
                 dtype=None) -> None:
        super().__init__()
        d_model, num_heads = _positive("d_model", d_model), _positive("num_heads", num_heads)
        if head_dim is None and d_model % num_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads} "
                             f"(d_k = d_model / h, seed 000), or pass head_dim explicitly")
        num_kv_heads = _positive("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads} (each K/V head serves h/h_kv query heads)")
        head_dim = _positive("head_dim", d_model // num_heads if head_dim is None else head_dim)
        v_head_dim = _positive("v_head_dim", head_dim if v_head_dim is None else v_head_dim)
        kdim = _positive("kdim", d_model if kdim is None else kdim)
        vdim = _positive("vdim", d_model if vdim is None else vdim)
        bias = check_bool("bias", bias)
        dropout = check_scalar("dropout", dropout, low=0.0, high=1.0, high_open=True)
        softcap = None if softcap is None else check_softcap(softcap)
        sinks, alibi = check_bool("sinks", sinks), check_bool("alibi", alibi)
        rope = as_rotary(rope, head_dim)
        dtype = check_float_dtype("dtype", dtype)
        device = check_device("device", device)
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim, self.v_head_dim, self.kdim, self.vdim = head_dim, v_head_dim, kdim, vdim
        self.dropout = dropout
        kw = dict(bias=bias, device=device, dtype=dtype)
        q_w, k_w, v_w = self.q_width, self.k_width, self.v_width
        self.packed = self.kdim == d_model and self.vdim == d_model
        if self.packed:
            self.in_proj = nn.Linear(d_model, q_w + k_w + v_w, **kw)  # [W^Q; W^K; W^V]
        else:
            self.q_proj = nn.Linear(d_model, q_w, **kw)
            self.k_proj = nn.Linear(self.kdim, k_w, **kw)
            self.v_proj = nn.Linear(self.vdim, v_w, **kw)
        self.out_proj = nn.Linear(num_heads * self.v_head_dim, d_model, **kw)  # W_O
        self.softcap = softcap
        # one sink logit per query head (gpt-oss initialises them to zeros too)
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype)) \
            if sinks else None  # (h,)
        # derived from h (not saved): persistent=False keeps it out of the state dict
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device) if alibi
                             else None, persistent=False)  # (h,) float32
        #: rotary position embeddings of Q and K (a frozen config; no parameters), or None
        self.rope = rope
        #: ranks the heads are split over (mha.distributed.tensor_parallel); the head counts
        #: above are then this rank's
        self.tensor_parallel = 1
        #: the weights packed once for the fused forward (:meth:`freeze`), or None
        self.frozen: Panels | None = None

    # Widths of the projected Q, K, V (derived, not stored).
    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim  # h * d_k

    @property
    def k_width(self) -> int:
        return self.num_kv_heads * self.head_dim  # h_kv * d_k

    @property
    def v_width(self) -> int:
        return self.num_kv_heads * self.v_head_dim  # h_kv * d_v

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, kdim={self.kdim}, vdim={self.vdim}, "
                f"dropout={self.dropout}"
                + (f", softcap={self.softcap}" if self.softcap is not None else "")
                + (", sinks=True" if self.sinks is not None else "")
                + (", alibi=True" if self.alibi_slopes is not None else "")
                + (f", rope={self.rope!r}" if self.rope is not None else ""))

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``, ``.cuda()``, ``.to_empty()`` ...: as nn.Module, but the ALiBi
        slopes are derived, so they are rebuilt on the new device: exact float32 (never
        rounded to bfloat16 / float16 — BLOOM also computes its slopes in float32) and never
        left uninitialised by ``to_empty`` (they are not in the state dict to reload)."""
        super()._apply(fn, recurse)
        slopes = self.alibi_slopes
        if slopes is not None:
            self.alibi_slopes = alibi_slopes(slopes.shape[0]).to(slopes.device)  # (h,) float32
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """``load_state_dict``, all or nothing for this module: the entries of all its tensors
        (its projections' included) are checked first, so a refused load leaves every weight as
        it was. (nn.Module copies the tensors that fit, then raises for the others.)"""
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        wrong = _state_dict_mismatches(self, state_dict, prefix, assign)
        if wrong:
            raise StateDictMismatch("load_state_dict: " + "; ".join(wrong) + " (nothing was "
                                    "loaded: the module's weights are unchanged)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # ----------------------------------------------------------------------------- projections
    def projection_weights(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """``((W^Q, b^Q), (W^K, b^K), (W^V, b^V))`` in nn.Linear layout (views, no copies)."""
        if not self.packed:
            return tuple((p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj))
        W, b = self.in_proj.weight, self.in_proj.bias
        cuts = (0, self.q_width, self.q_width + self.k_width,
                self.q_width + self.k_width + self.v_width)
        return tuple((W[lo:hi], None if b is None else b[lo:hi])
                     for lo, hi in zip(cuts[:-1], cuts[1:], strict=True))

    def project(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                self_attention: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V before the head split: ``(B, Tq, h*d_k)``, ``(B, Tk, h_kv*d_k)``,
        ``(B, Tk, h_kv*d_v)``. Self-attention with the packed weight is one GEMM."""
        first = self.in_proj if self.packed else self.q_proj
        if self.tensor_parallel > 1 or not isinstance(first, nn.Linear):
            return self._project_sharded(query, key, value, self_attention)
        if self.packed and self_attention:
            qkv = _apply(self.in_proj, query)  # one GEMM:
            # (B, T, d_model) -> (B, T, h*d_k + h_kv*d_k + h_kv*d_v)
            return qkv.split((self.q_width, self.k_width, self.v_width), dim=-1)
        (wq, bq), (wk, bk), (wv, bv) = self.projection_weights()
        return linear(query, wq, bq), linear(key, wk, bk), linear(value, wv, bv)

    def _project_sharded(self, query, key, value, self_attention: bool):
        """Through the projection modules: under tensor parallelism the nn.Linear modules,
        whose DTensor hooks (ColwiseParallel) give this rank's heads and all-reduce the input's
        gradient, and packed projections (:mod:`mha.llm.weights`), which hold their weights in
        their kernel's layout. The packed weight holds (this rank's) ``[W^Q; W^K; W^V]``; for
        cross-attention it is applied to each input and the matching part kept (three GEMMs of
        the full width)."""
        widths = (self.q_width, self.k_width, self.v_width)
        if not self.packed:
            return self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if self_attention:
            return self.in_proj(query).split(widths, dim=-1)
        return tuple(self.in_proj(x).split(widths, dim=-1)[i]
                     for i, x in enumerate((query, key, value)))

    def split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """``(B, T, heads*d) -> (B, heads, T, d)`` (seed 004, Step 3)."""
        B, T, width = x.shape
        return x.view(B, T, heads, width // heads).transpose(1, 2)  # (B, T, heads, d) -> (B, heads, T, d)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, h, T, d_v) -> (B, T, h*d_v)``: the concat of seed 004, Step 5."""
        B, h, T, d_v = x.shape
        return x.transpose(1, 2).reshape(B, T, h * d_v)  # (B, h, T, d_v) -> (B, T, h*d_v)

    # ----------------------------------------------------------------------------- forward
    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, mask=None, causal: bool = False,
                key_lengths=None, need_weights: bool = False, backend: str | None = None,
                cache=None, cu_seqlens=None, window: int | None = None, bias=None,
                mask_mod=None, score_mod=None, positions=None, angles=None):
        """query ``(B, Tq, d_model)``; key ``(B, Tk, kdim)`` and value ``(B, Tk, vdim)`` default
        to query (self-attention). ``mask``/``causal``/``key_lengths``/``window`` as in
        :func:`mha.attention` (True = may attend). Returns ``(B, Tq, d_model)``, or
        ``(output, weights (B, h, Tq, Tk))`` when ``need_weights``.

        Per-call score variants, as in :func:`mha.attention` (the module's own ``softcap``,
        ``sinks`` and ALiBi slopes are added to every call): ``bias`` a float score bias
        broadcastable to ``(B, h, Tq, Tk)`` (not the projections' biases); ``mask_mod``
        ``(b, h, q_idx, kv_idx) -> bool`` and ``score_mod`` ``(score, b, h, q_idx, kv_idx)
        -> score`` (:mod:`mha.mods`).

        ``cache`` (a :class:`mha.KVCache` from :meth:`new_cache`): incremental decoding. Only
        the new tokens ``query (B, Tn, d_model)`` are projected; their K/V are appended to the
        cache in place, and they attend causally (bottom-right per row) to everything cached.
        Prefill (Tn = prompt length) and single-token steps are the same call. Self-attention
        only; the cache supplies the masking, so ``mask``/``key_lengths`` must be None.
        Variants follow the cache positions, so that decoding step by step gives what one
        call over the whole sequence gives: ALiBi's distance is query position minus key
        position in each row (also for rows of different lengths), and ``mask_mod`` /
        ``score_mod`` receive as ``q_idx`` the query's position in its cache row and as
        ``kv_idx`` the key's (positions count from the start of the storage, left padding
        included). ``bias`` is ``(B, h, Tn, Tk)``-broadcastable, Tk the longest row after the
        append.

        ``cu_seqlens`` ``(S + 1,)``: packed sequences (see :func:`mha.varlen_attention`). The
        query is ``(1, N, d_model)``, S sequences end to end, and each token attends only within
        its own sequence (causally if ``causal``). Self-attention only; no mask, key_lengths,
        cache, weights, mask_mod or score_mod; ``bias`` is the per-sequence list of
        :func:`mha.varlen_attention`.

        ``positions`` (only with ``rope``): the tokens' positions in a plain call, ints >= 0 of
        shape ``(Tq,)`` or ``(B, Tq)`` (transformers' ``position_ids``, e.g. counting from each
        row's first real token in a left-padded batch); None = ``0 .. Tq-1``. With ``cache=``
        the positions come from the cache (:meth:`mha.KVCache.positions`: each row's length
        past its start) and with ``cu_seqlens=`` they restart at 0 in each sequence, so
        ``positions`` must be None there.

        ``angles`` (only with ``rope``, ``positions`` None): the ``(C, S)`` of
        ``self.rope.angles(...)`` (:meth:`mha.rope.Rotary.angles`, ``(B|1, Tq, r)`` each) for
        the positions this call would take, computed once by a caller whose layers share one
        ``Rotary`` and one set of positions (:class:`mha.models.Llama`: one per forward, not one
        per layer); used as they are instead of the mode's positions (their shape, dtype and
        device are checked, their values are the caller's: the angles of another rope, of
        the same dim but another theta or scaling, cannot be told from this one's and rotate
        by their angles, so they must come from ``self.rope``)."""
        causal = check_bool("causal", causal)  # also with a cache, which masks causally anyway
        need_weights = check_bool("need_weights", need_weights)
        _check_modes(query, key, value, mask=mask, key_lengths=key_lengths, window=window,
                     need_weights=need_weights, cache=cache, cu_seqlens=cu_seqlens,
                     mask_mod=mask_mod, score_mod=score_mod)
        self_attention = key is None and value is None
        self._check_rope_call(positions, self_attention, cache, cu_seqlens)
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        if angles is not None:
            self._check_angles(angles, query, positions)
        variants = self._variants(bias, mask_mod, score_mod)
        rec = trace.recorder()  # does nothing unless a trace is being recorded
        dropout_p = self.dropout if self.training else 0.0
        reason, weights = self._fused_plan(query, self_attention, dict(
            mask=mask, causal=causal, key_lengths=key_lengths, window=window,
            need_weights=need_weights or rec.on, backend=backend, cache=cache,
            cu_seqlens=cu_seqlens, dropout_p=dropout_p, **variants))
        if angles is None:
            angles = self._rope_angles(query, positions, cache, cu_seqlens)  # (B|1, Tq, r) x 2
        if reason is None:
            rope = None if angles is None else (*angles, self.rope.interleaved)
            return fused_forward(query, *weights, self.num_heads, self.head_dim ** -0.5,
                                 self.frozen, causal=causal, rope=rope)  # (B, T, d_model)
        q, k, v = self._project_heads(query, key, value, self_attention, rec, angles)
        # (B, h, Tq, d_k), (B, h_kv, Tk, d_k), (B, h_kv, Tk, d_v)
        want_weights = need_weights or rec.on  # a trace records the weights too
        if cu_seqlens is not None:
            out, weights = self._forward_packed(q, k, v, cu_seqlens, causal, dropout_p, backend,
                                                variants)
        elif cache is not None:
            out, weights = self._forward_cached(q, k, v, cache, dropout_p, want_weights, backend,
                                                variants)
        else:
            out, weights = self._forward_plain(q, k, v, mask, causal, key_lengths, window,
                                               dropout_p, want_weights, backend, variants)
        y = self._output(out, weights, rec)  # (B, Tq, d_model)
        return (y, weights) if need_weights else y

    def freeze(self) -> MultiHeadAttention:
        """Pack ``W_qkv`` and ``W_O`` once for the fused inference forward (bf16 or fp32,
        :mod:`mha.ops.self_attention`) instead of at every call, and return the module.

        Unfrozen, the fused call packs both weights into its panels each time (at the seeds'
        bf16 size about a twentieth of the call), so no way of changing a weight can leave a
        stale copy. Frozen, the panels are packed again only when a weight moves in a way its
        version counter or storage shows (an optimizer step, ``load_state_dict``, ``nn.init``,
        an in-place op, ``p.data = t``); writes through ``p.data.<op>_()`` or ``.numpy()`` are
        **not** seen until :meth:`freeze` is called again (which packs anew) or
        :meth:`unfreeze`. Calls that do not run fused (masks, gradients, another dtype than
        the weights', ...) read the weights as they are, frozen or not; a dtype change of the
        weights (``m.float()``) packs them again at the next fused call. Refused (the module
        unchanged) unless the module has the packed ``[W^Q; W^K; W^V]`` weight (kdim == vdim ==
        d_model), equal query and key/value heads on one rank, bfloat16 or float32 weights (of
        one dtype) on the CPU, and the native op with the tiles of that dtype (bf16: AVX512_BF16;
        fp32: AVX-512)."""
        if not (self.packed and self.tensor_parallel == 1 and self.num_kv_heads == self.num_heads
                and self.v_head_dim == self.head_dim and isinstance(self.in_proj, nn.Linear)
                and isinstance(self.out_proj, nn.Linear)):
            raise ValueError("freeze() packs the fused forward's weights, which serves the "
                             "packed [W^Q; W^K; W^V] weight (kdim == vdim == d_model) with equal "
                             "query and key/value heads on one rank, and nn.Linear projections "
                             "(not mha.llm.weights' packed modules)")
        w_qkv, w_o = self.in_proj.weight, self.out_proj.weight
        for name, p in (("in_proj.weight", w_qkv), ("out_proj.weight", w_o)):
            if p.device.type != "cpu" or p.dtype not in FUSED_DTYPES:
                raise ValueError(f"freeze() packs bfloat16 or float32 CPU weights for the fused "
                                 f"forward; {name} is {p.dtype} on {p.device} "
                                 f"(module.to(torch.bfloat16) or .float() first)")
        if w_qkv.dtype != w_o.dtype:
            raise ValueError(f"freeze() packs weights of one dtype; in_proj.weight is "
                             f"{w_qkv.dtype}, out_proj.weight {w_o.dtype}")
        missing = fused_tiles(w_qkv.dtype)
        if missing is not None:
            raise RuntimeError(f"freeze(): {missing}: the fused forward cannot run here")
        panels = Panels()
        panels.current(self.in_proj.weight, self.out_proj.weight)
        self.frozen = panels
        return self

    def unfreeze(self) -> MultiHeadAttention:
        """Drop the packed weights of :meth:`freeze`: every call reads the weights as they are."""
        self.frozen = None
        return self

    def _why_not_fused(self, query, self_attention: bool, call: dict) -> str | None:
        """Why this call runs step by step rather than in the fused forward (bf16 or fp32,
        :mod:`mha.ops.self_attention`), or None when the fused forward serves it. ``call``:
        the call's masks, mode, dropout and score variants (the module's and the call's);
        ``causal`` is served (the only mask the fused forward has), and so is the module's
        ``rope`` (any ``positions``)."""
        return self._fused_plan(query, self_attention, call)[0]

    def _fused_plan(self, query, self_attention: bool, call: dict) -> tuple:
        """``(reason, None)`` as :meth:`_why_not_fused`, or ``(None, (W_qkv, b_qkv, W_O,
        b_O))``: the weights the fused forward reads, each submodule and parameter looked up
        once per call (``nn.Module.__getattr__``, ~0.3 us a lookup, twice per weight)."""
        if query.dtype not in FUSED_DTYPES:
            return "the fused forward takes bfloat16 or float32 inputs only", None
        if not (self_attention and self.packed and self.tensor_parallel == 1
                and self.num_kv_heads == self.num_heads and self.v_head_dim == self.head_dim):
            return ("the fused forward serves self-attention with the packed weight and equal "
                    "query / key / value heads, on one rank"), None
        on = unserved(call)
        if on:
            return f"the fused forward has no {', '.join(on)} ({UNSERVED_HELP})", None
        inp, out = self.in_proj, self.out_proj
        if not (isinstance(inp, nn.Linear) and isinstance(out, nn.Linear)):
            return ("the projections are packed modules (mha.llm.weights.pack_weights); the "
                    "fused forward reads nn.Linear weights"), None
        params = inp.weight, inp.bias, out.weight, out.bias
        if torch.is_grad_enabled() and (query.requires_grad or any(
                p is not None and p.requires_grad for p in params)):
            return "a gradient is needed (the fused forward is for inference)", None
        reason = why_not_fused(query, *params, self.num_heads)
        return reason, (params if reason is None else None)

    def _variants(self, bias, mask_mod, score_mod) -> dict:
        """The score variants of one call: the module's (softcap, sinks, ALiBi slopes) and the
        call's (bias, mask_mod, score_mod), as keyword arguments of :func:`mha.attention`."""
        if self.tensor_parallel > 1 and (self.sinks is not None or self.alibi_slopes is not None):
            raise ValueError("sinks / alibi under tensor parallelism are not supported yet: "
                             "each rank would need its own heads' slice of the (h,) sinks "
                             "and slopes")
        return dict(softcap=self.softcap, sinks=self.sinks, alibi_slopes=self.alibi_slopes,
                    bias=bias, mask_mod=check_mod("mask_mod", mask_mod),
                    score_mod=check_mod("score_mod", score_mod))

    def _project_heads(self, query, key, value, self_attention: bool, rec, angles=None):
        """Project, rotate Q and K by ``angles`` (:meth:`_rope_angles`, or None) and split the
        heads: ``(B, h, Tq, d_k)``, ``(B, h_kv, Tk, d_k)``, ``(B, h_kv, Tk, d_v)``, recording
        each step on ``rec``."""
        rec.record("input", "X", query, "(B, Tq, d_model)")
        if not self_attention:
            rec.record("key/value input", "X_kv", key, "(B, Tk, kdim)")
        q, k, v = self.project(query, key, value, self_attention)
        src = "X" if self_attention else "X_kv"
        rec.record("project Q", "Q = X W^Q", q, "(B, Tq, h*d_k)")
        rec.record("project K", f"K = {src} W^K", k, "(B, Tk, h_kv*d_k)")
        rec.record("project V", f"V = {src} W^V", v, "(B, Tk, h_kv*d_v)")
        if angles is not None:  # RoPE in the projections' layout (heads not yet split)
            q, k = self._rotate_qk(q, k, angles)  # (B, T, h, d_k), (B, T, h_kv, d_k)
            rec.record("rotate Q (RoPE)", "Q = rope(Q, positions)", q, "(B, Tq, h, d_k)")
            rec.record("rotate K (RoPE)", "K = rope(K, positions)", k, "(B, Tk, h_kv, d_k)")
            q, k = q.flatten(2), k.flatten(2)  # (B, T, heads, d_k) -> (B, T, heads*d_k)
        q = self.split_heads(q, self.num_heads)  # (B, Tq, h*d_k) -> (B, h, Tq, d_k)
        k = self.split_heads(k, self.num_kv_heads)  # (B, Tk, h_kv*d_k) -> (B, h_kv, Tk, d_k)
        v = self.split_heads(v, self.num_kv_heads)  # (B, Tk, h_kv*d_v) -> (B, h_kv, Tk, d_v)
        rec.record("split heads Q", "reshape + transpose", q, "(B, h, Tq, d_k)")
        rec.record("split heads K", "reshape + transpose", k, "(B, h_kv, Tk, d_k)")
        rec.record("split heads V", "reshape + transpose", v, "(B, h_kv, Tk, d_v)")
        return q, k, v

    def _rotate_qk(self, q, k, angles):
        """Q ``(B, T, h*d_k)`` and K ``(B, T, h_kv*d_k)`` rotated by ``angles``: ``(B, T, h,
        d_k)`` and ``(B, T, h_kv, d_k)``. Where K's columns follow Q's in one tensor (the QKV
        GEMM's output, split) and no gradient is taken, both are rotated in one call on the
        ``h + h_kv`` heads: every head is turned by the same ``(C, S)``, so the values are those
        of two calls, at half the small ops of a decode step."""
        B, T, _ = q.shape
        H, H_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # inference only: a traced tensor has no data_ptr, and autograd would take the
        # as_strided view relative to the GEMM output's storage, not to Q. One storage: two
        # allocations may lie end to end, and a view of Q's storage cannot reach into K's
        if (not torch.compiler.is_compiling() and not q.requires_grad
                and q.shape[:2] == k.shape[:2] and q.stride() == k.stride() and q.stride(-1) == 1
                and q.dtype == k.dtype
                and k.data_ptr() == q.data_ptr() + q.shape[-1] * q.element_size()
                and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()):
            qk = q.as_strided((B, T, (H + H_kv) * d), q.stride())  # Q's and K's columns
            qk = qk.unflatten(-1, (H + H_kv, d))  # (B, T, (h+h_kv)*d_k) -> (B, T, h+h_kv, d_k)
            qk = self.rope.rotate_tokens(qk, *angles)  # (B, T, h+h_kv, d_k), new
            return qk[:, :, :H], qk[:, :, H:]  # (B, T, h, d_k), (B, T, h_kv, d_k)
        q = q.view(B, T, H, d)  # (B, T, h*d_k) -> (B, T, h, d_k)
        k = k.view(B, T, H_kv, d)  # (B, T, h_kv*d_k) -> (B, T, h_kv, d_k)
        return self.rope.rotate_tokens(q, *angles), self.rope.rotate_tokens(k, *angles)

    def _check_rope_call(self, positions, self_attention: bool, cache, cu_seqlens) -> None:
        """``positions`` and ``rope`` fit the call's mode (checked before anything moves)."""
        if self.rope is None:
            if positions is not None:
                raise ValueError("positions: this module has no rope (positions place the "
                                 "tokens for rotary embeddings); construct it with rope=...")
            return
        if not self_attention:
            raise ValueError("rope: cross-attention (key / value given) is not supported with "
                             "rotary embeddings: the queries' and keys' positions are not "
                             "defined relative to each other; call with key=value=None")
        if positions is not None and (cache is not None or cu_seqlens is not None):
            mode = "cache (the positions continue each row's cache: KVCache.positions)" \
                if cache is not None else "cu_seqlens (the positions restart in each sequence)"
            raise ValueError(f"positions must be None with {mode}")

    def _check_angles(self, angles, query, positions) -> None:
        """``angles``: ``(C, S)`` of :meth:`mha.rope.Rotary.angles` for ``query (B, Tq, ..)``,
        ``(B|1, Tq, r)`` each, float32 (float64 for a float64 query), on its device."""
        if self.rope is None:
            raise ValueError("angles: this module has no rope; pass None")
        if positions is not None:
            raise ValueError("angles and positions: give one (angles are the positions' "
                             "cos / sin, mha.rope.Rotary.angles)")
        B, Tq = query.shape[0], query.shape[1]
        r = self.rope.dim
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        if not (isinstance(angles, (tuple, list)) and len(angles) == 2):
            raise TypeError(f"angles must be a pair (C, S) of mha.rope.Rotary.angles, got "
                            f"{type(angles).__name__}")
        for name, t in zip("CS", angles, strict=True):
            if not (isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] in (1, B)
                    and t.shape[1] == Tq and t.shape[2] == r and t.dtype == work
                    and t.device == query.device):
                got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise ValueError(f"angles: {name} must be (B|1, Tq, r) = ({B} or 1, {Tq}, {r}) "
                                 f"{work} on {query.device} (Rotary.angles for this query), "
                                 f"got {got}")

    def _rope_angles(self, query, positions, cache, cu_seqlens):
        """``(C, S)`` ``(B|1, Tq, r)`` (:meth:`mha.rope.Rotary.angles`) of the call's positions,
        or None without rope: the given ``positions`` or ``0 .. Tq-1`` (plain), the cache's
        (``(B, Tn)``, read before the append), or restarting at 0 in each packed sequence
        (``(N,)``)."""
        if self.rope is None:
            return None
        B, Tq, _ = query.shape
        if cache is not None:
            # (B, Tn) or (1, Tn); a left-padding slot (before the row's start, never attended)
            # would count from below 0: it takes position 0
            positions = cache.positions(Tq).clamp(min=0).to(query.device)
        elif cu_seqlens is not None:
            # offsets checked by _check_packed_call (before anything moved): no second check
            lengths = torch.as_tensor(cu_seqlens).diff().tolist()  # (S + 1,) -> S lengths
            positions = torch.cat([torch.arange(n, device=query.device) for n in lengths]) \
                if lengths else torch.zeros(0, dtype=torch.int64, device=query.device)  # (N,)
        return self.rope.angles(positions, B, Tq, query.device, query.dtype)

    def _forward_plain(self, q, k, v, mask, causal, key_lengths, window, dropout_p,
                       want_weights, backend, variants):
        """One call of :func:`mha.attention`: ``(out (B, h, Tq, d_v), weights or None)``."""
        result = attention(q, k, v, mask=mask, causal=causal, key_lengths=key_lengths,
                           dropout_p=dropout_p, return_weights=want_weights, backend=backend,
                           window=window, **variants)
        return result if want_weights else (result, None)

    def _forward_cached(self, q, k, v, cache, dropout_p, want_weights, backend, variants):
        """Append the new K/V to ``cache`` in place (undone if attention raises) and attend
        over everything cached: ``(out (B, h, Tn, d_v), weights (B, h, Tn, Tk) or None)``.
        An int8 cache is attended in place by its decode kernel (:meth:`KVCache.attend`) where
        that serves the call; otherwise through dequantized copies of its K/V."""
        if _int8_in_place(cache, q.shape[2], dropout_p, want_weights, backend, variants):
            before = cache.lengths.clone()
            cache.append(k, v)
            try:
                masks = cache.masks(q.shape[2])
                on = {n: t for n, t in _at_cache_positions(
                    variants, masks, q.shape[2], cache.max_length).items() if t is not None}
                return cache.attend(q, **on), None  # (B, h, Tn, d_v)
            except BaseException:
                cache.lengths.copy_(before)
                raise
        with cache.appending(k, v) as (k_all, v_all, masks):  # (B, h_kv, Tk, d_k / d_v)
            variants = _at_cache_positions(variants, masks, q.shape[2], k_all.shape[2])
            result = attention(q, k_all, v_all, dropout_p=dropout_p,
                               return_weights=want_weights, backend=backend, **masks, **variants)
        return result if want_weights else (result, None)

    def _forward_packed(self, q, k, v, cu_seqlens, causal, dropout_p, backend, variants):
        """The batch of one holds S sequences end to end: ``(out (1, h, N, d_v), None)``
        (packed sequences return no weights)."""
        variants = {n: t for n, t in variants.items() if n not in ("mask_mod", "score_mod")}
        out = varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),  # (h, N, d) -> (N, h, d)
                               v[0].transpose(0, 1), cu_seqlens, causal=causal,
                               dropout_p=dropout_p, backend=backend, **variants)  # (N, h, d_v)
        return out.transpose(0, 1).unsqueeze(0), None  # (N, h, d_v) -> (1, h, N, d_v)

    def forward_paged(self, query: torch.Tensor, cache, layer: int, seq_ids, cu_seqlens,
                      positions: torch.Tensor | None = None, *,
                      angles=None) -> torch.Tensor:
        """Self-attention of one packed step over a :class:`mha.PagedKVCache` (continuous
        batching): ``query (1, N, d_model)`` holds the step's new tokens of S sequences end to
        end, ``seq_ids[i]`` owning tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` (the cache was
        :meth:`~mha.PagedKVCache.extend`-ed by them). Their K/V are written into layer
        ``layer``'s pages in place and each token attends causally (bottom-right) to its own
        sequence's keys (:meth:`mha.PagedKVCache.attend_varlen`: decode rows in one native
        paged decode call, prefill chunks in the paged flash forward). ``positions (N,)``
        (with ``rope``, else None): each token's position in its sequence, or instead
        ``angles``, their ``(C, S)`` ``(1, N, r)`` of :meth:`mha.rope.Rotary.angles` computed
        once for many layers (as :meth:`forward`'s ``angles``). ``positions`` must be each
        token's place in its sequence as the extended cache holds it
        (:meth:`mha.PagedKVCache.positions`), and ``cu_seqlens`` must cover the N tokens:
        refused naming them, before anything is written. The module's
        ``softcap``, ``sinks`` and ALiBi slopes apply; inference only (no dropout). Returns
        ``(1, N, d_model)``."""
        check_tensor("query", query, 3, "(1, N, d_model)")
        if query.shape[0] != 1 or query.shape[2] != self.d_model:
            raise ValueError(f"query must be (1, N, d_model) = (1, N, {self.d_model}) (the "
                             f"step's tokens packed in one row), got {tuple(query.shape)}")
        if angles is not None:
            self._check_angles(angles, query, positions)
        elif (positions is None) != (self.rope is None):
            raise ValueError("positions must be given (N,) with rope (each token's position in "
                             "its sequence) and None without" if self.rope is not None else
                             "positions: this module has no rope; pass None")
        if self.training and self.dropout > 0:
            raise ValueError(f"dropout={self.dropout} in training mode: the paged forward is "
                             "for inference (call .eval())")
        N = query.shape[1]
        if angles is None:  # (with angles, the caller checked the positions they turn by)
            if positions is not None:
                positions = check_positions(positions, 1, N, query.device)  # (N,) int64
            check_step(cache, N, positions, seq_ids, cu_seqlens)
        if angles is None and self.rope is not None:
            angles = self.rope.angles(positions, 1, N, query.device, query.dtype)  # (1, N, r) x 2
        variants = {n: t for n, t in self._variants(None, None, None).items() if t is not None}
        rec = trace.recorder()  # does nothing unless a trace is being recorded
        q, k, v = self._project_heads(query, query, query, True, rec, angles)
        # (1, h, N, d_k), (1, h_kv, N, d_k), (1, h_kv, N, d_v)
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (heads, N, d) -> (N, heads, d)
        cache.write(layer, seq_ids, k, v, cu_seqlens)
        out = cache.attend_varlen(layer, q, seq_ids, cu_seqlens, **variants)  # (N, h, d_v)
        return self._output(out.transpose(0, 1).unsqueeze(0), None, rec)
        # (N, h, d_v) -> (1, h, N, d_v) -> (1, N, d_model)

    def _output(self, out, weights, rec) -> torch.Tensor:
        """Merge the heads and apply W_O: ``(B, h, Tq, d_v) -> (B, Tq, d_model)``."""
        if weights is not None:
            rec.record("attention weights", "A = softmax(Q K^T / sqrt(d_k))", weights,
                       "(B, h, Tq, Tk)")
        rec.record("heads", "head_i = A_i V_i", out, "(B, h, Tq, d_v)")
        concat = self.merge_heads(out)  # (B, h, Tq, d_v) -> (B, Tq, h*d_v)
        if self.tensor_parallel > 1:  # RowwiseParallel: partial products, one all-reduce
            y = self.out_proj(concat)  # (B, Tq, h*d_v) @ W_O -> (B, Tq, d_model)
        else:
            y = _apply(self.out_proj, concat)  # (B, Tq, h*d_v) @ W_O -> (B, Tq, d_model)
        rec.record("concat heads", "Concat(head_1..head_h)", concat, "(B, Tq, h*d_v)")
        rec.record("output", "Y = Concat(...) W_O", y, "(B, Tq, d_model)")
        return y

    def explain(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, **kwargs) -> str:
        """What ``self(query, key, value, **kwargs)`` (the plain mode) would run, in words: the
        GEMM of each projection with the reason (:func:`mha.linear.describe`: the native tiles
        or torch's, as measured on this CPU) and every attention backend's verdict
        (:func:`mha.explain`, with the module's score variants), each condition of the fused
        forward (bf16 or fp32 inference, :mod:`mha.ops.self_attention`) with what holds or
        fails (:func:`mha.fused_verdicts.fused_conditions`), then on the last line
        (``forward: ...``) whether the call runs fused or step by step and why (the first
        condition that fails), under the current grad mode. No
        projection or attention is computed; the first fp32 call of a shape class on a machine
        may time both GEMMs (:mod:`mha.ops.linear_choice`)."""
        self_attention = key is None and value is None
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        B, Tq, _ = query.shape
        Tk = key.shape[1]
        if self.packed and self_attention:
            w, b = self.in_proj.weight, self.in_proj.bias
            lines = ["projections:", f"  Q, K, V (one GEMM): {describe(query, w, b)}"]
        else:
            lines = ["projections:"] + [
                f"  {n}: {describe(x, w, b)}" for n, x, (w, b)
                in zip("QKV", (query, key, value), self.projection_weights(), strict=True)]
        concat = query.new_empty(B, Tq, self.num_heads * self.v_head_dim)  # (B, Tq, h*d_v)
        lines.append(f"  W_O: {describe(concat, self.out_proj.weight, self.out_proj.bias)}")
        variants = self._variants(kwargs.pop("bias", None), kwargs.pop("mask_mod", None),
                                  kwargs.pop("score_mod", None))
        kwargs.pop("positions", None)  # rotary positions (or their angles) change no backend's
        kwargs.pop("angles", None)  # verdict
        q = query.new_empty(B, Tq, self.num_heads, self.head_dim).transpose(1, 2)  # (B, h, Tq, d_k)
        k = query.new_empty(B, Tk, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, h_kv, Tk, d_k)
        v = query.new_empty(B, Tk, self.num_kv_heads, self.v_head_dim).transpose(1, 2)  # (B, h_kv, Tk, d_v)
        verdicts = explain_attention(q, k, v, **kwargs, **variants)
        lines += ["attention:"] + [f"  {line}" for line in str(verdicts).splitlines()]
        dropout_p = self.dropout if self.training else 0.0
        call = dict(kwargs, dropout_p=dropout_p, **variants)
        lines += ["fused forward (one native call, mha.ops.self_attention), each condition:"] + [
            f"  {c}" for c in fused_conditions(self, query, self_attention, call)]
        reason = self._why_not_fused(query, self_attention, call)
        forward = (describe_fused(query, self.in_proj.weight, self.in_proj.bias,
                                  self.out_proj.weight, self.out_proj.bias, self.num_heads,
                                  causal=bool(kwargs.get("causal", False)),
                                  rope=self.rope is not None)
                   if reason is None else f"step by step: {reason}")
        if reason is None and self.frozen is not None:
            forward += ("; weights packed by freeze() (repacked when a weight's version counter "
                        "or storage moves; writes through p.data or .numpy() are not seen)")
        return "\n".join(lines + [f"forward: {forward}"])

    def new_cache(self, batch_size: int, max_len: int, kv_dtype: str | None = None, *,
                  dtype: torch.dtype | None = None):
        """An empty :class:`mha.KVCache` for this module: ``(batch_size, h_kv, max_len, d_k)``
        keys and ``(.., d_v)`` values, in ``dtype`` (None: the weights'; with projections
        packed by :mod:`mha.llm.weights`, the dtype the weights had before packing, not the
        packed copy's bf16) on the device of the weights; ``kv_dtype="int8"`` stores them as
        int8 with per-token-per-head scales."""
        from mha.cache import KVCache

        w = self.out_proj.weight
        if dtype is None:  # a packed projection keeps its source dtype
            dtype = getattr(self.out_proj, "source_dtype", w.dtype)
        return KVCache(batch_size, self.num_kv_heads, max_len, self.head_dim, self.v_head_dim,
                       dtype=dtype, device=w.device, kv_dtype=kv_dtype)

    def _check_inputs(self, query, key, value) -> None:
        check_tensor("query", query, 3, "(B, Tq, d_model)")
        check_tensor("key", key, 3, "(B, Tk, kdim)")
        check_tensor("value", value, 3, "(B, Tk, vdim)")
        names, tensors = ("query", "key", "value", "module weights"), (query, key, value,
                                                                       self.out_proj.weight)
        if not isinstance(self.out_proj, nn.Linear):  # packed: any floating input dtype
            names, tensors = names[:3], tensors[:3]
        check_same(names, tensors)
        if query.shape[-1] != self.d_model:
            raise ValueError(f"query must have shape (B, Tq, d_model) with d_model={self.d_model},"
                             f" got {tuple(query.shape)}")
        if key.shape[-1] != self.kdim:
            raise ValueError(f"key must have shape (B, Tk, kdim) with kdim={self.kdim}, "
                             f"got {tuple(key.shape)}")
        if value.shape[-1] != self.vdim:
            raise ValueError(f"value must have shape (B, Tk, vdim) with vdim={self.vdim}, "
                             f"got {tuple(value.shape)}")
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(f"query (B, Tq, d_model), key (B, Tk, kdim) and value (B, Tk, vdim) "
                             f"must agree on B and Tk: query {tuple(query.shape)}, "
                             f"key {tuple(key.shape)}, value {tuple(value.shape)}")

    # ----------------------------------------------------------------------------- seed 000 view
    def per_head_weights(self) -> dict:
        """The seed-000 view: independent per-head matrices in the seeds' ``X W`` convention.

        Returns a dict with ``W_q`` (h tensors ``(d_model, d_k)``), ``W_k`` (h_kv tensors
        ``(kdim, d_k)``), ``W_v`` (h_kv tensors ``(vdim, d_v)``), ``W_o`` ``(h*d_v, d_model)``,
        and the matching biases ``b_q``, ``b_k``, ``b_v`` (lists) and ``b_o`` (or None).
        These are copies; load changes with :meth:`load_per_head_weights`.
        """
        (wq, bq), (wk, bk), (wv, bv) = self.projection_weights()
        d_k, d_v = self.head_dim, self.v_head_dim

        def heads(W, b, d):  # nn.Linear (heads*d, in) -> heads x (in, d)
            Ws = [W[i * d:(i + 1) * d].t().detach().clone() for i in range(W.shape[0] // d)]
            bs = None if b is None else [b[i * d:(i + 1) * d].detach().clone()
                                         for i in range(W.shape[0] // d)]
            return Ws, bs

        (W_q, b_q), (W_k, b_k), (W_v, b_v) = heads(wq, bq, d_k), heads(wk, bk, d_k), heads(wv, bv, d_v)
        b_o = self.out_proj.bias
        return dict(W_q=W_q, W_k=W_k, W_v=W_v, W_o=self.out_proj.weight.t().detach().clone(),
                    b_q=b_q, b_k=b_k, b_v=b_v, b_o=None if b_o is None else b_o.detach().clone())

    @torch.no_grad()
    def load_per_head_weights(self, weights: dict) -> None:
        """Load the seed-000 per-head matrices (the format of :meth:`per_head_weights`).

        All or nothing: the whole dict is checked first (keys, counts, shapes, real dtypes,
        biases present iff the module has them); a refused dict raises (ValueError /
        TypeError naming the entry) and leaves every weight unchanged."""
        targets = self._per_head_targets(weights)  # validated, before the first copy
        for dst, src in targets:
            dst.copy_(src)

    def _per_head_targets(self, weights) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(parameter view, new value in nn.Linear layout)]`` for every weight and bias,
        after checking ``weights`` entirely; nothing is written here."""
        if not isinstance(weights, dict):
            raise TypeError(f"weights must be a dict as returned by per_head_weights(), got "
                            f"{type(weights).__name__}")
        has_bias = self.out_proj.bias is not None
        names = {"W_q", "W_k", "W_v", "W_o"} | ({"b_q", "b_k", "b_v", "b_o"} if has_bias else set())
        missing = sorted(names - set(weights))
        if missing:
            raise ValueError(f"weights: missing {missing} (expected the keys of "
                             f"per_head_weights(): {sorted(names)})")
        extra = sorted(n for n in set(weights) - names
                       if not (n in {"b_q", "b_k", "b_v", "b_o"} and weights[n] is None))
        if extra:
            why = " (this module has no biases)" if not has_bias and any(
                n.startswith("b_") for n in extra) else ""
            raise ValueError(f"weights: unexpected {extra}{why}; expected {sorted(names)}")
        (wq, bq), (wk, bk), (wv, bv) = self.projection_weights()
        h, h_kv, d_k, d_v = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        targets = []
        for key, W, b, n, rows, d in (("q", wq, bq, h, self.d_model, d_k),
                                     ("k", wk, bk, h_kv, self.kdim, d_k),
                                     ("v", wv, bv, h_kv, self.vdim, d_v)):
            mats = _tensor_list(f"W_{key}", weights[f"W_{key}"], n, (rows, d))
            targets.append((W, torch.cat([m.t() for m in mats], dim=0)))  # n x (in, d) -> (n*d, in)
            if b is not None:
                biases = _tensor_list(f"b_{key}", weights[f"b_{key}"], n, (d,))
                targets.append((b, torch.cat(biases)))  # n x (d,) -> (n*d,)
        W_o = _real_tensor("W_o", weights["W_o"], (h * d_v, self.d_model))
        targets.append((self.out_proj.weight, W_o.t()))  # (h*d_v, d_model) -> nn.Linear layout
        if has_bias:
            targets.append((self.out_proj.bias, _real_tensor("b_o", weights["b_o"], (self.d_model,))))
        return targets

    # ----------------------------------------------------------------------------- interop
    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """The same attention as a ``torch.nn.MultiheadAttention`` (see :mod:`mha.interop`)."""
        return interop.from_torch(module, cls)

    def to_torch(self) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention(batch_first=True)`` computing the same function.
        Refused (ValueError) for a module with score variants, which torch's module has not,
        and for one split over ranks (its weights are this rank's heads only)."""
        if self.tensor_parallel != 1:
            raise ValueError(f"to_torch: the module is split over {self.tensor_parallel} ranks "
                             f"(mha.distributed.tensor_parallel) and holds this rank's heads "
                             f"only; convert the module before splitting it")
        on = [n for n, x in (("softcap", self.softcap), ("sinks", self.sinks),
                             ("alibi", self.alibi_slopes), ("rope", self.rope)) if x is not None]
        if on:
            raise ValueError(f"to_torch: torch.nn.MultiheadAttention has no {', '.join(on)}; "
                             f"this module would compute a different function without them")
        return interop.to_torch(self)


def _check_modes(query, key, value, *, mask, key_lengths, window, need_weights, cache,
                 cu_seqlens, mask_mod, score_mod) -> None:
    """The arguments that choose the mode (cache, packed, plain) agree with one another."""
    if torch.compiler.is_exporting():
        _check_exportable_mode(cache, cu_seqlens)
    if cache is not None:
        _check_cache_call(cache, query, key, value, mask, key_lengths, window)
    if cu_seqlens is not None:
        _check_packed_call(query, key, value, mask, key_lengths, need_weights, cache, window,
                           cu_seqlens)
        if mask_mod is not None or score_mod is not None:
            raise ValueError("cu_seqlens: mask_mod and score_mod are not supported for packed "
                             "sequences (the offsets define the masking); call without "
                             "cu_seqlens=, e.g. with mha.mods.document(cu_seqlens=...)")


def _check_exportable_mode(cache, cu_seqlens) -> None:
    """Under ``torch.export``: the modes whose bookkeeping reads tensor values in Python (a
    traced program has only shapes) are refused before anything moves, naming the argument."""
    if cache is not None:
        raise ValueError("cache: torch.export cannot carry decoding with a KV cache: the cache "
                         "advances its lengths in place and reads them as Python ints at each "
                         "call; export mha.export.DecodeStep (past K/V in, present K/V out) "
                         "or the module without cache=")
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens: torch.export cannot carry packed sequences: the offsets "
                         "are read as Python ints to cut the sequences apart; export a padded "
                         "batch with key_lengths= or a bool mask instead")


@dataclass(frozen=True)
class _MaskAtPositions:
    """A ``mask_mod`` called with each query's cache position: ``q_idx + shifts[b]``.
    Hashable by ``(mask_mod, shifts)``, so block plans are cached per step shape."""

    fn: object
    shifts: tuple[int, ...]  # (B,) or (1,): position of query row 0 in each cache row

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, _shifted(q_idx, b, self.shifts), kv_idx)


@dataclass(frozen=True)
class _ScoreAtPositions:
    """A ``score_mod`` called with each query's cache position (as :class:`_MaskAtPositions`)."""

    fn: object
    shifts: tuple[int, ...]

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, _shifted(q_idx, b, self.shifts), kv_idx)


def _shifted(q_idx: torch.Tensor, b: torch.Tensor, shifts: tuple[int, ...]) -> torch.Tensor:
    """``q_idx (1, 1, rows, 1) + shifts[b]``: ``(1|B, 1, rows, 1)`` positions."""
    if len(shifts) == 1:
        return q_idx + shifts[0]
    return q_idx + torch.tensor(shifts, device=q_idx.device)[b]  # (B|1, 1, 1, 1) + (1, 1, rows, 1)


def _int8_in_place(cache, Tn: int, dropout_p, want_weights, backend, variants) -> bool:
    """True when an int8 :class:`KVCache` serves this call with its decode kernel: a few
    queries, no weights, dropout, forced backend or index-function variant."""
    reads = getattr(cache, "reads_int8_in_place", None)
    return (reads is not None and reads(Tn) and not want_weights
            and not dropout_p and backend is None and variants.get("mask_mod") is None
            and variants.get("score_mod") is None)


def _at_cache_positions(variants: dict, masks: dict, Tn: int, Tk: int) -> dict:
    """The variants of a cached call, aligned to the cache positions of each row.

    Row ``b`` holds ``L[b]`` keys (``masks["key_lengths"]``, or Tk for all) and its ``Tn`` new
    queries sit at positions ``L[b] - Tn + i``. :func:`mha.attention` aligns ALiBi and the
    built-in mods to the bottom right of the ``(Tn, Tk)`` problem, i.e. as if every row held
    ``Tk`` keys; index functions therefore get ``q_idx`` shifted to the row's positions, and
    ALiBi's distance, short by ``Tk - L[b]`` in a shorter row, gets a ``(B, h, 1, 1)`` bias
    ``slope * (Tk - L[b])`` back — needed only with sinks: without one a per-row constant
    cancels in the softmax."""
    lengths = masks.get("key_lengths")  # (B,) or None: every row holds Tk keys
    shifts = (Tk - Tn,) if lengths is None else tuple((lengths - Tn).tolist())
    out = dict(variants)
    if variants["mask_mod"] is not None:
        out["mask_mod"] = _MaskAtPositions(variants["mask_mod"], shifts)
    if variants["score_mod"] is not None:
        out["score_mod"] = _ScoreAtPositions(variants["score_mod"], shifts)
    slopes = variants["alibi_slopes"]
    if slopes is not None and variants["sinks"] is not None and lengths is not None:
        short = (Tk - lengths).to(slopes.dtype)  # (B,)
        fix = (slopes.view(1, -1) * short.view(-1, 1)).view(len(short), -1, 1, 1)  # (B, h, 1, 1)
        bias = variants["bias"]
        out["bias"] = fix if bias is None else fix + check_bias(  # (B, h, Tn|1, Tk|1)
            bias, len(short), slopes.shape[0], Tn, Tk, slopes.device)
    return out


def _check_packed_call(query, key, value, mask, key_lengths, need_weights, cache,
                       window, cu_seqlens) -> None:
    """With ``cu_seqlens``: one packed row of self-attention, the offsets define the masking."""
    if key is not None or value is not None:
        raise ValueError("cu_seqlens: packed sequences serve self-attention only "
                         "(key and value must be None)")
    if mask is not None or key_lengths is not None or cache is not None:
        raise ValueError("cu_seqlens: the offsets define which tokens see which; mask, "
                         "key_lengths and cache must be None")
    if need_weights:
        raise ValueError("cu_seqlens: need_weights is not supported for packed sequences")
    if isinstance(query, torch.Tensor) and query.dim() == 3 and query.shape[0] != 1:
        raise ValueError(f"cu_seqlens: query must be one packed row (1, N, d_model), "
                         f"got {tuple(query.shape)}")
    if isinstance(query, torch.Tensor) and query.dim() == 3:  # named as the caller passed it
        check_cu_seqlens("cu_seqlens", cu_seqlens, query.shape[1], query.device)
    if window is not None:
        raise ValueError("window: sliding windows over packed sequences are not "
                         "supported; call without cu_seqlens=")


def _check_cache_call(cache, query, key, value, mask, key_lengths, window) -> None:
    """With a cache: self-attention, the cache defines the masking, and the query's batch and
    device are the cache's (checked before any positions or angles are read off the cache)."""
    if not callable(getattr(cache, "appending", None)):
        raise TypeError(f"cache must be a KV cache (mha.KVCache, e.g. from "
                        f"module.new_cache(batch_size, max_len)) or None, got "
                        f"{type(cache).__name__}")
    if key is not None or value is not None:
        raise ValueError("cache: a KV cache serves self-attention only (key and value must be "
                         "None; the cache holds the keys and values)")
    if mask is not None or key_lengths is not None:
        raise ValueError("cache: mask and key_lengths must be None with a cache — it attends "
                         "causally per row over its own lengths (see KVCache.truncate and "
                         "KVCache.mark_left_padding for padded rows)")
    if window is not None:
        raise ValueError("window: sliding windows over a KV cache are not supported; "
                         "call without cache=")
    B, device = getattr(cache, "batch_size", None), getattr(cache, "device", None)
    if isinstance(query, torch.Tensor) and query.dim() == 3 and isinstance(B, int):
        if query.shape[0] != B:
            raise ValueError(f"query must have batch size {B} like the cache (one row per "
                             f"sequence), got {tuple(query.shape)}")
        if device is not None and query.device != device:
            raise ValueError(f"query must be on {device} like the cache, got {query.device}")


def _real_tensor(name: str, t, shape: tuple[int, ...]) -> torch.Tensor:
    """A real (floating or integer, not bool/complex) tensor of exactly ``shape``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {type(t).__name__}")
    if t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be a real tensor (floating or integer), got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t


def _tensor_list(name: str, seq, n: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """A list or tuple of ``n`` real tensors of ``shape`` (one per head)."""
    if not isinstance(seq, (list, tuple)):
        raise TypeError(f"{name} must be a list of {n} tensors {shape} (one per head), got "
                        f"{type(seq).__name__}")
    if len(seq) != n:
        raise ValueError(f"{name} must hold {n} tensors {shape} (one per head), got {len(seq)}")
    return [_real_tensor(f"{name}[{i}]", t, shape) for i, t in enumerate(seq)]


def _positive(name: str, value) -> int:
    """A constructor size: a positive int (numpy integers accepted), returned as int."""
    return check_int(name, value, low=1, what="a positive int")
