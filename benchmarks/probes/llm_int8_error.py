"""Developer probe: what int8 (and bf16) K/V storage changes in SmolLM2's greedy decoding.

    PYTHONPATH=src python benchmarks/probes/llm_int8_error.py [--new-tokens 200] \
        [--first 0 --prompts 5] [--out benchmarks/results/llm_int8_error.json]

For each of five chat prompts, with the fp32 model and ``attn_implementation="mha"``:

1. the reference: greedy decoding of ``--new-tokens`` tokens (no stop at end-of-turn) with an
   fp32 :func:`mha.integrations.hf_cache.MhaCache`, keeping every step's logits ``(V,)``;
2. per K/V storage (bf16, int8), teacher-forced along the reference's tokens: the max
   |logit - reference| over every step and the vocabulary (the logit error measured on the
   same contexts, before and after any divergence), and the steps whose argmax agrees;
3. where some argmax differs, greedy decoding again (free-running; up to the first such step
   it is the teacher-forced run, so it is skipped when none differs): the count of new tokens
   that differ from the reference position by position, the first step at which they differ
   (0 = the first new token) and the reference's top-1 / top-2 logit gap there.

Prints a table and writes the numbers as JSON. Shape legend: P prompt tokens, N new tokens,
V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mha.integrations.hf_cache import MhaCache
from mha.llm.generation import chat_ids
from mha.llm.model import load

PROMPTS = (
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, step by step.",
    "List five tips for staying productive when working from home.",
    "What are the differences between Python lists and tuples?",
)
KV = ("bf16", "int8")


@torch.inference_mode()
def greedy(model, ids: torch.Tensor, N: int, kv_dtype, forced: list[int] | None = None):
    """``N`` greedy tokens after ``ids (1, P)`` (or, with ``forced``, the logits along those
    tokens): ``(tokens [N], logits (N, V) float32)``."""
    cache = MhaCache(model.config, max_cache_len=ids.shape[1] + N, kv_dtype=kv_dtype)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    toks, rows = [], []
    for i in range(N):
        rows.append(logits.float())
        t = int(logits.argmax()) if forced is None else forced[i]
        toks.append(t)
        if i + 1 < N:
            step = torch.tensor([[t]])  # (1, 1)
            logits = model(input_ids=step, cache=cache, use_cache=True).logits[0, -1]  # (V,)
    return toks, torch.stack(rows)  # [N], (N, V)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts")
    ap.add_argument("--first", type=int, default=0, help="index of the first prompt")
    ap.add_argument("--out", default="benchmarks/results/llm_int8_error.json")
    args = ap.parse_args()
    loaded = load("fp32", "mha")
    model, tok = loaded.model, loaded.tokenizer
    N = args.new_tokens
    report = {"new_tokens": N, "threads": torch.get_num_threads(), "prompts": []}
    t0 = time.perf_counter()
    for prompt in PROMPTS[args.first:args.first + args.prompts]:
        ids = chat_ids(tok, [{"role": "user", "content": prompt}])  # (1, P)
        ref_toks, ref_logits = greedy(model, ids, N, None)
        entry = {"prompt": prompt, "prompt_tokens": ids.shape[1],
                 "max_abs_logit": ref_logits.abs().max().item()}
        for kv in KV:
            _, forced = greedy(model, ids, N, kv, forced=ref_toks)
            diff = (forced - ref_logits).abs()  # (N, V)
            same = forced.argmax(-1) == ref_logits.argmax(-1)  # (N,)
            forced_same = int(same.sum())
            # up to the first step whose argmax differs, free-running = teacher-forced (same
            # contexts): decode freely only when there is a divergence, to count the tokens
            differ, first, gap = [], None, None
            if not bool(same.all()):
                toks, _ = greedy(model, ids, N, kv)
                differ = [i for i, (a, b) in enumerate(zip(toks, ref_toks, strict=True))
                          if a != b]
                first = differ[0]
                top2 = ref_logits[first].topk(2).values
                gap = (top2[0] - top2[1]).item()
            entry[kv] = {"tokens_differ": len(differ), "first_divergence": first,
                         "ref_top2_gap_at_divergence": gap,
                         "max_logit_diff_forced": diff.max().item(),
                         "mean_logit_diff_forced": diff.mean().item(),
                         "forced_argmax_equal": forced_same}
        report["prompts"].append(entry)
        print(json.dumps(entry), flush=True)
    report["seconds"] = time.perf_counter() - t0
    print(f"\n{'prompt':<36} {'kv':<5} {'differ':>6} {'first':>5} {'gap':>6} {'max dlogit':>10}")
    for e in report["prompts"]:
        for kv in KV:
            r = e[kv]
            gap = "-" if r["ref_top2_gap_at_divergence"] is None else \
                f"{r['ref_top2_gap_at_divergence']:.3f}"
            first = "-" if r["first_divergence"] is None else r["first_divergence"]
            print(f"{e['prompt'][:36]:<36} {kv:<5} {r['tokens_differ']:>6} {first:>5} "
                  f"{gap:>6} {r['max_logit_diff_forced']:>10.4f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"written {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
