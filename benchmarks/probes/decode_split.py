"""Developer probe: where a packed-bf16 decode step of ``mha.models.Llama`` (SmolLM2-135M,
:func:`mha.llm.native.load_native`) spends its time outside the GEMMs.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src \\
        python benchmarks/probes/decode_split.py [--prompt 128] [--new 32] [--rounds 9] \\
        [--before REV]

One thread, thread CPU time (``time.thread_time``). Each round runs every variant (their order
alternating) on the same prompt: a prefill of ``--prompt`` tokens into fresh caches, then
``--new`` one-token steps timed; the medians over rounds of ms per step are printed. The
variants take one piece out (wrong logits, the same work otherwise), so each difference to
"as is" is what that piece costs in a step:

* no GEMM: every packed projection (:func:`mha.ops.gemv.gemv`, 4 per layer and the LM head)
  returns zeros of its output's shape; what is left is every non-GEMM cost of the step;
* no RMSNorm: the norms return their input;
* no SwiGLU activation: ``silu`` is the identity (the gate * up product stays);
* no attention call: the cached attention call (:func:`mha.attention`: dispatch and the
  decode kernel) returns zeros of the query's shape (the cache append stays);
* no RoPE: every layer's ``rope`` is None (the angles and the rotation).

``--before REV`` adds the model with ``KVCache``'s append / masks bookkeeping and
``Llama``'s same-tokens check of git revision ``REV`` (read with ``git show``), the same
logits (checked bitwise), to measure a change of those against the working tree. Also prints
the minor page faults per step (``resource.getrusage``) of the model as is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import time
import types

import torch

import mha.cache
import mha.models.llama
import mha.module
import mha.ops.gemv
from mha.llm.native import load_native
from mha.llm.weights import PackedMLP

_CACHE_METHODS = ("append", "_append", "appending", "masks", "_masks", "_read")


def _module_at(rev: str, path: str, name: str) -> types.ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                         check=True).stdout
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up there
    exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)  # noqa: S102 (the repo's own file)
    return mod


def _put(owner, name, value, absent) -> None:
    """``owner.name = value``, or the attribute deleted when ``value is absent``."""
    if value is absent:
        if name in owner.__dict__:
            delattr(owner, name)
    else:
        setattr(owner, name, value)


@contextlib.contextmanager
def _patched(pairs):
    """Set ``(owner, name, value)`` attributes (None value = delete), restore them after."""
    saved = [(o, n, o.__dict__.get(n, _MISSING)) for o, n, _ in pairs]
    try:
        for o, n, v in pairs:
            _put(o, n, v, None)
        yield
    finally:
        for o, n, v in saved:
            _put(o, n, v, _MISSING)


_MISSING = object()


def _zeros_gemv(x, packed, bias=None):
    return x.new_zeros(*x.shape[:-1], packed.n)  # (..., K) -> (..., N)


def _zeros_attention(q, k, v, **kw):
    return torch.zeros_like(q)  # (B, h, Tq, d_v) with d_v = d_k here


def _variants(model, before: str | None) -> dict:
    rms = mha.models.llama.RMSNorm
    no_rope = [(layer.self_attn, "rope", None) for layer in model.layers]
    out = {
        "as is": [],
        "no GEMM": [(mha.ops.gemv, "gemv", _zeros_gemv)],
        "no RMSNorm": [(rms, "forward", lambda self, x: x)],
        "no SwiGLU activation": [(m, "act_fn", lambda t: t) for m in model.modules()
                                 if isinstance(m, PackedMLP)],
        "no attention call": [(mha.module, "attention", _zeros_attention)],
        "no RoPE": no_rope,
    }
    if before:
        old_cache = _module_at(before, "src/mha/cache.py", "mha._cache_before")
        old_llama = _module_at(before, "src/mha/models/llama.py", "mha._llama_before")
        K = mha.cache.KVCache
        pairs = [(K, n, None) for n in _CACHE_METHODS]  # the working tree's, then REV's
        pairs += [(K, n, f) for n in _CACHE_METHODS if (f := old_cache.KVCache.__dict__.get(n))]
        pairs.append((mha.models.llama, "_check_same_tokens", old_llama._check_same_tokens))
        out[f"cache bookkeeping of {before}"] = pairs
    return out


def _run(model, ids, new: int, pairs) -> tuple[float, float, torch.Tensor]:
    """(seconds per step, minor faults per step, the steps' logits (new, V))."""
    rope_off = [(o, n) for o, n, v in pairs if n == "rope"]
    ropes = [o.rope for o, _ in rope_off]
    for o, _ in rope_off:
        o.rope = None
    try:
        with _patched([p for p in pairs if p[1] != "rope"]):
            caches = model.new_caches(1, ids.shape[1] + new)
            logits = model(ids, caches, last=True)  # (1, 1, V)
            outs = []
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.thread_time()
            for _ in range(new):
                token = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
                logits = model(token, caches, last=True)  # (1, 1, V)
                outs.append(logits[0])
            t = time.thread_time() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    finally:
        for (o, _), r in zip(rope_off, ropes, strict=True):
            o.rope = r
    return t / new, faults / new, torch.cat(outs)  # (new, V)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--before", default=None, help="a git revision whose cache bookkeeping to "
                    "time against the working tree's")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_native("fp32", "bf16").model
    ids = torch.randint(100, 49152, (1, args.prompt),
                        generator=torch.Generator().manual_seed(0))  # (1, P)
    runs = _variants(model, args.before)
    load0 = os.getloadavg()[0]
    with torch.inference_mode():
        first = {name: _run(model, ids, args.new, pairs) for name, pairs in runs.items()}
        if args.before:
            same = torch.equal(first["as is"][2], first[f"cache bookkeeping of {args.before}"][2])
            print(f"logits of {args.before}'s bookkeeping bitwise equal: {same}")
        times = {name: [] for name in runs}
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                times[name].append(_run(model, ids, args.new, runs[name])[0])
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"SmolLM2-135M packed bf16, prompt {args.prompt}, {args.new} steps, {args.rounds} "
          f"rounds, 1 thread, thread CPU time, load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; minor faults per step as is: {first['as is'][1]:.1f}")
    base = med["as is"]
    for name, ms in med.items():
        print(f"  {name:40s} {ms:7.2f} ms/step   {base - ms:+7.2f} ms against as is")


if __name__ == "__main__":
    main()
