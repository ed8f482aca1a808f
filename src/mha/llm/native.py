"""SmolLM2-135M-Instruct on mha's own modules: :class:`mha.models.Llama` (RMSNorm, SwiGLU,
:class:`mha.MultiHeadAttention` with :class:`mha.rope.Rotary`, one :class:`mha.KVCache` per
layer) reads the converted directory of :func:`mha.llm.model.convert` (safetensors +
config.json); transformers only provides the tokenizer. ``mha generate --impl mha``.
With ``weights="bf16"`` / ``"int8"`` its projections (the attention's packed ``[W^Q; W^K; W^V]``
and ``W_O``, the MLP's gate and up as one, down, and the LM head) are packed once for mha's
weight-stationary kernel (:func:`mha.llm.weights.pack_weights`), as the transformers path packs
its ``nn.Linear``.

Shape legend: P prompt tokens, N new tokens.

:func:`load_native` keeps the loaded model per process and dtype; :func:`run_native` decodes
(greedy, or sampled: :mod:`mha.sampling`) and times the prefill (up to the first new
token) and the decode (the rest), as :func:`mha.llm.generation.run_ids` does for the
transformers path, so the two print the same status line.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from mha.checks import check_int
from mha.llm.model import (
    Loaded,
    _tokenizer,
    check_dtype,
    convert,
    eos_token_ids,
    require_extra,
)
from mha.llm.runs import Result, check_fits, check_prompt_ids, streamer
from mha.sampling import Sampler, SamplingParams, check_sampling

KV = ("int8",)  #: K/V storages besides the model's dtype (mha.KVCache's kv_dtype)


def load_native(dtype="fp32", weights: str = "fp32") -> Loaded:
    """SmolLM2-135M-Instruct as :class:`mha.models.Llama` in ``dtype`` (fp32 or bf16), eval
    mode, kept for the rest of the process (``Loaded.impl == "mha"``). ``weights``: ``"fp32"``
    keeps the projections as loaded (in ``dtype``); ``"bf16"`` / ``"int8"`` packs them
    (:func:`mha.llm.weights.pack_weights`; without the native kernel: a warning, and the
    model's own weights)."""
    from mha.llm.weights import check_weights

    require_extra()
    return _load_native(check_dtype(dtype), check_weights(weights))


@functools.cache
def _load_native(dtype: torch.dtype, weights: str) -> Loaded:
    from mha.llm.weights import pack_loaded
    from mha.models.llama import Llama

    path = convert()
    model = Llama.from_pretrained(path, dtype=dtype)
    weights = pack_loaded(model, weights)
    return Loaded(model=model, tokenizer=_tokenizer(str(path)), dtype=dtype, attn="mha",
                  weights=weights, impl="mha", generation_eos=_generation_eos(path))


def _generation_eos(path):
    """``path/generation_config.json``'s eos_token_id (None without the file or the key)."""
    import json

    f = path / "generation_config.json"
    if not f.is_file():
        return None
    return json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")


def check_native_kv(kv, dtype: torch.dtype) -> str | None:
    """``kv`` for the native model: None / the model's own dtype, or ``"int8"``."""
    own = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    if kv is None or kv == own:
        return None
    if kv not in KV:
        raise ValueError(f"kv={kv!r} is not served by impl='mha' in {own}: its caches store "
                         f"K/V in the model's dtype ({own}) or int8")
    return kv


def run_native(loaded: Loaded, ids: torch.Tensor, max_new_tokens: int, *,
               on_text: Callable[[str], None] | None = None, stop_at_eos: bool = True,
               kv: str | None = None, sampling: SamplingParams | None = None,
               generator: torch.Generator | None = None) -> Result:
    """Decode up to ``max_new_tokens`` after ``ids (1, P)`` with the native model (its caches
    of capacity ``P + N``), stopping at any eos id the model declares (the tokenizer's
    end-of-turn token, the config's and the generation config's: :func:`eos_token_ids`, as
    ``mha serve``) unless ``stop_at_eos=False``: greedy, or sampled with ``sampling`` from ``generator`` (None: a
    new one from its seed), as :func:`mha.llm.generation.run_ids` draws."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1, what="a positive int")
    kv = check_native_kv(kv, loaded.dtype)
    sampling = check_sampling(sampling).with_seed()
    sampler = Sampler.one_row(sampling, generator)
    P = check_prompt_ids(ids)
    check_fits(P, max_new_tokens, loaded.context)
    tok = loaded.tokenizer
    marks: list[float] = []
    stream = streamer(tok, on_text, marks)
    stream.put(ids)  # the prompt first (skipped), as transformers' generate does

    def step(token: torch.Tensor) -> None:  # (1,)
        stream.put(token)

    eos = eos_token_ids(loaded) if stop_at_eos else None  # None, an id or a list
    t0 = time.perf_counter()
    out = loaded.model.generate(ids, max_new_tokens, eos_token_id=eos, kv_dtype=kv,
                                on_token=step, sampling=sampler)  # (1, P + N)
    t1 = time.perf_counter()
    stream.end()
    new = out[0, P:].tolist()
    first = marks[1] if len(marks) > 1 else t1  # marks[0]: the prompt handed to the streamer
    return Result(text=tok.decode(new, skip_special_tokens=True), prompt_tokens=P,
                  new_tokens=len(new), prefill_seconds=first - t0, decode_seconds=t1 - first,
                  attn="mha", dtype=str(loaded.dtype).replace("torch.", ""), tokens=new,
                  kv=kv, weights=loaded.weights, impl="mha", sampling=sampling.describe())


__all__ = ["KV", "check_native_kv", "load_native", "run_native"]
