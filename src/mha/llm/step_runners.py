"""How :class:`mha.llm.serving.Scheduler` runs one packed step on a model: one runner per kind
of model it serves, so the scheduler's admission, preemption and cancellation stay one code
whatever the model is.

Shape legend: N packed tokens of one step, R requests in the step, h / h_kv query / K/V heads,
d head dim, V vocabulary.

A runner tells the scheduler what the paged cache must hold (:meth:`cache_shape`), the
vocabulary and the context (for its refusals), and computes a step's logits: the step's token
ids ``(1, N)``, each token's position, and the :class:`Step` (the cache, the requests' sequence
ids and ``cu_seqlens``) -> the logits ``(R, V)`` of each request's last token. Each attention
layer writes the step's K/V into its pages and attends through them
(:meth:`mha.PagedKVCache.attend_varlen`: the decode rows in one native paged decode call, the
prefill chunks in one call of the paged flash forward), whichever the model:

- :class:`HFRunner`, a transformers causal LM (e.g. :func:`mha.llm.model.load` ``(...).model``):
  its attention is mha's :func:`attention_forward`, registered in transformers'
  ``AttentionInterface`` under :data:`NAME`; no mask function is registered for it, so
  transformers builds no mask, and the step reaches the layers as the ``paged_step`` keyword
  that models forward to their attention function. While the scheduler runs, the model's
  attention implementation is switched to :data:`NAME` and restored after (:meth:`active`).
- :class:`LlamaRunner`, :class:`mha.models.Llama` (mha's own modules end to end):
  :meth:`mha.models.Llama.forward_paged`, each layer's :class:`mha.MultiHeadAttention` in its
  paged mode (:meth:`mha.MultiHeadAttention.forward_paged`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mha.models.llama import Llama
from mha.paged import PagedKVCache

NAME = "mha_paged"


@dataclass
class Step:
    """One forward's packing: ``seq_ids[i]`` owns tokens ``cu_seqlens[i]:cu_seqlens[i+1]``."""

    cache: PagedKVCache
    seq_ids: list[int]
    cu_seqlens: list[int]

    @property
    def last(self) -> list[int]:
        """The index of each sequence's last token in the step (whose logits are kept)."""
        return [n - 1 for n in self.cu_seqlens[1:]]


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      paged_step: Step | None = None, **kwargs):
    """transformers' attention hook for :data:`NAME`: ``query (1, h, N, d)``, ``key`` /
    ``value (1, h_kv, N, d)`` (the step's new tokens, packed); writes K/V into layer
    ``module.layer_idx``'s pages and returns ``(out (1, N, h, d), None)``."""
    if paged_step is None:
        raise ValueError(f"attn_implementation={NAME!r} runs inside mha.llm.serving.Scheduler "
                         "(it needs the step's paged_step keyword)")
    step, layer = paged_step, module.layer_idx
    step.cache.write(layer, step.seq_ids, key[0].transpose(0, 1),  # (h_kv, N, d) -> (N, h_kv, d)
                     value[0].transpose(0, 1), step.cu_seqlens)
    out = step.cache.attend_varlen(layer, query[0].transpose(0, 1), step.seq_ids,  # (N, h, d)
                                   step.cu_seqlens, scale=scaling)  # (N, h, d_v)
    return out.unsqueeze(0), None  # (1, N, h, d_v)


def register() -> None:
    """Add :func:`attention_forward` to transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)


class HFRunner:
    """A transformers causal LM's step: ``model(input_ids (1, N), position_ids (1, N),
    logits_to_keep=<each request's last token>, paged_step=step)`` under :data:`NAME`."""

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config.get_text_config()
        self.vocab_size = model.get_input_embeddings().num_embeddings
        context = getattr(self.config, "max_position_embeddings", None)
        self.context = context if isinstance(context, int) else None

    def cache_shape(self) -> dict:
        """The :class:`mha.PagedKVCache` keywords the model's layers need."""
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return dict(num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                    num_layers=cfg.num_hidden_layers, dtype=self.model.dtype,
                    device=self.model.device)

    @contextlib.contextmanager
    def active(self):
        """The model's attention is :data:`NAME` inside, its own again after."""
        register()
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation(NAME)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    def logits(self, ids: list[int], positions: list[int], step: Step) -> torch.Tensor:
        dev = self.model.device
        return self.model(input_ids=torch.tensor([ids], device=dev),  # (1, N)
                          position_ids=torch.tensor([positions], device=dev),
                          use_cache=False, logits_to_keep=torch.tensor(step.last, device=dev),
                          paged_step=step).logits[0]  # (1, R, V) -> (R, V)


class LlamaRunner:
    """:class:`mha.models.Llama`'s step: :meth:`mha.models.Llama.forward_paged`."""

    def __init__(self, model: Llama) -> None:
        self.model = model
        self.vocab_size = model.settings.vocab_size
        self.context = model.settings.max_position_embeddings

    def cache_shape(self) -> dict:
        s, w = self.model.settings, self.model.embed_tokens.weight
        return dict(num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, num_layers=s.num_layers,
                    dtype=w.dtype, device=w.device)

    def active(self):
        return contextlib.nullcontext()

    def logits(self, ids: list[int], positions: list[int], step: Step) -> torch.Tensor:
        dev = self.model.embed_tokens.weight.device
        return self.model.forward_paged(
            torch.tensor([ids], device=dev), torch.tensor(positions, device=dev),  # (1, N), (N,)
            step.cache, step.seq_ids, step.cu_seqlens,
            rows=torch.tensor(step.last, device=dev))[0]  # (1, R, V) -> (R, V)


def runner_for(model, name: str = "model") -> HFRunner | LlamaRunner:
    """The runner of ``model``: an :class:`mha.models.Llama` or a transformers causal LM;
    anything else is refused (TypeError naming the argument, ``name``)."""
    if isinstance(model, Llama):
        return LlamaRunner(model)
    config = getattr(model, "config", None)
    if isinstance(model, torch.nn.Module) and hasattr(config, "get_text_config") and hasattr(
            model, "get_input_embeddings") and hasattr(model, "set_attn_implementation"):
        return HFRunner(model)
    raise TypeError(f"{name} must be a transformers causal LM (e.g. mha.llm.model.load(...)"
                    f".model) or an mha.models.Llama, got {type(model).__name__}")


__all__ = ["NAME", "HFRunner", "LlamaRunner", "Step", "attention_forward", "register",
           "runner_for"]
