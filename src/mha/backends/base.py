"""What a backend is: its capabilities as data, and the one call it serves.

Shape legend: B batch, h query heads, h_kv key/value heads (h_kv divides h), Tq query length,
Tk key length, d_k query/key head dim, d_v value head dim.

Dispatch derives every rejection reason from :class:`Capabilities` (plus an optional
backend-specific check), so the same table drives ``mha.explain``, forced backends and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mha.masks import MaskSpec
from mha.scores import NO_SCORES, ScoreSpec

BASIC_MASK_KINDS = frozenset({"causal", "key_lengths", "mask"})
ALL_MASK_KINDS = BASIC_MASK_KINDS | {"window"}
MOD_MASK_KINDS = ALL_MASK_KINDS | {"mask_mod"}  # mask functions of indices (mha.mods)


class AttentionCall:
    """One validated attention call. q ``(B, h, Tq, d_k)``, k ``(B, h_kv, Tk, d_k)``,
    v ``(B, h_kv, Tk, d_v)``.

    Read-only by convention (made by :func:`mha.functional.make_call` after validation). The
    sizes, dtype and device are read off the tensors once, here: dispatch asks for them many
    times per call, and a slotted attribute is cheaper than ``tensor.shape[i]``.
    """

    __slots__ = ("q", "k", "v", "masks", "scale", "dropout_p", "return_weights", "scores", "score_mod",
                 "return_lse", "B", "h", "h_kv", "Tq", "Tk", "d_k", "d_v", "dtype", "device")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: MaskSpec,
                 scale: float, dropout_p: float = 0.0, return_weights: bool = False,
                 scores: ScoreSpec | None = None, score_mod=None,
                 return_lse: bool = False, sizes: tuple[int, ...] | None = None) -> None:
        self.q, self.k, self.v, self.masks = q, k, v, masks
        self.return_lse = return_lse  # the backend returns the log-sum-exp instead of weights
        self.scores = NO_SCORES if scores is None else scores  # softcap, sinks, bias, ALiBi
        self.score_mod = score_mod  # (score, b, h, q_idx, kv_idx) -> score (mha.mods)
        self.scale, self.dropout_p, self.return_weights = scale, dropout_p, return_weights
        if sizes is None:  # (B, h, Tq, d_k, h_kv, Tk, d_v), when the caller has read them
            sizes = (*q.shape, k.shape[1], k.shape[2], v.shape[3])
        self.B, self.h, self.Tq, self.d_k, self.h_kv, self.Tk, self.d_v = sizes
        self.dtype, self.device = q.dtype, q.device

    @property
    def needs_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        if self.q.requires_grad or self.k.requires_grad or self.v.requires_grad:
            return True
        return bool(self.scores.kinds) and any(t.requires_grad for t in self.scores.grad_tensors())

    def signature(self) -> tuple:
        """Every property of the call a backend's capability table reads (:meth:`Backend.rejects`
        caches its verdict by it): dtype, device type, mask and variant kinds, score_mod or
        not, head dims, grouped heads or not, dropout or not, what is returned, grad needed,
        ALiBi slopes that require grad. Not the batch, the lengths nor the tensors' values:
        the table never reads them (the backends' own checks, which may, run every call)."""
        sc = self.scores
        alibi_grad = (sc.alibi_slopes is not None and sc.alibi_slopes.requires_grad
                      and torch.is_grad_enabled())
        return (self.dtype, self.device.type, self.masks.kinds, sc.kinds,
                self.score_mod is not None, self.d_k, self.d_v, self.h_kv == self.h,
                self.dropout_p > 0, self.return_weights, self.return_lse, self.needs_grad,
                alibi_grad)

    def describe(self) -> str:
        """One line naming the inputs, for error messages."""
        kinds = ",".join(sorted(self.masks.kinds)) or "none"
        variants = ",".join(sorted(self.scores.kinds)) or "none"
        return (f"q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, v {tuple(self.v.shape)}, "
                f"{self.dtype}, {self.device.type}, masks={kinds}, variants={variants}, "
                f"dropout_p={self.dropout_p}, "
                f"return_weights={self.return_weights}, return_lse={self.return_lse}, "
                f"grad={self.needs_grad}")


_TABLE_CACHE_SIZE = 1024  # signatures kept per backend (cleared when full)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can serve, as data. ``None`` on a limit means "no limit"."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    mask_kinds: frozenset[str] = BASIC_MASK_KINDS  # ALL_MASK_KINDS adds sliding windows
    min_head_dim: int | None = None
    max_head_dim: int | None = None
    gqa: bool = True  # h_kv < h without the caller repeating K/V
    different_v_dim: bool = True  # d_v != d_k
    dropout: bool = False
    weights: bool = False  # can return the (B, h, Tq, Tk) attention weights
    lse: bool = False  # can return the (B, h, Tq) float32 log-sum-exp of each row's scores
    grad: bool = True
    #: The score variants served, a subset of :data:`mha.scores.VARIANT_KINDS`.
    variants: frozenset[str] = frozenset()
    #: Why a variant is not served, in words, when there is more to say than "not supported".
    variant_gaps: tuple[tuple[str, str], ...] = ()
    score_mod: bool = False  # applies a score_mod (mha.mods)
    #: Differentiates ALiBi slopes that require grad (its scores go through autograd); a
    #: kernel that reads the slopes as constants refuses them rather than drop their gradient.
    alibi_grad: bool = False


@dataclass
class Backend:
    """A backend: a name, its capabilities, and a forward function.

    ``forward(call) -> (out (B, h, Tq, d_v), weights (B, h, Tq, Tk) or None)``; when
    ``call.return_lse`` the second element is the log-sum-exp ``(B, h, Tq)`` float32 instead
    (``log`` of each row's softmax denominator, the sink included; ``-inf`` for a row that sees
    no key), which is what merging partial results over disjoint keys needs.
    ``unavailable`` returns a reason when the backend cannot run at all here (e.g. its native
    build failed); ``extra_reasons`` adds checks that the capability table cannot express.
    ``defers`` returns a reason to leave a call it *can* serve to the next capable backend when
    dispatch chooses (a measured speed difference on this CPU); a forced backend still runs.
    ``note`` says, for a call it can serve, something about how it would run that a reader of
    ``mha.explain`` should know (e.g. on software AMX tiles, slow by design), else None.
    """

    name: str
    caps: Capabilities
    forward: Callable[[AttentionCall], tuple[torch.Tensor, torch.Tensor | None]]
    summary: str = ""
    unavailable: Callable[[], str | None] = field(default=lambda: None)
    extra_reasons: Callable[[AttentionCall], list[str]] = field(default=lambda call: [])
    defers: Callable[[AttentionCall], str | None] = field(default=lambda call: None)
    note: Callable[[AttentionCall], str | None] = field(default=lambda call: None)
    _table: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Whether a native build loaded does not change within a process: under torch.compile
        # the answer is taken once at trace time instead of tracing into the build cache.
        probe = self.unavailable

        def unavailable() -> str | None:  # a plain function: dynamo sees through lru caches
            return probe()

        self.unavailable = torch.compiler.assume_constant_result(unavailable)

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name == "caps" and "_table" in self.__dict__:
            self._table.clear()  # verdicts of the old table

    def rejects(self, call: AttentionCall, signature: tuple | None) -> bool:
        """Whether :meth:`not_supported_reasons` would give any reason, without building them:
        the capability table's verdict is cached by ``signature`` (:meth:`AttentionCall.signature`,
        every property the table reads; dropped when ``caps`` is replaced); ``unavailable`` and
        ``extra_reasons`` are asked every call (they may read sizes or change, e.g. a build
        forgotten by a test). ``signature`` None (a trace): the reasons themselves, uncached."""
        if signature is None:
            return bool(self.not_supported_reasons(call))
        if self.unavailable():
            return True
        table = self._table.get(signature)
        if table is None:
            if len(self._table) >= _TABLE_CACHE_SIZE:
                self._table.clear()
            table = self._table[signature] = bool(self._table_reasons(call))
        return table or bool(self.extra_reasons(call))

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        """Every reason, in words, why this backend cannot serve ``call`` (empty: it can)."""
        why = self.unavailable()
        if why:
            return [why]
        reasons = self._table_reasons(call)
        reasons.extend(self.extra_reasons(call))
        return reasons

    def _table_reasons(self, call: AttentionCall) -> list[str]:
        """The capability table's reasons: they read only what :meth:`AttentionCall.signature`
        holds."""
        c = self.caps
        reasons: list[str] = []
        if call.device.type not in c.devices:
            reasons.append(f"device {call.device.type} not supported (supports {sorted(c.devices)})")
        if call.dtype not in c.dtypes:
            names = sorted(str(d).replace("torch.", "") for d in c.dtypes)
            reasons.append(f"dtype {str(call.dtype).replace('torch.', '')} not supported "
                           f"(supports {names})")
        for kind in sorted(call.masks.kinds - c.mask_kinds):
            reasons.append(f"mask kind '{kind}' not supported")
        gaps = dict(c.variant_gaps)
        for kind in sorted(call.scores.kinds - c.variants):
            reasons.append(f"{kind} {gaps.get(kind, 'not supported')}")
        if call.score_mod is not None and not c.score_mod:
            reasons.append("score_mod not supported")
        if call.score_mod is not None and call.scores.kinds:
            reasons.append("score_mod together with " + ", ".join(sorted(call.scores.kinds)) +
                           " is not served yet (fold them into the score_mod)")
        hd = max(call.d_k, call.d_v)
        if c.max_head_dim is not None and hd > c.max_head_dim:
            reasons.append(f"head dim {hd} > {c.max_head_dim}")
        if c.min_head_dim is not None and min(call.d_k, call.d_v) < c.min_head_dim:
            reasons.append(f"head dim {min(call.d_k, call.d_v)} < {c.min_head_dim}")
        if not c.gqa and call.h_kv != call.h:
            reasons.append(f"grouped K/V heads (h={call.h}, h_kv={call.h_kv}) not supported")
        if not c.different_v_dim and call.d_v != call.d_k:
            reasons.append(f"d_v={call.d_v} != d_k={call.d_k} not supported")
        if not c.dropout and call.dropout_p > 0:
            reasons.append("dropout not supported")
        if not c.weights and call.return_weights:
            reasons.append("cannot return attention weights")
        if not c.lse and call.return_lse:
            reasons.append("cannot return the log-sum-exp")
        if not c.grad and call.needs_grad:
            reasons.append("no backward pass (inputs require grad)")
        elif (not c.alibi_grad and "alibi" in c.variants and torch.is_grad_enabled()
              and call.scores.alibi_slopes is not None and call.scores.alibi_slopes.requires_grad):
            reasons.append("no gradient for alibi_slopes (they require grad; the kernel reads "
                           "them as constants: pass alibi_slopes.detach() to keep them fixed)")
        return reasons
