"""What one generation run returns, how its time is taken and its text streamed, and the
context check before it: shared by the transformers path (:mod:`mha.llm.generation`) and mha's
own model (:mod:`mha.llm.native`), which both report a :class:`Result`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Result:
    """One generation: the text, the token counts and where the time went."""

    text: str
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    attn: str = "mha"
    dtype: str = "fp32"
    tokens: list[int] = field(default_factory=list)
    kv: str | None = None  #: the cache's K/V storage when not the model's dtype
    weights: str = "fp32"  #: the projections' weights (fp32: as loaded; bf16/int8: packed)
    impl: str = "transformers"  #: or "mha": mha.models.Llama, no transformers in the forward
    sampling: str = "greedy"  #: how tokens were chosen (SamplingParams.describe: with the seed)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """New tokens after the first, per second of decoding."""
        n = self.new_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    def status(self) -> str:
        """The one-line status: tokens and speeds."""
        kv = "" if self.kv is None else f" · kv {self.kv}"
        w = "" if self.weights == "fp32" else f" · weights {self.weights}"
        model = ("impl mha (mha.models.Llama)" if self.impl == "mha"
                 else f"attn {self.attn}")
        sampled = "" if self.sampling == "greedy" else f" · {self.sampling}"
        return (f"{self.prompt_tokens} prompt + {self.new_tokens} new tokens · prefill "
                f"{self.prefill_tok_s:,.0f} tok/s · decode {self.decode_tok_s:,.1f} tok/s · "
                f"{model} · {self.dtype}{w}{kv}{sampled}")


def streamer(tokenizer, on_text: Callable[[str], None] | None, marks: list[float]):
    """A transformers streamer that records when each batch of tokens arrives (the prompt
    first, then one per step) and passes the decoded text on."""
    from transformers import TextStreamer

    class _Timed(TextStreamer):
        def put(self, value):
            marks.append(time.perf_counter())
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False):
            if on_text is not None and text:
                on_text(text)

    return _Timed(tokenizer, skip_prompt=True, skip_special_tokens=True)


def check_prompt_ids(ids) -> int:
    """``ids``: one prompt of token ids, an integer tensor ``(1, P)``; returns P. A batch of
    several rows is refused (a run reports one reply: the other rows would be dropped)."""
    import torch

    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point \
            or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor (1, P) of token ids, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must have shape (1, P) (one prompt), got {tuple(ids.shape)}")
    return ids.shape[1]



def check_fits(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse a prompt of no tokens, or one that, with ``max_new_tokens`` more, exceeds the
    model's context."""
    if prompt_tokens < 1:
        raise ValueError("the prompt has no tokens: greedy decoding continues at least one "
                         "(an empty text without the chat template has none)")
    if prompt_tokens + max_new_tokens > context:
        room = context - prompt_tokens
        fix = (f"ask for at most {room} new tokens" if room > 0
               else "shorten the prompt")
        raise ValueError(f"the prompt has {prompt_tokens} tokens and {max_new_tokens} new tokens "
                         f"were asked for: {prompt_tokens + max_new_tokens} > the model's "
                         f"context of {context} tokens; {fix}")
