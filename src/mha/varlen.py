"""``mha.varlen_attention``: attention over packed sequences of different lengths (no padding).

Shape legend: S sequences, N_q / N_k packed query / key tokens (all sequences end to end),
h query heads, h_kv key/value heads (h_kv divides h), d_k / d_v head dims, n_q[s] / n_k[s] the
lengths of sequence s, max_q / max_k the longest ones.

The layout is the one of FlashAttention's ``flash_attn_varlen_func``: tokens of every sequence
one after the other, and ``cu_seqlens`` ``(S + 1,)`` the running offsets, so sequence ``s`` is
rows ``cu_seqlens[s] : cu_seqlens[s + 1]``. Tokens of one sequence never see another's.
``causal`` is bottom-right *per sequence* (query ``r`` of sequence ``s`` sees its keys
``j <= r + n_k[s] - n_q[s]``), as in :func:`mha.attention`.

Two exact ways to run it, chosen per call by a cost model (or forced with ``strategy``):

* ``"pad"`` — one batched :func:`mha.attention` call over ``(S, h, max, d)`` (a view, no copy,
  when all sequences have one length). Padding goes after each sequence (the kernel skips
  keys past ``key_lengths``), except for causal calls with ``n_q != n_k`` and ALiBi calls:
  there every sequence is right-aligned (its padding in front), so the bottom-right causal diagonal of the padded
  problem is each sequence's own; a ``(S, 1, 1, max_k)`` key mask hides the padding keys.
  With padding, q, k, v are copied in and the output back (O(S max d)); compute grows to
  ``S * max_q * max_k`` score elements.
* ``"loop"`` — one call per sequence on strided views of the packed tensors (no copy in);
  compute is exactly ``sum_s n_q[s] * n_k[s]``, plus one call's overhead per sequence.

Score variants: ``softcap``, ``sinks`` and ``alibi_slopes`` as in :func:`mha.attention` (ALiBi
measured within each sequence), and ``bias`` **one tensor per sequence**: ``bias[s]``
broadcastable to ``(h, n_q[s], n_k[s])`` — the block of sequence ``s`` on the diagonal of the
packed ``(h, N_q, N_k)`` score matrix, the only block that is ever read (a packed
``(h, N_q, N_k)`` tensor would be mostly never-read memory, quadratic in the total). A
``(h, 1, 1)`` or ``(1, 1, n_k[s])`` bias stays that small in the loop strategy; the pad strategy
copies the biases into one ``(S, h|1, max_q|1, max_k|1)`` tensor.

Both are differentiable and give the same values (tested against each other and against the
float64 per-head loop, one sequence at a time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mha.checks import (
    _check_float_tensor,
    check_alibi_slopes,
    check_bool,
    check_cu_seqlens,
    check_packed_qkv,
    check_scalar,
    check_sinks,
    check_softcap,
)

#: Cost model: seconds per attention FLOP, per call, and per padded element copied (zeroed new
#: buffers, page faults included). Rough figures of this CPU (~150 GFLOP/s attention, ~40 us a
#: call, ~0.5 G elements/s); only the choice of strategy depends on them, never the result.
_SECONDS_PER_FLOP = 1 / 150e9
_SECONDS_PER_CALL = 40e-6
_SECONDS_PER_COPIED = 2e-9

STRATEGIES = ("auto", "pad", "loop")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None, *,
                     causal: bool = False, scale: float | None = None, dropout_p: float = 0.0,
                     backend: str | None = None, strategy: str = "auto",
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     alibi_slopes: torch.Tensor | None = None,
                     bias: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Attention within each of several packed sequences.

    Args:
        q: ``(N_q, h, d_k)`` the queries of all sequences, end to end.
        k: ``(N_k, h_kv, d_k)``; v: ``(N_k, h_kv, d_v)``.
        cu_seqlens_q: ``(S + 1,)`` integers, ``0 = c_0 <= c_1 <= ... <= c_S = N_q``.
        cu_seqlens_k: the same for keys; None means ``cu_seqlens_q`` (self-attention).
        causal: bottom-right causal within each sequence.
        scale, dropout_p, backend: as in :func:`mha.attention`.
        strategy: ``"pad"``, ``"loop"`` or ``"auto"`` (the cheaper by the cost model above).
        softcap: as in :func:`mha.attention`.
        sinks: ``(h,)``, as in :func:`mha.attention` (one sink per head, every sequence).
        alibi_slopes: ``(h,)``; the distance is each sequence's own ``r + n_k[s] - n_q[s] - c``
            (query ``r``, key ``c`` within sequence ``s``).
        bias: a list (or tuple) of S float tensors, ``bias[s]`` broadcastable to
            ``(h, n_q[s], n_k[s])`` (e.g. ``(h, 1, 1)``, ``(1, n_q[s], n_k[s])``): added to the
            scores of sequence ``s`` after the softcap, as :func:`mha.attention`'s bias.
            Differentiable; each gradient comes back in its own shape.

    Returns:
        ``(N_q, h, d_v)``. A query whose sequence has no visible key gets zeros.
    """
    from mha.functional import attention

    check_packed_qkv(q, k, v)
    causal = check_bool("causal", causal)
    scale = None if scale is None else check_scalar("scale", scale, low=0.0)
    dropout_p = check_scalar("dropout_p", dropout_p, low=0.0, high=1.0, high_open=True)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if cu_seqlens_k is None:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"cu_seqlens_k is needed when q and k have different token counts "
                             f"(q {tuple(q.shape)}, k {tuple(k.shape)})")
        cu_seqlens_k = cu_seqlens_q
    n_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    n_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if len(n_q) != len(n_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {len(n_q)} and {len(n_k)}")
    h = q.shape[1]
    variants = dict(
        softcap=None if softcap is None else check_softcap(softcap),
        sinks=None if sinks is None else check_sinks(sinks, h, q.device),
        alibi_slopes=None if alibi_slopes is None else check_alibi_slopes(alibi_slopes, 1, h,
                                                                          q.device)[0])
    biases = None if bias is None else _check_bias_list(bias, n_q, n_k, h, q.device)
    kwargs = dict(causal=causal, scale=scale, dropout_p=dropout_p, backend=backend, **variants)
    if strategy == "auto":
        strategy = _choose(n_q, n_k, q.shape[1] * (q.shape[2] + v.shape[2]),
                           0 if biases is None else _numel(_padded_bias_shape(biases, n_q, n_k)))
    if strategy == "loop" or not n_q:
        return _loop(q, k, v, n_q, n_k, attention, kwargs, biases)
    return _pad(q, k, v, n_q, n_k, attention, kwargs, biases)


def _check_bias_list(bias, n_q: list[int], n_k: list[int], h: int,
                     device: torch.device) -> list[torch.Tensor]:
    """One float tensor per sequence, ``bias[s]`` broadcastable to ``(h, n_q[s], n_k[s])``;
    returned as 3-D views ``(h|1, n_q[s]|1, n_k[s]|1)``."""
    S = len(n_q)
    if isinstance(bias, (torch.Tensor, str, bytes)) or not isinstance(bias, Sequence):
        got = f"a tensor of shape {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) \
            else type(bias).__name__
        raise TypeError(f"bias must be a list of S={S} tensors, bias[s] broadcastable to "
                        f"(h, n_q[s], n_k[s]) (one block per packed sequence), got {got}")
    if len(bias) != S:
        raise ValueError(f"bias must hold one tensor per sequence (S={S}), got {len(bias)}")
    out = []
    for s, (b, a, c) in enumerate(zip(bias, n_q, n_k, strict=True)):
        want = (h, a, c)
        _check_float_tensor(f"bias[{s}]", b, f"broadcastable to (h, n_q[s], n_k[s]) = {want}",
                            device)
        v3 = b.reshape((1,) * (3 - b.dim()) + tuple(b.shape)) if b.dim() <= 3 else None
        if v3 is None or any(g not in (1, n) for g, n in zip(v3.shape, want, strict=True)):
            raise ValueError(f"bias[{s}] of shape {tuple(b.shape)} is not broadcastable to "
                             f"(h, n_q[s], n_k[s]) = {want}")
        out.append(v3)  # (h|1, n_q[s]|1, n_k[s]|1)
    return out


def _padded_bias_shape(biases: list[torch.Tensor], n_q: list[int], n_k: list[int]):
    """``(S, h|1, max_q|1, max_k|1)``: a dim is 1 when every bias broadcasts along it (has
    size 1 there)."""
    ones = [all(b.shape[i] == 1 for b in biases) for i in range(3)]
    h = max((b.shape[0] for b in biases), default=1)
    big = (h, max(n_q, default=0), max(n_k, default=0))
    return (len(biases), *(1 if one else m for one, m in zip(ones, big, strict=True)))


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _choose(n_q: list[int], n_k: list[int], width: int, bias_padded: int = 0) -> str:
    """The strategy with the lower modelled time; ``width`` = h * (d_k + d_v);
    ``bias_padded`` the elements of the padded bias the pad strategy would build."""
    S = len(n_q)
    if S <= 1:
        return "loop"  # a single sequence: a view, no padding, one call
    exact = sum(a * b for a, b in zip(n_q, n_k, strict=True))
    padded = S * max(n_q) * max(n_k)
    t_loop = 2 * width * exact * _SECONDS_PER_FLOP + S * _SECONDS_PER_CALL
    t_pad = 2 * width * padded * _SECONDS_PER_FLOP + _SECONDS_PER_CALL
    if min(n_q) < max(n_q) or min(n_k) < max(n_k):  # padding: copies in and out
        t_pad += S * (max(n_q) + max(n_k)) * width * _SECONDS_PER_COPIED
    t_pad += bias_padded * _SECONDS_PER_COPIED
    return "pad" if t_pad <= t_loop else "loop"


def _loop(q, k, v, n_q, n_k, attention, kwargs, biases=None) -> torch.Tensor:
    """One :func:`mha.attention` call per sequence, on views of the packed tensors."""
    outs = []
    iq = ik = 0
    for s, (a, b) in enumerate(zip(n_q, n_k, strict=True)):
        if biases is not None:
            kwargs = {**kwargs, "bias": biases[s].unsqueeze(0)}  # (1, h|1, a|1, b|1)
        qs = q[iq:iq + a].transpose(0, 1).unsqueeze(0)  # (a, h, d_k) -> (1, h, a, d_k)
        ks = k[ik:ik + b].transpose(0, 1).unsqueeze(0)  # (b, h_kv, d_k) -> (1, h_kv, b, d_k)
        vs = v[ik:ik + b].transpose(0, 1).unsqueeze(0)  # (b, h_kv, d_v) -> (1, h_kv, b, d_v)
        out = attention(qs, ks, vs, **kwargs)  # (1, h, a, d_v)
        outs.append(out[0].transpose(0, 1))  # (1, h, a, d_v) -> (a, h, d_v)
        iq, ik = iq + a, ik + b
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[2])  # (0, h, d_v)
    return torch.cat(outs)  # (N_q, h, d_v)


def _rows(n: list[int], width: int, front: bool, device) -> torch.Tensor:
    """For every packed token, its row in the padded ``(S * width)`` layout: sequence ``s``
    fills rows ``s * width + [0, n_s)``, or the last ``n_s`` rows of its block when ``front``
    (padding in front, the sequence right-aligned)."""
    lengths = torch.tensor(n, dtype=torch.int64, device=device)  # (S,)
    seq = torch.repeat_interleave(torch.arange(len(n), device=device), lengths)  # (N,)
    starts = torch.cumsum(lengths, 0) - lengths  # (S,) first packed token of each sequence
    row = torch.arange(int(lengths.sum()), device=device) - starts[seq]  # (N,) within sequence
    if front:
        row = row + (width - lengths[seq])
    return seq * width + row  # (N,)


def _scatter(x: torch.Tensor, rows: torch.Tensor, S: int, width: int) -> torch.Tensor:
    """``(N, heads, d)`` packed -> ``(S, heads, width, d)`` padded with zeros (a strided view of
    a ``(S, width, heads, d)`` buffer)."""
    buf = x.new_zeros(S * width, *x.shape[1:]).index_copy_(0, rows, x)  # (S*width, heads, d)
    return buf.view(S, width, *x.shape[1:]).transpose(1, 2)  # (S, heads, width, d)


def _split(x: torch.Tensor, S: int) -> torch.Tensor:
    """``(S * n, heads, d)`` -> ``(S, heads, n, d)``, a view (sequences of one length)."""
    return x.view(S, x.shape[0] // S, *x.shape[1:]).transpose(1, 2)  # (S, heads, n, d)


def _pad_bias(biases: list[torch.Tensor], n_q: list[int], n_k: list[int],
              front: bool) -> torch.Tensor:
    """The per-sequence biases in the padded layout ``(S, h|1, max_q|1, max_k|1)``: sequence
    ``s`` at the rows/columns its queries/keys take (the last ones when ``front``), zeros
    elsewhere (padding: never read). Differentiable (a copy into a new tensor)."""
    shape = _padded_bias_shape(biases, n_q, n_k)
    dtype = biases[0].dtype
    for b in biases[1:]:
        dtype = torch.promote_types(dtype, b.dtype)
    buf = biases[0].new_zeros(shape, dtype=dtype)  # (S, h|1, max_q|1, max_k|1)
    along_q, along_k = (all(b.shape[i] == 1 for b in biases) for i in (1, 2))  # broadcast dims
    for s, (b, a, c) in enumerate(zip(biases, n_q, n_k, strict=True)):
        rows = slice(None) if along_q else _span(a, shape[2], front)
        cols = slice(None) if along_k else _span(c, shape[3], front)
        block = buf[s, :, rows, cols]  # (h|1, a|1, c|1)
        block.copy_(b.expand(block.shape))
    return buf


def _span(n: int, width: int, front: bool) -> slice:
    """The positions of a length-``n`` sequence in a padded dim of ``width``."""
    return slice(width - n, width) if front else slice(0, n)


def _pad(q, k, v, n_q, n_k, attention, kwargs, biases=None) -> torch.Tensor:
    """One batched call over padded ``(S, h, max, d)`` tensors.

    Padding goes after each sequence (keys past ``key_lengths`` are skipped by the kernel)
    unless the call is causal with ``n_q != n_k`` for some sequence, or uses ALiBi: then every
    sequence is right-aligned, so the bottom-right diagonal is each sequence's own, and a key mask hides
    the padding in front.
    """
    S, max_q, max_k = len(n_q), max(n_q), max(n_k)
    front = (kwargs["causal"] and n_q != n_k) or kwargs["alibi_slopes"] is not None
    if biases is not None:
        kwargs = {**kwargs, "bias": _pad_bias(biases, n_q, n_k, front)}  # (S, h|1, max_q|1,
        # max_k|1)
    if min(n_q) == max_q and min(n_k) == max_k:  # equal lengths: no padding, only views
        out = attention(_split(q, S), _split(k, S), _split(v, S), **kwargs)  # (S, h, n_q, d_v)
        return out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[3])  # (N_q, h, d_v)
    # right-aligned (front above) when the bottom-right diagonal matters: causal with
    # n_q != n_k, or ALiBi (its distance i + Tk - Tq - j must be each sequence's own)
    rows_q = _rows(n_q, max_q, front, q.device)  # (N_q,)
    rows_k = _rows(n_k, max_k, front, q.device)  # (N_k,)
    lengths = torch.tensor(n_k, dtype=torch.int64, device=q.device)  # (S,)
    masking = {}
    if front and min(n_k) < max_k:
        j = torch.arange(max_k, device=q.device)  # (max_k,)
        masking["mask"] = (j[None, :] >= (max_k - lengths)[:, None])[:, None, None, :]  # (S,1,1,max_k)
    elif not front and min(n_k) < max_k:
        masking["key_lengths"] = lengths
    out = attention(_scatter(q, rows_q, S, max_q), _scatter(k, rows_k, S, max_k),
                    _scatter(v, rows_k, S, max_k), **masking, **kwargs)  # (S, h, max_q, d_v)
    flat = out.transpose(1, 2).reshape(S * max_q, *out.shape[1:2], out.shape[3])  # (S*max_q, h, d_v)
    return flat.index_select(0, rows_q)  # (N_q, h, d_v)
