"""Generation (greedy, or sampled: :mod:`mha.sampling`) with SmolLM2 through mha:
transformers' ``generate`` with ``attn_implementation="mha"`` and
:func:`mha.integrations.hf_cache.MhaCache` (preallocated K/V, written in place, no per-step
mask).

Shape legend: B batch (1 here), P prompt tokens, N new tokens, T_max = P + N the cache's
capacity.

:func:`generate` runs one prompt (as a chat turn, through the tokenizer's chat template, unless
``chat=False``); :class:`Chat` keeps a conversation. Both time the prefill (up to the first new
token) and the decode (the rest) separately and can stream the text as it is decoded.

``kv`` picks the K/V storage of the cache (mha only): None (the model's dtype), ``"fp32"``,
``"bf16"`` or ``"int8"`` (per-token-per-head scales, read in place by the decode kernel;
see :mod:`mha.integrations.hf_cache`).

``sampling`` (a :class:`mha.sampling.SamplingParams`, None: greedy) samples through mha's
own sampler, which transformers' ``generate`` runs as its last logits processor (the one
token drawn stays finite, so transformers' argmax takes it): the same draws as ``impl="mha"``
(:mod:`mha.llm.native`) for the same seed, so the two give the same tokens as long as their
logits choose alike (as their greedy tokens do).

Refusals are made before any work and leave nothing changed: a prompt that, with the new
tokens asked for, does not fit the model's context (ValueError naming both numbers), a
``max_new_tokens`` that is not a positive int, a dtype other than fp32/bf16, a ``kv`` other
than those (or any ``kv`` with transformers' own attention, which has its own cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mha.checks import check_int, check_text
from mha.llm.model import Loaded, load
from mha.llm.runs import Result, check_fits, check_prompt_ids, streamer
from mha.sampling import Sampler, SamplingParams, check_sampling

KV = ("fp32", "bf16", "int8")  #: the K/V storages ``kv`` names


def check_kv(kv, attn: str) -> str | None:
    """``kv`` checked against :data:`KV` and the attention (only mha's cache takes one)."""
    if kv is None:
        return None
    if not isinstance(kv, str) or kv not in KV:
        raise ValueError(f"kv must be one of {', '.join(KV)} (or None: the model's dtype), "
                         f"got {kv!r}")
    if attn != "mha":
        raise ValueError(f"kv={kv!r} needs attn='mha' (mha's K/V cache); attn={attn!r} uses "
                         "transformers' own cache in the model's dtype")
    return kv


def run_ids(loaded: Loaded, ids: torch.Tensor, max_new_tokens: int, *,
            on_text: Callable[[str], None] | None = None, stop_at_eos: bool = True,
            kv: str | None = None, sampling: SamplingParams | None = None,
            generator: torch.Generator | None = None) -> Result:
    """Decode ``max_new_tokens`` after ``ids (1, P)`` with ``loaded``'s model (through an
    :func:`MhaCache` of capacity ``P + N``, K/V stored as ``kv``, when its attention is mha):
    greedy, or sampled with ``sampling`` from ``generator`` (None: a new one from its seed)."""
    from mha.integrations.hf_cache import MhaCache

    max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1, what="a positive int")
    kv = check_kv(kv, loaded.attn)
    sampling = check_sampling(sampling).with_seed()
    sampler = Sampler.one_row(sampling, generator)
    P = check_prompt_ids(ids)
    check_fits(P, max_new_tokens, loaded.context)
    model, tok = loaded.model, loaded.tokenizer
    marks: list[float] = []
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None,
              temperature=None, pad_token_id=tok.eos_token_id,
              streamer=streamer(tok, on_text, marks))
    if not stop_at_eos:
        kw["min_new_tokens"] = max_new_tokens
    if sampler is not None:
        kw["logits_processor"] = _as_processors(sampler)
    if loaded.attn == "mha":
        kw["cache"] = MhaCache(model.config, max_cache_len=P + max_new_tokens, kv_dtype=kv)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)  # (1, P+N)
    t1 = time.perf_counter()
    new = out[0, P:].tolist()
    first = marks[1] if len(marks) > 1 else t1  # marks[0]: the prompt handed to the streamer
    return Result(text=tok.decode(new, skip_special_tokens=True), prompt_tokens=P,
                  new_tokens=len(new), prefill_seconds=first - t0, decode_seconds=t1 - first,
                  attn=loaded.attn, dtype=str(loaded.dtype).replace("torch.", ""), tokens=new,
                  kv=kv, weights=loaded.weights, sampling=sampling.describe())


def _as_processors(sampler: Sampler):
    """``sampler`` as transformers' last logits processor: each step's scores ``(1, V)``
    become -inf but for the drawn token (0), which greedy decoding then takes."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class _Draw(LogitsProcessor):
        def __call__(self, input_ids, scores):  # scores (1, V)
            token = sampler(scores)  # (1,)
            out = torch.full_like(scores, -float("inf"))  # (1, V)
            return out.scatter_(1, token[:, None], 0.0)

    return LogitsProcessorList([_Draw()])


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """The chat template applied to ``messages``, ready for the assistant's turn: ``(1, P)``."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    return enc["input_ids"]


def generate(prompt: str, *, max_new_tokens: int = 64, dtype="fp32", attn: str = "mha",
             kv: str | None = None, weights: str = "fp32", chat: bool = True,
             on_text: Callable[[str], None] | None = None,
             sampling: SamplingParams | None = None) -> Result:
    """Continuation (greedy, or sampled: ``sampling``) of ``prompt`` by SmolLM2-135M-Instruct
    (as a user turn of a chat unless ``chat=False``), K/V stored as ``kv`` (see the module
    docstring), projections' weights as ``weights`` (see :func:`mha.llm.load`). ``on_text``
    receives the text as it is decoded (streaming)."""
    check_text("prompt", prompt)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1, what="a positive int")
    check_kv(kv, attn)
    check_sampling(sampling)
    loaded = load(dtype, attn, weights)
    tok = loaded.tokenizer
    ids = (chat_ids(tok, [{"role": "user", "content": prompt}]) if chat
           else tok(prompt, return_tensors="pt")["input_ids"])  # (1, P)
    return run_ids(loaded, ids, max_new_tokens, on_text=on_text, kv=kv, sampling=sampling)


class Chat:
    """A conversation with SmolLM2: each :meth:`say` renders the whole history with the chat
    template and generates the reply (a cache of capacity ``P + max_new_tokens`` per turn).

    A refused or interrupted turn (too long for the context, ``text`` not UTF-8 text, Ctrl-C)
    leaves the history, and the sampling generator, as they were. ``impl="mha"``: the model built from mha's own modules
    (:mod:`mha.llm.native`), which runs ``attn="mha"``, with the projections' ``weights`` (as
    loaded, or packed bf16 / int8) and K/V in the model's dtype or int8; other values of those
    are refused naming the argument.
    ``sampling``: None (greedy) or a :class:`SamplingParams`; one generator, seeded once,
    runs through every turn (the same seed replays the same conversation).
    """

    def __init__(self, *, dtype="fp32", attn: str = "mha", kv: str | None = None,
                 weights: str = "fp32", max_new_tokens: int = 256,
                 system: str | None = None, impl: str = "transformers",
                 sampling: SamplingParams | None = None) -> None:
        if impl not in ("transformers", "mha"):
            raise ValueError(f"impl must be 'transformers' or 'mha', got {impl!r}")
        self.sampling = check_sampling(sampling).with_seed()
        self.generator = self.sampling.generator()  # None when greedy
        self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1,
                                        what="a positive int")
        if impl == "mha":
            from mha.llm.model import check_dtype
            from mha.llm.native import check_native_kv, load_native, run_native

            if attn != "mha":
                raise ValueError(f"impl='mha' runs mha.MultiHeadAttention; attn={attn!r} "
                                 "chooses transformers' attention (use impl='transformers')")
            self.kv = check_native_kv(kv, check_dtype(dtype))
            self.loaded = load_native(dtype, weights)
            self._run = run_native
        else:
            self.kv = check_kv(kv, attn)
            self.loaded = load(dtype, attn, weights)
            self._run = run_ids
        self.messages: list[dict] = ([{"role": "system", "content": system}]
                                     if system else [])

    def say(self, text: str, on_text: Callable[[str], None] | None = None) -> Result:
        check_text("text", text)
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = chat_ids(self.loaded.tokenizer, messages)  # (1, P)
        state = None if self.generator is None else self.generator.get_state()
        try:
            res = self._run(self.loaded, ids, self.max_new_tokens, on_text=on_text, kv=self.kv,
                            sampling=self.sampling, generator=self.generator)
        except BaseException:  # Ctrl-C or an error mid-turn: the generator as before the turn
            if state is not None:
                self.generator.set_state(state)
            raise
        self.messages = [*messages, {"role": "assistant", "content": res.text}]
        return res


__all__ = ["KV", "Chat", "Result", "chat_ids", "check_fits", "check_kv", "generate", "run_ids"]
