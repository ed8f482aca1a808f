"""Packed sequences through ``attn_implementation="mha"``: one row holding several sequences
(``position_ids`` restarting, ``cu_seq_lens_q/k`` as transformers' flattening collator passes
them) gives each sequence the logits it gets alone under ``"eager"``.

Shape legend: S sequences, N packed tokens, V vocabulary.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'mha[hf]')")

import torch  # noqa: E402

from test_hf_decode import gpt2, llama, pair  # noqa: E402

LENGTHS = [5, 9, 1, 6]


def _packed_inputs():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (n,), generator=g) for n in LENGTHS]
    ids = torch.cat(seqs)[None]  # (1, N)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]  # (1, N) restarting per sequence
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)  # (S+1,)
    return seqs, ids, pos, cu


@pytest.fixture
def varlen_calls(monkeypatch):
    """Record the cu_seqlens of every varlen call the integration makes, still running it."""
    import mha.integrations.transformers as hf

    calls: list[list[int]] = []
    real = hf.varlen_attention

    def recording(q, k, v, cu_q, cu_k=None, **kw):
        calls.append(cu_q.tolist())
        return real(q, k, v, cu_q, cu_k, **kw)

    monkeypatch.setattr(hf, "varlen_attention", recording)
    return calls


@pytest.mark.parametrize("arch", [llama, gpt2], ids=["llama-gqa", "gpt2"])
def test_packed_row_equals_each_sequence_alone(arch, varlen_calls):
    models = pair(arch())
    seqs, ids, pos, cu = _packed_inputs()
    with torch.no_grad():
        packed = models["mha"](input_ids=ids, position_ids=pos, cu_seq_lens_q=cu,
                               cu_seq_lens_k=cu, max_length_q=max(LENGTHS),
                               max_length_k=max(LENGTHS)).logits[0]  # (N, V)
        alone = torch.cat([models["eager"](input_ids=s[None]).logits[0] for s in seqs])  # (N, V)
    assert varlen_calls and all(c == cu.tolist() for c in varlen_calls)  # every layer, packed
    assert (packed - alone).abs().max().item() < 1e-4


def test_packed_refuses_weights():
    models = pair(llama())
    _, ids, pos, cu = _packed_inputs()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="packed sequences"):
        models["mha"](input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=9, max_length_k=9, output_attentions=True)
