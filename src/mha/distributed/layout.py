"""Which rows of a sequence each rank holds, and which (query, key) pairs may meet.

Shape legend: W ranks, r a rank, T a full length, n = T / W one rank's shard length.

Two layouts:

* ``"contiguous"``: rank r holds rows ``[r n, (r + 1) n)``. Under ``causal`` the last rank's
  queries see every key and the first rank's see only its own: the work per rank grows with r.
* ``"zigzag"``: the sequence is cut into 2W chunks of ``c = T / (2W)`` rows and rank r holds
  chunks r and 2W - 1 - r (one early, one late), so under ``causal`` every rank has the same
  number of visible (query, key) pairs (balanced work; ``mha.distributed.visible_pairs``
  counts them).

:func:`shard` takes a rank's rows of a full tensor, :func:`unshard` gathers every rank's rows
back into the full sequence, :func:`positions` gives the global row indices of a shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mha.checks import check_int

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_world_rank(world, rank) -> tuple[int, int]:
    """``world`` a positive int, ``rank`` in ``[0, world)`` (errors naming them)."""
    world = check_int("world", world, low=1, what="a positive int")
    rank = check_int("rank", rank, what="an int")
    if not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, {world}) (world={world}), got {rank}")
    return world, rank


def positions(T: int, world: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """``(T / world,)`` int64: the global indices of rank ``rank``'s rows, in the order the
    shard holds them."""
    check_layout(layout)
    T = check_int("T", T, low=0, what="a non-negative int")
    world, rank = _check_world_rank(world, rank)
    parts = world if layout == "contiguous" else 2 * world
    if T % parts:
        raise ValueError(f"a sequence of length {T} cannot be split in the {layout} layout over "
                         f"{world} ranks: the length must be a multiple of {parts}")
    if layout == "contiguous":
        n = T // world
        return torch.arange(rank * n, (rank + 1) * n)
    c = T // parts
    late = 2 * world - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


def shard(x: torch.Tensor, world: int, rank: int, *, layout: str = "contiguous",
          dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s rows of the full tensor ``x`` along ``dim`` (a copy for zigzag, a view
    for contiguous)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = check_int("dim", dim, what="an int")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must lie in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{tuple(x.shape)}, got {dim}")
    pos = positions(x.shape[dim], world, rank, layout)
    if layout == "contiguous":
        return x.narrow(dim, int(pos[0]), pos.numel())
    return x.index_select(dim, pos)


def unshard(x: torch.Tensor, *, layout: str = "contiguous", dim: int = 2,
            group=None) -> torch.Tensor:
    """The full tensor from every rank's shard ``x`` (all ranks call it with same-shaped
    shards): an all-gather, then each shard's rows put back at their global positions."""
    W = dist.get_world_size(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(W)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return from_rank_order(torch.cat(parts, dim=dim), W, layout=layout, dim=dim)


def from_rank_order(x: torch.Tensor, world: int, *, layout: str, dim: int = 2) -> torch.Tensor:
    """Rows concatenated in rank order (shard 0, shard 1, ...) put back in sequence order."""
    if layout == "contiguous":
        return x
    T = x.shape[dim]
    order = torch.cat([positions(T, world, r, layout) for r in range(world)])  # (T,)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(T)
    return x.index_select(dim, inverse.to(x.device))


def visible(pos_q: torch.Tensor, pos_k: torch.Tensor, Tq: int, Tk: int, causal: bool,
            window: int | None) -> torch.Tensor | None:
    """``(n_q, n_k)`` bool, True where global query ``pos_q[i]`` may attend global key
    ``pos_k[j]`` under mha's rule (causal bottom-right on the full ``(Tq, Tk)`` problem,
    window ``j > i + Tk - Tq - window``); None when every pair is visible."""
    if not causal:
        return None
    diag = pos_q[:, None] + (Tk - Tq)  # (n_q, 1): the last key each query sees
    allowed = pos_k[None, :] <= diag  # (n_q, n_k)
    if window is not None:
        allowed &= pos_k[None, :] > diag - window
    return None if bool(allowed.all()) else allowed


def visible_pairs(Tq: int, Tk: int, world: int, *, layout: str = "contiguous",
                  causal: bool = True, window: int | None = None) -> list[int]:
    """The number of (query, key) pairs each rank's queries may attend: its share of the work."""
    world = check_int("world", world, low=1, what="a positive int")
    counts = []
    for r in range(world):
        pq = positions(Tq, world, r, layout)
        m = visible(pq, torch.arange(Tk), Tq, Tk, causal, window)
        counts.append(pq.numel() * Tk if m is None else int(m.sum()))
    return counts
