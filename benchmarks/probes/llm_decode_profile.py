"""Developer probe: where a SmolLM2 decode step spends its time at a given context.

    PYTHONPATH=src python benchmarks/probes/llm_decode_profile.py --context 2048 --attn mha \
        [--kv bf16|int8] [--weights bf16|int8]

Fills the cache with a C-token prompt (mha: MhaCache; sdpa/eager: DynamicCache), then times
``--steps`` decode steps (cropped back to C after each, like the ``llm`` bench suite) with
forward hooks on the modules, split into: attention (the self-attention module minus its four
projections: RoPE, the cache write, the attention itself), projections (q/k/v/o), MLP,
RMSNorms, lm_head, and the rest (Python glue of the model: masks, embeddings, outputs). Prints
the split in ms per step and %, then torch.profiler's top operators for one step.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from mha.integrations.hf_cache import MhaCache
from mha.llm.model import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--attn", default="mha", choices=("mha", "sdpa", "eager"))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kv", default=None, choices=("fp32", "bf16", "int8"),
                    help="mha's cache storage (default: the model's dtype; --attn mha only)")
    ap.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8"),
                    help="the projections' weights: fp32 (as loaded) or packed (mha.llm.weights)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    C = args.context
    model = load(args.dtype, args.attn, args.weights).model
    ids = torch.randint(100, model.config.vocab_size, (1, C),
                        generator=torch.Generator().manual_seed(0))  # (1, C)
    if args.attn == "mha":
        cache = MhaCache(model.config, max_cache_len=C + 1, kv_dtype=args.kv)
    else:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

    spent: dict[str, float] = defaultdict(float)
    start: dict[int, float] = {}

    def kind(name: str) -> str | None:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return "projections"
        if leaf == "self_attn":
            return "attention"
        if leaf == "mlp":
            return "MLP"
        if leaf.endswith("norm"):
            return "RMSNorm"
        if leaf == "lm_head":
            return "lm_head"
        return None

    hooks = []
    for name, mod in model.named_modules():
        k = kind(name)
        if k is None:
            continue

        def pre(m, a):
            start[id(m)] = time.perf_counter()

        def post(m, a, o, k=k):
            spent[k] += time.perf_counter() - start[id(m)]

        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    tok = torch.tensor([[28]])
    mask = torch.ones(1, C + 1, dtype=torch.long)
    pos = torch.tensor([[C]])

    def step():
        model(input_ids=tok, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        cache.crop(-1)

    with torch.inference_mode():
        step()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        total = (time.perf_counter() - t0) / args.steps
    for h in hooks:
        h.remove()
    per = {k: v / args.steps for k, v in spent.items()}
    per["attention"] -= per.get("projections", 0.0)  # self_attn includes its projections
    per["rest (Python glue, embeddings, masks)"] = total - sum(per.values())
    print(f"SmolLM2 decode step, context {C}, attn {args.attn}, {args.dtype}, kv {args.kv}, "
          f"weights {args.weights}, {torch.get_num_threads()} threads: "
          f"{1e3 * total:.1f} ms/step ({1 / total:.1f} tok/s)")
    for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {1e3 * v:8.2f} ms  {100 * v / total:5.1f} %")

    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
