"""Developer probe: SmolLM2-135M on mha's own model (``mha.models.Llama``, ``--impl mha``)
against transformers' LlamaForCausalLM with mha's attention (``attn mha``, MhaCache), fp32,
in one process; the projections' weights as loaded (fp32) in both, or with ``--weights fp32
bf16 int8`` each of those (bf16 / int8: packed for mha's weight-stationary kernel,
:func:`mha.llm.weights.pack_weights`), both models per kind.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src \\
        python benchmarks/probes/llm_native.py [--prompt 128] [--new 32] [--rounds 7] \\
        [--threads 1 2] [--weights fp32 bf16] [--rope-cost]

Per thread count, each round runs every model (their order alternating) on the same prompt:
a prefill of ``--prompt`` random tokens into a fresh cache (last position's logits only), then
``--new`` greedy one-token steps. Prints the medians over rounds of prefill tok/s and decode
tok/s, and their ratios (mha / transformers, per weights kind). With 1 thread the clock is
the thread's CPU time (``time.thread_time``: a busy machine's descheduling stays out); with
more, wall time.
``--rope-cost`` adds two runs: the native model with every layer's ``rope`` set to None
(wrong logits, the same work otherwise), whose difference is what RoPE costs inside the model
(the angles once per forward, :meth:`Llama.rope_angles`, and the rotation in every layer), and
the native model with its angles computed per layer (``rope_angles`` returning None: each
layer's ``MultiHeadAttention`` reads its cache's positions and takes their angles, as before
the angles were shared; the same logits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mha.integrations.hf_cache import MhaCache
from mha.llm.model import load
from mha.llm.native import load_native


def _hf(model, ids, new: int, clock):
    P = ids.shape[1]
    cache = MhaCache(model.config, max_cache_len=P + new)
    t0 = clock()
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    t1 = clock()
    for _ in range(new):
        token = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        logits = model(input_ids=token, cache=cache, use_cache=True).logits  # (1, 1, V)
    return t1 - t0, clock() - t1


def _native(model, ids, new: int, clock, rope: str = "once"):
    """``rope``: "once" (as the model runs), "per layer" (each layer its own angles) or "off"."""
    ropes = [layer.self_attn.rope for layer in model.layers]
    if rope == "off":
        for layer in model.layers:
            layer.self_attn.rope = None
    if rope == "per layer":
        model.rope_angles = lambda *a: None  # an instance attribute over the method
    try:
        return _native_run(model, ids, new, clock)
    finally:
        for layer, r in zip(model.layers, ropes, strict=True):
            layer.self_attn.rope = r
        model.__dict__.pop("rope_angles", None)


def _native_run(model, ids, new: int, clock):
    caches = model.new_caches(1, ids.shape[1] + new)
    t0 = clock()
    logits = model(ids, caches, last=True)  # (1, 1, V)
    t1 = clock()
    for _ in range(new):
        token = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        logits = model(token, caches, last=True)  # (1, 1, V)
    return t1 - t0, clock() - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--weights", nargs="+", default=["fp32"], choices=("fp32", "bf16", "int8"),
                    help="the projections' weights, each kind run on both models")
    ap.add_argument("--rope-cost", action="store_true",
                    help="also time the native model without RoPE (its cost; wrong logits) and "
                         "with its angles computed per layer")
    args = ap.parse_args()
    ids = torch.randint(100, 49152, (1, args.prompt),
                        generator=torch.Generator().manual_seed(0))  # (1, P)
    runs, pairs = {}, []
    for w in args.weights:
        hf = load("fp32", "mha", w).model
        native = load_native("fp32", w).model
        names = (f"transformers (attn mha) {w}", f"mha.models.Llama {w}")
        runs[names[0]] = lambda c, hf=hf: _hf(hf, ids, args.new, c)
        runs[names[1]] = lambda c, native=native: _native(native, ids, args.new, c)
        pairs.append((w, names))
    if args.rope_cost:
        native = load_native("fp32", args.weights[0]).model
        runs["mha.models.Llama, no rope"] = lambda c: _native(native, ids, args.new, c, "off")
        runs["mha.models.Llama, per-layer angles"] = \
            lambda c: _native(native, ids, args.new, c, "per layer")
    print(f"SmolLM2-135M fp32 activations, prompt {args.prompt}, {args.new} new tokens, {args.rounds} "
          f"rounds, load average {os.getloadavg()[0]:.1f} at start")
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            for fn in runs.values():
                fn(clock)  # warm-up
            times = {name: ([], []) for name in runs}
            for r in range(args.rounds):
                order = list(runs) if r % 2 == 0 else list(reversed(runs))
                for name in order:
                    pre, dec = runs[name](clock)
                    times[name][0].append(pre)
                    times[name][1].append(dec)
            rates = {name: (args.prompt / statistics.median(p), args.new / statistics.median(d))
                     for name, (p, d) in times.items()}
            print(f"\n{threads} thread(s), {'thread CPU time' if threads == 1 else 'wall time'}"
                  f" (load average {os.getloadavg()[0]:.1f})")
            for name, (pre, dec) in rates.items():
                print(f"  {name:36s} prefill {pre:8.1f} tok/s   decode {dec:6.1f} tok/s")
            for w, (h_name, m_name) in pairs:
                (hp, hd), (mp, md) = rates[h_name], rates[m_name]
                print(f"  {'mha / transformers ' + w:36s} prefill {mp / hp:8.2f}x      "
                      f"decode {md / hd:6.2f}x")


if __name__ == "__main__":
    main()
