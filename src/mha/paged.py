"""Paged K/V: a pool of fixed-size pages shared by many sequences (continuous batching).

Shape legend: L layers, P pages in the pool, p page size (tokens per page), h / h_kv query /
K/V heads, d_k / d_v head dims, S sequence slots, M = ceil(max_len / p) pages per sequence at
most, N packed tokens (of several sequences, end to end), n_s the tokens of sequence s in one
call, Tq queries per row of a decode call.

:class:`PagedKVCache` holds, per layer, K and V page pools ``(P, h_kv, p, d)`` and, per
sequence slot, a row of the block table ``(S, M)`` int32 (page of each logical page index)
and a length. Sequences grow a page at a time; pages of finished sequences return to the pool
at once, so many sequences of different lengths share memory without a ``T_max`` per row.

Layout ``(P, h_kv, p, d)``: the decode kernel works on (row, K/V head, key split) items, and
here one K/V head's keys of one page are a contiguous ``(p, d)`` block with the dense cache's
row stride ``d``. So the kernel's q.k / p.v loops (portable, AVX-512, AMX) read a page as
they read a dense cache's run of ``p`` keys, and an item streams only its own head's bytes.
vLLM's ``(P, p, h_kv, d)`` would interleave heads (row stride ``h_kv * d``) and make each
head's read strided. The int8 scales follow the same layout, ``(P, h_kv, p)``.

Reading: :meth:`attend` (decode rows, ``flash_decode`` through the block table) and
:meth:`attend_varlen` (ragged prefill chunks mixed with decode rows: the paged flash forward,
K/V packed from the pages, or a gathered copy where it does not apply, :meth:`explain`).

Copy-on-write: :meth:`fork` makes a child that shares every page of its parent (refcounts).
Full pages are never written again (appends go to the end), so only a shared partial last
page is copied, by the next :meth:`extend` of either sequence that writes into it.

Refusals change nothing: every check (ids, lengths, pages needed against pages free, shapes,
dtypes, non-finite values for int8) runs before the first write. An exhausted pool raises
:class:`PagePoolExhausted` naming the pages needed and free; the documented way out is
preemption: the caller frees a sequence (:meth:`free`) and retries, recomputing the freed one
later (what :mod:`mha.serving`'s scheduler does).
"""

from __future__ import annotations

import warnings

import torch

from mha import hugepages
from mha.checks import (
    check_float_dtype,
    check_int,
    check_scalar,
    check_sinks,
    check_softcap,
    check_tensor,
)

STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}


_NATIVE_VARIANTS = ("scale", "softcap", "sinks")  # what the paged flash forward applies
_DECODE_VARIANTS = ("scale", "softcap", "sinks", "bias", "alibi_slopes")  # what attend takes
_CACHE_SETS = ("causal", "key_lengths", "block_table", "cu_seqlens", "k_scale", "v_scale")


def _check_variant_names(method: str, variants: dict, allowed: tuple[str, ...] | None) -> None:
    """TypeError naming a keyword ``method`` cannot take: one the cache sets itself (causal,
    key_lengths, ...), or, with ``allowed``, any other than those."""
    for name in variants:
        if name in _CACHE_SETS:
            raise TypeError(f"{method}: {name} is set by the cache itself (causal to each "
                            f"sequence's own length, from its pages), not an argument")
        if allowed is not None and name not in allowed:
            raise TypeError(f"{method} got an unexpected keyword {name!r}; its variants are "
                            f"{', '.join(allowed)} (and portable)")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _id_list(seq_ids) -> list:
    """``seq_ids`` as a list: a list, tuple or range of ids, or a 1-D integer tensor (TypeError
    naming it otherwise; the ids themselves are checked by the cache)."""
    if isinstance(seq_ids, torch.Tensor) and seq_ids.dim() == 1:
        return seq_ids.tolist()
    if isinstance(seq_ids, (list, tuple, range)):
        return list(seq_ids)
    got = (f"a {seq_ids.dim()}-d tensor" if isinstance(seq_ids, torch.Tensor)
           else type(seq_ids).__name__)
    raise TypeError(f"seq_ids must be a list (or tuple) of sequence ids or a 1-D integer tensor, "
                    f"one per sequence in order, got {got}")


def _row_variants(variants: dict, i: int, n: int) -> dict:
    """The decode kernel's variants of row ``i`` (a sequence of ``n`` tokens) for a call on
    that row alone: a bias broadcastable to ``(S', h, Tq, M * p)`` cut to ``(1|., h|1, Tq|1,
    n|1)``, ``(S', h)`` ALiBi slopes to ``(1, h)``; the others as they are."""
    out = dict(variants)
    bias = out.get("bias")
    if isinstance(bias, torch.Tensor) and 1 <= bias.dim() <= 4:
        b = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # (S'|1, h|1, Tq|1, Mp|1)
        b = b[i:i + 1] if b.shape[0] > 1 else b
        out["bias"] = b[..., :n] if b.shape[-1] > 1 else b  # (1, h|1, Tq|1, n|1)
    slopes = out.get("alibi_slopes")
    if isinstance(slopes, torch.Tensor) and slopes.dim() == 2 and slopes.shape[0] > 1:
        out["alibi_slopes"] = slopes[i:i + 1]  # (S', h) -> (1, h)
    return out


class PagePoolExhausted(RuntimeError):
    """Not enough free pages for a call; the cache is unchanged. ``needed`` / ``free``: pages."""

    def __init__(self, needed: int, free: int, what: str) -> None:
        super().__init__(f"page pool exhausted: {what} needs {needed} page(s), {free} free; the "
                         "cache is unchanged (free a sequence and retry, or make the pool larger)")
        self.needed, self.free = needed, free


def _check_kv_dtype(kv_dtype, dtype: torch.dtype) -> torch.dtype:
    """None (K/V stored in ``dtype``), "float32"/"fp32", "bfloat16"/"bf16", "int8", or the
    torch dtype -> the storage dtype (one the paged kernels read)."""
    if kv_dtype is None:
        if dtype not in STORAGE.values():
            raise ValueError(f"kv_dtype=None stores K/V in dtype={dtype}, which the paged "
                             "kernels do not read; pass kv_dtype='float32', 'bfloat16' or "
                             "'int8' (queries and K/V written stay in dtype)")
        return dtype
    name = _ALIASES.get(kv_dtype, kv_dtype) if isinstance(kv_dtype, str) else None
    if name in STORAGE:
        return STORAGE[name]
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in STORAGE.values():
        return kv_dtype
    raise ValueError(f"kv_dtype must be None (K/V stored in dtype), 'float32', 'bfloat16' or "
                     f"'int8' (one float32 scale per token and K/V head), got {kv_dtype!r}")


def pool_bytes(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               v_head_dim: int | None = None, *, num_layers: int = 1,
               dtype: torch.dtype | None = None, kv_dtype=None) -> int:
    """The bytes of the page pools a :class:`PagedKVCache` of these arguments allocates (the
    same arguments): K ``(L, P, h_kv, p, d_k)`` and V ``(L, P, h_kv, p, d_v)`` in the storage
    dtype, plus int8's two float32 scales per token and K/V head; the block table and the
    per-sequence counters are not counted. Nothing is allocated: a size can be checked
    against free memory first."""
    sizes = dict(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, v_head_dim=head_dim if v_head_dim is None else v_head_dim,
                 num_layers=num_layers)
    P, p, h_kv, d_k, d_v, L = (check_int(name, val, low=1, what="a positive int")
                               for name, val in sizes.items())
    store = _check_kv_dtype(kv_dtype, check_float_dtype("dtype", dtype)
                            or torch.get_default_dtype())
    scales = 2 * 4 if store == torch.int8 else 0  # k_scale, v_scale: float32 per token, head
    return L * P * h_kv * p * ((d_k + d_v) * store.itemsize + scales)


class PagedKVCache:
    """K/V of many sequences in fixed-size pages, per layer; see the module docstring.

    Attributes (the state):
        k, v: ``(L, P, h_kv, p, d_k)`` / ``(L, P, h_kv, p, d_v)`` page pools, in the storage
            dtype (``kv_dtype``: float32, bfloat16 or int8).
        k_scale, v_scale: ``(L, P, h_kv, p)`` float32 with int8 storage, else None.
        block_table: ``(S, M)`` int32; row s lists the pages of sequence slot s in order
            (entries past its length are -1).
        lengths: ``(S,)`` int64, tokens held by each slot.
        refcount: ``(P,)`` int32, how many sequences hold each page (0: free).

    Updated in place: :meth:`add_sequence`, :meth:`fork` and :meth:`free` change the block
    table, refcounts and lengths; :meth:`extend` allocates pages (copying a shared last page
    first) and advances lengths; :meth:`write` stores K/V of the tokens just extended into one
    layer's pages; :meth:`append` is extend + write for a one-layer cache.

    ``dtype`` is that of the K/V written and the queries; bfloat16 storage with float32
    queries is read by casting the queries (the kernel computes in fp32 either way). int8:
    :func:`mha.ops.decode.quantize_int8`, the error bound of :class:`mha.KVCache`.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int | None = None, *, max_seqs: int, max_len: int,
                 num_layers: int = 1, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, kv_dtype=None) -> None:
        sizes = dict(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, v_head_dim=head_dim if v_head_dim is None else v_head_dim,
                     max_seqs=max_seqs, max_len=max_len, num_layers=num_layers)
        P, p, h_kv, d_k, d_v, S, T, L = (check_int(name, val, low=1, what="a positive int")
                                         for name, val in sizes.items())
        self._dtype = check_float_dtype("dtype", dtype) or torch.get_default_dtype()
        store = _check_kv_dtype(kv_dtype, self._dtype)
        self.kv_dtype = store
        M = -(-T // p)  # ceil(max_len / page_size)
        kw = dict(dtype=store, device=device)
        # the page pools on huge pages where the OS allows (mha.hugepages): steps stream them
        self.k = hugepages.zeros(L, P, h_kv, p, d_k, **kw)  # (L, P, h_kv, p, d_k)
        self.v = hugepages.zeros(L, P, h_kv, p, d_v, **kw)  # (L, P, h_kv, p, d_v)
        dev = self.k.device
        self.k_scale = self.v_scale = None
        if store == torch.int8:
            self.k_scale = torch.zeros(L, P, h_kv, p, dtype=torch.float32, device=dev)
            self.v_scale = torch.zeros(L, P, h_kv, p, dtype=torch.float32, device=dev)
        self.block_table = torch.full((S, M), -1, dtype=torch.int32, device=dev)  # (S, M)
        self.lengths = torch.zeros(S, dtype=torch.int64, device=dev)  # (S,)
        self.refcount = torch.zeros(P, dtype=torch.int32, device=dev)  # (P,)
        self._live = [False] * S  # slot s holds a sequence
        self._free = list(range(P - 1, -1, -1))  # free pages, the next one last

    # ------------------------------------------------------------------ derived
    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        """The tokens one sequence can hold: M pages."""
        return self.block_table.shape[1] * self.page_size

    @property
    def nbytes(self) -> int:
        """The bytes of the page pools (K, V, int8's scales): :func:`pool_bytes`."""
        L, P, h_kv, p, d_k = self.k.shape
        return pool_bytes(P, p, h_kv, d_k, self.v.shape[4], num_layers=L,
                          dtype=self._dtype, kv_dtype=self.kv_dtype)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def sequences(self) -> list[int]:
        """The live sequence ids (slots), in order."""
        return [s for s, live in enumerate(self._live) if live]

    def __repr__(self) -> str:
        L, P, h_kv, p, d_k = self.k.shape
        store = str(self.kv_dtype).replace("torch.", "")
        return (f"PagedKVCache(L={L}, pages={P}x{p}, h_kv={h_kv}, d_k={d_k}, "
                f"d_v={self.v.shape[4]}, {store}, free={self.free_pages}, "
                f"sequences={len(self.sequences)})")

    def pages_for(self, n_tokens: int) -> int:
        """Pages that hold ``n_tokens`` tokens (an int >= 0)."""
        n_tokens = check_int("n_tokens", n_tokens, low=0, what="a token count (an int >= 0)")
        return -(-n_tokens // self.page_size)

    def state(self) -> dict:
        """A copy of everything (for tests and debugging: before/after comparisons)."""
        out = {name: getattr(self, name).clone() for name in
               ("k", "v", "block_table", "lengths", "refcount")}
        for name in ("k_scale", "v_scale"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).clone()
        out["live"], out["free"] = list(self._live), list(self._free)
        return out

    # ------------------------------------------------------------------ sequences
    def add_sequence(self) -> int:
        """A new empty sequence; returns its id (a block table row). Pages come with
        :meth:`extend`. Raises ValueError when all ``max_seqs`` slots are taken."""
        for s, live in enumerate(self._live):
            if not live:
                self._live[s] = True
                return s
        raise ValueError(f"PagedKVCache: all max_seqs={len(self._live)} sequence slots are in "
                         "use; free a sequence first")

    allocate = add_sequence

    def free(self, seq_id: int) -> None:
        """Drop sequence ``seq_id``: its pages lose a holder (pages with none return to the
        pool) and its id may be reused by :meth:`add_sequence`."""
        s = self._check_seq("seq_id", seq_id)
        n = self.pages_for(int(self.lengths[s]))
        pages = self.block_table[s, :n].tolist()
        for page in pages:
            self.refcount[page] -= 1
        self._free.extend(page for page in reversed(pages) if int(self.refcount[page]) == 0)
        self.block_table[s].fill_(-1)
        self.lengths[s] = 0
        self._live[s] = False

    def fork(self, parent: int) -> int:
        """A new sequence holding the same tokens as ``parent`` (beam search, parallel
        sampling): the pages are shared (refcounts + 1), nothing is copied now; the first
        write into a shared partial last page copies that page (:meth:`extend`)."""
        s = self._check_seq("parent", parent)
        child = self.add_sequence()
        n = self.pages_for(int(self.lengths[s]))
        self.block_table[child] = self.block_table[s]
        self.lengths[child] = self.lengths[s]
        if n:
            self.refcount[self.block_table[s, :n].long()] += 1
        return child

    def extend(self, seq_ids, counts) -> None:
        """Make room for ``counts[i]`` more tokens of sequence ``seq_ids[i]`` and advance its
        length: new pages from the pool and, where the last page is shared (after a
        :meth:`fork`) and will be written, a private copy of it first. All or nothing: raises
        :class:`PagePoolExhausted` (pages needed / free) or ValueError (an unknown id, a
        duplicate id, a negative count, more than ``max_len`` tokens) with nothing changed."""
        seqs, counts = self._check_batch(seq_ids, counts)
        p = self.page_size
        plan = []  # (seq, new pages, copy the shared last page)
        writers: dict[int, int] = {}  # shared last page -> sequences of this call writing it
        for s, n in zip(seqs, counts, strict=True):
            length = int(self.lengths[s])
            if length + n > self.max_len:
                raise ValueError(f"sequence {s}: {length} tokens + {n} new exceed max_len="
                                 f"{self.max_len}; the cache is unchanged")
            shared_tail = (n > 0 and length % p != 0
                           and int(self.refcount[self.block_table[s, length // p]]) > 1)
            if shared_tail:
                tail = int(self.block_table[s, length // p])
                writers[tail] = writers.get(tail, 0) + 1
            plan.append((s, self.pages_for(length + n) - self.pages_for(length), shared_tail))
        # a page shared by r sequences and written by m of them: m copies, or m - 1 when all r
        # write (the last one keeps the page, then held by it alone)
        copies = sum(m - (m == int(self.refcount[page])) for page, m in writers.items())
        needed = sum(new for _, new, _ in plan) + copies
        if needed > self.free_pages:
            raise PagePoolExhausted(needed, self.free_pages,
                                    f"extending sequences {seqs} by {counts} token(s)")
        for (s, new, cow), n in zip(plan, counts, strict=True):
            length = int(self.lengths[s])
            if cow and int(self.refcount[self.block_table[s, length // p]]) > 1:
                self._copy_last_page(s, length // p)
            first = self.pages_for(length)
            for i in range(first, first + new):
                page = self._free.pop()
                self.refcount[page] = 1
                self.block_table[s, i] = page
            self.lengths[s] = length + n

    def _copy_last_page(self, s: int, index: int) -> None:
        old = int(self.block_table[s, index])
        page = self._free.pop()
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[:, page].copy_(t[:, old])  # (L, h_kv, p[, d]) of every layer
        self.refcount[old] -= 1
        self.refcount[page] = 1
        self.block_table[s, index] = page

    def positions(self, seq_ids, cu_seqlens=None) -> torch.Tensor:
        """``(N,)`` int64 on the cache's device: the place in its sequence of each token of a
        step just :meth:`extend`-ed, sequence ``seq_ids[i]`` owning tokens
        ``cu_seqlens[i]:cu_seqlens[i+1]`` (None: one token each). Sequence s's n tokens are its
        last: ``lengths[s] - n .. lengths[s] - 1``, where :meth:`write` stores them, so these
        are their RoPE positions. Ids and offsets are checked as :meth:`write` checks them."""
        seqs, counts = self._check_batch(seq_ids, self._counts(seq_ids, cu_seqlens))
        ends = self.lengths[torch.tensor(seqs, dtype=torch.long, device=self.k.device)]  # (S',)
        short = ends < torch.tensor(counts, dtype=torch.long, device=ends.device)  # (S',)
        if bool(short.any()):
            i = int(short.nonzero()[0])
            raise ValueError(f"sequence {seqs[i]} holds {int(ends[i])} tokens, fewer than the "
                             f"{counts[i]} of this step (extend it first)")
        return self._last_positions(seqs, counts)  # (N,)

    def _last_positions(self, seqs: list[int], counts: list[int]) -> torch.Tensor:
        """``(N,)`` int64: the last counts[i] positions of each sequence seqs[i], in order."""
        dev = self.k.device
        n = torch.tensor(counts, dtype=torch.long, device=dev)  # (S',)
        ends = self.lengths[torch.tensor(seqs, dtype=torch.long, device=dev)]  # (S',)
        first = torch.cumsum(n, 0) - n  # (S',) each sequence's first row in the step
        offset = torch.repeat_interleave(ends - n - first, n)  # (N,)
        return torch.arange(int(n.sum()), device=dev) + offset  # (N,)

    # ------------------------------------------------------------------ K/V
    def write(self, layer: int, seq_ids, k: torch.Tensor, v: torch.Tensor,
              cu_seqlens=None) -> None:
        """Store the K/V of the tokens just :meth:`extend`-ed in ``layer``'s pages: ``k (N,
        h_kv, d_k)``, ``v (N, h_kv, d_v)`` packed, sequence ``seq_ids[i]`` owning rows
        ``cu_seqlens[i]:cu_seqlens[i+1]`` (None: one token each), which become its last
        ``n_i`` positions. Checked before anything is written (unchanged on error)."""
        layer = self._check_layer(layer)
        seqs, counts = self._check_batch(seq_ids, self._counts(seq_ids, cu_seqlens))
        self._check_new(k, v, sum(counts))
        for s, n in zip(seqs, counts, strict=True):
            if n > int(self.lengths[s]):
                raise ValueError(f"write: sequence {s} holds {int(self.lengths[s])} tokens, "
                                 f"fewer than the {n} written (extend it first)")
        page, slot = self._slots(seqs, counts)  # (N,), (N,)
        self._check_private(seqs, counts, page)
        pairs = self._encode(k, v)
        for store, new in pairs:
            store[layer][page, :, slot] = new  # (N, h_kv[, d]) into (P, h_kv, p[, d])

    def append(self, seq_ids, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None) -> None:
        """:meth:`extend` then :meth:`write` (a one-layer cache): ``k (N, h_kv, d_k)``,
        ``v (N, h_kv, d_v)`` packed as in :meth:`write`. All or nothing."""
        if self.num_layers != 1:
            raise ValueError(f"append is for a one-layer cache (this one has {self.num_layers} "
                             "layers): call extend once, then write for each layer")
        counts = self._counts(seq_ids, cu_seqlens)
        self._check_batch(seq_ids, counts)
        self._check_new(k, v, sum(counts))
        self._encode(k, v)  # refuses NaN / Inf for int8 before anything changes
        self.extend(seq_ids, counts)
        self.write(0, seq_ids, k, v, cu_seqlens)

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq_id``'s K/V of ``layer`` as new contiguous tensors ``(1, h_kv, n,
        d_k)`` / ``(1, h_kv, n, d_v)`` in :attr:`dtype` (int8 dequantized): a copy, for the
        fallback prefill path (:meth:`explain`) and for debugging."""
        layer, s = self._check_layer(layer), self._check_seq("seq_id", seq_id)
        n = int(self.lengths[s])
        pages = self.block_table[s, :self.pages_for(n)].long()  # (m,)
        out = []
        for store, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = store[layer, pages].transpose(0, 1)  # (m, h_kv, p, d) -> (h_kv, m, p, d)
            x = x.reshape(x.shape[0], -1, x.shape[-1])[:, :n]  # (h_kv, n, d)
            if scale is not None:
                sc = scale[layer, pages].transpose(0, 1).reshape(x.shape[0], -1)[:, :n]  # (h_kv, n)
                x = x.float() * sc.unsqueeze(-1)  # (h_kv, n, d)
            out.append(x.to(self.dtype).unsqueeze(0))  # (1, h_kv, n, d)
        return out[0], out[1]

    def attend(self, layer: int, q: torch.Tensor, seq_ids, *, portable: bool = False,
               **variants) -> torch.Tensor:
        """``(S', h, Tq, d_v)``: queries ``q (S', h, Tq, d_k)`` of the last Tq tokens of
        sequences ``seq_ids`` (written first), each attending its own keys, causally aligned to
        its own length. The native decode kernel reads the pages through the block table (Tq
        <= 16; nothing is gathered). ``variants``: softcap, sinks, bias, alibi_slopes as in
        :func:`mha.flash_decode` (bias broadcast to ``(S', h, Tq, M * p)``). Where the kernel
        cannot be built (warned once), each sequence runs :func:`mha.attention` on its gathered
        K/V instead (the same result, with a copy)."""
        from mha.ops import decode

        _check_variant_names("attend", variants, _DECODE_VARIANTS)
        layer = self._check_layer(layer)
        seqs = self._check_ids(seq_ids)
        check_tensor("q", q, 4, f"(S', h, Tq, d_k) = ({len(seqs)}, h, Tq, {self.k.shape[4]})")
        if q.shape[0] != len(seqs):
            raise ValueError(f"q must have one row per sequence, (S', h, Tq, d_k) with S' = "
                             f"{len(seqs)}, got {tuple(q.shape)}")
        if q.dtype != self.dtype:
            raise TypeError(f"q must be {self.dtype} like the cache's K/V, got {q.dtype}")
        self._check_heads("attend", q)
        if q.shape[2] > decode.MAX_TQ:
            raise ValueError(f"attend serves Tq <= {decode.MAX_TQ} queries per sequence (decode "
                             f"rows), got Tq={q.shape[2]}; use attend_varlen for prefill chunks")
        idx = torch.tensor(seqs, dtype=torch.long, device=self.k.device)
        lengths = self.lengths[idx]  # (S',)
        if bool((lengths < q.shape[2]).any()):
            raise ValueError(f"attend: sequences {seqs} hold {lengths.tolist()} tokens, fewer "
                             f"than the Tq={q.shape[2]} queries (write their K/V first)")
        if decode.unavailable():  # no native kernel (its build failed, warned once): gathered
            return torch.cat([self._attend_gathered(layer, q[i:i + 1], s,
                                                    _row_variants(variants, i, int(lengths[i])))
                              for i, s in enumerate(seqs)])  # (S', h, Tq, d_v)
        int8 = self.kv_dtype == torch.int8
        if int8:  # the kernel computes in float32 and takes float32 / bfloat16 queries
            qk = q if q.dtype in (torch.float32, torch.bfloat16) else q.float()
        else:
            qk = q if self.kv_dtype == q.dtype else q.to(self.kv_dtype)
        out = decode.flash_decode(
            qk, self.k[layer], self.v[layer], block_table=self.block_table[idx],
            key_lengths=lengths, causal=q.shape[2] > 1, portable=portable,
            k_scale=self.k_scale[layer] if int8 else None,
            v_scale=self.v_scale[layer] if int8 else None, **variants)
        return out.to(q.dtype)  # (S', h, Tq, d_v)

    def attend_varlen(self, layer: int, q: torch.Tensor, seq_ids, cu_seqlens,
                      **variants) -> torch.Tensor:
        """``(N, h, d_v)``: packed queries ``q (N, h, d_k)``, sequence ``seq_ids[i]`` owning
        rows ``cu_seqlens[i]:cu_seqlens[i+1]`` (its last n_i tokens, written first), causal
        bottom-right per sequence: a chunk of a longer sequence sees its cached prefix. For
        n_i = 2 queries of a 5-token sequence::

            1 1 1 1 0
            1 1 1 1 1

        Decode rows (one query) go to the native paged decode kernel in one call; chunks of
        several queries, all of them, to one call of the paged flash forward
        (:func:`mha.ops.flash.flash_attention_paged`), which packs each key block straight from
        the pages (ragged rows, no gathered copy). Where that forward does not serve the call
        (:meth:`explain` gives the reason; warned once), each chunk runs :func:`mha.attention`
        on its sequence's K/V gathered from the pages (:meth:`gather`, a copy): int8 pages,
        ``bias`` / ``alibi_slopes``, q that requires grad, or no native kernel.
        ``variants``: ``scale``, ``softcap``, ``sinks`` natively, plus those of
        :func:`mha.attention` on the gathered path."""
        _check_variant_names("attend_varlen", variants, None)
        seqs, counts = self._check_batch(seq_ids, self._counts(seq_ids, cu_seqlens))
        check_tensor("q", q, 3, f"(N, h, d_k) = ({sum(counts)}, h, {self.k.shape[4]})")
        if q.shape[0] != sum(counts):
            raise ValueError(f"q must hold N = {sum(counts)} packed queries (cu_seqlens), got "
                             f"{tuple(q.shape)}")
        if q.dtype != self.dtype:
            raise TypeError(f"q must be {self.dtype} like the cache's K/V, got {q.dtype}")
        self._check_heads("attend_varlen", q)
        variants = self._check_native_variants(q, variants)
        held = [int(self.lengths[s]) for s in seqs]
        short = [(s, n, m) for s, n, m in zip(seqs, counts, held, strict=True) if n > m]
        if short:
            s, n, m = short[0]
            raise ValueError(f"attend_varlen: sequence {s} holds {m} tokens, fewer than its {n} "
                             "queries (write their K/V first)")
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        rows = [i for i, n in enumerate(counts) if n == 1]
        chunks = [i for i, n in enumerate(counts) if n > 1]
        reason = self._prefill_reason(q, variants) if chunks else None
        if chunks and not rows and reason is None:  # prefill only: the forward's output as is
            return self._attend_paged_prefill(layer, q, seqs, counts, variants)  # (N, h, d_v)
        out = q.new_empty(q.shape[0], q.shape[1], self.v.shape[4])  # (N, h, d_v)
        if rows:
            at = torch.tensor([starts[i] for i in rows], device=q.device)  # (S1,)
            qd = q[at].unsqueeze(2)  # (S1, h, d_k) -> (S1, h, 1, d_k)
            out[at] = self.attend(layer, qd, [seqs[i] for i in rows], **variants)[:, :, 0]
        if not chunks:
            return out
        if reason is None:
            spans = [(starts[i], starts[i + 1]) for i in chunks]
            at = torch.cat([torch.arange(a, b, device=q.device) for a, b in spans])  # (N',)
            out[at] = self._attend_paged_prefill(layer, q[at], [seqs[i] for i in chunks],
                                                 [counts[i] for i in chunks], variants)  # (N', h, d_v)
            return out
        _warn_once(f"PagedKVCache.attend_varlen: prefill chunks run on gathered K/V copies: "
                   f"{reason}")
        for i in chunks:
            qs = q[starts[i]:starts[i + 1]].transpose(0, 1).unsqueeze(0)  # (1, h, n, d_k)
            o = self._attend_gathered(layer, qs, seqs[i], variants)  # (1, h, n, d_v)
            out[starts[i]:starts[i + 1]] = o[0].transpose(0, 1)  # (n, h, d_v)
        return out

    def explain(self, q: torch.Tensor, **variants) -> str:
        """Which path :meth:`attend_varlen` takes for prefill chunks of queries like ``q`` with
        these variants, and why: the native paged forward, or gathered copies (the reason)."""
        reason = self._prefill_reason(q, variants)
        if reason is None:
            return ("prefill chunks: native paged flash forward (K/V packed from the pages "
                    "through the block table); decode rows: native paged decode kernel")
        return f"prefill chunks: gathered K/V copies + mha.attention, because {reason}"

    def _prefill_reason(self, q: torch.Tensor, variants: dict) -> str | None:
        """Why the paged flash forward does not serve this call, or None."""
        from mha.ops import flash

        other = sorted(name for name, val in variants.items()
                       if val is not None and name not in _NATIVE_VARIANTS)
        if self.kv_dtype == torch.int8:
            return ("int8 pages: the flash forward packs float32 / bfloat16 K/V only (int8 "
                    "is dequantized into the gathered copy)")
        if other:
            return (f"{', '.join(other)}: the paged forward applies scale, softcap and sinks "
                    "only (position-dependent variants run on the gathered copy)")
        if self.k.device.type != "cpu":
            return f"K/V on {self.k.device}: the paged forward is a CPU kernel"
        if torch.is_grad_enabled() and q.requires_grad:
            return "q requires grad: the paged forward is inference only"
        return flash.unavailable()

    def _attend_paged_prefill(self, layer: int, q: torch.Tensor, seqs: list[int],
                              counts: list[int], variants: dict) -> torch.Tensor:
        """``(N', h, d_v)``: the chunks of sequences ``seqs``, ``counts[i]`` queries each,
        packed in ``q (N', h, d_k)``, in one call of the paged flash forward."""
        from mha.ops import flash

        dev = q.device
        idx = torch.tensor(seqs, dtype=torch.long, device=dev)  # (S',)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int64, device=dev)  # (S' + 1,)
        cu[1:] = torch.cumsum(torch.tensor(counts, device=dev), 0)
        o, _ = flash.flash_attention_paged(
            q.to(self.kv_dtype), self.k[layer], self.v[layer], self.block_table[idx], cu,
            self.lengths[idx], causal=True, **variants)  # (N', h, d_v)
        return o.to(q.dtype)

    def _attend_gathered(self, layer: int, q: torch.Tensor, seq: int, variants: dict):
        """``q (1, h, n, d_k)``, the last n tokens of ``seq``, on its gathered K/V with
        :func:`mha.attention` (causal, bottom-right): ``(1, h, n, d_v)``."""
        from mha.functional import attention

        k, v = self.gather(layer, seq)  # (1, h_kv, len, d)
        return attention(q, k, v, causal=q.shape[2] > 1, **variants)  # (1, h, n, d_v)

    # ------------------------------------------------------------------ checks and helpers
    def _check_seq(self, name: str, seq_id) -> int:
        s = check_int(name, seq_id, low=0, what="a sequence id (a non-negative int)")
        if s >= len(self._live) or not self._live[s]:
            raise ValueError(f"{name}={s} is not a live sequence of this cache (live: "
                             f"{self.sequences}); it was never added or has been freed")
        return s

    def _check_layer(self, layer) -> int:
        layer = check_int("layer", layer, low=0, what="a layer index (a non-negative int)")
        if layer >= self.num_layers:
            raise ValueError(f"layer must lie in [0, {self.num_layers}), got {layer}")
        return layer

    def _check_ids(self, seq_ids) -> list[int]:
        seqs = [self._check_seq("seq_ids", s) for s in _id_list(seq_ids)]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seq_ids must not repeat a sequence, got {seqs}")
        return seqs

    def _check_batch(self, seq_ids, counts) -> tuple[list[int], list[int]]:
        seqs = self._check_ids(seq_ids)
        counts = [check_int("counts", n, low=0, what="a non-negative int") for n in counts]
        if len(counts) != len(seqs):
            raise ValueError(f"one count per sequence: {len(seqs)} seq_ids, {len(counts)} counts")
        return seqs, counts

    def _counts(self, seq_ids, cu_seqlens) -> list[int]:
        n = len(_id_list(seq_ids))
        if cu_seqlens is None:
            return [1] * n
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() <= 1:
            cu = cu_seqlens.reshape(-1).tolist()  # (S'+1,) or () -> (S'+1,) or (1,)
        elif isinstance(cu_seqlens, (list, tuple, range)):
            cu = list(cu_seqlens)
        else:
            got = (f"a {cu_seqlens.dim()}-d tensor" if isinstance(cu_seqlens, torch.Tensor)
                   else type(cu_seqlens).__name__)
            raise TypeError(f"cu_seqlens must be (S' + 1,) = ({n + 1},) integer offsets (a list "
                            f"or a 1-D integer tensor) or None, got {got}")
        cu = [check_int("cu_seqlens", c, what="(S' + 1,) integer offsets") for c in cu]
        if len(cu) != n + 1 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
            raise ValueError(f"cu_seqlens must be (S' + 1,) = ({n + 1},) non-decreasing offsets "
                             f"from 0, got {cu}")
        return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]

    def _check_private(self, seqs: list[int], counts: list[int], page: torch.Tensor) -> None:
        """The pages ``page (N,)`` written for these sequences are held by them alone: a page
        shared after :meth:`fork` holds the other sequence's tokens too (ValueError)."""
        shared = self.refcount[page] > 1  # (N,)
        if not bool(shared.any()):
            return
        row = int(shared.nonzero()[0])
        owner = next(i for i, end in enumerate(torch.tensor(counts).cumsum(0).tolist())
                     if row < end)
        raise ValueError(f"write: sequence {seqs[owner]}'s last {counts[owner]} positions lie in "
                         f"page {int(page[row])}, shared with another sequence (fork); writing "
                         "them would change that sequence's tokens. write stores the tokens "
                         "just extend-ed (extend gives a sequence a private copy of a shared "
                         "last page); the cache is unchanged")

    def _check_heads(self, method: str, q: torch.Tensor) -> None:
        """q ``(S', h, Tq, d_k)`` or ``(N, h, d_k)``: d_k as the pages', h a multiple of h_kv
        (ValueError naming q)."""
        h, h_kv, d_k = q.shape[1], self.k.shape[2], self.k.shape[4]
        if q.shape[-1] != d_k or h % h_kv:
            raise ValueError(f"{method}: q {tuple(q.shape)} must have d_k={d_k} (the pages' head "
                             f"dim) and h={h} a multiple of h_kv={h_kv} (grouped-query "
                             "attention)")

    @staticmethod
    def _check_native_variants(q: torch.Tensor, variants: dict) -> dict:
        """``scale``, ``softcap`` and ``sinks`` checked as :func:`mha.attention` checks them
        (they reach the paged forward, whose C++ guards are not the boundary); the others are
        checked by :func:`mha.attention` on the gathered path."""
        out = dict(variants)
        if out.get("scale") is not None:
            out["scale"] = check_scalar("scale", out["scale"], low=0.0)
        if out.get("softcap") is not None:
            out["softcap"] = check_softcap(out["softcap"])
        if out.get("sinks") is not None:
            out["sinks"] = check_sinks(out["sinks"], q.shape[1], q.device)  # q (N, h, d_k)
        return out

    def _check_new(self, k, v, N: int) -> None:
        h_kv, d_k, d_v = self.k.shape[2], self.k.shape[4], self.v.shape[4]
        check_tensor("k", k, 3, f"(N, h_kv, d_k) = ({N}, {h_kv}, {d_k})")
        check_tensor("v", v, 3, f"(N, h_kv, d_v) = ({N}, {h_kv}, {d_v})")
        if tuple(k.shape) != (N, h_kv, d_k) or tuple(v.shape) != (N, h_kv, d_v):
            raise ValueError(f"expected k (N, h_kv, d_k) = ({N}, {h_kv}, {d_k}) and v (N, h_kv, "
                             f"d_v) = ({N}, {h_kv}, {d_v}), got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        for name, t in (("k", k), ("v", v)):
            if t.dtype != self.dtype or t.device != self.k.device:
                raise TypeError(f"{name} must be {self.dtype} on {self.k.device} like the "
                                f"cache, got {t.dtype} on {t.device}")
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError("PagedKVCache is for inference: K/V that require grad cannot be "
                               "cached; run under torch.no_grad() or torch.inference_mode()")

    def _encode(self, k, v) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(storage, new rows) pairs in the storage format; int8 refuses NaN / Inf."""
        if self.kv_dtype != torch.int8:
            return [(self.k, k.to(self.kv_dtype)), (self.v, v.to(self.kv_dtype))]
        from mha.ops.decode import quantize_int8

        for name, t in (("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} holds NaN or Inf, which int8 K/V storage cannot hold; "
                                 "the cache is unchanged")
        kq, ks = quantize_int8(k)  # (N, h_kv, d_k) int8, (N, h_kv) float32
        vq, vs = quantize_int8(v)  # (N, h_kv, d_v) int8, (N, h_kv) float32
        return [(self.k, kq), (self.v, vq), (self.k_scale, ks), (self.v_scale, vs)]

    def _slots(self, seqs: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page (N,), slot (N,))`` of the last counts[i] positions of each sequence."""
        dev = self.k.device
        pos = self._last_positions(seqs, counts)  # (N,)
        row = torch.repeat_interleave(torch.tensor(seqs, dtype=torch.long, device=dev),
                                      torch.tensor(counts, dtype=torch.long, device=dev))  # (N,)
        p = self.page_size
        return self.block_table[row, pos // p].long(), pos % p


def check_step(cache, N: int, positions: torch.Tensor | None, seq_ids, cu_seqlens) -> None:
    """A packed step's arguments agree with ``cache``, a :class:`PagedKVCache` already
    :meth:`~PagedKVCache.extend`-ed by the step's tokens: ``cu_seqlens`` covers the step's
    ``N`` tokens, and ``positions (N,)`` (int64 on any device; None: not checked) is each
    token's place in its sequence (:meth:`PagedKVCache.positions`). Any other position would
    rotate the token's query and key by another angle (RoPE) and give wrong logits with no
    error. Refused naming the argument, before anything is written."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a mha.PagedKVCache, got {type(cache).__name__}")
    want = cache.positions(seq_ids, cu_seqlens)  # (N',)
    if want.numel() != N:
        raise ValueError(f"cu_seqlens must cover the step's N = {N} tokens (offsets from 0 to "
                         f"N, one token per sequence when None), got offsets covering "
                         f"{want.numel()}")
    if positions is None:
        return
    wrong = positions.reshape(-1) != want.to(positions.device)  # (N,)
    if bool(wrong.any()):
        j = int(wrong.nonzero()[0])
        raise ValueError(f"positions must be each token's place in its sequence (its sequence's "
                         f"last tokens after extend: lengths - n .. lengths - 1), got "
                         f"{int(positions.reshape(-1)[j])} for token {j}, which the cache holds "
                         f"at {int(want[j])}; another position would rotate its query and key "
                         f"by another angle (RoPE)")
