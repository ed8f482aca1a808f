"""Choosing the next token from logits: greedy (argmax) or sampled with temperature, top-k,
top-p and min-p, each row from its own seeded ``torch.Generator``.

Shape legend: R rows (requests, or a batch's rows), V vocabulary, K tokens kept in a row.

The filters run in transformers' order and with its semantics (``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``, ``min_tokens_to_keep=1``)::

    x = logits / temperature
    top-k   keep x >= the k-th largest x (ties at the k-th are kept)
    top-p   sort ascending, p = softmax(x), drop the tokens whose cumulative p <= 1 - top_p
            (the largest is always kept)
    min-p   p = softmax(x), drop p < min_p * max(p)

then one token is drawn from ``softmax(x)`` over the kept tokens, by inverse CDF with **one**
uniform of the row's generator per token (kept tokens in id order). A row's token therefore
depends only on its logits, its :class:`SamplingParams` and its generator: never on the other
rows of the batch, nor on how many rows there are.

``temperature=0`` is greedy: ``logits.argmax(-1)``, the very call of the greedy paths (no
generator is read). A row whose logits hold a NaN or a +inf, or no finite value (or overflow
to +inf when divided by the temperature), cannot be a distribution: its token is ``argmax``
too, whatever its parameters, and no uniform is read (torch's argmax takes NaN as the largest:
the first NaN's id), so NaN propagates as on the greedy path and nothing raises halfway
through a batch. -inf logits are tokens that can never be drawn.

Cost: top-k and top-p look at the top of the row only (``torch.topk``, growing for top-p until
the kept mass is reached) rather than sorting all V; ``benchmarks/probes/sampling_step.py``
measures a step against the greedy argmax (docs/llm.md).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mha.checks import check_int, check_readable, check_scalar

SEED_LIMIT = 2**64  #: seeds are ints in [0, SEED_LIMIT) (torch.Generator.manual_seed's range)


@dataclass(frozen=True)
class SamplingParams:
    """How one row picks its tokens (checked when built; errors name the field).

    Args:
        temperature: >= 0; 0 is greedy (argmax, the other fields then do nothing).
        top_k: keep the k most likely tokens; None or 0: off.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p,
            in (0, 1]; 1: off.
        min_p: drop tokens less likely than ``min_p`` times the most likely, in [0, 1];
            None or 0: off.
        seed: the row's generator's seed, an int in [0, 2**64); None: a random one
            (:meth:`with_seed` draws it).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # (frozen: the checked values replace the given ones)
        set_(self, "temperature", check_scalar("temperature", self.temperature, low=0.0))
        if self.top_k is not None:
            k = check_int("top_k", self.top_k, low=0, what="an int >= 0 (0: off) or None")
            set_(self, "top_k", k or None)
        set_(self, "top_p", check_scalar("top_p", self.top_p, low=0.0, high=1.0, low_open=True))
        if self.min_p is not None:
            set_(self, "min_p", check_scalar("min_p", self.min_p, low=0.0, high=1.0) or None)
        if self.seed is not None:
            seed = check_int("seed", self.seed, low=0, what="an int in [0, 2**64) or None")
            if seed >= SEED_LIMIT:
                raise ValueError(f"seed must be an int in [0, 2**64) or None, got {seed}")
            set_(self, "seed", seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> SamplingParams:
        """These parameters with a seed: their own, or a random one (sampled rows only)."""
        if self.seed is not None or self.greedy:
            return self
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p,
                              secrets.randbits(64))

    def describe(self) -> str:
        """A short line for a status: "greedy", or the sampling fields that act and the seed."""
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        parts += [] if self.top_k is None else [f"top-k {self.top_k}"]
        parts += [] if self.top_p == 1.0 else [f"top-p {self.top_p:g}"]
        parts += [] if self.min_p is None else [f"min-p {self.min_p:g}"]
        return " ".join(parts + [f"seed {self.seed}"])

    def generator(self, offset: int = 0) -> torch.Generator | None:
        """A CPU generator seeded with ``(seed + offset) mod 2**64`` (None when greedy).
        ``offset``: row i of a batch that shares one :class:`SamplingParams` draws from
        ``seed + i``, so its row 0 draws as a batch of one."""
        if self.greedy:
            return None
        seed = self.with_seed().seed
        return torch.Generator(device="cpu").manual_seed((seed + offset) % SEED_LIMIT)


GREEDY = SamplingParams()


def check_sampling(sampling, name: str = "sampling") -> SamplingParams:
    """``sampling``: a :class:`SamplingParams` or None (greedy); TypeError naming it
    (``name``)."""
    if sampling is None:
        return GREEDY
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"{name} must be a mha.sampling.SamplingParams or None "
                        f"(greedy), got {type(sampling).__name__}")
    return sampling


def filter_without_temperature(params: SamplingParams, *, temperature_given: bool,
                               names: Mapping[str, str]) -> tuple[str, str] | None:
    """A top-k / top-p / min-p given without a temperature is refused: the default temperature
    0 is greedy, so the filter would do nothing. ``names`` spells ``temperature``, ``top_k``,
    ``top_p`` and ``min_p`` as the caller's user writes them (CLI options, JSON fields).
    Returns None, or the first such field of ``params`` and the message naming it."""
    if temperature_given:
        return None
    temperature = names["temperature"]
    for field, on in (("top_k", params.top_k is not None), ("top_p", params.top_p < 1.0),
                      ("min_p", params.min_p is not None)):
        if on:
            return field, (f"{names[field]} samples only with {temperature} > 0, and the "
                           f"default {temperature} is 0 (greedy, the argmax): add "
                           f"{temperature}, e.g. 1")
    return None


def reference_filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits ``(V,)`` after temperature, top-k, top-p and min-p, written as
    transformers' warpers compute them (a full sort for top-p): the same row in float32 with
    the dropped tokens at -inf. The readable oracle of :func:`filtered`."""
    x = logits.float() / params.temperature  # (V,)
    V = x.shape[-1]
    if params.top_k is not None and params.top_k < V:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        xs, order = torch.sort(x)  # ascending (V,)
        drop = xs.softmax(-1).cumsum(-1) <= 1 - params.top_p  # (V,)
        drop[-1] = False  # the most likely token stays
        x = x.masked_fill(drop.scatter(0, order, drop), -math.inf)
    if params.min_p is not None:
        p = x.softmax(-1)  # (V,)
        drop = p < params.min_p * p.max()
        drop[p.argmax()] = False
        x = x.masked_fill(drop, -math.inf)
    return x


def _top_p(ids: torch.Tensor, x: torch.Tensor, top_p: float):
    """The candidates ``ids (K,)``, ``x (K,)`` that top-p keeps: a token stays while the mass
    of the more likely ones is < top_p (transformers' rule, counted from the top). Only the
    top m candidates are sorted, m growing x4 from 64 until their mass reaches top_p (every
    token past them is then dropped)."""
    K = x.numel()
    lse = torch.logsumexp(x, 0)
    m = min(K, 64)
    while True:
        vals, pos = torch.topk(x, m)  # (m,) descending
        p = (vals - lse).exp()  # (m,)
        mass = p.cumsum(0)  # (m,)
        if m == K or float(mass[-1]) >= top_p:
            keep = (mass - p) < top_p  # (m,) the mass before each token
            return ids[pos[keep]], vals[keep]
        m = min(K, 4 * m)


def _scaled(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, bool]:
    """``logits (V,) / temperature`` in float32, and whether it is a distribution: no NaN, no
    +inf (given, or an overflow of the division), a finite value."""
    x = logits.float() / params.temperature  # (V,)
    if math.isfinite(float(x.sum())):  # every value finite (the cheap test: one reduction)
        return x, True
    ok = not (bool(torch.isnan(x).any()) or bool(torch.isposinf(x).any())) \
        and bool(torch.isfinite(x).any())
    return x, ok


def _kept(x: torch.Tensor, params: SamplingParams):
    """The tokens a sampled ``params`` keeps of a row's scaled logits ``x (V,)`` (from
    :func:`_scaled`, a distribution): ``ids (K,)`` ascending and their ``x (K,)``. Top-k and
    top-p look at the top of the row only (topk, not a sort of all V)."""
    V = x.shape[0]
    ids = None  # None: every token so far (x is the whole row)
    if not math.isfinite(float(x.sum())):  # -inf logits: never drawn
        ids = torch.isfinite(x).nonzero()[:, 0]  # (K,)
        x = x[ids]
    K = x.numel()
    if params.top_k is not None and params.top_k < K:
        vals, pos = torch.topk(x, params.top_k)  # (k,) descending
        ties = x >= vals[-1]  # transformers keeps every token tied with the k-th
        if int(ties.sum()) > params.top_k:
            pos = ties.nonzero()[:, 0]
            vals = x[pos]
        ids = pos if ids is None else ids[pos]
        x = vals
    if params.top_p < 1.0:
        ids, x = _top_p(torch.arange(V) if ids is None else ids, x, params.top_p)
    if params.min_p is not None:
        p = x.softmax(0)
        keep = p >= params.min_p * p.max()
        ids = keep.nonzero()[:, 0] if ids is None else ids[keep]
        x = x[keep]
    if ids is None:
        return None, x  # (every token, in id order)
    ids, order = ids.sort()  # id order: the draw does not depend on how the set was found
    return ids, x[order]


def filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits ``(V,)`` after temperature, top-k, top-p and min-p, as the sampler
    computes them: float32, the dropped tokens at -inf (a sampled ``params``; a row with
    NaN or +inf is not filtered: the sampler takes its argmax)."""
    x, ok = _scaled(logits, params)
    if not ok:
        return x
    ids, x = _kept(x, params)
    if ids is None:
        return x
    out = torch.full((logits.shape[-1],), -math.inf)  # (V,)
    out[ids] = x
    return out


def _sample_row(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> int | None:
    """One draw from row ``logits (V,)``; None when the row is no distribution (NaN, +inf,
    nothing finite)."""
    x, ok = _scaled(logits, params)
    if not ok:
        return None
    ids, x = _kept(x, params)  # (K,) or None (all V), (K,)
    cdf = (x - x.max()).exp().cumsum(0)  # (K,) unnormalised
    u = torch.rand((), generator=generator, dtype=torch.float64)
    i = int(torch.searchsorted(cdf, (u * cdf[-1]).float().reshape(1), right=True))
    if i == x.numel():  # u * total rounded up to the total (u within 2**-24 of 1): the last
        # token that adds mass, not the last kept one (its exp may underflow to 0)
        i = int(torch.searchsorted(cdf, cdf[-1:]))
    return i if ids is None else int(ids[i])


def _check_rows(params, generators, R: int) -> None:
    """``params``: R :class:`SamplingParams`; ``generators``: R ``torch.Generator`` or None (a
    generator wherever the row samples). Every row is checked before any generator draws."""
    for name, seq in (("params", params), ("generators", generators)):
        if not isinstance(seq, Sequence):
            raise TypeError(f"{name} must be a list with one entry per row of logits (R={R}), "
                            f"got {type(seq).__name__}")
    if len(params) != R or len(generators) != R:
        raise ValueError(f"params and generators must hold one entry per row of logits "
                         f"(R={R}), got {len(params)} and {len(generators)}")
    for r, (p, g) in enumerate(zip(params, generators, strict=True)):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{r}] must be a mha.sampling.SamplingParams, got "
                            f"{type(p).__name__}")
        if g is not None and not isinstance(g, torch.Generator):
            raise TypeError(f"generators[{r}] must be a torch.Generator or None, got "
                            f"{type(g).__name__}")
        if g is None and not p.greedy:
            raise ValueError(f"generators[{r}] is None but params[{r}] samples "
                             f"(temperature={p.temperature:g})")


def next_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """The next token of each row: ``logits (R, V)`` -> ``(R,)`` int64.

    ``params[r]`` and ``generators[r]``: row r's parameters and generator (None for a greedy
    row; a sampled row reads exactly one uniform from its generator). Greedy rows, NaN rows:
    ``logits.argmax(-1)`` (see the module docstring)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 \
            or not logits.dtype.is_floating_point or logits.shape[1] == 0:
        raise ValueError(f"logits must be a floating tensor (R, V) with V >= 1, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    check_readable("logits", logits)
    logits = logits.detach()  # (no gradient flows through a choice of token)
    R = logits.shape[0]
    _check_rows(params, generators, R)
    tokens = logits.argmax(-1)  # (R,) the greedy tokens
    for r, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        t = _sample_row(logits[r], p, g)
        if t is not None:
            tokens[r] = t
    return tokens


class Sampler:
    """The rows of one batch, each with its parameters and generator: ``sampler(logits)``
    is :func:`next_tokens` on them (None: every row greedy, the plain argmax)."""

    def __init__(self, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> None:
        self.params, self.generators = list(params), list(generators)

    @classmethod
    def one_row(cls, sampling, generator: torch.Generator | None = None) -> Sampler | None:
        """A batch of one row (None: greedy); ``generator`` continues a stream (a chat's
        turns), None: a new one from the seed."""
        sampling = check_sampling(sampling)
        if sampling.greedy:
            return None
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got "
                            f"{type(generator).__name__}")
        return cls([sampling], [generator or sampling.generator()])

    @classmethod
    def for_batch(cls, sampling, B: int) -> Sampler | None:
        """``sampling``: None / one :class:`SamplingParams` for every row (row i draws from
        ``seed + i``) / a list of B of them (each from its own seed) / a :class:`Sampler` of B
        rows (its generators go on). None when every row is greedy."""
        if isinstance(sampling, Sampler):
            if len(sampling.params) != B:
                raise ValueError(f"sampling must have one row per row of ids (B={B}), got a "
                                 f"Sampler of {len(sampling.params)}")
            return sampling
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != B:
                raise ValueError(f"sampling must be one SamplingParams or a list of one per "
                                 f"row (B={B}), got a list of {len(sampling)}")
            params = [check_sampling(s, f"sampling[{i}]") for i, s in enumerate(sampling)]
            gens = [p.generator() for p in params]
        else:
            one = check_sampling(sampling).with_seed()
            params = [one] * B
            gens = [one.generator(i) for i in range(B)]
        if all(p.greedy for p in params):
            return None
        return cls(params, gens)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return next_tokens(logits, self.params, self.generators)  # (R, V) -> (R,)


__all__ = ["GREEDY", "Sampler", "SamplingParams", "check_sampling", "filter_without_temperature",
           "filtered", "next_tokens", "reference_filtered"]
