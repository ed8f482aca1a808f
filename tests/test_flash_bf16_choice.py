"""Which tiles run the flash kernels' bf16 products (mha.ops.flash_choice): the choice follows
the measurement, is measured once per machine (keyed by the CPU's identity) and survives a
corrupt or raced cache file; the process runs the measured kernel (forward and backward),
``MHA_FLASH_BF16`` still overrides it, the setter refuses what it cannot honour, and
``mha.explain`` says it was measured, with the two rates.

Shape legend: B batch, h heads, Tq/Tk lengths, d head dim. No test here times anything: the
measurement is injected (``flash_choice.measure`` replaced) or a record is written to the cache
file. The kernel choice is fixed per process, so the checks of the kernel that runs go to a
subprocess each, with a private cache file of the choice (the built kernels are shared).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mha
from mha.ops import flash_choice, linear_choice
from mha.ops.forcing import cpu_flags
from racing import race

KERNEL = "mha_flash-test"  # a build key of our own: entries never mix with the real ones
SRC = str(Path(mha.__file__).parent.parent)
FORCING = ("MHA_FLASH_BF16", "MHA_DECODE_BF16", "MHA_LINEAR", "MHA_AMX_EMULATE",
           "MHA_TEST_AMX_REFUSED")


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    """A private cache file, an empty memory, and a measurement that must be injected."""
    file = tmp_path / flash_choice.FILE
    monkeypatch.setattr(flash_choice, "path", lambda: file)
    monkeypatch.setattr(flash_choice, "_memo", {})

    def not_injected(shape):
        raise AssertionError("the test did not inject a measurement")

    monkeypatch.setattr(flash_choice, "measure", not_injected)
    return file


def inject(monkeypatch, bf16_s: float, f32_s: float, speedups=None) -> list:
    """Replace the measurement by fixed times; returns the list of shapes it was asked for."""
    asked = []

    def fake(shape):
        asked.append(shape)
        return (bf16_s, f32_s) if speedups is None else (bf16_s, f32_s, speedups)

    monkeypatch.setattr(flash_choice, "measure", fake)
    return asked


@pytest.mark.parametrize(("bf16_s", "f32_s", "choice", "words"), [
    (1.0, 1.6, "avx512bf16", "avx512bf16 (vdpbf16ps): measured 1.60x faster than avx512f"),
    (2.0, 1.0, "avx512f", "avx512f (bf16 widened to fp32): measured 2.00x faster than "
                          "avx512bf16"),
    (1.0, 1.0, "avx512f", "avx512bf16 measured only 1.00x faster"),  # a tie stays widened
    (1.0, 1.02, "avx512f", "less than the 1.05x required"),  # inside the margin
    (1.0, flash_choice.MARGIN, "avx512bf16", "avx512bf16 (vdpbf16ps): measured"),
])
def test_choice_follows_the_measurement(cache_file, monkeypatch, bf16_s, f32_s, choice, words):
    asked = inject(monkeypatch, bf16_s * 1e-3, f32_s * 1e-3, (0.9, 1.1))
    got = flash_choice.choose(KERNEL)
    assert got.choice == choice and asked == [flash_choice.SHAPE]
    text = got.describe()
    B, h, T, d = flash_choice.SHAPE
    assert words in text and f"(B={B}, h={h}, T={T}, d={d})" in text
    assert f"avx512bf16 {bf16_s:.3g} ms, avx512f {f32_s:.3g} ms" in text  # the two rates
    assert linear_choice.cpu_model() in text and "measured at load" in text


def test_measured_once_then_read_from_the_file(cache_file, monkeypatch):
    asked = inject(monkeypatch, 1e-3, 2e-3, (1.9, 2.1))
    first = flash_choice.choose(KERNEL)
    assert flash_choice.choose(KERNEL) is first and len(asked) == 1  # memory
    flash_choice.forget()
    again = flash_choice.choose(KERNEL)
    assert len(asked) == 1 and again.choice == "avx512bf16"  # the file
    assert (again.bf16_s, again.f32_s, again.shape) == (1e-3, 2e-3, flash_choice.SHAPE)
    assert again.conditions.speedups == (1.9, 2.1)
    (machine,) = json.loads(cache_file.read_text())["machines"]
    assert machine == linear_choice.machine_key(KERNEL)
    assert linear_choice.cpu_model() in machine and f"| {KERNEL}" in machine


def test_keyed_per_cpu(cache_file, monkeypatch):
    """A record of another CPU (or another build of the kernel) is not this machine's: measured
    here and stored beside it; the other stays as it was. The key holds the CPU's identity,
    not only its model name (VMs show several kinds of CPU as one "AMD EPYC")."""
    other = {"choice": "avx512f", "avx512bf16_s": 2.0,
             "avx512f_s": 1.0, "shape": list(flash_choice.SHAPE)}
    cache_file.write_text(json.dumps({"format": 1, "machines": {
        "another CPU | torch 0 | k": {flash_choice.NAME: other}}}))
    asked = inject(monkeypatch, 1.0, 3.0)
    assert flash_choice.choose(KERNEL).choice == "avx512bf16" and len(asked) == 1
    machines = json.loads(cache_file.read_text())["machines"]
    assert machines["another CPU | torch 0 | k"] == {flash_choice.NAME: other}
    assert machines[linear_choice.machine_key(KERNEL)][flash_choice.NAME]["choice"] == "avx512bf16"
    here = linear_choice.machine_key(KERNEL)
    fields = dict(linear_choice.cpu_fields(), stepping="99")
    monkeypatch.setattr(linear_choice, "cpu_fields", lambda: fields)
    linear_choice.machine_key.cache_clear()
    try:
        assert linear_choice.machine_key(KERNEL) != here  # a stepping apart: another machine
    finally:
        monkeypatch.undo()
        linear_choice.machine_key.cache_clear()


@pytest.mark.parametrize("contents", ["", "{not json", '{"format": 2, "machines": {}}',
                                      '{"format": 1, "machines": {"x": 3}}'])
def test_missing_or_corrupt_file_is_measured_again(cache_file, monkeypatch, contents):
    cache_file.write_text(contents)
    asked = inject(monkeypatch, 1.0, 2.0)
    assert flash_choice.choose(KERNEL).choice == "avx512bf16" and len(asked) == 1
    assert json.loads(cache_file.read_text())["format"] == 1


@pytest.mark.parametrize("record", [
    {"choice": "avx512f", "avx512bf16_s": 1.0, "avx512f_s": 2.0, "shape": [1, 8, 512, 64]},
    {"choice": "avx512bf16", "avx512bf16_s": 0.0, "avx512f_s": 2.0, "shape": [1, 8, 512, 64]},
    {"choice": "avx512bf16", "avx512bf16_s": 1.0, "avx512f_s": 2.0, "shape": [1, 8]},
    {"choice": "avx512bf16", "avx512bf16_s": 1.0, "avx512f_s": 2.0,
     "shape": [math.inf, 8, 512, 64]},
    {"choice": "avx512bf16", "avx512bf16_s": 1.0, "avx512f_s": 2.0,
     "shape": [math.nan, 8, 512, 64]},
    {"choice": "avx512bf16", "avx512bf16_s": 1.0, "avx512f_s": 2.0, "shape": "1864"},
    {"choice": "avx512bf16", "avx512bf16_s": 1.0, "avx512f_s": 2.0, "shape": [1, 8, 512.7, 64]},
    {"choice": "avx512bf16", "avx512bf16_s": 1.0, "avx512f_s": 2.0, "shape": [1, 8, 0, 64]},
    {"choice": "avx512bf16", "avx512bf16_s": 1.0, "avx512f_s": 2.0, "shape": [1, 8, True, 64]},
    "oops", [1.0, 2.0], None,
])
def test_an_insane_record_is_measured_again(cache_file, monkeypatch, record):
    """A record whose choice contradicts its times (hand-edited), or whose times or shape are
    not sane (an infinite or NaN size included), is measured again and replaced."""
    cache_file.write_text(json.dumps({"format": 1, "machines": {
        linear_choice.machine_key(KERNEL): {flash_choice.NAME: record}}}))
    asked = inject(monkeypatch, 3.0, 1.0)
    assert flash_choice.choose(KERNEL).choice == "avx512f" and len(asked) == 1


@pytest.mark.parametrize("conditions", [{"load": 1.0, "cpus": math.inf},
                                        {"load": 1.0, "cpus": math.nan},
                                        {"load": 1.0, "cpus": "two"}])
def test_insane_conditions_keep_the_records_choice(cache_file, monkeypatch, conditions):
    """A record with sane times but conditions that are not (an infinite CPU count): its choice
    is read, without the conditions; nothing is measured."""
    record = {"choice": "avx512bf16", "avx512bf16_s": 1.0, "avx512f_s": 2.0,
              "shape": list(flash_choice.SHAPE), **conditions}
    cache_file.write_text(json.dumps({"format": 1, "machines": {
        linear_choice.machine_key(KERNEL): {flash_choice.NAME: record}}}))
    asked = inject(monkeypatch, 3.0, 1.0)
    got = flash_choice.choose(KERNEL)
    assert (got.choice, got.conditions, asked) == ("avx512bf16", None, [])


def test_remeasure_replaces_the_record(cache_file, monkeypatch):
    inject(monkeypatch, 1.0, 2.0)
    flash_choice.choose(KERNEL)
    asked = inject(monkeypatch, 2.0, 1.0)
    before, after = flash_choice.remeasure(KERNEL)
    assert (before.choice, after.choice, len(asked)) == ("avx512bf16", "avx512f", 1)
    assert flash_choice.choose(KERNEL) is after  # memory
    flash_choice.forget()
    assert flash_choice.choose(KERNEL).choice == "avx512f" and len(asked) == 1  # the file


def test_cli_build_remeasure_prints_the_flash_choice(cache_file, monkeypatch, capsys):
    """``mha build --remeasure``'s flash step: one line, before and after, with the rates; none
    where nothing was measured (forced, AMX, no vdpbf16ps kernel)."""
    import mha.cli.build as cli_build
    from mha.ops import flash

    monkeypatch.setattr(flash, "unavailable", lambda: None)
    monkeypatch.setattr(flash, "kernel_key", lambda: KERNEL)
    monkeypatch.setattr(flash, "bf16_choice", lambda: "forced by MHA_FLASH_BF16=avx512f")
    assert cli_build._remeasure_flash() == 0 and capsys.readouterr().out == ""
    inject(monkeypatch, 1.0, 2.0)
    measured = flash_choice.choose(KERNEL)
    monkeypatch.setattr(flash, "bf16_choice", lambda: measured)
    inject(monkeypatch, 2e-3, 1e-3, (0.4, 0.6))
    assert cli_build._remeasure_flash() == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"remeasured flash {flash_choice.NAME}: avx512f (was avx512bf16; "
                           "the next process runs it): avx512f (bf16 widened to fp32): measured "
                           "2.00x faster than avx512bf16 (avx512bf16 2 ms, avx512f 1 ms")
    assert "avx512bf16 speedup 0.40-0.60x" in line


_RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from mha.ops import flash_choice
    file, log = Path(sys.argv[1]), Path(sys.argv[2])
    flash_choice.path = lambda: file
    def slow(shape):  # a measurement long enough for the other process to arrive
        with open(log, "a") as f:
            f.write(f"{shape}\\n")
        time.sleep(0.5)
        return 1.0, 2.0
    flash_choice.measure = slow
    Path(sys.argv[3]).touch()  # ready
    while not Path(sys.argv[4]).exists():  # start together
        time.sleep(0.005)
    print(flash_choice.choose("mha_flash-race").choice)
""")


def test_two_processes_racing_measure_once(tmp_path):
    file, log = tmp_path / flash_choice.FILE, tmp_path / "measured.log"
    outs = race(tmp_path, _RACER, [[str(file), str(log)]] * 2)
    assert outs == ["avx512bf16", "avx512bf16"]
    assert len(log.read_text().splitlines()) == 1  # the second waited and read the first's
    (entries,) = json.loads(file.read_text())["machines"].values()
    assert list(entries) == [flash_choice.NAME]


# ----------------------------------------------------------------------------- in a process
_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    import mha
    from mha.ops import build, flash, flash_choice, linear_choice
    file, want = Path(sys.argv[1]), sys.argv[2]
    flash_choice.path = lambda: file
    def not_measured(shape):
        raise AssertionError("measured, although the cache file holds this machine's record")
    flash_choice.measure = not_measured
    # this machine's record, written before the extension is loaded (and handed the choice)
    build.load(flash.NAME, flash.SOURCES)
    times = {"avx512bf16": (1e-3, 1.6e-3), "avx512f": (2e-3, 1e-3)}[want]
    record = {"choice": want, "avx512bf16_s": times[0], "avx512f_s": times[1],
              "shape": list(flash_choice.SHAPE), "load": 0.5, "cpus": 2}
    machine = linear_choice.machine_key(flash.kernel_key())
    file.write_text(json.dumps({"format": 1, "machines": {machine: {flash_choice.NAME: record}}}))
    res = {"kernels": flash.kernels(), "said": flash.bf16_said()}
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 100, 64, generator=g).bfloat16() for _ in range(4))
    out, lse = flash.flash_attention(q, k, v)  # Tk = 100: the tiles, not the small path
    named = {kn: torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, False,
                                                          64 ** -0.5, kn)[0]
             for kn in ("avx512bf16", "avx512f")}
    res["forward"] = [kn for kn, o in named.items() if torch.equal(o, out)]
    res["explain"] = str(mha.explain(q, k, v))
    missing = flash.load_backward()
    if missing is not None:
        res["backward_missing"] = missing
    else:
        res["backward_math"] = torch.ops.mha.flash_attention_bwd_bf16_math()
        lse64 = lse.double()
        grads = torch.ops.mha.flash_attention_bwd_fused(dout, None, q, k, v, out, lse64, None,
                                                        None, False, 64 ** -0.5)
        named_bwd = torch.ops.mha._flash_attention_bwd_fused_math
        res["backward"] = [m for m in ("bf16", "fp32") if all(
            torch.equal(a, b) for a, b in zip(grads[:3], named_bwd(
                dout, None, q, k, v, out, lse64, None, None, False, 64 ** -0.5, m, 0)))]
    refusals = []
    other = {"avx512bf16": "avx512f", "avx512f": "avx512bf16"}[want]
    for value in (other, "amx", want):  # fixed once read; only what this build runs; same: ok
        try:
            torch.ops.mha._flash_set_bf16_choice(value)
            refusals.append(None)
        except RuntimeError as e:
            refusals.append(str(e).splitlines()[0])
    res["refusals"] = refusals
    print(json.dumps(res))
""")


def _run_child(tmp_path, want: str, env: dict | None = None) -> dict:
    """The child above in a fresh process, its choice file holding ``want`` for this machine."""
    flags = cpu_flags()
    if not {"avx512f", "avx512_bf16"} <= flags:
        pytest.skip("no avx512_bf16 on this CPU: the build has no vdpbf16ps kernel, nothing "
                    "to choose")
    if {"amx_tile", "amx_bf16"} <= flags:
        pytest.skip("an AMX CPU: the AMX tiles run first, nothing is measured")
    base = {k: v for k, v in os.environ.items() if k not in FORCING}
    base["PYTHONPATH"] = SRC
    p = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / flash_choice.FILE), want],
                       capture_output=True, text=True, timeout=600, env={**base, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("want", ["avx512bf16", "avx512f"])
def test_the_process_runs_the_measured_kernel(tmp_path, want):
    """The cached outcome forced either way: the forward's automatic kernel is bitwise the named
    one (and not the other), the backward's products follow it, explain and ``mha.ops.flash``
    say it was measured with the two rates, and the setter refuses a change once a bf16 call
    has read the choice, or a kernel the build does not run."""
    res = _run_child(tmp_path, want)
    assert res["kernels"]["bfloat16"] == want
    assert res["forward"] == [want]  # bitwise the measured kernel's result, not the other's
    assert "backward" in res, f"the fused backward did not load: {res['backward_missing']}"
    products = {"avx512bf16": "bf16", "avx512f": "fp32"}[want]
    assert res["backward_math"] == products and res["backward"] == [products]
    rates = ("avx512bf16 1 ms, avx512f 1.6 ms" if want == "avx512bf16"
             else "avx512bf16 2 ms, avx512f 1 ms")
    first = ("avx512bf16 (vdpbf16ps): measured 1.60x faster than avx512f"
             if want == "avx512bf16"
             else "avx512f (bf16 widened to fp32): measured 2.00x faster than avx512bf16")
    assert res["said"].startswith(first) and rates in res["said"]
    assert "measured at load 0.50 on 2 CPUs" in res["said"]
    (line,) = [ln for ln in res["explain"].splitlines() if ln.startswith("flash_cpu")]
    assert line.startswith(f"flash_cpu  chosen (bf16 tiles: {first}") and rates in line
    changed, unknown, same = res["refusals"]
    assert "fixed for the process once a bf16 call has read it" in changed
    assert f"('{want}'); refusing" in changed
    assert "the measured bf16 kernel must be one this build runs" in unknown and "'amx'" in unknown
    assert same is None


def test_mha_flash_bf16_still_overrides(tmp_path):
    """``MHA_FLASH_BF16`` wins over the cached measurement (nothing is measured) and says so."""
    res = _run_child(tmp_path, "avx512bf16", {"MHA_FLASH_BF16": "avx512f"})
    assert res["kernels"]["bfloat16"] == "avx512f" and res["forward"] == ["avx512f"]
    assert res["said"] == "avx512f: forced by MHA_FLASH_BF16=avx512f"
    assert "backward" in res, f"the fused backward did not load: {res['backward_missing']}"
    assert res["backward_math"] == "fp32" and res["backward"] == ["fp32"]
    assert "measured" not in res["explain"]


# ----------------------------------------------------------------------------- failures
@pytest.mark.parametrize("error", [RuntimeError("the op failed"), OverflowError("int(inf)"),
                                   ValueError("bad record")])
def test_a_failed_measurement_widens_and_says_why(tmp_path, monkeypatch, error):
    """A measurement (or a cache record) that raises does not reach the caller: the choice says
    "not measured" with the error's type and first line, and bf16 is widened to fp32."""
    from mha.ops import flash

    reason = flash.unavailable()  # loaded (and handed its choice) before anything is replaced
    if reason is not None:
        pytest.skip(f"the flash kernel is not available: {reason}")
    flags = cpu_flags()
    if not {"avx512f", "avx512_bf16"} <= flags or {"amx_tile", "amx_bf16"} <= flags:
        pytest.skip("nothing is measured on this CPU (no avx512_bf16, or AMX)")
    monkeypatch.delenv("MHA_FLASH_BF16", raising=False)
    monkeypatch.setattr(flash_choice, "path", lambda: tmp_path / flash_choice.FILE)
    monkeypatch.setattr(flash_choice, "_memo", {})

    def failing(shape):
        raise error

    monkeypatch.setattr(flash_choice, "measure", failing)
    flash.bf16_choice.cache_clear()
    try:
        said = flash.bf16_choice()
    finally:
        flash.bf16_choice.cache_clear()  # the next caller reads the real choice
    assert said == (f"not measured ({type(error).__name__}: {error}): bf16 is widened to "
                    "fp32")


def test_measure_restores_the_thread_count_when_the_op_raises(monkeypatch):
    """The measurement runs on one thread; an op that raises leaves the caller's count as it
    was."""
    import torch

    def failing(*args):
        raise RuntimeError("the kernel failed")

    monkeypatch.setattr(torch.ops.mha, "_flash_attention_fwd_kernel", failing, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="the kernel failed"):
            flash_choice.measure((1, 1, 8, 8))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_directory_where_the_file_goes_is_measured_not_cached(cache_file, monkeypatch):
    """The cache file's name taken by a directory: measured, kept in memory, nothing raised;
    the process asks once."""
    cache_file.mkdir()
    asked = inject(monkeypatch, 1.0, 2.0)
    assert flash_choice.choose(KERNEL).choice == "avx512bf16"
    assert flash_choice.choose(KERNEL).choice == "avx512bf16" and len(asked) == 1
    assert cache_file.is_dir()
