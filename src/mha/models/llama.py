"""A Llama-architecture decoder built from :class:`mha.MultiHeadAttention` with
:class:`mha.rope.Rotary`: real Llama-family weights (SmolLM2, TinyLlama, Llama 2 / 3 ...) run on
mha's own module end to end, with no transformers code in the forward.

Shape legend: B batch, T tokens in one call, P prompt tokens, N new tokens, V vocabulary,
d_model model width (``hidden_size``), I the MLP's intermediate size, h / h_kv query /
key-value heads, d_k head dim.

One layer (pre-norm, as transformers' ``LlamaDecoderLayer``)::

    x = x + MHA(RMSNorm(x))                 causal; RoPE on Q and K inside the module
    x = x + down(silu(gate(y)) * up(y))     y = RMSNorm(x)   (SwiGLU)

then a final RMSNorm and the LM head (tied to the token embedding or not, per the config).

The attention is ``MultiHeadAttention(d_model, h, num_kv_heads=h_kv, head_dim=d_k,
bias=False, rope=Rotary(d_k, theta=rope_theta, scaling=<the config's rope scaling>))``; its
packed ``in_proj`` holds ``[W^Q; W^K; W^V]`` (``(h d_k + 2 h_kv d_k, d_model)``), which
:meth:`Llama.load_hf_state_dict` fills from transformers' ``q_proj`` / ``k_proj`` / ``v_proj``;
``o_proj`` is its ``out_proj``. Every other parameter keeps transformers' name without the
``model.`` prefix (``layers.3.mlp.gate_proj.weight``, ``norm.weight``, ``lm_head.weight``).

Building: :meth:`Llama.from_config` (a transformers ``LlamaConfig`` or its dict; random
weights), :meth:`Llama.from_hf` (a loaded transformers ``LlamaForCausalLM``) and
:meth:`Llama.from_pretrained` (a directory with ``config.json`` and ``*.safetensors``, read
with ``safetensors``: nothing is unpickled). Config fields mha cannot serve are refused by
name (:func:`llama_settings`).

Decoding: :meth:`Llama.new_caches` (one :class:`mha.KVCache` per layer), ``forward(ids,
caches=...)`` (prefill and steps are the same call; RoPE positions come from the caches) and
:meth:`Llama.generate` (greedy, or sampled with :class:`mha.sampling.SamplingParams`) that
takes left-padded prompts of different lengths (``attention_mask`` as transformers': 1 = a real
token).

Serving: :meth:`Llama.forward_paged` runs one packed step of continuous batching over a
:class:`mha.PagedKVCache` (:class:`mha.llm.serving.Scheduler`, ``mha serve --impl mha``): the
tokens of many sequences in one row ``(1, N)``, each at its own position. Both forwards share
the layer's math (:meth:`LlamaLayer.around`); only how the attention reaches its keys differs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mha.cache import ConcatKVCache, KVCache
from mha.checks import (
    check_bool,
    check_eos_ids,
    check_int,
    check_int_tensor,
    check_readable,
    check_scalar,
)
from mha.module import MultiHeadAttention
from mha.paged import PagedKVCache, check_step
from mha.rope import Rotary, check_positions
from mha.sampling import Sampler

ROPE_TYPES = ("default", "linear", "llama3")  #: the config's rope types that Rotary serves


# ----------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class LlamaSettings:
    """What the model is built from, read (and checked) from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  #: None, or the ``rope_parameters`` dict of a linear / llama3 type
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: int | list | None = None

    def rotary(self) -> Rotary:
        return Rotary(self.head_dim, theta=self.rope_theta, scaling=self.rope_scaling)


def _config_dict(config) -> dict:
    if isinstance(config, dict):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"config must be a transformers LlamaConfig or its dict, got "
                        f"{type(config).__name__}")
    return to_dict()


def _rope(c: dict) -> tuple[float, dict | None]:
    """``(theta, scaling)`` from transformers' spelling: ``rope_parameters`` (v5), or
    ``rope_theta`` and ``rope_scaling`` (v4)."""
    for name in ("rope_parameters", "rope_scaling"):
        if c.get(name) is not None and not isinstance(c[name], dict):
            raise TypeError(f"config.{name} must be None or a dict (transformers' spelling, "
                            f"e.g. {{'rope_type': 'linear', 'factor': 2.0}}), got "
                            f"{type(c[name]).__name__}")
    params = dict(c.get("rope_parameters") or {})
    legacy = c.get("rope_scaling")
    if legacy:
        params = {**params, **legacy}
    theta = params.get("rope_theta", c.get("rope_theta"))
    theta = 10000.0 if theta is None else check_scalar("config.rope_theta", theta, low=0.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise ValueError(f"config.rope_parameters: rope_type {kind!r} is not served by "
                         f"mha.rope.Rotary (it serves {', '.join(ROPE_TYPES)})")
    factor = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(f"config.partial_rotary_factor must be 1.0 for a Llama (every head dim "
                         f"rotated), got {factor}")
    if theta == 0.0:
        raise ValueError("config.rope_theta must be a finite number > 0, got 0.0")
    if kind == "default":
        return float(theta), None
    scaling = {k: v for k, v in params.items()
               if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling["rope_type"] = kind
    return float(theta), scaling


def llama_settings(config) -> LlamaSettings:
    """A transformers ``LlamaConfig`` (or its dict) -> :class:`LlamaSettings`. Refuses, naming
    the field, what this model does not compute: another ``model_type``, ``hidden_act`` other
    than silu, ``attention_bias`` / ``mlp_bias``, a rope type other than default / linear /
    llama3, partial rotary."""
    c = _config_dict(config)
    kind = c.get("model_type", "llama")
    if kind != "llama":
        raise ValueError(f"config.model_type must be 'llama', got {kind!r}")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.hidden_act must be 'silu' (SwiGLU), got {c['hidden_act']!r}")
    for name in ("attention_bias", "mlp_bias"):
        if c.get(name):
            raise ValueError(f"config.{name}=True is not served: the model's projections have "
                             f"no biases (MultiHeadAttention(..., bias=False))")
    if c.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"config.pretraining_tp must be 1, got {c['pretraining_tp']}")
    hidden = check_int("config.hidden_size", c.get("hidden_size"), low=1, what="a positive int")
    heads = check_int("config.num_attention_heads", c.get("num_attention_heads"), low=1,
                      what="a positive int")
    kv = heads if c.get("num_key_value_heads") is None else c["num_key_value_heads"]
    head_dim = c.get("head_dim")
    if head_dim is None:  # transformers' default: hidden_size // num_attention_heads
        if hidden < heads:
            raise ValueError(f"config.hidden_size={hidden} must be at least "
                             f"config.num_attention_heads={heads} (head_dim = hidden_size // "
                             f"num_attention_heads), or give config.head_dim")
        head_dim = hidden // heads
    theta, scaling = _rope(c)
    eps = check_scalar("config.rms_norm_eps", c.get("rms_norm_eps", 1e-6), low=0.0)
    if eps == 0.0:
        raise ValueError("config.rms_norm_eps must be a finite number > 0, got 0.0")
    tie = c.get("tie_word_embeddings", False)
    tie = check_bool("config.tie_word_embeddings", False if tie is None else tie)
    max_pos = c.get("max_position_embeddings")
    max_pos = 2048 if max_pos is None else check_int(
        "config.max_position_embeddings", max_pos, low=1, what="a positive int")
    return LlamaSettings(
        vocab_size=check_int("config.vocab_size", c.get("vocab_size"), low=1,
                             what="a positive int"),
        hidden_size=hidden,
        intermediate_size=check_int("config.intermediate_size", c.get("intermediate_size"),
                                    low=1, what="a positive int"),
        num_layers=check_int("config.num_hidden_layers", c.get("num_hidden_layers"), low=1,
                             what="a positive int"),
        num_heads=heads, num_kv_heads=check_int("config.num_key_value_heads", kv, low=1,
                                                what="a positive int"),
        head_dim=check_int("config.head_dim", head_dim, low=1, what="a positive int"),
        rms_norm_eps=eps, rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=tie,
        max_position_embeddings=max_pos, eos_token_id=_config_eos(c.get("eos_token_id")))


def _config_eos(eos):
    """``config.eos_token_id``: None, an id >= 0 or a list of them (as transformers')."""
    if eos is None:
        return None
    many = isinstance(eos, (list, tuple))
    for i, t in enumerate(eos if many else [eos]):
        check_int(f"config.eos_token_id[{i}]" if many else "config.eos_token_id", t, low=0,
                  what="a token id (an int >= 0)")
    return list(eos) if many else int(eos)


# ----------------------------------------------------------------------------- the layers
class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in float32 and rounded to
    the input's dtype before the weight (as transformers' ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float, **kw) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **kw))  # (d_model,)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # (B, T, d_model)
        var = x32.pow(2).mean(-1, keepdim=True)  # (B, T, 1)
        return self.weight * (x32 * torch.rsqrt(var + self.eps)).to(x.dtype)  # (B, T, d_model)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``(B, T, d_model) -> (B, T, I) -> (B, T, d_model)``."""

    def __init__(self, d_model: int, hidden: int, **kw) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False, **kw)
        self.up_proj = nn.Linear(d_model, hidden, bias=False, **kw)
        self.down_proj = nn.Linear(hidden, d_model, bias=False, **kw)
        self.act_fn = F.silu  # transformers' LlamaMLP's name (mha.llm.weights.PackedMLP reads it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))  # (B, T, d_model)


class LlamaLayer(nn.Module):
    """``x + MHA(RMSNorm(x))`` (causal, RoPE), then ``x + SwiGLU(RMSNorm(x))``."""

    def __init__(self, s: LlamaSettings, rope: Rotary | None = None, **kw) -> None:
        """``rope``: the :class:`Rotary` to use (the model passes one to all its layers, so
        they share its cached cos / sin tables); None = ``s.rotary()``."""
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, **kw)
        self.self_attn = MultiHeadAttention(s.hidden_size, s.num_heads,
                                            num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                            bias=False, rope=rope or s.rotary(), **kw)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, **kw)
        self.mlp = SwiGLU(s.hidden_size, s.intermediate_size, **kw)

    def forward(self, x: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, *, angles=None) -> torch.Tensor:
        """``mask (B, 1, 1, T)`` (True = a real key) and ``positions (B, T)``: a left-padded
        batch without a cache (:meth:`Llama.forward`'s ``attention_mask``). ``angles``: the
        RoPE ``(C, S)`` of these tokens (:meth:`Llama.rope_angles`), computed once for every
        layer, instead of ``positions`` (:meth:`mha.MultiHeadAttention.forward`)."""
        return self.around(x, lambda h: self.self_attn(
            h, causal=cache is None, cache=cache, mask=mask, positions=positions,
            angles=angles))

    def forward_paged(self, x: torch.Tensor, cache, layer: int, seq_ids, cu_seqlens,
                      positions: torch.Tensor | None, *, angles=None) -> torch.Tensor:
        """One packed step ``x (1, N, d_model)`` over layer ``layer`` of a
        :class:`mha.PagedKVCache` (:meth:`mha.MultiHeadAttention.forward_paged`; ``positions``
        or their ``angles``)."""
        return self.around(x, lambda h: self.self_attn.forward_paged(
            h, cache, layer, seq_ids, cu_seqlens, positions, angles=angles))

    def around(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
               ) -> torch.Tensor:
        """The layer around its attention ``attend`` (``(B, T, d_model)`` in and out, however
        it reaches its keys): ``x + attend(RMSNorm(x))``, then the MLP's residual."""
        h = self.input_layernorm(x)  # (B, T, d_model)
        x = x + attend(h)  # (B, T, d_model)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, d_model)


# ----------------------------------------------------------------------------- the model
class Llama(nn.Module):
    """Token ids ``(B, T)`` -> next-token logits ``(B, T, V)``; see the module docstring."""

    def __init__(self, config, *, device=None, dtype=None) -> None:
        super().__init__()
        s = config if isinstance(config, LlamaSettings) else llama_settings(config)
        kw = dict(device=device, dtype=dtype)
        self.settings = s
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size, **kw)
        rope = s.rotary()  # one for all layers: one cached table of angles, not num_layers
        self.layers = nn.ModuleList(LlamaLayer(s, rope, **kw) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, **kw)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False, **kw)
        if s.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one (V, d_model) parameter

    # ------------------------------------------------------------------ building
    @classmethod
    def from_config(cls, config, *, device=None, dtype=None) -> Llama:
        """Random weights (nn's default initialisation) for ``config``."""
        return cls(config, device=device, dtype=dtype)

    @classmethod
    def from_hf(cls, model: nn.Module) -> Llama:
        """The same model as a loaded transformers ``LlamaForCausalLM`` (its weights copied),
        in its dtype and on its device, in eval mode."""
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a loaded transformers LlamaForCausalLM, got "
                            f"{type(model).__name__}")
        p = next(model.parameters())
        out = cls._empty(model.config, p.device, p.dtype)
        out.load_hf_state_dict(model.state_dict())
        return out.eval()

    @classmethod
    def _empty(cls, config, device, dtype) -> Llama:
        """Uninitialised storage (no random init of weights about to be overwritten: the
        load checks that every one of them is given)."""
        with torch.device("meta"):
            model = cls(config, dtype=dtype)
        model.to_empty(device=device)
        if model.settings.tie_word_embeddings:  # to_empty gives each module its own storage
            model.lm_head.weight = model.embed_tokens.weight
        return model

    @classmethod
    def from_pretrained(cls, path, *, dtype=None) -> Llama:
        """Read ``path/config.json`` and ``path/*.safetensors`` (transformers' names; e.g.
        :func:`mha.llm.model.convert`'s directory); eval mode. ``dtype``: None keeps the
        stored dtype."""
        from safetensors.torch import load_file

        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"path must be a model directory with a config.json, got "
                                    f"{str(path)!r}")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"path {str(path)!r} holds no *.safetensors weights")
        config = json.loads(config_file.read_text(encoding="utf-8"))
        state = {}
        for f in files:
            state.update(load_file(f))
        if dtype is None:
            dtype = next(iter(state.values())).dtype
        model = cls._empty(config, "cpu", dtype)
        model.load_hf_state_dict(state)
        return model.eval()

    def load_hf_state_dict(self, state: dict) -> None:
        """Load transformers' names (``model.layers.N.self_attn.q_proj.weight`` ...), q / k / v
        packed into each layer's ``in_proj``. Every key, shape and value is checked first
        (string keys; floating tensors with data, copied into the model's dtype): a refused
        load names the keys and changes nothing. Refused too for a model whose projections
        are packed (:mod:`mha.llm.weights`): load the unpacked model, then pack it."""
        self._check_unpacked("load_hf_state_dict")
        _check_state(state)
        state = {k.removeprefix("model."): v for k, v in state.items()
                 if not k.endswith("rotary_emb.inv_freq")}
        ours = {}
        for i in range(self.settings.num_layers):
            a = f"layers.{i}.self_attn."
            names = [a + f"{n}_proj.weight" for n in "qkv"]
            if all(n in state for n in names):  # else left as they are: reported below
                parts = [state.pop(n) for n in names]  # (h d_k | h_kv d_k, d_model) each
                if len({p.shape[1:] for p in parts}) > 1:
                    raise ValueError(f"state: {', '.join(names)} must share their input width "
                                     f"(d_model), got {[tuple(p.shape) for p in parts]} "
                                     f"(nothing was loaded)")
                ours[a + "in_proj.weight"] = torch.cat(parts)  # (h d_k + 2 h_kv d_k, d_model)
            if a + "o_proj.weight" in state:
                ours[a + "out_proj.weight"] = state.pop(a + "o_proj.weight")
        ours.update(state)
        if self.settings.tie_word_embeddings:
            ours.pop("lm_head.weight", None)  # the embedding's (tied)
        want = {k: v.shape for k, v in self.state_dict().items()}
        if self.settings.tie_word_embeddings:
            want.pop("lm_head.weight")
        missing = sorted(set(want) - set(ours))
        extra = sorted(set(ours) - set(want))
        wrong = sorted(f"{k}: {tuple(ours[k].shape)} for {tuple(want[k])}"
                       for k in set(want) & set(ours) if ours[k].shape != want[k])
        if missing or extra or wrong:
            raise ValueError(f"state: not this config's Llama weights (nothing was loaded): "
                             f"missing {missing[:6]}, unexpected {extra[:6]}, shapes {wrong[:6]}")
        with torch.no_grad():
            for k, p in self.state_dict().items():
                if k in ours:
                    p.copy_(ours[k])

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, refused for a model whose projections are packed
        (:mod:`mha.llm.weights`): their weights are constants outside the state dict, so a
        load would change the norms and the embedding only and keep the projections."""
        self._check_unpacked("load_state_dict")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _check_unpacked(self, method: str) -> None:
        """ValueError naming the first projection packed by :mod:`mha.llm.weights` (which
        replaces nn.Linear modules by modules that hold their weights packed)."""
        for name, module in self.named_modules():
            if name.endswith(("_proj", "lm_head", ".mlp")) and type(module).__name__.startswith(
                    "Packed"):
                raise ValueError(f"{method}: the model's projections are packed ({name} is a "
                                 f"{type(module).__name__}, whose weight is not in the state "
                                 f"dict); load the weights into the unpacked model, then pack "
                                 f"it (mha.llm.weights.pack_weights)")

    # ------------------------------------------------------------------ running
    def new_caches(self, batch_size: int, max_len: int, kv_dtype: str | None = None
                   ) -> list[KVCache]:
        """One empty :class:`mha.KVCache` per layer (``(batch_size, h_kv, max_len, d_k)``) in
        the model's dtype (its embedding's: the attention's projections may be packed)."""
        dtype = self.embed_tokens.weight.dtype
        return [layer.self_attn.new_cache(batch_size, max_len, kv_dtype, dtype=dtype)
                for layer in self.layers]

    def forward(self, ids: torch.Tensor, caches: list[KVCache] | None = None, *,
                attention_mask: torch.Tensor | None = None, last: bool = False) -> torch.Tensor:
        """``ids (B, T)`` -> logits ``(B, T, V)`` (``last=True``: only the last position's,
        ``(B, 1, V)``, sparing the LM head's ``T - 1`` other rows, as transformers'
        ``logits_to_keep=1``). Without ``caches``: one causal pass over positions
        ``0 .. T-1``. With ``caches`` (:meth:`new_caches`): the tokens are appended after what
        each layer's cache holds (in place) and take their RoPE positions from it
        (:meth:`mha.KVCache.positions`: left padding declared with ``mark_left_padding`` is
        not counted).

        ``attention_mask (B, T)`` (without ``caches``; 1 = a real token, transformers'
        spelling, as :meth:`generate`'s): a left-padded batch in one pass. Each row's positions
        count from its first real token and no query attends a padding key, so the logits at
        the real positions are those of the row alone; a padding query sees no key (its
        attention output is zeros) and its logits mean nothing. With ``caches`` the padding
        is declared to them instead (:meth:`mha.KVCache.mark_left_padding`, as
        :meth:`generate` does).

        Refused, nothing appended to any cache: ids outside the vocabulary ``[0, V)`` or on
        another device than the model, caches that do not hold the same tokens in every
        layer; a layer that refuses mid-call (a full cache) has the earlier layers' appends
        undone."""
        V = self.embed_tokens.num_embeddings
        _check_ids(ids, V, self.embed_tokens.weight.device)
        B, T = ids.shape
        if caches is not None:
            if not isinstance(caches, (list, tuple)) or len(caches) != len(self.layers):
                raise ValueError(f"caches must be a list of one KVCache per layer "
                                 f"({len(self.layers)}), got {_described(caches)}")
            _check_same_tokens(caches)
            if attention_mask is not None:
                raise ValueError("attention_mask must be None with caches: declare the left "
                                 "padding to the caches (KVCache.mark_left_padding), as "
                                 "generate does")
        last = check_bool("last", last)
        mask = positions = None
        if attention_mask is not None:
            pads = _left_padding(attention_mask, B, T, ids.device)  # (B,)
            at = torch.arange(T, device=ids.device)  # (T,)
            mask = (at[None] >= pads[:, None])[:, None, None]  # (B, T) -> (B, 1, 1, T)
            positions = (at[None] - pads[:, None]).clamp(min=0)  # (B, T)
        x = self.embed_tokens(ids)  # (B, T) -> (B, T, d_model)
        # every layer's cache holds the same tokens (checked above): the first one's positions
        # (B, T) or (1, T), read before the appends, are every layer's
        at = positions if caches is None else caches[0].positions(T).to(ids.device)
        angles = self.rope_angles(at, B, T, x)  # (B|1, T, r) x 2, or None
        if angles is not None:
            positions = None  # every layer rotates by the angles instead
        before = None if caches is None else _cache_states(caches)
        try:
            for i, layer in enumerate(self.layers):
                cache = None if caches is None else caches[i]
                x = layer(x, cache, mask, positions, angles=angles)  # (B, T, d_model)
        except BaseException:
            if before is not None:  # a later layer refused: the earlier appends are undone
                for c, state in zip(caches, before, strict=True):
                    _restore(c, state)
            raise
        if last:
            x = x[:, -1:]  # (B, T, d_model) -> (B, 1, d_model)
        return self.lm_head(self.norm(x))  # (B, T | 1, V)

    def rope_angles(self, positions: torch.Tensor | None, B: int, T: int, x: torch.Tensor):
        """The RoPE ``(C, S)`` ``(B|1, T, r)`` (:meth:`mha.rope.Rotary.angles`) of one forward's
        tokens at ``positions`` (``(T,)``, ``(B, T)``, ``(1, T)``, or None = ``0 .. T-1``),
        computed once and handed to every layer, whose attentions share one ``Rotary`` (the
        model builds them so); None when a layer holds another rope (one swapped in by the
        user: each layer then turns by its own) or none. ``x``: the embedded tokens (their
        device and dtype). B, T and x are checked by name (a T < 0 would slice the table to
        the wrong length)."""
        B = check_int("B", B, low=0, what="a batch size (an int >= 0)")
        T = check_int("T", T, low=0, what="a token count (an int >= 0)")
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"x must be the embedded tokens, a floating tensor (its device and "
                            f"dtype are the angles'), got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        rope = self.layers[0].self_attn.rope if len(self.layers) else None
        if rope is None or any(layer.self_attn.rope is not rope for layer in self.layers):
            return None
        return rope.angles(positions, B, T, x.device, x.dtype)

    @torch.no_grad()
    def forward_paged(self, ids: torch.Tensor, positions: torch.Tensor, cache, seq_ids,
                      cu_seqlens, *, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One packed step of continuous batching over ``cache`` (a :class:`mha.PagedKVCache`
        of one layer per model layer, already :meth:`~mha.PagedKVCache.extend`-ed by the
        step's tokens, as :class:`mha.llm.serving.Scheduler` does): ``ids (1, N)`` the new
        tokens of S sequences end to end, sequence ``seq_ids[i]`` owning tokens
        ``cu_seqlens[i]:cu_seqlens[i+1]``; ``positions (N,)`` each token's position in its
        sequence (RoPE). Each layer writes the step's K/V into its pages and attends through
        them (:meth:`LlamaLayer.forward_paged`). Returns the logits ``(1, N, V)``, or with
        ``rows (R,)`` (token indices, e.g. the last token of each sequence) only those rows'
        ``(1, R, V)``, sparing the LM head the others.

        Refused before anything is written, naming the argument: ids outside ``[0, V)`` or not
        ``(1, N)``, positions not ``(N,)`` or not each token's place in its sequence as the
        extended cache holds it (:meth:`mha.PagedKVCache.positions`: another position would
        turn the token by another RoPE angle), ``seq_ids`` / ``cu_seqlens`` the cache refuses
        or offsets not covering the N tokens, a cache of another layer count, K/V heads, head
        dim or dtype than the model's, rows not ``(R,)`` token indices in ``[0, N)``."""
        V = self.embed_tokens.num_embeddings
        w = self.embed_tokens.weight
        _check_ids(ids, V, w.device)
        if ids.shape[0] != 1:
            raise ValueError(f"ids must be (1, N) (the step's tokens packed in one row), got "
                             f"shape {tuple(ids.shape)}")
        if not isinstance(positions, torch.Tensor) or positions.shape != ids.shape[1:]:
            raise ValueError(f"positions must be a tensor (N,) = ({ids.shape[1]},) of each "
                             f"token's position in its sequence, got "
                             f"{tuple(getattr(positions, 'shape', ())) or type(positions).__name__}")
        _check_paged_cache(cache, self.settings, w.dtype)
        if rows is not None:
            rows = _check_rows(rows, ids.shape[1], w.device)
        positions = check_positions(positions, 1, ids.shape[1], w.device)  # (N,) int64
        check_step(cache, ids.shape[1], positions, seq_ids, cu_seqlens)
        x = self.embed_tokens(ids)  # (1, N) -> (1, N, d_model)
        angles = self.rope_angles(positions, 1, ids.shape[1], x)  # (1, N, r) x 2, or None
        if angles is not None:
            positions = None  # every layer rotates by the angles instead
        for i, layer in enumerate(self.layers):
            x = layer.forward_paged(x, cache, i, seq_ids, cu_seqlens, positions, angles=angles)
            # (1, N, d_model)
        if rows is not None:
            x = x[:, rows]  # (1, N, d_model) -> (1, R, d_model)
        return self.lm_head(self.norm(x))  # (1, N | R, V)

    def _allocate_caches(self, B: int, P: int, N: int, kv_dtype) -> list[KVCache]:
        """:meth:`new_caches` of ``P + N`` positions; an allocation that fails (a huge
        ``max_new_tokens``) is refused naming it."""
        try:
            return self.new_caches(B, P + N, kv_dtype)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
                raise
            s = self.settings
            size = 2 * s.num_layers * B * s.num_kv_heads * (P + N) * s.head_dim \
                * self.embed_tokens.weight.element_size()
            raise ValueError(f"max_new_tokens={N}: the caches of P + N = {P + N} positions "
                             f"({s.num_layers} layers, B={B}) would take about "
                             f"{size / 2**30:.3g} GiB, which could not be allocated") from None

    def _eos_ids(self, eos_token_id) -> list[int] | None:
        """``eos_token_id`` (an id or a list of ids) as a list of ids of the vocabulary
        ``[0, V)``; an id outside it could never stop a row (ValueError naming it)."""
        return check_eos_ids(eos_token_id, self.embed_tokens.num_embeddings,
                             stops="generation")

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, *,
                 attention_mask: torch.Tensor | None = None,
                 eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None,
                 kv_dtype: str | None = None,
                 on_token: Callable[[torch.Tensor], None] | None = None,
                 sampling=None) -> torch.Tensor:
        """Greedy decoding (or sampled: ``sampling``): ``ids (B, P)`` -> ``(B, P + N)``,
        ``N <= max_new_tokens``.

        ``attention_mask (B, P)`` (1 = a real token, transformers' spelling): left-padded
        prompts of different lengths; each row's padding is declared to the caches, so its
        positions count from its first real token. ``eos_token_id``: a row that produced it
        continues with ``pad_token_id`` (default ``eos_token_id``, the first of a list), and
        decoding stops when every row has; None runs ``max_new_tokens``; an id (or each of a
        list) must lie in the vocabulary ``[0, V)``, else ValueError naming it (so must
        ``pad_token_id``, fed back as a finished row's next token). ``on_token`` (a callable)
        receives each step's new tokens ``(B,)`` (streaming, timing). Refused before anything
        runs, naming the argument: ids outside ``[0, V)``, an ``attention_mask`` of other
        values than 0 / 1 or not left padding, a ``max_new_tokens`` whose caches cannot be
        allocated. ``sampling`` (:mod:`mha.sampling`): None (greedy), one
        ``SamplingParams`` for every row (row i draws from ``seed + i``) or a list of B (each
        row from its own seed); a ``temperature=0`` row is the greedy argmax."""
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=1,
                                   what="a positive int")
        V = self.embed_tokens.num_embeddings
        _check_ids(ids, V, self.embed_tokens.weight.device)
        if ids.shape[1] < 1:
            raise ValueError(f"ids must be an integer tensor (B, P) with P >= 1, got shape "
                             f"{tuple(ids.shape)}")
        B, P = ids.shape
        eos = self._eos_ids(eos_token_id)  # list of ids, or None
        if pad_token_id is not None:
            pad_token_id = check_int("pad_token_id", pad_token_id, low=0,
                                     what="a token id (an int >= 0)")
            if pad_token_id >= V:
                raise ValueError(f"pad_token_id must be a token id of the model's vocabulary "
                                 f"[0, {V}), got {pad_token_id} (it is fed back as the next "
                                 f"token of a finished row)")
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be callable (it receives each step's new tokens "
                            f"(B,)) or None, got {type(on_token).__name__}")
        sampler = Sampler.for_batch(sampling, B)  # None: every row greedy
        pads = None if attention_mask is None else _left_padding(attention_mask, B, P,
                                                                 ids.device)  # (B,)
        caches = self._allocate_caches(B, P, max_new_tokens, kv_dtype)
        if pads is not None:
            for cache in caches:
                cache.mark_left_padding(pads.to(cache.device))
        pad = (eos[0] if eos else None) if pad_token_id is None else pad_token_id
        stop = None if eos is None else torch.tensor(eos, device=ids.device)  # (E,)
        done = torch.zeros(B, dtype=torch.bool, device=ids.device)  # (B,)
        logits = self(ids, caches, last=True)[:, -1]  # (B, 1, V) -> (B, V)
        new = []
        for step in range(max_new_tokens):
            token = logits.argmax(-1) if sampler is None else sampler(logits)  # (B,)
            if stop is not None:
                token = torch.where(done, torch.full_like(token, pad), token)  # (B,)
                done |= torch.isin(token, stop)  # (B,)
            new.append(token)
            if on_token is not None:
                on_token(token)
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            logits = self(token[:, None], caches, last=True)[:, -1]  # (B, 1) -> (B, V)
        return torch.cat([ids, torch.stack(new, dim=1)], dim=1)  # (B, P) + (B, N) -> (B, P + N)


def _check_state(state) -> None:
    """A mapping of string keys to floating tensors that hold data (a meta tensor, an array or
    an integer / bool / complex tensor would fail or change meaning halfway through the copy)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to tensors (a state dict), got "
                        f"{type(state).__name__}")
    for k, v in state.items():
        if not isinstance(k, str):
            raise TypeError(f"state: keys must be parameter names (str), got {k!r}")
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"state[{k!r}] must be a torch.Tensor, got {type(v).__name__} "
                            f"(nothing was loaded)")
        if not v.dtype.is_floating_point:
            raise TypeError(f"state[{k!r}] must be a floating tensor (weights), got {v.dtype} "
                            f"(nothing was loaded)")
        if v.is_meta:
            raise ValueError(f"state[{k!r}] is a meta tensor: it holds no values to load "
                             f"(nothing was loaded)")


def _check_ids(ids, V: int, device: torch.device) -> None:
    """``ids``: an int64 / int32 tensor ``(B, T)`` of token ids in ``[0, V)`` on ``device``
    (an id outside the vocabulary would index past the embedding)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (
            torch.int64, torch.int32):
        raise ValueError(f"ids must be an integer tensor (B, T), got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} of shape "
                         f"{tuple(getattr(ids, 'shape', ()))}")
    if ids.device != device:
        raise ValueError(f"ids must be on {device} like the model, got {ids.device}")
    check_readable("ids", ids)
    if ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(ids))  # one pass over the values
        if lo < 0 or hi >= V:
            raise ValueError(f"ids must be token ids of the vocabulary [0, {V}), got values "
                             f"from {lo} to {hi}")


def _check_paged_cache(cache, s: LlamaSettings, dtype: torch.dtype) -> None:
    """``cache``: a :class:`mha.PagedKVCache` shaped for the model (one layer per layer, its
    K/V heads and head dim) in the model's dtype (what its queries are)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a mha.PagedKVCache, got {type(cache).__name__}")
    L, _, h_kv, _, d_k = cache.k.shape
    d_v = cache.v.shape[-1]
    want = (s.num_layers, s.num_kv_heads, s.head_dim, s.head_dim, dtype)
    got = (L, h_kv, d_k, d_v, cache.dtype)
    if got != want:
        raise ValueError(f"cache must hold (num_layers, h_kv, d_k, d_v, dtype) = {want} like "
                         f"the model, got {got}")


def _check_rows(rows, N: int, device: torch.device) -> torch.Tensor:
    """``rows``: an integer tensor ``(R,)`` of the step's token indices, in ``[0, N)``."""
    what = f"(R,) of the step's token indices in [0, {N})"
    rows = check_int_tensor("rows", rows, what, device)
    if rows.dim() != 1:
        raise ValueError(f"rows must be a tensor {what}, got shape {tuple(rows.shape)}")
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < N):
        raise ValueError(f"rows must be a tensor {what}, got values from {int(rows.min())} to "
                         f"{int(rows.max())}")
    return rows


def _described(x) -> str:
    return f"{len(x)} item(s)" if isinstance(x, (list, tuple)) else type(x).__name__


def _check_same_tokens(caches) -> None:
    """Every layer's cache holds the same tokens (equal ``lengths`` and ``starts``, where the
    caches have them; equal lengths of ConcatKVCaches): the tokens' positions come from each
    layer's cache."""
    first = caches[0]
    want = {name: t.tolist() for name in ("lengths", "starts")
            if isinstance(t := getattr(first, name, None), torch.Tensor)}  # read once a step
    for i, c in enumerate(caches[1:], start=1):
        if isinstance(first, ConcatKVCache) and isinstance(c, ConcatKVCache) and \
                c.max_length != first.max_length:
            raise ValueError(f"caches[{i}] must hold the same tokens as caches[0] (one per "
                             f"layer, all fed the same ids): {c.max_length} tokens against "
                             f"{first.max_length}")
        for name, a in want.items():
            b = getattr(c, name, None)
            if isinstance(b, torch.Tensor) and (b := b.tolist()) != a:
                raise ValueError(f"caches[{i}] must hold the same tokens as caches[0] (one "
                                 f"per layer, all fed the same ids): {name} {b} against {a}")


def _cache_state(cache):
    """What a layer's call changes in ``cache``: its lengths and starts (the storage past them
    is never read); a :class:`ConcatKVCache`'s K/V tensors (an append replaces them)."""
    if isinstance(cache, ConcatKVCache):
        return {"k": cache.k, "v": cache.v}
    return {n: t.clone() for n in ("lengths", "starts")
            if isinstance(t := getattr(cache, n, None), torch.Tensor)}


def _cache_states(caches) -> list:
    """:func:`_cache_state` of each layer's cache. Every cache that has lengths and starts
    holds those of ``caches[0]`` (:func:`_check_same_tokens` compared them), so when
    ``caches[0]`` has them one copy serves every such layer."""
    if isinstance(caches[0], ConcatKVCache):
        return [_cache_state(c) for c in caches]
    shared = _cache_state(caches[0])
    return [_cache_state(c) if isinstance(c, ConcatKVCache) else shared for c in caches]


def _restore(cache, state: dict) -> None:
    if isinstance(cache, ConcatKVCache):
        cache.k, cache.v = state["k"], state["v"]
        return
    for n, t in state.items():
        getattr(cache, n).copy_(t)


def _left_padding(mask, B: int, P: int, device: torch.device) -> torch.Tensor:
    """``attention_mask (B, P)`` of 0 / 1 (bool, integer or floating) with each row's ones a
    suffix (left padding) -> the pads per row ``(B,)`` int64."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor (B, P) = ({B}, {P}) of 0 / 1, "
                        f"got {type(mask).__name__}")
    if mask.dtype.is_complex:
        raise TypeError(f"attention_mask must be a real tensor of 0 / 1 (bool, integer or "
                        f"floating), got {mask.dtype}")
    if tuple(mask.shape) != (B, P):
        raise ValueError(f"attention_mask must be a tensor (B, P) = ({B}, {P}), got "
                         f"{tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"attention_mask must be on {device} like ids, got {mask.device}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (a real token) only, got "
                         "other values")
    real = mask.to(torch.bool)  # (B, P)
    pads = P - real.sum(dim=1)  # (B,)
    suffix = torch.arange(P, device=mask.device)[None] >= pads[:, None]  # (B, P)
    if not bool((real == suffix).all()) or (P > 0 and bool((pads >= P).any())):
        raise ValueError("attention_mask must mark left padding: in each row 0s, then 1s "
                         "(at least one real token); right padding or holes are not served")
    return pads


__all__ = ["ROPE_TYPES", "Llama", "LlamaLayer", "LlamaSettings", "RMSNorm", "SwiGLU",
           "llama_settings"]
