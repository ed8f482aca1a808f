"""Block plans: which key blocks each query block visits under a ``mask_mod`` (:mod:`mha.mods`).

Shape legend: B batch, h query heads, Tq/Tk lengths; ``B_p`` / ``h_p`` the plan's batch and
heads (1 when the mask does not depend on ``b`` / ``h``), ``n_q = ceil(Tq / block_q)`` query
blocks, ``n_k = ceil(Tk / block_k)`` key blocks.

A block (query block x key block) is **FULL** (every pair may attend: computed without calling
the mask), **PARTIAL** (some pairs: the mask is evaluated over the block when attention runs) or
**EMPTY** (no pair: never read). The plan stores the FULL and the PARTIAL key blocks of each
query block in compressed rows (CSR), the form a kernel can walk::

    row r = (b * h_p + hh) * n_q + qb
    full key blocks of row r:    full_idx[full_ptr[r] : full_ptr[r + 1]]         (int32)
    partial key blocks of row r: partial_idx[partial_ptr[r] : partial_ptr[r + 1]]

For the native kernel the plan also keeps, from the same evaluation, one int32 entry per block
(``block_index``: -2 EMPTY, -1 FULL, e >= 0 PARTIAL) and the PARTIAL blocks' values
``partial_bits (n_partial, block_q, block_k)`` (:meth:`BlockPlan.kernel_tensors`): the kernel
never calls the mask.

Building a plan evaluates the mask once over every block (in bounded chunks); plans are cached
by (mask_mod, B, h, Tq, Tk, block sizes, device). Built-in mask_mods are keyed by their
parameters, tensors by content; a custom function by identity, and its plan is built anew when
a tensor it reads has changed since (:func:`_reads`: the tensors in its closure, in the globals
its code names, among a bound method's or callable object's tensor fields and a partial's
arguments, at most :data:`_READ_BUDGET` container items in all — compared by identity,
storage and version counter, so in-place writes and rebinding are seen). Data it reads any
other way (a Python list, a tensor written through ``.data``, a tensor past those items) is
not seen: pass ``cache=False`` then (or make a new function).
"""

from __future__ import annotations

import functools
import itertools
import math
import types
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mha.checks import check_device, check_int
from mha.mods import ModError, _Combine, _Mod, bind, check_mod, eval_mask_mod

FULL, PARTIAL, EMPTY = 2, 1, 0
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 64  # plans kept (least recently used dropped first)
_MAX_BLOCKS = 1 << 32  # a plan's block states are a byte each: at most 4 GiB of them
_CHUNK = 1 << 24  # mask elements evaluated at once while building
_READ_ITEMS = 256  # items of one container looked at for tensors a mask_mod reads
_READ_BUDGET = 1024  # items of containers looked at in all, per call (bounds the fingerprint)
_CONTAINERS = (list, tuple, set, frozenset, dict)
_MAX_BLOCK = 1 << 24  # pairs in one block: a partial block's mask is kept, a byte per pair


@dataclass(frozen=True)
class WalkGroup:
    """Query blocks of one plan row ``(b, hh)`` walked together, padded to one key count ``n``.

    ``qbs`` ``(R,)`` the query blocks; ``cols`` ``(R, n)`` the key indices of each (partial
    blocks first, then full blocks, then padding; padding clamped to a valid index); ``ok``
    ``(R, n)`` the real keys; ``partial`` ``(R, n)`` the keys of partial blocks (a prefix of
    each row, at most ``n_partial`` columns).
    """

    b: int
    hh: int
    qbs: torch.Tensor
    cols: torch.Tensor
    ok: torch.Tensor
    partial: torch.Tensor
    n_partial: int


class BlockPlan:
    """The block structure of one mask (see the module docstring). Read-only."""

    def __init__(self, mask_mod, states: torch.Tensor, bits: torch.Tensor, *, B: int, h: int,
                 Tq: int, Tk: int, block_q: int, block_k: int, device: torch.device) -> None:
        self.mask_mod = mask_mod  # bound to the sizes (mha.mods.bind)
        self.batch, self.heads, self.Tq, self.Tk = B, h, Tq, Tk
        self.B, self.h = states.shape[0], states.shape[1]  # B_p, h_p: 1 or B, 1 or h
        self.block_q, self.block_k, self.device = block_q, block_k, device
        self.n_q, self.n_k = states.shape[2], states.shape[3]
        flat = states.reshape(-1, self.n_k)  # (B_p, h_p, n_q, n_k) -> (B_p * h_p * n_q, n_k)
        self.full_ptr, self.full_idx = _csr(flat == FULL)
        self.partial_ptr, self.partial_idx = _csr(flat == PARTIAL)
        self.counts = {name: int((flat == s).sum()) for name, s in
                       (("full", FULL), ("partial", PARTIAL), ("empty", EMPTY))}
        # for the kernel: one int32 entry per block (-2 EMPTY, -1 FULL, e >= 0 the PARTIAL
        # block's bits[e]) and the partial blocks' bits, kept from the one evaluation
        part = (states == PARTIAL).to(torch.int32)
        order = (part.flatten().cumsum(0) - 1).view_as(part)  # (B_p, h_p, n_q, n_k)
        self.block_index = torch.where(states == FULL, -1, torch.where(
            states == EMPTY, -2, order)).to(torch.int32)  # (B_p, h_p, n_q, n_k)
        self.partial_bits = bits  # (n_partial, block_q, block_k) bool
        self._walk = None
        self._groups = None

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_index (B_p, h_p, n_q, n_k) int32, partial_bits (n_partial, block_q,
        block_k) bool)``: the plan as the native kernel walks it (``csrc/common/block_plan.h``;
        built with ``block_q=48, block_k=128``). The mask is not called again."""
        return self.block_index, self.partial_bits

    def row(self, b: int, hh: int, qb: int) -> int:
        return (b * self.h + hh) * self.n_q + qb

    def blocks(self, b: int, hh: int, qb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(full key blocks, partial key blocks)`` of query block ``qb`` (plan indices)."""
        r = self.row(b, hh, qb)
        return (self.full_idx[self.full_ptr[r]:self.full_ptr[r + 1]],
                self.partial_idx[self.partial_ptr[r]:self.partial_ptr[r + 1]])

    def rows(self, qb: int) -> torch.Tensor:
        """The query indices of query block ``qb``."""
        return torch.arange(qb * self.block_q, min(self.Tq, (qb + 1) * self.block_q),
                            device=self.device)

    def cols(self, blocks: torch.Tensor) -> torch.Tensor:
        """The key indices of the key blocks ``blocks``, in order (the last block may be short)."""
        j = (blocks.to(torch.int64)[:, None] * self.block_k
             + torch.arange(self.block_k)[None])  # (n, block_k)
        j = j.flatten()
        return j[j < self.Tk].to(self.device)

    def index(self, b: int, hh: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``b`` and ``h`` index tensors the mask is called with for plan row ``(b, hh)``."""
        bi = torch.arange(self.batch, device=self.device) if self.B > 1 else \
            torch.zeros(1, dtype=torch.int64, device=self.device)
        hi = torch.arange(self.heads, device=self.device) if self.h > 1 else \
            torch.zeros(1, dtype=torch.int64, device=self.device)
        return bi[b:b + 1] if self.B > 1 else bi, hi[hh:hh + 1] if self.h > 1 else hi

    def walk(self) -> list[tuple[int, int, int, torch.Tensor, int, torch.Tensor]]:
        """Every non-empty plan row as ``(b, hh, qb, cols, n_full, partial cols)``: ``cols`` the
        key indices to gather (the full blocks' first, ``n_full`` of them). Built once."""
        if self._walk is None:
            steps = []
            for b in range(self.B):
                for hh in range(self.h):
                    for qb in range(self.n_q):
                        full, part = self.blocks(b, hh, qb)
                        if full.numel() + part.numel() == 0:
                            continue
                        fc, pc = self.cols(full), self.cols(part)
                        steps.append((b, hh, qb, torch.cat([fc, pc]), fc.numel(), pc))
            self._walk = steps
        return self._walk

    def groups(self) -> list[WalkGroup]:
        """The non-empty query blocks of each plan row, bucketed by their number of key blocks
        (up to the next power of two) so that one batched step serves each bucket. Built once."""
        if self._groups is None:
            self._groups = [g for b in range(self.B) for hh in range(self.h)
                            for g in self._row_groups(b, hh)]
        return self._groups

    def _row_groups(self, b: int, hh: int) -> list[WalkGroup]:
        buckets: dict[int, list] = {}
        for qb in range(self.n_q):
            full, part = (x.tolist() for x in self.blocks(b, hh, qb))
            n = len(full) + len(part)
            if n:
                buckets.setdefault(1 << (n - 1).bit_length(), []).append((qb, part, full))
        out = []
        bk = self.block_k
        for _, rows in sorted(buckets.items()):
            nb = max(len(p) + len(f) for _, p, f in rows)
            blk = torch.full((len(rows), nb), -1, dtype=torch.int64)  # (R, nb) key blocks
            n_part = torch.tensor([len(p) for _, p, _ in rows])  # (R,)
            for i, (_, p, f) in enumerate(rows):
                blk[i, :len(p) + len(f)] = torch.tensor(p + f, dtype=torch.int64)
            j = blk[:, :, None] * bk + torch.arange(bk)  # (R, nb, bk) key indices
            ok = (blk[:, :, None] >= 0) & (j < self.Tk)  # (R, nb, bk)
            part = (torch.arange(nb)[None, :] < n_part[:, None])[:, :, None] & ok  # (R, nb, bk)
            R = len(rows)
            out.append(WalkGroup(
                b, hh, torch.tensor([qb for qb, _, _ in rows], device=self.device),
                torch.where(ok, j, 0).reshape(R, nb * bk).to(self.device),  # (R, n)
                ok.reshape(R, nb * bk).to(self.device), part.reshape(R, nb * bk).to(self.device),
                int(n_part.max()) * bk))
        return out

    def eval_group(self, grp: WalkGroup, qrows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask over the partial keys of a group: ``(sel (R',), m (.|1, .|1, R' * block_q,
        n_partial))`` for the query blocks ``grp.qbs[sel]`` that have partial blocks; positions
        that are not partial keys are True. ``qrows`` ``(R, block_q)``: the query index of each
        row (clamped). Only keys inside partial blocks are passed to the function."""
        P = grp.n_partial
        sel = grp.partial[:, 0].nonzero()[:, 0]  # (R',) rows with partial blocks
        pc, pok = grp.cols[sel, :P], grp.partial[sel, :P]  # (R', P)
        pc = torch.where(pok, pc, pc[:, :1])  # padding -> the row's first partial key
        bi, hi = self.index(grp.b, grp.hh)
        bq = qrows.shape[1]
        where = (f"query blocks {grp.qbs[sel].tolist()}, their partial key blocks")
        m = eval_mask_mod(self.mask_mod, bi, hi, qrows[sel].flatten(),
                          pc.repeat_interleave(bq, 0), where)  # (.|1, .|1, R' bq|1, P|1)
        return sel, m | ~pok.repeat_interleave(bq, 0)  # (., ., R' * block_q, P)

    def eval_partial(self, b: int, hh: int, qb: int, cols: torch.Tensor) -> torch.Tensor:
        """The mask over query block ``qb`` and key indices ``cols`` (of partial blocks):
        ``(1|., 1|., rows, len(cols))`` bool."""
        bi, hi = self.index(b, hh)
        where = f"query block {qb}, partial key blocks {self.blocks(b, hh, qb)[1].tolist()}"
        return eval_mask_mod(self.mask_mod, bi, hi, self.rows(qb), cols, where)

    def materialize(self) -> torch.Tensor:
        """The dense bool mask ``(B_p, h_p, Tq, Tk)`` (True = may attend), built from the plan:
        full blocks are set without calling the mask, partial blocks evaluate it. Debugging."""
        out = torch.zeros(self.B, self.h, self.Tq, self.Tk, dtype=torch.bool, device=self.device)
        for b, hh, qb, cols, n_full, pcols in self.walk():
            r0, r1 = qb * self.block_q, min(self.Tq, (qb + 1) * self.block_q)
            out[b, hh, r0:r1, cols[:n_full]] = True
            if pcols.numel():
                m = self.eval_partial(b, hh, qb, pcols)  # (1, 1, rows|1, n|1)
                out[b, hh, r0:r1, pcols] = m[0, 0].expand(r1 - r0, pcols.numel())
        return out

    def __repr__(self) -> str:
        total = max(1, sum(self.counts.values()))
        frac = ", ".join(f"{name} {100 * n / total:.1f}%" for name, n in self.counts.items())
        return (f"BlockPlan(B={self.B}, h={self.h}, Tq={self.Tq}, Tk={self.Tk}, "
                f"block=({self.block_q}, {self.block_k}), {sum(self.counts.values())} blocks: "
                f"{frac})")


def _csr(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a bool matrix ``(R, n_k)`` -> ``(ptr (R + 1,) int64, idx (nnz,) int32)``."""
    ptr = torch.zeros(sel.shape[0] + 1, dtype=torch.int64)
    ptr[1:] = sel.sum(1).cumsum(0)
    return ptr, sel.nonzero()[:, 1].to(torch.int32)  # nonzero is row-major: grouped by row


def block_plan(mask_mod, B: int, h: int, Tq: int, Tk: int, *, block_q: int = 128,
               block_k: int = 128, device: torch.device | str | None = None,
               cache: bool = True) -> BlockPlan:
    """The :class:`BlockPlan` of ``mask_mod`` over ``(B, h, Tq, Tk)`` (cached; see the module
    docstring). ``print(plan)`` shows the fraction of full / partial / empty blocks. Blocks
    of more than 2^24 pairs (``block_q * block_k``) and a plan of more than 2^32 blocks
    (``B h ceil(Tq / block_q) ceil(Tk / block_k)``, a byte each) are refused before anything
    is evaluated."""
    check_mod("mask_mod", mask_mod)
    if mask_mod is None:
        raise TypeError("mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool, got None")
    B, h, Tq, Tk = (check_int(n, x, low=0, what="an int >= 0")
                    for n, x in (("B", B), ("h", h), ("Tq", Tq), ("Tk", Tk)))
    block_q = check_int("block_q", block_q, low=1, what="a positive int")
    block_k = check_int("block_k", block_k, low=1, what="a positive int")
    if block_q * block_k > _MAX_BLOCK:
        name = "block_q" if block_q >= block_k else "block_k"
        raise ValueError(f"{name}: blocks of block_q * block_k = {block_q} x {block_k} pairs are "
                         f"more than {_MAX_BLOCK} (a partial block's mask is kept, a byte per "
                         f"pair, whatever Tq and Tk); use smaller blocks")
    blocks = B * h * math.ceil(Tq / block_q) * math.ceil(Tk / block_k)
    if blocks > _MAX_BLOCKS:
        raise ValueError(f"a block plan of B={B}, h={h}, Tq={Tq}, Tk={Tk} in blocks of "
                         f"{block_q} x {block_k} would hold {blocks} blocks (a byte each), more "
                         f"than {_MAX_BLOCKS}; use larger block_q / block_k or shorter sequences")
    device = check_device("device", device) or torch.device("cpu")
    key = (mask_mod, B, h, Tq, Tk, block_q, block_k, str(device))
    try:
        hash(key)
    except TypeError:  # an unhashable callable object: no caching
        cache = False
    reads = _reads(mask_mod) if cache else None
    if reads is None:  # a tensor it reads cannot be followed (an inference tensor): no caching
        cache = False
    if cache and key in _CACHE and _unchanged(_CACHE[key][0], reads):
        _CACHE.move_to_end(key)
        return _CACHE[key][1]
    mod = bind(mask_mod, B, Tq, Tk)
    states, bits = _states(mod, B, h, Tq, Tk, block_q, block_k, device)
    plan = BlockPlan(mod, states, bits, B=B, h=h, Tq=Tq, Tk=Tk, block_q=block_q,
                     block_k=block_k, device=device)
    if cache:  # only a plan that was built completely is kept
        _CACHE[key] = (reads, plan)
        _CACHE.move_to_end(key)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return plan


def _reads(fn, depth: int = 3, seen: set | None = None,
           budget: list[int] | None = None) -> tuple | None:
    """What a custom mask_mod reads that may change between calls: ``(weak reference, data
    pointer, version, shape)`` of each tensor in its closure cells, in the globals its code (and the
    code nested in it) names (and in the containers there), among the tensor fields of a
    bound method's ``__self__`` / a callable object and a ``functools.partial``'s arguments,
    following functions and containers found there ``depth`` levels down (the first
    :data:`_READ_ITEMS` of a container, and :data:`_READ_BUDGET` container items in all: this
    runs at every call). None when a tensor's version cannot be read (inference tensors).
    Built-ins are keyed by their parameters: nothing to read but their parts."""
    seen = set() if seen is None else seen
    budget = [_READ_BUDGET] if budget is None else budget  # container items left to look at
    if id(fn) in seen or depth < 0:
        return ()
    seen.add(id(fn))
    if isinstance(fn, torch.Tensor):
        try:
            version = fn._version
        except RuntimeError:  # "Inference tensors do not track version counter"
            return None
        # a weak reference, not id(): a tensor made after this one died may take its address
        return ((weakref.ref(fn), fn.data_ptr(), version, tuple(fn.shape)),)
    if isinstance(fn, _Combine):
        values = list(fn.mods)
    elif isinstance(fn, _Mod):
        return ()
    elif isinstance(fn, _CONTAINERS):
        items = fn.values() if isinstance(fn, dict) else fn
        values = list(itertools.islice(items, min(_READ_ITEMS, budget[0])))
        budget[0] -= len(values)
    elif isinstance(fn, functools.partial):
        values = [fn.func, *fn.args, *fn.keywords.values()]
    elif isinstance(fn, types.MethodType):
        values = [fn.__func__, fn.__self__]
    elif isinstance(fn, types.FunctionType):
        codes, names = [fn.__code__], set()
        while codes:  # names used by the function and the lambdas / defs inside it
            code = codes.pop()
            names.update(code.co_names)
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        values = [c.cell_contents for c in fn.__closure__ or () if _filled(c)]
        values += [fn.__globals__[n] for n in sorted(names) if n in fn.__globals__]
    elif hasattr(fn, "__dict__") and not isinstance(fn, (type, types.ModuleType)):
        # an object's tensor and function fields (not its containers: an object that records
        # its calls in a list would otherwise look changed at every call)
        values = [x for x in itertools.islice(vars(fn).values(), _READ_ITEMS)
                  if isinstance(x, torch.Tensor) or callable(x)]
        if callable(fn):
            values.append(type(fn).__call__)  # a callable object: what its __call__ reads
    else:
        return ()
    out = []
    for value in values:
        if isinstance(value, (types.ModuleType, type, str, bytes, int, float, bool)) or \
                value is None:
            continue
        if budget[0] <= 0 and isinstance(value, _CONTAINERS):
            continue  # (no container item left to look at)
        got = _reads(value, depth - 1, seen, budget)
        if got is None:
            return None
        out.extend(got)
    return tuple(out)


def _unchanged(before: tuple, now: tuple) -> bool:
    """:func:`_reads` at a plan's build (``before``) and now: the same live tensors (compared by
    object: a dead one's weak reference is None), storages, versions and shapes."""
    return len(before) == len(now) and all(
        a[0]() is not None and a[0]() is b[0]() and a[1:] == b[1:]
        for a, b in zip(before, now, strict=True))


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 -- an empty cell raises
    except ValueError:
        return False
    return True


def _states(mod, B, h, Tq, Tk, bq, bk, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(states, bits)``: ``(B_p, h_p, n_q, n_k)`` int8 of FULL / PARTIAL / EMPTY, and the
    mask's values over each PARTIAL block in the order of ``states == PARTIAL``'s nonzero
    (row-major), ``(n_partial, bq, bk)`` bool, False past Tq / Tk. Evaluates ``mod`` in chunks,
    once: the bits are kept from the same evaluation."""
    n_q, n_k = math.ceil(Tq / bq), math.ceil(Tk / bk)
    if 0 in (B, h, n_q, n_k):
        return (torch.zeros(1, 1, n_q, n_k, dtype=torch.int8),
                torch.zeros(0, bq, bk, dtype=torch.bool))
    bi, hi = torch.arange(B, device=device), torch.arange(h, device=device)
    kchunk = max(1, _CHUNK // (B * h * bq * bk))  # key blocks per evaluation
    shape = None
    rows_out, bits = [], []  # bits: (qb, [(b, hh, kb) of each partial block], (n, bq, bk))
    for qb in range(n_q):
        r0, r1 = qb * bq, min(Tq, (qb + 1) * bq)
        rows = torch.arange(r0, r1, device=device)
        parts = []
        for kb0 in range(0, n_k, kchunk):
            kb1 = min(n_k, kb0 + kchunk)
            cols = torch.arange(kb0 * bk, min(Tk, kb1 * bk), device=device)
            r = eval_mask_mod(mod, bi, hi, rows, cols,
                              f"query block {qb}, key blocks {kb0}..{kb1 - 1}")
            if shape is None:
                shape = (r.shape[0], r.shape[1])  # 1 where the mask ignores b / h
            elif r.shape[0] > shape[0] or r.shape[1] > shape[1]:
                raise ModError(f"mask_mod's result depends on b or h in some blocks only (shape "
                               f"{tuple(r.shape)} on query block {qb}, earlier {shape}): make "
                               "every result broadcast the same way")
            r = r.expand(*shape, r1 - r0, cols.numel())  # (B_p, h_p, rows, n)
            pad = (kb1 - kb0) * bk - cols.numel()  # the last key block may be short
            if pad:
                r = torch.cat([r, r.new_zeros(*shape, r1 - r0, pad)], dim=-1)
            count = r.reshape(*shape, r1 - r0, kb1 - kb0, bk).sum(dim=(2, 4))  # (B_p, h_p, nk)
            width = (torch.arange(kb0, kb1, device=device) * bk).neg().add(Tk).clamp(max=bk)
            area = (r1 - r0) * width  # (nk,) pairs in each block
            state = torch.where(count == area, FULL,
                                torch.where(count == 0, EMPTY, PARTIAL)).to(torch.int8)
            parts.append(state)  # (B_p, h_p, nk)
            sel = (state == PARTIAL).nonzero()  # (n, 3): b, hh, key block in the chunk
            if sel.numel():
                blk = r.reshape(*shape, r1 - r0, kb1 - kb0, bk)  # (B_p, h_p, rows, nk, bk)
                got = blk[sel[:, 0], sel[:, 1], :, sel[:, 2]].cpu()  # (n, rows, bk)
                if r1 - r0 < bq:  # a short last query block: False below Tq
                    got = torch.cat([got, got.new_zeros(got.shape[0], bq - (r1 - r0), bk)], 1)
                sel = sel.cpu()
                bits.append((qb, sel[:, 0], sel[:, 1], sel[:, 2] + kb0, got))
        rows_out.append(torch.cat(parts, dim=-1))  # (B_p, h_p, n_k)
    states = torch.stack(rows_out, dim=2).cpu()  # (B_p, h_p, n_q, n_k)
    return states, _order_bits(states, bits, bq, bk)


def _order_bits(states: torch.Tensor, found: list, bq: int, bk: int) -> torch.Tensor:
    """The partial blocks' bits ``(n_partial, bq, bk)`` in the row-major order of
    ``states == PARTIAL`` (found chunk by chunk, in query-block order)."""
    if not found:
        return torch.zeros(0, bq, bk, dtype=torch.bool)
    B_p, h_p, n_q, n_k = states.shape
    key = torch.cat([((b * h_p + hh) * n_q + qb) * n_k + kb for qb, b, hh, kb, _ in found])
    blocks = torch.cat([x for *_, x in found])  # (n_partial, bq, bk), found order
    return blocks[key.argsort()]  # row-major order of (b, hh, qb, kb)
