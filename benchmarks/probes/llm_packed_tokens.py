"""Developer probe: do packed weights change SmolLM2's greedy tokens on mha's own model?

    PYTHONPATH=src python benchmarks/probes/llm_packed_tokens.py [--new 48]

Decodes four chat prompts greedily (stopping at the end-of-turn token) with
``mha.models.Llama`` holding fp32, packed bf16 and packed int8 projections
(:func:`mha.llm.native.load_native`), and with transformers' model holding packed bf16 ones
(:func:`mha.llm.model.load`, attn mha), fp32 activations, one thread. Per prompt and model it
prints the reply's length and the first step whose token differs from the fp32 model's, with
the fp32 model's gap between its two best logits at that step (a near tie when small).
"""

from __future__ import annotations

import argparse

import torch

from mha.llm.generation import chat_ids
from mha.llm.model import load
from mha.llm.native import load_native

PROMPTS = ("What is the capital of France?", "Tell me a story about a dragon.",
           "Explain what a hash table is.", "Write a haiku about the sea.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = {"mha fp32": load_native("fp32", "fp32"), "mha bf16": load_native("fp32", "bf16"),
              "mha int8": load_native("fp32", "int8"),
              "transformers bf16": load("fp32", "mha", "bf16")}
    tok = models["mha fp32"].tokenizer
    eos = tok.eos_token_id
    for prompt in PROMPTS:
        ids = chat_ids(tok, [{"role": "user", "content": prompt}])  # (1, P)
        P = ids.shape[1]
        outs = {}
        with torch.no_grad():
            for name, loaded in models.items():
                if loaded.impl == "mha":
                    out = loaded.model.generate(ids, args.new, eos_token_id=eos)
                else:
                    out = loaded.model.generate(ids, max_new_tokens=args.new, do_sample=False,
                                                eos_token_id=eos, pad_token_id=eos)
                outs[name] = out[0, P:].tolist()  # (N,)
            ref = outs["mha fp32"]
            full = torch.tensor([ids[0].tolist() + ref])  # (1, P + N)
            top2 = models["mha fp32"].model(full)[0, P - 1:-1].topk(2, -1).values  # (N, 2)
        print(f"\n{prompt!r}")
        for name, toks in outs.items():
            first = next((i for i, (a, b) in enumerate(zip(toks, ref, strict=False)) if a != b),
                         None if len(toks) == len(ref) else min(len(toks), len(ref)))
            gap = "" if first is None or first >= len(ref) else (
                f" (fp32 top-2 gap there {float(top2[first, 0] - top2[first, 1]):.3f})")
            where = "equal to mha fp32" if first is None else f"first differs at step {first}{gap}"
            print(f"  {name:18s} {len(toks):3d} tokens, {where}")


if __name__ == "__main__":
    main()
