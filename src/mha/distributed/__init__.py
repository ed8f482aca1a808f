"""Attention across processes (seed 001: heads and sequence computed in parallel).

* :mod:`mha.distributed.sequence` — the sequence split over ranks: context parallel
  (all-gather K/V) and ring attention (K/V shards passed round a ring, merged by log-sum-exp).

Every strategy returns this rank's part of the same numbers as :func:`mha.attention` on the
whole problem. docs/distributed.md says which strategy suits which problem.
"""

from mha.distributed.sequence import context_parallel_attention, ring_attention

__all__ = ["context_parallel_attention", "ring_attention"]
