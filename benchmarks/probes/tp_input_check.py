"""Developer probe: what checking that every rank got the same ``x`` would cost a
tensor-parallel :class:`mha.MultiHeadAttention` call (:func:`mha.distributed.tensor_parallel`),
against the call itself: one more all-reduce of a checksum (the max of ``x.sum()`` and of its
negation; the ranks agree when the two add to 0).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src \\
        python benchmarks/probes/tp_input_check.py [--ranks 2] [--rounds 30]

``MultiHeadAttention(512, 8, num_kv_heads=4)`` split over gloo ranks of one thread each,
inference; medians of ``--rounds`` calls of each, interleaved, every call after a barrier.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(1, 1, 512), (1, 16, 512), (2, 128, 512)]  #: x (B, T, d_model)


def _worker(rank: int, world: int, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    import mha
    from mha.distributed import tensor_parallel

    torch.manual_seed(0)
    m = tensor_parallel(mha.MultiHeadAttention(512, 8, num_kv_heads=4).eval(),
                        init_device_mesh("cpu", (world,)))
    for shape in SHAPES:
        x = torch.randn(*shape)

        def check(x=x) -> bool:
            s = torch.stack([x.sum(), -x.sum()])  # (2,)
            dist.all_reduce(s, op=dist.ReduceOp.MAX)
            return bool(s[0] + s[1] == 0)

        def forward(x=x) -> None:
            with torch.no_grad():
                m(x)  # (B, T, d_model)

        times: dict[str, list[float]] = {"check": [], "forward": []}
        for _ in range(3):
            check(), forward()
        for _ in range(rounds):
            for name, fn in (("check", check), ("forward", forward)):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        if rank == 0:
            c, f = (statistics.median(times[n]) for n in ("check", "forward"))
            print(f"x {shape}: check {c * 1e6:.0f} us, forward {f * 1e6:.0f} us, "
                  f"check / forward {c / f:.2f}", flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's shutdown race (docs/distributed.md): leave once all is done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    mp.spawn(_worker, args=(args.ranks, args.rounds), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
