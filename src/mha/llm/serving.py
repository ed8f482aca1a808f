"""Continuous batching of a causal LM over :class:`mha.PagedKVCache`: a Hugging Face model or
mha's own :class:`mha.models.Llama`; greedy, or sampled per request (:mod:`mha.sampling`).

Shape legend: N packed tokens of one step (every running request's chunk, end to end), R
requests in a step, h / h_kv query / K/V heads, d head dim, V vocabulary.

Requests arrive (:meth:`Scheduler.add`), each gets a sequence of the paged cache, and every
:meth:`Scheduler.step` runs **one forward** over a packed batch: the next token of every
decoding request (one row each) and a chunk of the prompt of requests still in prefill
(``prefill_chunk`` tokens at most per request), as one row ``(1, N)`` with each token's own
position. Each attention layer writes the step's K/V into its pages and attends through them
(:meth:`mha.PagedKVCache.attend_varlen`: the decode rows in one native paged decode call, the
prefill chunks in one call of the paged flash forward); the last token of each request whose prompt is complete
yields its next token (argmax, or drawn with the request's own sampling parameters and
generator: :func:`mha.sampling.next_tokens`). Finished requests free their pages at once.

Sampling: each request's generator is seeded from its seed when it is added (a random seed
when it has none) and reads one uniform per generated token, only when that request yields
one: a request's tokens depend on its prompt, parameters and seed, not on the requests it is
batched with, nor on chunking or preemption (recompute yields no token, so it draws nothing).

How a step runs on the model is its runner's (:mod:`mha.llm.step_runners`): a transformers
model's attention is mha's :func:`attention_forward`, registered in transformers'
``AttentionInterface`` under :data:`NAME` (switched to while the scheduler runs, restored
after); a :class:`mha.models.Llama` runs :meth:`~mha.models.Llama.forward_paged`. Both write
and attend through the same paged cache calls; everything below is the scheduler's, whatever
the model.

Admission: a waiting request starts when a sequence slot is free and the pool holds its first
chunk besides what the running requests' next chunks need. Preemption: when the pool cannot
hold a step's tokens (:class:`mha.PagePoolExhausted`: running requests grew into new pages),
the request admitted last is preempted: its pages are freed and it waits again with its prompt
plus the tokens generated so far (recomputed when it is admitted again), and the step is
retried; greedy (and seeded) tokens do not change. A forward or a draw that raises (Ctrl-C, an
error in a layer) preempts every running request the same way before the exception propagates
(the sampled requests' generators set back to before the step), so a later
:meth:`Scheduler.run` resumes to the same tokens.

A long-running caller (:mod:`mha.llm.server`) streams each step's tokens (:meth:`Scheduler.step`
returns them) and takes each finished or cancelled request once (:meth:`Scheduler.take`), so
the scheduler keeps no results.

Why not ``model.generate_batch`` (transformers' own continuous batching, 5.24): its
``ContinuousBatchingManager.switch_to_cb_friendly_attn`` (generation/continuous_batching/
continuous_api.py) raises ValueError unless ``config._attn_implementation`` is ``"paged|eager"``,
``"sdpa"`` or a name containing ``"flash"`` (``is_flash_attention_requested`` tests the
substring), and its ``PagedAttentionCache`` owns the K/V layout and the read/write indices;
there is no registration path for a custom paged attention (an ``AttentionInterface`` entry
named with "flash" would pass that string test only by accident of its name).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mha.checks import check_eos_ids, check_int, check_int_tensor
from mha.llm.runs import check_fits
from mha.llm.step_runners import (  # noqa: F401 (NAME, attention_forward, register: re-exported)
    NAME,
    Step,
    attention_forward,
    register,
    runner_for,
)
from mha.paged import PagedKVCache, PagePoolExhausted
from mha.sampling import GREEDY, SamplingParams, check_sampling, next_tokens


@dataclass
class Request:
    """A prompt and its continuation. ``done``: the tokens already in the cache. ``sampling``
    (with its seed) and ``generator``: how its tokens are chosen (None: greedy)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    seq: int | None = None
    done: int = 0
    sampling: SamplingParams = GREEDY
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        """What the cache must hold before the next token: the prompt and what was generated
        (the last generated token is fed as the next step's input)."""
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class Scheduler:
    """Continuous batching of ``model`` (a transformers causal LM or :class:`mha.models.Llama`)
    over a paged cache.

    Args:
        model: a transformers causal LM, e.g. :func:`mha.llm.model.load` ``(...).model`` (its
            attention implementation is switched to :data:`NAME` during :meth:`run` /
            :meth:`step` and restored after), or a :class:`mha.models.Llama` (e.g.
            :func:`mha.llm.native.load_native` ``(...).model``); anything else is refused
            (TypeError naming ``model``).
        num_pages, page_size: the pool (per layer).
        max_seqs: requests running at once.
        max_len: tokens one request may hold (prompt + new tokens).
        prefill_chunk: prompt tokens per request per step (chunked prefill).
        kv_dtype: the K/V storage (None: the model's dtype; "bfloat16", "int8").
        eos_token_id: stop a request at this token, or at any of a list of them (Llama-3-style
            models list several; :func:`mha.checks.check_eos_ids`); None: run to
            ``max_new_tokens``. Each a token id of the model's vocabulary ``[0, V)`` (any
            other id could never stop a request); kept as given (an int or a list).
    """

    def __init__(self, model, *, num_pages: int, page_size: int = 16, max_seqs: int = 16,
                 max_len: int = 512, prefill_chunk: int = 64, kv_dtype=None,
                 eos_token_id: int | list[int] | None = None) -> None:
        self.runner = runner_for(model)  # how one step runs on this kind of model
        self.model = model
        self.prefill_chunk = check_int("prefill_chunk", prefill_chunk, low=1,
                                       what="a positive int")
        eos = check_eos_ids(eos_token_id, self.runner.vocab_size)  # None or a list of ids
        self.cache = PagedKVCache(num_pages, page_size, max_seqs=max_seqs, max_len=max_len,
                                  kv_dtype=kv_dtype, **self.runner.cache_shape())
        self.eos_token_id = eos if eos is None or isinstance(eos_token_id, (list, tuple)) \
            else eos[0]  # as given: an id or a list of ids
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self.cancelled: dict[int, Request] = {}
        self.forwards = 0
        self.preemptions = 0
        #: the requests of the last step if its forward raised (they wait again, first in line)
        self.interrupted: list[int] = []
        self._next_rid = 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that stop a request (empty: none), from :attr:`eos_token_id`."""
        eos = self.eos_token_id
        return frozenset(() if eos is None else eos if isinstance(eos, list) else (eos,))

    def add(self, prompt, max_new_tokens: int, sampling: SamplingParams | None = None) -> int:
        """Queue a request (prompt: token ids ``(P,)``, a list, tuple, integer tensor or
        array; ``sampling``: None, greedy, or a :class:`mha.sampling.SamplingParams`, a
        random seed drawn here when it has none); returns its id. Refused (nothing queued)
        when an id is not an integer of the model's vocabulary ``[0, V)``, when ``sampling`` is
        not a ``SamplingParams`` or None, or when the prompt and ``max_new_tokens`` exceed
        ``max_len``, the model's context (``max_position_embeddings``) or the page pool (a
        request alone may use every page, so one that fits runs, preempting others)."""
        prompt = self._check_prompt(prompt)
        n = check_int("max_new_tokens", max_new_tokens, low=1, what="a positive int")
        sampling = check_sampling(sampling).with_seed()
        if len(prompt) + n > self.cache.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={n} exceed "
                             f"max_len={self.cache.max_len}")
        if self.runner.context is not None:  # as mha.llm.generation refuses it
            check_fits(len(prompt), n, self.runner.context)
        held = len(prompt) + n - 1  # the last new token is returned, never fed back
        if self.cache.pages_for(held) > self.cache.num_pages:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={n} need "
                             f"{self.cache.pages_for(held)} pages of {self.cache.page_size} "
                             f"tokens, more than the pool's num_pages={self.cache.num_pages} "
                             "even when it runs alone")
        req = Request(self._next_rid, prompt, n, sampling=sampling,
                      generator=sampling.generator())
        self._next_rid += 1
        self.waiting.append(req)
        return req.rid

    def cancel(self, rid: int) -> list[int]:
        """Drop request ``rid`` (its client is gone); returns the tokens it generated so far.

        Waiting: it leaves the queue. Running: its pages return to the pool and it leaves the
        batch; the other requests' tokens do not change. Finished: a no-op (its tokens
        stay in :attr:`finished` and :meth:`run`'s result). Cancelled already: a no-op. A
        cancelled request is kept in :attr:`cancelled` and left out of :meth:`run`'s result.
        Refused (ValueError / TypeError naming ``rid``, nothing changed) for an id that
        :meth:`add` never returned."""
        rid = check_int("rid", rid, what="a request id (an int returned by add)")
        if rid in self.finished:
            return list(self.finished[rid].output)
        if rid in self.cancelled:
            return list(self.cancelled[rid].output)
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                break
        else:
            for req in self.running:
                if req.rid == rid:
                    self.cache.free(req.seq)
                    req.seq, req.done = None, 0
                    self.running.remove(req)
                    break
            else:
                raise ValueError(f"rid={rid} is no request of this scheduler (add returned "
                                 f"ids 0 … {self._next_rid - 1})" if self._next_rid else
                                 f"rid={rid} is no request of this scheduler (none was added)")
        self.cancelled[rid] = req
        return list(req.output)

    def take(self, rid: int) -> Request:
        """Hand over finished or cancelled request ``rid`` and forget it (a long-running caller
        takes each result once, so :attr:`finished` and :attr:`cancelled` do not grow for
        ever); its tokens are ``.output``. Refused (ValueError / TypeError naming ``rid``,
        nothing changed) for a request still waiting or running, one already taken, or an id
        :meth:`add` never returned."""
        rid = check_int("rid", rid, what="a request id (an int returned by add)")
        for done in (self.finished, self.cancelled):
            if rid in done:
                return done.pop(rid)
        for state, reqs in (("waiting", self.waiting), ("running", self.running)):
            if any(r.rid == rid for r in reqs):
                raise ValueError(f"rid={rid} is still {state}: only a finished or cancelled "
                                 "request can be taken (cancel it first)")
        if 0 <= rid < self._next_rid:
            raise ValueError(f"rid={rid} was taken already")
        raise ValueError(f"rid={rid} is no request of this scheduler (add returned ids 0 … "
                         f"{self._next_rid - 1})" if self._next_rid else
                         f"rid={rid} is no request of this scheduler (none was added)")

    def _check_prompt(self, prompt) -> list[int]:
        """``prompt`` as a list of ids of the model's vocabulary (TypeError / ValueError naming
        it: the embedding would raise torch's 'index out of range' in the step that ran it)."""
        if isinstance(prompt, (str, bytes)):
            raise TypeError(f"prompt must be token ids (P,), got a {type(prompt).__name__}; "
                            "tokenize it first")
        if isinstance(prompt, (list, tuple)) and not prompt:  # as_tensor([]) is float32
            raise ValueError("prompt must hold at least one token")
        if isinstance(prompt, (list, tuple)) and any(
                isinstance(t, bool) or type(t).__name__ == "bool_" for t in prompt):
            raise TypeError("prompt must be token ids (P,), got a bool among them")
        ids = check_int_tensor("prompt", prompt, "(P,) of token ids")
        if ids.dim() != 1:
            raise ValueError(f"prompt must be token ids of shape (P,), got shape "
                             f"{tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError("prompt must hold at least one token")
        V = self.runner.vocab_size
        bad = ((ids < 0) | (ids >= V)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"prompt must hold token ids in [0, {V}) (the model's vocabulary), "
                             f"got {int(ids[i])} at position {i}")
        return ids.tolist()

    def run(self) -> dict[int, list[int]]:
        """Step until every request is finished; returns ``{rid: new tokens}``."""
        with self.runner.active():
            while self.waiting or self.running:
                self._step()
        return {rid: r.output for rid, r in sorted(self.finished.items())}

    def step(self) -> dict[int, int]:
        """One forward (admissions, one packed batch, frees); none when no request waits or
        runs. Returns ``{rid: token}``: the token each request generated in this step (those
        still in prefill generate none), for a caller that streams them."""
        if not (self.waiting or self.running):
            return {}
        with self.runner.active():
            return self._step()

    def _pages(self, r: Request) -> int:
        """Pages request r's next chunk needs (its cache holds ``r.done`` tokens)."""
        n = min(self.prefill_chunk, len(r.tokens) - r.done)
        return self.cache.pages_for(r.done + n) - self.cache.pages_for(r.done)

    def _admit(self) -> None:
        """Admit waiting requests (in order) while a slot is free and the pool holds their
        first chunk besides the running requests' next chunks (always one when nothing runs)."""
        budget = self.cache.free_pages - sum(self._pages(r) for r in self.running)
        while self.waiting and len(self.running) < len(self.cache.block_table):
            need = self._pages(self.waiting[0])
            if self.running and need > budget:
                break
            req = self.waiting.pop(0)
            req.seq, req.done = self.cache.add_sequence(), 0
            self.running.append(req)
            budget -= need

    def _preempt(self) -> None:
        """Free the request admitted last; it waits again (first in line) and will recompute
        its prompt and the tokens it generated."""
        self._wait_again(self.running.pop())
        self.preemptions += 1

    def _requeue_running(self) -> None:
        """After a forward that did not finish: every running request waits again (in order,
        first in line), so :meth:`run` resumes to the same tokens."""
        while self.running:
            self._wait_again(self.running.pop())

    def _wait_again(self, req: Request) -> None:
        """``req``'s pages freed; it waits first in line and will recompute its prompt and the
        tokens it generated."""
        self.cache.free(req.seq)
        req.seq, req.done = None, 0
        self.waiting.insert(0, req)

    def _step(self) -> dict[int, int]:
        self.interrupted = []
        self._admit()
        while True:
            chunks = [(r, r.tokens[r.done:r.done + self.prefill_chunk]) for r in self.running]
            try:
                self.cache.extend([r.seq for r, _ in chunks], [len(c) for _, c in chunks])
                break
            except PagePoolExhausted:
                if len(self.running) <= 1:
                    raise
                self._preempt()
        ids, pos, cu = [], [], [0]
        for r, c in chunks:
            ids += c
            pos += range(r.done, r.done + len(c))
            cu.append(cu[-1] + len(c))
        step = Step(self.cache, [r.seq for r, _ in chunks], cu)
        emit = [r.done + len(c) == len(r.tokens) for r, c in chunks]  # (R,) yields a token
        params = [r.sampling if e else GREEDY for (r, _), e in zip(chunks, emit, strict=True)]
        gens = [r.generator if e else None for (r, _), e in zip(chunks, emit, strict=True)]
        drawn = [(g, g.get_state()) for g in gens if g is not None]  # (sampled rows only)
        try:
            with torch.no_grad():
                logits = self.runner.logits(ids, pos, step)  # (R, V): each chunk's last token
            nxt = next_tokens(logits, params, gens).tolist()  # (R, V) -> (R,)
        except BaseException:  # Ctrl-C or an error: the cache holds part of the step's K/V
            for g, state in drawn:  # the recomputed token draws its uniform again, once
                g.set_state(state)
            self.interrupted = [r.rid for r in self.running]
            self._requeue_running()
            raise
        self.forwards += 1
        new = {}
        stop = self.eos_token_ids
        for (r, c), tok, e in zip(chunks, nxt, emit, strict=True):
            r.done += len(c)
            if e:  # the prompt (and what was generated) is in the cache
                r.output.append(tok)
                new[r.rid] = tok
                if r.finished or tok in stop:
                    self.cache.free(r.seq)
                    self.finished[r.rid] = r
        self.running = [r for r in self.running if r.rid not in self.finished]
        return new
