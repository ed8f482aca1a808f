"""Tensor-parallel heads: each rank holds h / W of a module's heads (seed 001's parallel heads).

Shape legend: W ranks, h / h_kv query / key-value heads, d_k / d_v head dims, d_model width.

Built on torch.distributed's own machinery (DTensor and ``torch.distributed.tensor.parallel``):
the Q/K/V projections are ``ColwiseParallel`` (each rank computes the projections of its heads
from the replicated input; in the backward the input's gradient is all-reduced), attention
runs locally on the rank's heads (any backend, any mask, the KV cache), and W_O is
``RowwiseParallel`` (each rank multiplies its heads' slice of the concat; one all-reduce sums
them, then the bias). One collective per forward, one per backward, no home-made ones.

The packed ``in_proj`` weight ``[W^Q; W^K; W^V]`` is first reordered rank-major, ``[W^Q_0;
W^K_0; W^V_0; W^Q_1; ...]``, so that an even ``Shard(0)`` split gives every rank whole heads of
all three. Query head i reads K/V head ``i // (h / h_kv)``, so splitting both h and h_kv in W
contiguous groups keeps every rank's query heads with the K/V heads they read: both must be
multiples of W. With fewer K/V heads than ranks (``h_kv < W``) each K/V head would be needed
on several ranks; that replication is not implemented, and the call is refused with the
reason before anything changes.
"""

from __future__ import annotations

import torch


def tensor_parallel_plan(module) -> dict:
    """The ``parallelize_module`` plan of a :class:`mha.MultiHeadAttention`: ColwiseParallel on
    the Q/K/V projections, RowwiseParallel on W_O. For a packed module the ``in_proj`` rows
    must be rank-major first (:func:`tensor_parallel` does both)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    names = ("in_proj",) if module.packed else ("q_proj", "k_proj", "v_proj")
    return {**{n: ColwiseParallel() for n in names}, "out_proj": RowwiseParallel()}


def tensor_parallel(module, device_mesh):
    """Split ``module``'s heads over the ranks of a 1-D ``device_mesh`` in place and return it.

    Every rank calls it with the same module (same weights). Afterwards the parameters are
    DTensors, ``module.num_heads`` / ``num_kv_heads`` are this rank's (h / W, h_kv / W),
    ``module.new_cache`` caches this rank's K/V heads, and ``module(x)`` returns the full
    ``(B, Tq, d_model)`` output on every rank; gradients flow to the sharded parameters.
    Every rank must then call it with the same inputs (ColwiseParallel takes the input as
    replicated): a rank fed another ``x`` computes its heads from its own ``x`` and the
    all-reduce mixes them into a wrong output on every rank, with no error. This is not
    checked: a checksum all-reduced per call cost 0.27-0.35x a decode-sized forward on two
    gloo ranks (docs/distributed.md); broadcast the inputs from one rank where they may differ.
    A mesh of one rank (a script run without a launcher) leaves the module as it is: every
    head is that rank's, the parameters stay tensors.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mha.module import MultiHeadAttention

    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"module must be a mha.MultiHeadAttention, got {type(module).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh (e.g. "
                        f"init_device_mesh('cpu', (world_size,))), got "
                        f"{type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        raise ValueError(f"device_mesh must be 1-D (the ranks heads are split over), got "
                         f"{device_mesh.ndim}-D")
    if module.tensor_parallel != 1:
        raise ValueError("module is already split over ranks (tensor_parallel="
                         f"{module.tensor_parallel})")
    W, h, h_kv = device_mesh.size(), module.num_heads, module.num_kv_heads
    if W == 1:  # nothing to split (DTensor parameters would meet the unsplit path's tensors)
        return module
    variants = [name for name, t in (("sinks", module.sinks), ("alibi", module.alibi_slopes))
                if t is not None]
    if variants:  # every call would be refused afterwards (MultiHeadAttention._variants)
        raise ValueError(f"module has {' and '.join(variants)}, which tensor parallelism does "
                         f"not split yet (each rank would need its heads' slice of the (h,) "
                         f"{'sinks' if 'sinks' in variants else 'slopes'}); the module is "
                         f"unchanged")
    if h_kv < W:
        raise ValueError(f"num_kv_heads={h_kv} < world size {W}: every rank needs whole K/V "
                         f"heads, and replicating a K/V head on several ranks is not "
                         f"implemented; use at most {h_kv} ranks")
    if h % W or h_kv % W:
        raise ValueError(f"num_heads={h} and num_kv_heads={h_kv} must be multiples of the world "
                         f"size {W} (each rank holds h / W query heads and h_kv / W K/V heads)")
    if module.packed:
        _rank_major(module, W)
    parallelize_module(module, device_mesh, tensor_parallel_plan(module))
    module.num_heads, module.num_kv_heads = h // W, h_kv // W
    module.tensor_parallel = W
    return module


def rank_major_rows(module, W: int) -> torch.Tensor:
    """The row order that makes the packed ``[W^Q; W^K; W^V]`` rank-major: ``new = old[idx]``."""
    qw, kw, vw = module.q_width, module.k_width, module.v_width
    parts = []
    for r in range(W):
        parts += [torch.arange(r * qw // W, (r + 1) * qw // W),
                  qw + torch.arange(r * kw // W, (r + 1) * kw // W),
                  qw + kw + torch.arange(r * vw // W, (r + 1) * vw // W)]
    return torch.cat(parts)  # (q_w + k_w + v_w,)


def _rank_major(module, W: int) -> None:
    idx = rank_major_rows(module, W).to(module.in_proj.weight.device)
    with torch.no_grad():
        module.in_proj.weight.copy_(module.in_proj.weight[idx])
        if module.in_proj.bias is not None:
            module.in_proj.bias.copy_(module.in_proj.bias[idx])
