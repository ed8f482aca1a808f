"""int8 vs bf16 vs fp32 K/V in the decode kernel: one decode step per K/V storage, side by side
in one process (round-robin medians, ``_timing.interleaved``), for two shapes:

* ``mha``     (B, h, h_kv, d) = (1, 32, 32, 128): the issue's kernel row, G = 1;
* ``smollm2`` (B, h, h_kv, d) = (1, 9, 3, 64): SmolLM2-135M's attention, GQA (G = 3).

Run (under the timing lock, see docs/kernel.md):
    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        .venv/bin/python benchmarks/probes/decode_int8.py --Tk 4096 8192 16384 32768

Each K/V is a full :class:`mha.KVCache` (int8: ``kv_dtype="int8"``, the step through
``KVCache.attend``, i.e. the kernel's int8 path, with fp32 queries (``int8``) and with bf16
queries (``int8/bf16q``, a bf16 model's cache); bf16 / fp32: ``mha.ops.decode.flash_decode``
on the cache views, bf16 queries for bf16). Prints ms per step, the bytes a step
reads (K and V, plus the int8 scales: int8 values + 2 x 4 bytes per token and K/V head), GB/s =
bytes / time, and the speed relative to the bf16 step (``x bf16``: bf16 time / this time).
``--clock cpu``: CPU seconds per step instead (all threads; the GB/s column is then bytes per
CPU second), for an oversubscribed machine.
"""

from __future__ import annotations

import argparse

import torch

import mha
from _timing import interleaved
from decode_variants import _cpu_interleaved
from mha.ops.decode import flash_decode

SHAPES = {"mha": (1, 32, 32, 128), "smollm2": (1, 9, 3, 64)}  # (B, h, h_kv, d)


def _step(name: str, c: mha.KVCache, q: torch.Tensor, qb: torch.Tensor):
    """One decode step on cache ``c``: int8 through ``KVCache.attend``, else the kernel on the
    cache's views (bf16 queries for the bf16 cache)."""
    if name.startswith("int8"):
        qq = qb if name == "int8/bf16q" else q

        def fn():
            with torch.no_grad():
                c.attend(qq)
        return fn
    qq = qb if name == "bf16" else q
    kk, vv = c.keys(), c.values()  # (B, h_kv, Tk, d) views

    def fn():
        with torch.no_grad():
            flash_decode(qq, kk, vv)
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--Tk", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["mha", "smollm2"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {a.clock} clock, Tq = 1")
    print(f"{'shape':>11} {'Tk':>6} {'K/V':>10} {'ms':>9} {'MB read':>8} {'GB/s':>6} {'x bf16':>7}")
    for shape in a.shape:
        B, H, H_KV, D = SHAPES[shape]
        for Tk in a.Tk:
            k, v = (torch.randn(B, H_KV, Tk, D) for _ in range(2))  # (B, h_kv, Tk, d)
            q = torch.randn(B, H, 1, D)  # (B, h, Tq, d)
            caches, nbytes = {}, {}
            for name, dtype, kv in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                    ("int8", torch.float32, "int8"),
                                    ("int8/bf16q", torch.bfloat16, "int8")):
                c = mha.KVCache(B, H_KV, Tk, D, dtype=dtype, kv_dtype=kv)
                with torch.no_grad():
                    c.append(k.to(dtype), v.to(dtype))
                caches[name] = c
                per = c.k.element_size() * 2 * B * H_KV * Tk * D  # K and V
                per += 0 if kv is None else 2 * B * H_KV * Tk * 4  # k_scale, v_scale
                nbytes[name] = per
            qb = q.bfloat16()

            fns = {name: _step(name, c, q, qb) for name, c in caches.items()}
            t = (_cpu_interleaved(fns, a.rounds, calls=1) if a.clock == "cpu"
                 else interleaved(fns, a.rounds, min_time=0.2))
            label = f"{B},{H}/{H_KV},{D}"
            for name, sec in t.items():
                print(f"{label:>11} {Tk:>6} {name:>10} {sec * 1e3:9.3f} {nbytes[name] / 1e6:8.1f} "
                      f"{nbytes[name] / sec / 1e9:6.2f} {t['bf16'] / sec:7.2f}")
            del caches, fns  # free the storage before the next Tk


if __name__ == "__main__":
    main()
