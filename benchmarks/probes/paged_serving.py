"""Continuous batching throughput on SmolLM2 (:mod:`mha.llm.serving`): 16 requests arriving
together, served batched over one paged cache vs one at a time.

Run (under the timing lock, see docs/kernel.md):
    flock -x /tmp/mha-bench.lock env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        .venv/bin/python benchmarks/probes/paged_serving.py --new 32

Rows: ``batched`` (one Scheduler, 16 sequences at once: one forward per step for all of
them), ``one-by-one paged`` (the same Scheduler code with ``max_seqs=1``), and ``one-by-one
HF`` (transformers' ``generate`` per prompt, sdpa attention, its DynamicCache). Prompts of
3 … 40 tokens, greedy, ``--new`` tokens each, fp32. Prints wall seconds, requests/s and
generated tok/s, and whether every row's tokens equal the HF one-by-one tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from mha.llm.model import load
from mha.llm.serving import Scheduler

TEXT = ("The quick brown fox jumps over the lazy dog while the sun sets slowly behind the "
        "hills, and the children of the village run home to eat bread, soup and apples before "
        "night falls on the old town by the river.")


def _scheduler(model, prompts, new, max_seqs):
    s = Scheduler(model, num_pages=16 * 8, page_size=16, max_seqs=max_seqs, max_len=48 + new,
                  prefill_chunk=64)
    for p in prompts:
        s.add(p, new)
    return s.run(), s.forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()
    ref = load("fp32", "sdpa")
    lm = load("fp32", "mha")
    ids = ref.tokenizer(TEXT)["input_ids"]
    prompts = [ids[:3 + (i * 37) // 15] for i in range(16)]
    rows = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        want = [ref.model.generate(torch.tensor([p]), max_new_tokens=a.new,
                                   min_new_tokens=a.new, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    rows["one-by-one HF sdpa"] = (time.perf_counter() - t0, want, 16 * a.new)
    for name, max_seqs in (("one-by-one paged", 1), ("batched paged", 16)):
        t0 = time.perf_counter()
        got, forwards = _scheduler(lm.model, prompts, a.new, max_seqs)
        rows[name] = (time.perf_counter() - t0, [got[i] for i in range(16)], forwards)
    print(f"16 requests, prompts 3..40 tokens, {a.new} new tokens each, fp32, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':>20} {'s':>7} {'req/s':>6} {'tok/s':>7} {'forwards':>8} {'= HF':>5}")
    for name, (sec, toks, fw) in rows.items():
        print(f"{name:>20} {sec:7.2f} {16 / sec:6.2f} {16 * a.new / sec:7.1f} {fw:>8} "
              f"{str(toks == want):>5}")


if __name__ == "__main__":
    main()
