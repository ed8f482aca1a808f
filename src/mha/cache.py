"""K/V caches for incremental decoding (seed 002: token t attends tokens 1..t).

Shape legend: B batch, h_kv key/value heads, T_max capacity, Tn new tokens in one call,
Tk the cached length seen by attention (the longest row), Tq the queries of one call (= Tn),
d_k / d_v head dims.

:class:`KVCache` is preallocated and written in place: a decoding step copies only the new
tokens' K/V (``O(Tn * d)``), never the history. :class:`ConcatKVCache` is the textbook
``torch.cat`` baseline (the whole history copied every step), kept for tests and benchmarks.
Both serve :meth:`mha.MultiHeadAttention.forward` through the same small protocol::

    with cache.appending(k_new, v_new) as (k_all, v_all, masks):
        out = mha.attention(q, k_all, v_all, **masks)

:class:`KVCache` can store K/V as int8 (``kv_dtype="int8"``): quantized on append, read by the
decode kernel through :meth:`KVCache.attend` without being dequantized in memory (the error
bound is in the class docstring).

Per-row alignment (the choice documented in docs/decoding.md): mha's ``causal`` is bottom-right
w.r.t. the tensor lengths (Tq, Tk), which is right only when every row holds Tk keys. When rows
differ (ragged lengths, left padding) the cache passes ``key_lengths`` (keys past a row's end
are never read by the decode kernel) and, when Tq > 1 or rows start late, a bool mask
``(B, 1, Tq, Tk)`` (True = may attend) built from its lengths: query ``i`` of row ``b`` sees
keys ``starts[b] <= j <= lengths[b] - Tq + i``.
"""

from __future__ import annotations

import contextlib

import torch

from mha import hugepages
from mha.checks import (
    check_float_dtype,
    check_int,
    check_int_tensor,
    check_readable,
    check_tensor,
)

#: mha.attention keywords that attend() sets from the cache (its masks), refused as arguments
_CACHE_SETS = ("causal", "key_lengths", "mask", "window")

KV_DTYPES = ("int8",)  #: storage formats besides the compute dtype (kv_dtype=None)


def _check_kv_dtype(kv_dtype) -> str | None:
    """None (K/V stored in the cache's dtype) or "int8" (also accepted: torch.int8)."""
    if kv_dtype is None:
        return None
    if kv_dtype is torch.int8 or (isinstance(kv_dtype, str) and kv_dtype in KV_DTYPES):
        return "int8"
    raise ValueError(f"kv_dtype must be None (K/V stored in dtype) or 'int8' (symmetric, one "
                     f"float32 scale per token and K/V head), got {kv_dtype!r}")


def _as_rows(name: str, n, B: int, device: torch.device) -> torch.Tensor:
    """An int or ``(B,)`` integer tensor/sequence -> ``(B,)`` int64 on ``device``."""
    t = check_int_tensor(name, n, f"(B,) = ({B},) or an int", device)
    check_readable(name, t)  # its values are compared before anything changes
    t = t.to(device)
    if t.dim() == 0:
        t = t.expand(B)
    if t.shape != (B,):
        raise ValueError(f"{name} must be an int or have shape (B,) = ({B},), got {tuple(t.shape)}")
    return t.to(torch.int64)


class KVCache:
    """Preallocated K/V storage for ``B`` rows, written in place; lengths tracked per row.

    Attributes (the only state):
        k: ``(B, h_kv, T_max, d_k)`` key storage.
        v: ``(B, h_kv, T_max, d_v)`` value storage.
        lengths: ``(B,)`` int64, positions written in each row (the next token goes there).
        starts: ``(B,)`` int64, the first real position of each row (0 unless left padding
            was declared with :meth:`mark_left_padding`); earlier positions are never attended.

        k_scale, v_scale: ``(B, h_kv, T_max)`` float32 with ``kv_dtype="int8"`` (else None).

    Updated in place, and nothing else: :meth:`append` (and the module call, which uses it)
    writes ``k[b, :, lengths[b]:lengths[b]+Tn]``, ``v[b, :, lengths[b]:lengths[b]+Tn]`` (and
    the same positions of the scales) and adds Tn to ``lengths``; :meth:`reorder` (beam search) copies whole rows into other rows;
    :meth:`truncate`, :meth:`reset` and :meth:`mark_left_padding` change only ``lengths`` /
    ``starts`` (speculative-decoding rollback is a truncate). The storage is never
    reallocated, so ``k.data_ptr()`` is fixed for the cache's life. Everything else (capacity, the views
    attention reads, the masks) is derived on demand.

    An append that does not fit raises ValueError naming the capacity and changes nothing.
    Decoding is inference: appending K/V that require grad raises (use ``torch.no_grad()``).

    **int8 storage** (``kv_dtype="int8"``; ``dtype`` stays the dtype of what is appended and of
    the queries): each appended K and V row (one token, one K/V head, ``d`` values) is stored
    as int8 with a float32 scale ``s = absmax / 127``, rounded to nearest
    (:func:`mha.ops.decode.quantize_int8`), so each element is off by at most
    ``s / 2 = absmax / 254``; a row with a NaN or an Inf is refused (the cache unchanged). K/V
    take 1 byte per element plus 8 bytes per token and head, against 4 (fp32) or 2 (bf16).
    :meth:`attend` decodes (Tq <= 16) with the int8 rows and their scales straight from the
    storage; :meth:`keys` / :meth:`values` (and so the module call) return dequantized copies.

    Error bound against the same cache in full precision, for query row ``q`` with scale
    ``sigma`` over the keys ``J`` it sees: every score moves by at most
    ``eps = sigma * ||q||_1 * max_{j in J} absmax(k_j) / 254``; so each softmax weight (a sink
    included, its logit does not move) changes by a factor within ``[e^(-2 eps), e^(2 eps)]``
    and, writing ``out - out_fp = sum_j p^_j (v^_j - v_j) + sum_j (p^_j - p_j) v_j``, every
    output column ``c`` obeys::

        |out_int8[c] - out_fp[c]| <= max_{j in J} absmax(v_j) / 254
                                     + (e^(2 eps) - 1) * max_{j in J} |v_j[c]|

    plus the float32 rounding of either computation. It holds with every score variant:
    softcap is 1-Lipschitz (tanh), bias and ALiBi do not depend on K.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 v_head_dim: int | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, kv_dtype: str | None = None) -> None:
        sizes = dict(batch_size=batch_size, num_kv_heads=num_kv_heads, max_len=max_len,
                     head_dim=head_dim, v_head_dim=head_dim if v_head_dim is None else v_head_dim)
        B, h_kv, T_max, d_k, d_v = (check_int(name, val, low=1, what="a positive int")
                                    for name, val in sizes.items())
        kw = dict(dtype=check_float_dtype("dtype", dtype), device=device)
        self.kv_dtype = _check_kv_dtype(kv_dtype)
        store = dict(kw, dtype=torch.int8) if self.kv_dtype == "int8" else kw
        # zeros, not empty: positions past a row's end are inside the (B, h_kv, Tk, d) views
        # that masked backends multiply by zero weights, and 0 * NaN garbage would be NaN.
        # On huge pages where the OS allows (mha.hugepages): every decoding step streams them.
        self.k = hugepages.zeros(B, h_kv, T_max, d_k, **store)  # (B, h_kv, T_max, d_k)
        self.v = hugepages.zeros(B, h_kv, T_max, d_v, **store)  # (B, h_kv, T_max, d_v)
        self._dtype = torch.zeros(0, **kw).dtype  # what is appended and attended (not stored)
        self.k_scale = self.v_scale = None
        if self.kv_dtype == "int8":
            self.k_scale = torch.zeros(B, h_kv, T_max, dtype=torch.float32, device=self.k.device)
            self.v_scale = torch.zeros(B, h_kv, T_max, dtype=torch.float32, device=self.k.device)
        self.lengths = torch.zeros(B, dtype=torch.int64, device=self.k.device)
        self.starts = torch.zeros(B, dtype=torch.int64, device=self.k.device)

    # ------------------------------------------------------------------ derived
    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        """T_max, the positions each row can hold."""
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the K/V appended and of the queries (the storage is int8 with
        ``kv_dtype="int8"``)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def max_length(self) -> int:
        """Tk: the longest row (the length of the views attention reads)."""
        return int(self.lengths.max()) if self.batch_size else 0

    def __repr__(self) -> str:
        B, h_kv, T, d_k = self.k.shape
        stored = "" if self.kv_dtype is None else f", kv_dtype={self.kv_dtype}"
        return (f"KVCache(B={B}, h_kv={h_kv}, T_max={T}, d_k={d_k}, d_v={self.v.shape[3]}, "
                f"{str(self.dtype).replace('torch.', '')}{stored}, lengths={self.lengths.tolist()})")

    def keys(self) -> torch.Tensor:
        """``(B, h_kv, Tk, d_k)``: a view of the storage (no copy); int8: dequantized copy."""
        return self._read(self.k, self.k_scale)

    def values(self) -> torch.Tensor:
        """``(B, h_kv, Tk, d_v)``: a view of the storage (no copy); int8: dequantized copy."""
        return self._read(self.v, self.v_scale)

    def _read(self, store: torch.Tensor, scale: torch.Tensor | None,
              Tk: int | None = None) -> torch.Tensor:
        """The first ``Tk`` positions of ``store`` (default :attr:`max_length`)."""
        Tk = self.max_length if Tk is None else Tk
        if scale is None:
            return store[:, :, :Tk]  # (B, h_kv, Tk, d)
        deq = store[:, :, :Tk].float() * scale[:, :, :Tk, None]  # (B, h_kv, Tk, d) * (.., 1)
        return deq.to(self.dtype)

    def attend(self, q: torch.Tensor, **variants) -> torch.Tensor:
        """``(B, h, Tq, d_v)``: ``q (B, h, Tq, d_k)``, the queries of the last ``Tq`` cached
        tokens (append their K/V first), attending everything cached with the cache's masks
        (:meth:`masks`); ``variants`` are the score variants of :func:`mha.attention`
        (softcap, sinks, bias, alibi_slopes).

        With ``kv_dtype="int8"`` and Tq <= 16 this is the decode kernel reading the int8 rows
        and their scales in place (dequantized in its loops, nothing materialized); otherwise
        :func:`mha.attention` over :meth:`keys` / :meth:`values`."""
        from mha.functional import attention
        from mha.ops import decode

        self._check_attend(q, variants)
        masks = self.masks(q.shape[2])
        if self.reads_int8_in_place(q.shape[2]):
            Tk = self.max_length
            return decode.flash_decode(q, self.k[:, :, :Tk], self.v[:, :, :Tk],
                                       k_scale=self.k_scale[:, :, :Tk],
                                       v_scale=self.v_scale[:, :, :Tk], **masks, **variants)
        return attention(q, self.keys(), self.values(), **masks, **variants)

    def reads_int8_in_place(self, Tq: int) -> bool:
        """Whether :meth:`attend` of ``Tq`` queries runs the decode kernel on the int8 rows in
        place: int8 storage, Tq <= 16, a float32 / bfloat16 cache (the kernel's dtypes; a
        float16 / float64 one attends its dequantized K/V) and the kernel built."""
        from mha.ops import decode

        return (self.kv_dtype == "int8" and Tq <= decode.MAX_TQ
                and self.dtype in (torch.float32, torch.bfloat16) and not decode.unavailable())

    def positions(self, Tn: int) -> torch.Tensor:
        """``(B, Tn)`` int64: the positions (counted from each row's start) that the next
        ``Tn`` appended tokens will take — what a model needs for its position embeddings.
        Never below 0: a token that lands inside a row's declared left padding (never
        attended) takes position 0."""
        Tn = check_int("Tn", Tn, low=0, what="a non-negative int")
        at = (self.lengths - self.starts).unsqueeze(1) + torch.arange(Tn, device=self.device)
        return at.clamp(min=0)  # (B, Tn)

    def masks(self, Tq: int) -> dict:
        """The ``mha.attention`` keyword arguments that make the last Tq cached tokens of each
        row attend causally to that row's own keys (see the module docstring)."""
        return self._masks(Tq, self.lengths.tolist(), self.starts.tolist())

    def _masks(self, Tq: int, lengths: list[int], starts: list[int]) -> dict:
        """:meth:`masks` from the rows' ``lengths`` and ``starts`` read once as lists (one
        device read each, not one per reduction)."""
        L, S = self.lengths, self.starts
        late = any(starts)  # a row starts past position 0 (left padding)
        if not late and all(n == lengths[0] for n in lengths):
            return {"causal": True} if Tq > 1 else {}
        out: dict = {"key_lengths": L}
        if Tq > 1 or late:
            Tk = max(lengths, default=0)
            j = torch.arange(Tk, device=self.device)  # (Tk,)
            i = torch.arange(Tq, device=self.device)  # (Tq,)
            last = (L - Tq).view(-1, 1, 1) + i.view(1, -1, 1)  # (B, Tq, 1)
            seen = (j.view(1, 1, -1) <= last) & (j.view(1, 1, -1) >= S.view(-1, 1, 1))  # (B, Tq, Tk)
            out["mask"] = seen.unsqueeze(1)  # (B, Tq, Tk) -> (B, 1, Tq, Tk)
        return out

    # ------------------------------------------------------------------ in place
    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write ``k_new (B, h_kv, Tn, d_k)`` / ``v_new (B, h_kv, Tn, d_v)`` at each row's end.

        Raises (changing nothing) when they do not fit, or their shape/dtype/device differs.
        """
        self._append(k_new, v_new, self.lengths.tolist())

    def _append(self, k_new: torch.Tensor, v_new: torch.Tensor, lengths: list[int]) -> None:
        """:meth:`append`, the rows' ``lengths`` read once as a list (one device read for
        the capacity check and the equal-rows test)."""
        self._check_new(k_new, v_new)
        Tn = k_new.shape[2]
        if lengths and max(lengths) + Tn > self.capacity:
            raise ValueError(f"KVCache is full: appending {Tn} token(s) to rows of lengths "
                             f"{self.lengths.tolist()} exceeds the capacity T_max={self.capacity}; "
                             "the cache is unchanged (make it larger with new_cache(batch_size, "
                             "max_len), or truncate/reset it)")
        if Tn == 0:
            return
        pairs = [(self.k, k_new), (self.v, v_new)]
        if self.kv_dtype == "int8":
            from mha.ops.decode import quantize_int8

            for name, t in (("k_new", k_new), ("v_new", v_new)):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name} holds NaN or Inf, which int8 K/V storage cannot "
                                     "hold; the cache is unchanged")
            kq, ks = quantize_int8(k_new)  # (B, h_kv, Tn, d_k) int8, (B, h_kv, Tn) float32
            vq, vs = quantize_int8(v_new)  # (B, h_kv, Tn, d_v) int8, (B, h_kv, Tn) float32
            pairs = [(self.k, kq), (self.v, vq), (self.k_scale, ks), (self.v_scale, vs)]
        L0 = lengths[0] if lengths else 0
        if all(n == L0 for n in lengths):
            for store, new in pairs:
                store[:, :, L0:L0 + Tn].copy_(new)  # (B, h_kv, Tn[, d]) into the storage
        else:  # ragged rows: one scatter per tensor, still only the new tokens are written
            at = self.lengths.view(-1, 1, 1) + torch.arange(Tn, device=self.device).view(
                1, 1, -1)  # (B, 1, Tn)
            for store, new in pairs:
                pos = at if new.dim() == 3 else at.unsqueeze(-1)  # (B, 1, Tn[, 1])
                store.scatter_(2, pos.expand_as(new), new)  # (B, h_kv, Tn[, d])
        self.lengths += Tn

    @contextlib.contextmanager
    def appending(self, k_new: torch.Tensor, v_new: torch.Tensor):
        """Append, then yield ``(k_all (B, h_kv, Tk, d_k), v_all, masks)`` for attention over
        everything cached; if the body raises, the append is undone (lengths restored)."""
        before = self.lengths.tolist()  # (B,) as a list: one device read serves the step
        self._append(k_new, v_new, before)
        Tn = k_new.shape[2]
        after = [n + Tn for n in before]  # the lengths the append wrote
        Tk = max(after, default=0)
        try:
            yield (self._read(self.k, self.k_scale, Tk), self._read(self.v, self.v_scale, Tk),
                   self._masks(Tn, after, self.starts.tolist()))
        except BaseException:
            self.lengths.copy_(torch.tensor(before, dtype=torch.int64, device=self.device))
            raise

    def truncate(self, n) -> None:
        """Keep the first ``n`` positions (an int, or ``(B,)`` per row) — speculative-decoding
        rollback, beam pruning, or cutting right padding after a batched prefill. ``lengths``
        changes, and ``starts`` where the cut reaches into a row's left padding (the row keeps
        ``n`` padding slots, and the next token appended is its first real one, at position
        0); ``n`` may not exceed a row's current length (refused, the cache unchanged)."""
        n = _as_rows("n", n, self.batch_size, self.device)
        if bool((n < 0).any()) or bool((n > self.lengths).any()):
            raise ValueError(f"truncate: n must lie in [0, current length] per row; lengths are "
                             f"{self.lengths.tolist()}, got n={n.tolist()}")
        self.lengths.copy_(n)
        torch.minimum(self.starts, n, out=self.starts)

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search: row ``b`` becomes a copy of row ``index[b]`` (``index`` an integer tensor
        ``(B,)``, duplicates allowed, like ``index_select`` on the batch dim / HF's
        ``reorder_cache``), in place; ``lengths`` and ``starts`` follow their rows.

        Only rows that change are written, and of each only the first ``Tk`` positions (the
        longest row kept): ``O(B * Tk * d)`` bytes, and the storage is never reallocated. The
        index is checked (dtype, shape, device, range) before anything changes: a refused call
        leaves the cache exactly as it was.
        """
        B = self.batch_size
        if not isinstance(index, torch.Tensor):
            raise TypeError(f"reorder: index must be an integer tensor (B,) = ({B},), got "
                            f"{type(index).__name__}")
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise TypeError(f"reorder: index must be an integer tensor (B,) = ({B},), got "
                            f"{index.dtype}")
        if index.shape != (B,):
            raise ValueError(f"reorder: index must have shape (B,) = ({B},), got "
                             f"{tuple(index.shape)}")
        if index.device != self.device:
            raise ValueError(f"reorder: index must be on the cache's device {self.device}, got "
                             f"{index.device}")
        if B and (bool((index < 0).any()) or bool((index >= B).any())):
            raise ValueError(f"reorder: index values must lie in [0, B) = [0, {B}), got "
                             f"{index.tolist()}")
        index = index.to(torch.int64)
        rows = torch.nonzero(index != torch.arange(B, device=self.device)).flatten()  # (n,)
        if rows.numel() == 0:
            return
        src = index[rows]  # (n,) source row of each changed row
        Tk = int(self.lengths[src].max())
        # gather first (copies: a source row may itself be overwritten), then write
        stores = [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        gathered = [t[src, :, :Tk] for t in stores]  # (n, h_kv, Tk[, d]) each
        lengths, starts = self.lengths[index], self.starts[index]  # (B,)
        for t, got in zip(stores, gathered, strict=True):
            t[:, :, :Tk].index_copy_(0, rows, got)
        self.lengths.copy_(lengths)
        self.starts.copy_(starts)

    def reset(self) -> None:
        """Forget everything (lengths and starts to 0); the storage is kept, not cleared."""
        self.lengths.zero_()
        self.starts.zero_()

    def mark_left_padding(self, n) -> None:
        """Declare that the first ``n`` positions (int or ``(B,)``) of each row are padding
        (left-padded prompts): no query attends them, and :meth:`positions` counts from there.

        Usually called on an empty cache, before the padded prompt is appended (possibly in
        chunks: tokens appended inside the padding are never attended, so the prompt must
        reach past ``n`` before decoding); on a row that already holds tokens, ``n`` may not
        exceed its length. Refused (ValueError / TypeError, the cache unchanged) otherwise, or
        when ``n`` is negative, above T_max, or not an int / integer ``(B,)``."""
        n = _as_rows("n", n, self.batch_size, self.device)
        limit = torch.where(self.lengths > 0, self.lengths, self.capacity)  # (B,)
        if bool((n < 0).any()) or bool((n > limit).any()):
            raise ValueError(f"mark_left_padding: n must lie in [0, T_max={self.capacity}] and, "
                             f"for rows already holding tokens, within their lengths "
                             f"{self.lengths.tolist()}; got n={n.tolist()}")
        self.starts.copy_(n)

    def _check_attend(self, q, variants: dict) -> None:
        """q ``(B, h, Tq, d_k)`` in the cache's dtype, for at most as many tokens as every row
        holds; no keyword among the masks the cache sets itself (TypeError / ValueError)."""
        for name in _CACHE_SETS:
            if name in variants:
                raise TypeError(f"KVCache.attend: {name} is set by the cache itself (each row "
                                "attends its own keys, causally from its length), not an "
                                "argument; pass score variants only (softcap, sinks, bias, "
                                "alibi_slopes)")
        check_tensor("q", q, 4, f"(B, h, Tq, d_k) = ({self.batch_size}, h, Tq, "
                                f"{self.k.shape[3]})")
        if q.dtype != self.dtype:
            raise TypeError(f"KVCache.attend: q must be {self.dtype} like the cache's K/V, got "
                            f"{q.dtype}")
        if bool((self.lengths < q.shape[2]).any()):
            raise ValueError(f"KVCache.attend: q holds Tq={q.shape[2]} queries per row, more "
                             f"than the rows' lengths {self.lengths.tolist()} (q is the "
                             "queries of the last Tq cached tokens: append their K/V first)")

    def _check_new(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        B, h_kv, _, d_k = self.k.shape
        d_v = self.v.shape[3]
        check_tensor("k_new", k_new, 4, f"(B, h_kv, Tn, d_k) = ({B}, {h_kv}, Tn, {d_k})")
        check_tensor("v_new", v_new, 4, f"(B, h_kv, Tn, d_v) = ({B}, {h_kv}, Tn, {d_v})")
        if (k_new.shape[:2], k_new.shape[3]) != ((B, h_kv), d_k) or \
                v_new.shape != (B, h_kv, k_new.shape[2], d_v):
            raise ValueError(f"KVCache expects k_new (B, h_kv, Tn, d_k) = ({B}, {h_kv}, Tn, {d_k}) "
                             f"and v_new (B, h_kv, Tn, d_v) = ({B}, {h_kv}, Tn, {d_v}), got "
                             f"{tuple(k_new.shape)} and {tuple(v_new.shape)}")
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if t.dtype != self.dtype or t.device != self.device:
                raise TypeError(f"{name} must be {self.dtype} on {self.device} like the cache, "
                                f"got {t.dtype} on {t.device}")
        if torch.is_grad_enabled() and (k_new.requires_grad or v_new.requires_grad):
            raise RuntimeError("KVCache is for inference: K/V that require grad cannot be "
                               "cached in place; decode under torch.no_grad() or "
                               "torch.inference_mode()")


class ConcatKVCache:
    """The textbook baseline: K/V grown with ``torch.cat`` every step (copies the whole history,
    ``O(N^2 d)`` bytes over N steps). Same protocol and same math as :class:`KVCache` for
    equal-length rows; for tests and benchmarks. State: ``k``, ``v`` ``(B, h_kv, T, d)`` or None.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def max_length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    @property
    def batch_size(self) -> int | None:
        """B of what is cached (None while empty: the first append sets it)."""
        return None if self.k is None else self.k.shape[0]

    @property
    def device(self) -> torch.device | None:
        return None if self.k is None else self.k.device

    def positions(self, Tn: int) -> torch.Tensor:
        """``(1, Tn)``: the positions the next Tn tokens take (rows are equally long)."""
        Tn = check_int("Tn", Tn, low=0, what="a non-negative int")
        at = torch.arange(Tn, device=self.device).unsqueeze(0)  # (Tn,) -> (1, Tn)
        return self.max_length + at

    @contextlib.contextmanager
    def appending(self, k_new: torch.Tensor, v_new: torch.Tensor):
        """Grow by concatenation and yield ``(k_all, v_all, masks)``; undone if the body raises.
        New K/V whose batch, heads, head dims, dtype or device differ from what is cached are
        refused (ValueError / TypeError naming them), the cache unchanged."""
        self._check_new(k_new, v_new)
        before = (self.k, self.v)
        if self.k is None:
            self.k, self.v = k_new, v_new
        else:
            self.k = torch.cat([self.k, k_new], dim=2)  # (B, h_kv, T + Tn, d_k): copies all
            self.v = torch.cat([self.v, v_new], dim=2)  # (B, h_kv, T + Tn, d_v)
        try:
            yield self.k, self.v, ({"causal": True} if k_new.shape[2] > 1 else {})
        except BaseException:
            self.k, self.v = before
            raise

    def _check_new(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        check_tensor("k_new", k_new, 4, "(B, h_kv, Tn, d_k)")
        check_tensor("v_new", v_new, 4, "(B, h_kv, Tn, d_v)")
        if v_new.shape[:3] != k_new.shape[:3]:
            raise ValueError(f"v_new must have k_new's (B, h_kv, Tn) = {tuple(k_new.shape[:3])}, "
                             f"got {tuple(v_new.shape)}")
        if self.k is None:
            return
        B, h_kv, _, d_k = self.k.shape
        d_v = self.v.shape[3]
        for name, t, d, dn in (("k_new", k_new, d_k, "d_k"), ("v_new", v_new, d_v, "d_v")):
            want = f"(B, h_kv, Tn, {dn}) = ({B}, {h_kv}, Tn, {d})"
            if t.shape[0] != B:
                raise ValueError(f"{name} must have batch size B={B} like the cached rows "
                                 f"{want}, got {tuple(t.shape)}")
            if (t.shape[1], t.shape[3]) != (h_kv, d):
                raise ValueError(f"{name} must have h_kv={h_kv} and {dn}={d} like the cached "
                                 f"rows {want}, got {tuple(t.shape)}")
            if t.dtype != self.k.dtype or t.device != self.k.device:
                raise TypeError(f"{name} must be {self.k.dtype} on {self.k.device} like the "
                                f"cached rows, got {t.dtype} on {t.device}")
