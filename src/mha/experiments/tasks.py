"""Synthetic tasks for the head-count experiment: generated on the fly, nothing downloaded.

Shape legend: B batch (sequences), T sequence length, V input vocabulary, C output classes.

Every task makes ``(x, y)`` with ``x (B, T)`` input token ids and ``y (B, T, S)`` target class
ids (S targets, "slots", per position; S = 1 except for ``lags``), ``-1`` where a position is
not scored. Models read ``x`` causally (position t sees tokens
0..t) and predict ``y[:, t]``. Each task is a plain object with a name, a one-line claim it
probes, its vocabulary sizes and ``batch(B, generator)``.

- ``lags``    several relations at once: ``y_t = (x_{t-a_1}, ..., x_{t-a_k})``, k slots.
              Each position must read k different earlier positions (seed 003: "one head may
              struggle to capture several relations at once").
- ``recall``  associative recall by content: pairs (key, value) then queries "key?" whose
              answer is that key's value. Matching one of many keys needs a query/key space of
              several dimensions (seed 003: "head_dim 1 is too weak").
- ``markov``  a language-modelling-style baseline: next-token prediction on text sampled from
              a random sparse order-2 Markov source, whose entropy (the best possible loss) is
              known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

IGNORE = -1  # target id of positions that are not scored


@dataclass(frozen=True)
class LagTask:
    """``y_t = (x_{t-a_1}, ..., x_{t-a_k})``: k targets ("slots") per position, one per lag,
    each a class in ``[0, V)``. A position counts as correct when all k slots are."""

    lags: tuple[int, ...] = (1, 2, 3, 5, 8, 13)
    vocab: int = 8
    seq_len: int = 32
    name: str = "lags"
    claim: str = "several relations at once"

    @property
    def n_inputs(self) -> int:
        return self.vocab

    @property
    def n_classes(self) -> int:
        return self.vocab

    @property
    def n_slots(self) -> int:
        return len(self.lags)

    def chance_loss(self) -> float:
        return math.log(self.vocab)  # per slot (the loss is the mean over slots)

    def batch(self, B: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        T, V = self.seq_len, self.vocab
        x = torch.randint(V, (B, T), generator=gen)  # (B, T)
        y = torch.stack([torch.roll(x, lag, dims=1) for lag in self.lags], dim=-1)  # (B, T, k)
        y[:, :max(self.lags)] = IGNORE  # y[:, t, i] = x[:, t - lags[i]] once t >= max lag
        return x, y


@dataclass(frozen=True)
class RecallTask:
    """Associative recall. Inputs: ``n_pairs`` pair tokens (key k with value v is token
    ``k * n_values + v``; keys distinct within a sequence), then ``n_queries`` query tokens
    (token ``n_keys * n_values + k`` asks for key k, always one of the sequence's keys).
    Targets: the value, at the query positions only."""

    n_keys: int = 16
    n_values: int = 16
    n_pairs: int = 8
    n_queries: int = 8
    name: str = "recall"
    claim: str = "content lookup among many keys"

    @property
    def seq_len(self) -> int:
        return self.n_pairs + self.n_queries

    @property
    def n_inputs(self) -> int:
        return self.n_keys * self.n_values + self.n_keys

    @property
    def n_classes(self) -> int:
        return self.n_values

    n_slots = 1

    def chance_loss(self) -> float:
        return math.log(self.n_values)

    def batch(self, B: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        P, Q = self.n_pairs, self.n_queries
        keys = torch.rand(B, self.n_keys, generator=gen).argsort(dim=1)[:, :P]  # (B, P) distinct
        values = torch.randint(self.n_values, (B, P), generator=gen)  # (B, P)
        pick = torch.randint(P, (B, Q), generator=gen)  # (B, Q): which pair each query asks for
        q_keys = keys.gather(1, pick)  # (B, Q)
        x = torch.cat([keys * self.n_values + values,
                       self.n_keys * self.n_values + q_keys], dim=1)  # (B, P + Q)
        y = torch.full((B, P + Q), IGNORE, dtype=torch.long)  # (B, P + Q)
        y[:, P:] = values.gather(1, pick)  # (B, Q)
        return x, y.unsqueeze(-1)  # (B, P + Q, 1)


@dataclass(frozen=True)
class MarkovTask:
    """Text from a random order-2 Markov source: ``P(x_t | x_{t-2}, x_{t-1})`` is a sparse
    Dirichlet draw per context, fixed by ``source_seed`` (the same "language" for every run).
    Targets: the next token, at every position after the first two."""

    vocab: int = 16
    seq_len: int = 32
    concentration: float = 0.1
    source_seed: int = 1234
    name: str = "markov"
    claim: str = "language-modelling baseline"
    _table: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.source_seed)
        alpha = torch.full((self.vocab * self.vocab, self.vocab), self.concentration)
        gamma = torch._standard_gamma(alpha, generator=g)  # (V*V, V) Dirichlet via Gamma draws
        object.__setattr__(self, "_table", gamma / gamma.sum(dim=1, keepdim=True))  # (V*V, V)

    @property
    def n_inputs(self) -> int:
        return self.vocab

    @property
    def n_classes(self) -> int:
        return self.vocab

    n_slots = 1

    def chance_loss(self) -> float:
        return math.log(self.vocab)

    def entropy(self) -> float:
        """The source's entropy rate in nats: the lowest loss any model can reach (weighted by
        the stationary distribution of contexts, estimated by power iteration)."""
        V, P = self.vocab, self._table.double()
        pi = torch.full((V * V,), 1.0 / (V * V), dtype=torch.float64)  # over contexts (a, b)
        for _ in range(500):
            nxt = pi[:, None] * P  # (V*V, V): mass of (a, b) -> c
            pi = nxt.view(V, V, V).sum(dim=0).reshape(V * V)  # new context (b, c)
        ent = -(P * P.clamp_min(1e-300).log()).sum(dim=1)  # (V*V,)
        return float((pi * ent).sum())

    def batch(self, B: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        V, T = self.vocab, self.seq_len
        x = torch.empty(B, T + 1, dtype=torch.long)  # (B, T + 1): inputs plus the last target
        x[:, :2] = torch.randint(V, (B, 2), generator=gen)
        for t in range(2, T + 1):
            probs = self._table[x[:, t - 2] * V + x[:, t - 1]]  # (B, V)
            x[:, t] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        y = x[:, 1:].clone()  # (B, T): next token
        y[:, :1] = IGNORE  # position 0 has no order-2 context yet
        return x[:, :T], y.unsqueeze(-1)  # (B, T), (B, T, 1)


TASKS = {"lags": LagTask, "recall": RecallTask, "markov": MarkovTask}


def make_task(name: str):
    """The task called ``name`` with its default settings."""
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]()
