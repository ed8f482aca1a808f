"""Attention across processes (seed 001: heads and sequence computed in parallel).

* :mod:`mha.distributed.sequence` — the sequence split over ranks, K/V all-gathered
  (context parallel); :mod:`mha.distributed.ring` — K/V shards passed round a ring, merged by
  log-sum-exp, forward and backward; :mod:`mha.distributed.layout` — which rows each rank
  holds (contiguous or zig-zag), shard / unshard.
* :mod:`mha.distributed.tensor_parallel` — a module's heads split over the ranks (DTensor,
  ColwiseParallel Q/K/V, RowwiseParallel W_O): tensor parallelism.
* :mod:`mha.distributed.ulysses` — heads split over the ranks by an all-to-all
  (DeepSpeed-Ulysses): each rank attends over the whole sequence for h / W heads.

Every strategy returns this rank's part of the same numbers as :func:`mha.attention` on the
whole problem. docs/distributed.md says which strategy suits which problem.
"""

from mha.distributed.layout import LAYOUTS, positions, shard, unshard, visible_pairs
from mha.distributed.ring import ring_attention
from mha.distributed.sequence import context_parallel_attention
from mha.distributed.tensor_parallel import tensor_parallel, tensor_parallel_plan
from mha.distributed.ulysses import ulysses_attention

__all__ = ["context_parallel_attention", "ring_attention", "ulysses_attention", "shard", "unshard", "positions",
           "visible_pairs", "LAYOUTS", "tensor_parallel", "tensor_parallel_plan"]
