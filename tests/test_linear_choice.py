"""Which GEMM runs the projections (mha.ops.linear_choice): the choice follows the measurement,
is measured once per machine and shape class, survives a missing, corrupt or raced cache
file, and forcing either side gives the same numbers.

Shape legend: M rows of x, N output features, K input features. No test here times anything:
the measurement is injected (``linear_choice.measure`` replaced), the mechanism is what is
tested.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mha
from autograd_nodes import node_names
from mha.ops import linear, linear_choice
from racing import race

KERNEL = "mha_linear-test"  # a build key of our own: entries never mix with the real ones


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    """A private cache file, an empty memory, and a measurement that must be injected."""
    file = tmp_path / linear_choice.FILE
    monkeypatch.setattr(linear_choice, "path", lambda: file)
    monkeypatch.setattr(linear_choice, "forced", lambda: None)
    monkeypatch.setattr(linear_choice, "_memo", {})

    def not_injected(shape):
        raise AssertionError("the test did not inject a measurement")

    monkeypatch.setattr(linear_choice, "measure", not_injected)
    monkeypatch.setattr(linear_choice, "measure_bf16", not_injected)
    monkeypatch.setattr(linear_choice, "measure_bf16_tiles", not_injected)
    return file


def inject(monkeypatch, native_s: float, torch_s: float, which: str = "measure") -> list:
    """Replace the measurement (``measure``, or ``measure_bf16``) by fixed times; returns the
    list of shapes it was asked for."""
    asked = []

    def fake(shape):
        asked.append(shape)
        return native_s, torch_s

    monkeypatch.setattr(linear_choice, which, fake)
    return asked


@pytest.mark.parametrize(("M", "N", "K", "bucket"), [
    (640, 1536, 512, (512, 2048, 512)),  # the seeds' QKV projection
    (640, 512, 512, (512, 512, 512)),  # ... and W_O
    (4096, 3072, 1024, (4096, 4096, 1024)),
    (1, 16, 16, (1, 16, 16)),
    (0, 0, 0, (1, 16, 16)),
    (767, 48, 96, (1024, 64, 128)),  # nearest in log scale: above 2^(k + 1/2) rounds up
    (700, 40, 90, (512, 32, 64)),  # ... below it, down (2^9.5 = 724)
])
def test_buckets(M, N, K, bucket):
    b = linear_choice.Bucket.of(M, N, K)
    assert (b.M, b.N, b.K) == bucket
    rows, n, k = b.shape
    assert (n, k) == bucket[1:] and rows <= b.M
    assert rows * n * k <= linear_choice.BUDGET or rows == min(b.M, linear_choice.MIN_ROWS)


@pytest.mark.parametrize(("native_s", "torch_s", "choice", "words"), [
    (1.0, 2.0, "native", "the native tiles: measured 2.00x faster than torch's GEMM"),
    (1.8, 1.0, "torch", "torch's GEMM: measured 1.80x faster than the native tiles"),
    (1.0, 1.0, "torch", "torch's GEMM: measured 1.00x faster"),  # a tie stays with torch
    (1.0, 1.02, "torch", "the native tiles measured only 1.02x faster"),  # inside the margin
    (1.0, linear_choice.MARGIN, "native", "the native tiles: measured"),
])
def test_choice_follows_the_measurement(cache_file, monkeypatch, native_s, torch_s, choice, words):
    asked = inject(monkeypatch, native_s, torch_s)
    got = linear_choice.choose(640, 1536, 512, KERNEL)
    assert got.choice == choice and asked == [(512, 2048, 512)]
    text = got.describe()
    assert words in text and "(M=512, N=2048, K=512)" in text
    assert linear_choice.cpu_model() in text


def test_why_not_native_and_describe_say_the_measured_choice(cache_file, monkeypatch):
    if linear.load() is not None:
        pytest.skip(f"the native projections did not build: {linear.load()}")
    x, w = torch.randn(640, 512), torch.randn(1536, 512)
    inject(monkeypatch, 1.8, 1.0)
    reason = linear.why_not_native(x, w, None)
    assert reason.startswith("torch's GEMM: measured 1.80x faster than the native tiles")
    assert linear.describe(x, w, None) == reason
    linear_choice.forget()
    cache_file.unlink()
    inject(monkeypatch, 1.0, 1.5)
    assert linear.why_not_native(x, w, None) is None
    assert linear.describe(x, w, None).startswith("the native tiles: measured 1.50x faster")
    inject(monkeypatch, 3.0, 1.0, "measure_bf16")
    inject(monkeypatch, 3.0, 1.0, "measure_bf16_tiles")
    bf16 = linear.describe(x.bfloat16(), w.bfloat16(), None)
    ours = "the native bf16 tiles" if linear.bf16_tiles() else "an fp32 GEMM on upcast inputs"
    assert bf16.startswith(f"torch's bf16 GEMM: measured 3.00x faster than {ours}")
    assert linear.why_not_native(x.bfloat16(), w.bfloat16(), None) == bf16


@pytest.mark.parametrize(("upcast_s", "torch_s", "upcast"), [(1.0, 3.0, True), (3.0, 1.0, False)])
def test_bf16_projections_follow_their_own_measurement(cache_file, monkeypatch, upcast_s,
                                                       torch_s, upcast):
    """bfloat16 where the build has no bf16 tiles (as on a CPU without AVX512_BF16): fp32 on
    upcast inputs (then the fp32 choice) or torch's bf16 GEMM, as measured for the class
    "bf16 M.. N.. K..", stored beside the fp32 classes; the result is the fp32 product rounded
    once, or F.linear in bf16."""
    monkeypatch.setattr(linear, "bf16_tiles", lambda: False)
    fp32 = inject(monkeypatch, 2.0, 1.0)  # the fp32 side: torch's GEMM
    bf16 = inject(monkeypatch, upcast_s, torch_s, "measure_bf16")
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((4, 160, 512), (1536, 512),
                                                                   (1536,)))
    text = linear.describe(x, w, b)
    if upcast:
        assert text.startswith("an fp32 GEMM on upcast inputs: measured 3.00x faster than "
                               "torch's bf16 GEMM for (M=512, N=2048, K=512)")
        assert "; in fp32, torch's GEMM: measured 2.00x faster than the native tiles" in text
        want = F.linear(x.float(), w.float(), b.float()).bfloat16()
    else:
        assert text.startswith("torch's bf16 GEMM: measured 3.00x faster than an fp32 GEMM")
        want = F.linear(x, w, b)
    with torch.no_grad():
        got = linear.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    y = linear.linear(x, w.clone().requires_grad_(), b)  # gradients flow through the casts
    y.float().sum().backward()
    assert bf16 == [(512, 2048, 512)] and len(fp32) == (1 if upcast else 0)
    entries = json.loads(cache_file.read_text())["machines"]
    assert any("bf16 M512 N2048 K512" in e for e in entries.values())


def test_measured_once_then_read_from_the_file(cache_file, monkeypatch):
    """A second process (memory dropped) reads the file; a new shape class is measured and
    added beside the first; another machine's or another kernel's entries are left alone."""
    other = {"format": 1, "machines": {"another CPU | torch 0 | k": {"M1 N16 K16": {
        "choice": "native", "native_s": 1.0, "torch_s": 2.0, "shape": [1, 16, 16]}}}}
    cache_file.write_text(json.dumps(other))
    asked = inject(monkeypatch, 2.0, 1.0)
    first = linear_choice.choose(640, 1536, 512, KERNEL)
    assert linear_choice.choose(600, 1500, 500, KERNEL) is first  # same class: memory
    linear_choice.forget()
    assert linear_choice.choose(640, 1536, 512, KERNEL) == first  # from the file
    assert len(asked) == 1
    linear_choice.choose(640, 512, 512, KERNEL)  # a new class
    linear_choice.choose(640, 512, 512, "mha_linear-rebuilt")  # a new kernel build
    assert len(asked) == 3
    data = json.loads(cache_file.read_text())
    mine = data["machines"][linear_choice.machine_key(KERNEL)]
    assert sorted(mine) == ["M512 N2048 K512", "M512 N512 K512"]
    rec = mine["M512 N2048 K512"]
    assert {k: rec[k] for k in ("choice", "native_s", "torch_s", "shape")} == {
        "choice": "torch", "native_s": 2.0, "torch_s": 1.0, "shape": [512, 2048, 512]}
    assert {"load", "cpus"} <= rec.keys()  # the conditions it was taken under
    assert data["machines"]["another CPU | torch 0 | k"] == other["machines"]["another CPU | torch 0 | k"]
    assert linear_choice.machine_key("mha_linear-rebuilt") in data["machines"]


def _entry(**change) -> dict:
    e = {"choice": "torch", "native_s": 2.0, "torch_s": 1.0, "shape": [512, 2048, 512]}
    e.update(change)
    return e


def _file_with(entry) -> str:
    return json.dumps({"format": 1, "machines": {linear_choice.machine_key(KERNEL): {
        "M512 N2048 K512": entry}}})


@pytest.mark.parametrize("contents", [
    None,  # missing
    b"",  # empty
    _file_with(_entry())[:40].encode(),  # truncated
    b"\xff\xfe not utf-8 \x00",
    b"[]",
    json.dumps({"format": 99, "machines": {}}).encode(),  # another format
    json.dumps({"format": 1, "machines": []}).encode(),
    json.dumps({"format": 1, "machines": {"x": 3}}).encode(),
    _file_with("torch").encode(),
    _file_with(_entry(native_s=-1.0)).encode(),
    _file_with(_entry(torch_s="NaN")).encode(),
    _file_with(_entry(native_s=float("inf"))).encode(),
    _file_with(_entry(choice="native")).encode(),  # contradicts its own times
    _file_with(_entry(choice="cuBLAS")).encode(),
    _file_with(_entry(shape=[512, 2048])).encode(),
    _file_with(_entry(shape=[float("inf"), 2048, 512])).encode(),
    _file_with(_entry(shape="512")).encode(),  # a string of three digits: not a shape
    _file_with(_entry(shape=[512.7, 2048, 512])).encode(),  # int() would read 512
    _file_with(_entry(shape=[0, 2048, 512])).encode(),
    _file_with({k: v for k, v in _entry().items() if k != "torch_s"}).encode(),
], ids=["missing", "empty", "truncated", "binary", "list", "format", "machines-list",
        "machine-int", "entry-str", "negative", "nan", "inf", "contradiction", "unknown-side",
        "short-shape", "inf-shape", "str-shape", "float-shape", "zero-shape", "no-torch-time"])
def test_missing_or_corrupt_file_is_measured_again(cache_file, monkeypatch, contents):
    if contents is not None:
        cache_file.write_bytes(contents)
    asked = inject(monkeypatch, 1.0, 3.0)
    got = linear_choice.choose(640, 1536, 512, KERNEL)
    assert got.choice == "native" and len(asked) == 1
    data = json.loads(cache_file.read_text())  # replaced by a whole, valid file
    assert data["format"] == 1
    assert data["machines"][linear_choice.machine_key(KERNEL)]["M512 N2048 K512"]["choice"] == "native"
    assert not list(cache_file.parent.glob("*.part"))  # no temporary file left behind


def test_a_valid_entry_is_not_measured_again(cache_file, monkeypatch):
    cache_file.write_text(_file_with(_entry()))
    asked = inject(monkeypatch, 1.0, 3.0)
    assert linear_choice.choose(640, 1536, 512, KERNEL).choice == "torch"  # the file's, not 1:3
    assert asked == []


def test_an_unwritable_cache_still_chooses(cache_file, monkeypatch):
    """A directory where the file cannot be written: measured, kept in memory, no error."""
    monkeypatch.setattr(linear_choice, "path", lambda: cache_file.parent / "missing" / "x.json")
    asked = inject(monkeypatch, 1.0, 3.0)
    assert linear_choice.choose(640, 1536, 512, KERNEL).choice == "native"
    assert linear_choice.choose(640, 1536, 512, KERNEL).choice == "native"
    assert len(asked) == 1


_RACER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from mha.ops import linear_choice
    file, log, M, N, K = Path(sys.argv[1]), Path(sys.argv[2]), *map(int, sys.argv[3:6])
    linear_choice.path = lambda: file
    linear_choice.forced = lambda: None
    def slow(shape):  # a measurement long enough for the other process to arrive
        with open(log, "a") as f:
            f.write(f"{shape}\\n")
        time.sleep(0.5)
        return 1.0, 2.0
    linear_choice.measure = slow
    Path(sys.argv[6]).touch()  # ready
    while not Path(sys.argv[7]).exists():  # start together
        time.sleep(0.005)
    print(linear_choice.choose(M, N, K, "mha_linear-race").choice)
""")


def _race(tmp_path, shapes) -> tuple[list[str], Path, Path]:
    """One racing process per (M, N, K) in ``shapes`` (:func:`racing.race`): their choices,
    the shared cache file and the log of what was measured."""
    file, log = tmp_path / linear_choice.FILE, tmp_path / "measured.log"
    outs = race(tmp_path, _RACER, [[str(file), str(log), str(M), str(N), str(K)]
                                   for M, N, K in shapes])
    return outs, file, log


def test_two_processes_racing_on_one_class_measure_once(tmp_path):
    outs, file, log = _race(tmp_path, [(640, 1536, 512), (600, 1500, 500)])
    assert outs == ["native", "native"]
    assert len(log.read_text().splitlines()) == 1  # the second waited and read the first's
    assert json.loads(file.read_text())["format"] == 1


def test_two_processes_racing_on_two_classes_lose_neither(tmp_path):
    outs, file, log = _race(tmp_path, [(640, 1536, 512), (640, 512, 512)])
    assert outs == ["native", "native"] and len(log.read_text().splitlines()) == 2
    (entries,) = json.loads(file.read_text())["machines"].values()
    assert sorted(entries) == ["M512 N2048 K512", "M512 N512 K512"]


def test_forced_value_is_checked(monkeypatch):
    for value, want in (("native", "native"), ("TORCH", "torch"), ("measure", None), ("", None)):
        monkeypatch.setenv(linear_choice.ENV, value)
        linear_choice.forced.cache_clear()
        assert linear_choice.forced() == want
    monkeypatch.setenv(linear_choice.ENV, "mkl")
    linear_choice.forced.cache_clear()
    with pytest.raises(ValueError, match="MHA_LINEAR=mkl is not a choice: expected one of "
                                         "native, torch, measure"):
        linear_choice.forced()
    monkeypatch.delenv(linear_choice.ENV)
    linear_choice.forced.cache_clear()


def test_forced_native_that_cannot_run_is_refused(monkeypatch):
    """``MHA_LINEAR=native`` where the native op did not build: the projection is refused with
    the reason (mha.ops.forcing's words), never quietly handed to F.linear; torch still runs."""
    reason = "mha_linear unavailable (no C++ compiler found)"
    monkeypatch.setattr(linear, "load", lambda: reason)
    x, w = torch.randn(64, 256), torch.randn(512, 256)  # big enough to be measured
    monkeypatch.setattr(linear_choice, "forced", lambda: "native")
    with pytest.raises(RuntimeError, match=r"MHA_LINEAR=native cannot run here: mha_linear "
                                           r"unavailable \(no C\+\+ compiler found\) \(choices "
                                           r"this build can run: torch, measure"):
        linear.linear(x, w)
    monkeypatch.setattr(linear_choice, "forced", lambda: "torch")
    torch.testing.assert_close(linear.linear(x, w), F.linear(x, w), rtol=0, atol=0)


@pytest.mark.parametrize(("tiles_s", "torch_s", "tiles"), [(1.0, 3.0, True), (3.0, 1.0, False)])
def test_bf16_tiles_follow_their_measurement(cache_file, monkeypatch, tiles_s, torch_s, tiles):
    """bfloat16 where the build has the bf16 tiles: they or torch's bf16 GEMM, as measured for
    the class "bf16 tiles M.. N.. K.." (no fp32 class measured); either result is within one
    bf16 rounding of the float64 product, and the tiles' autograd function is in the graph
    exactly when they were chosen."""
    if not linear.bf16_tiles():
        pytest.skip("the native op has no bf16 tiles here (its build lacks AVX512_BF16)")
    fp32 = inject(monkeypatch, 2.0, 1.0)
    asked = inject(monkeypatch, tiles_s, torch_s, "measure_bf16_tiles")
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((4, 160, 512), (1536, 512),
                                                                   (1536,)))
    text = linear.describe(x, w, b)
    if tiles:
        assert text.startswith("the native bf16 tiles: measured 3.00x faster than torch's "
                               "bf16 GEMM for (M=512, N=2048, K=512) on "
                               + linear_choice.cpu_model() + " (measured at load ")
    else:
        assert text.startswith("torch's bf16 GEMM: measured 3.00x faster than the native bf16")
    with torch.no_grad():
        got = linear.linear(x, w, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(x, w, b))  # bf16 tolerances: one rounding apart
    y = linear.linear(x, w.clone().requires_grad_(), b)
    assert ("_LinearBf16Backward" in node_names(y)) == tiles
    assert asked == [(512, 2048, 512)] and fp32 == []
    entries = json.loads(cache_file.read_text())["machines"]
    assert any("bf16 tiles M512 N2048 K512" in e for e in entries.values())


@pytest.mark.parametrize("bias", [True, False])
def test_both_sides_forced_give_the_same_numbers_bf16(monkeypatch, bias):
    """bfloat16: forced native (the bf16 tiles, or fp32 native tiles on upcast inputs where the
    build has no bf16 tiles) and forced torch (its bf16 GEMM) within bf16 rounding of each
    other and of the float64 reference."""
    if linear.load() is not None:
        pytest.skip(f"the native projections did not build: {linear.load()}")
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(512, 8, bias=bias)
    x = torch.randn(32, 20, 512)
    m, x = m.bfloat16(), x.bfloat16()
    outs = {}
    for side in ("native", "torch"):
        monkeypatch.setattr(linear_choice, "forced", lambda side=side: side)
        # QKV and W_O; forced native upcast says it twice each: the upcast, then the fp32 tiles
        twice = side == "native" and not linear.bf16_tiles()
        assert m.explain(x).count(f"forced by MHA_LINEAR={side}") == (4 if twice else 2)
        with torch.no_grad():
            outs[side] = m(x).double()
    with torch.no_grad():
        ref, _ = mha.reference.multi_head_attention(x.double(), x.double(), upcast=True,
                                                    **m.per_head_weights())
    for name, y in outs.items():
        assert (y - ref).abs().max().item() < 2e-2, name
    assert (outs["native"] - outs["torch"]).abs().max().item() < 2e-2


@pytest.mark.parametrize("bias", [True, False])
def test_both_sides_forced_give_the_same_numbers(monkeypatch, bias):
    """The module forced onto the native tiles and onto torch's GEMM: the same output within
    fp32 rounding, both close to the float64 per-head reference, with and without gradients,
    and each side said so (and taken: the native autograd function is in the graph or not)."""
    if linear.load() is not None:
        pytest.skip(f"the native projections did not build: {linear.load()}")
    torch.manual_seed(0)
    m = mha.MultiHeadAttention(512, 8, bias=bias)
    x = torch.randn(32, 20, 512)
    outs = {}
    for side in ("native", "torch"):
        monkeypatch.setattr(linear_choice, "forced", lambda side=side: side)
        assert m.explain(x).count(f"forced by MHA_LINEAR={side}") == 2  # QKV and W_O
        with torch.no_grad():
            outs[side] = m(x)
        y = m(x)
        assert ("_LinearBackward" in node_names(y)) == (side == "native")
        outs[side + " grad"] = y.detach()
    with torch.no_grad():
        ref, _ = mha.reference.multi_head_attention(x, x, upcast=True, **m.per_head_weights())
    for name, y in outs.items():
        assert (y.double() - ref).abs().max().item() < 1e-4, name
    torch.testing.assert_close(outs["native"], outs["torch"], rtol=1e-4, atol=1e-5)




# ----------------------------------------------------------------------------- conditions
def test_a_record_says_under_what_conditions_it_was_taken(cache_file, monkeypatch):
    """The load average, the CPU count and the rounds' speedup range are stored and shown;
    a file written without them stays valid (and says nothing about them)."""
    monkeypatch.setattr(linear_choice.os, "getloadavg", lambda: (3.25, 2.0, 1.0))
    inject(monkeypatch, 1.0, 2.0, "measure")
    monkeypatch.setattr(linear_choice, "measure", lambda shape: (1.0, 2.0, (1.8, 2.3)))
    got = linear_choice.choose(640, 1536, 512, KERNEL)
    (entries,) = json.loads(cache_file.read_text())["machines"].values()
    rec = entries["M512 N2048 K512"]
    assert rec["load"] == 3.25 and rec["cpus"] == (linear_choice.os.cpu_count() or 1)
    assert rec["speedups"] == [1.8, 2.3]
    text = got.describe()
    assert "measured at load 3.25 on" in text and "native speedup 1.80-2.30x over 5 rounds" in text
    assert "noise" not in text
    linear_choice.forget()
    assert linear_choice.choose(640, 1536, 512, KERNEL).describe() == text  # read back
    for key in ("load", "cpus", "speedups"):  # a record written before conditions existed
        del rec[key]
    cache_file.write_text(json.dumps({"format": 1, "machines": {
        linear_choice.machine_key(KERNEL): entries}}))
    linear_choice.forget()
    old = linear_choice.choose(640, 1536, 512, KERNEL)
    assert old.choice == "native" and old.conditions is None and "load" not in old.describe()


@pytest.mark.parametrize(("speedups", "noise"), [((0.93, 1.12), True), ((1.01, 1.2), False),
                                                 ((0.7, 0.98), False), (None, False)])
def test_sides_within_the_measurements_noise_are_said_to_be(speedups, noise):
    c = linear_choice.Conditions(1.5, 2, speedups)
    m = linear_choice.Measured.of(1.0, 1.03, (512, 512, 512), "a CPU", conditions=c)
    assert c.within_noise == noise
    assert ("within this measurement's noise" in m.describe()) == noise


def test_fastest_reports_the_rounds_spread():
    best_a, best_b, (lo, hi) = linear_choice._fastest((lambda: None, lambda: None))
    assert best_a > 0 and best_b > 0 and 0 < lo <= hi


def test_remeasure_replaces_this_machines_records(cache_file, monkeypatch):
    """``remeasure``: every class recorded for this machine measured again, in the file and
    in memory; another machine's records and an unknown class name are left alone."""
    other = {"choice": "native", "native_s": 1.0, "torch_s": 2.0, "shape": [1, 16, 16]}
    inject(monkeypatch, 1.0, 2.0)
    inject(monkeypatch, 1.0, 2.0, "measure_bf16_tiles")
    linear_choice.choose(640, 1536, 512, KERNEL)
    linear_choice.choose(640, 512, 512, KERNEL, bf16=True, tiles=True)
    data = json.loads(cache_file.read_text())
    data["machines"]["another CPU | torch 0 | k"] = {"M1 N16 K16": other}
    data["machines"][linear_choice.machine_key(KERNEL)]["a name of another format"] = other
    cache_file.write_text(json.dumps(data))
    asked = inject(monkeypatch, 2.0, 1.0)
    asked_tiles = inject(monkeypatch, 3.0, 1.0, "measure_bf16_tiles")
    done = linear_choice.remeasure(KERNEL)
    assert [(n, b.choice, a.choice) for n, b, a in done] == [
        ("M512 N2048 K512", "native", "torch"), ("bf16 tiles M512 N512 K512", "native", "torch")]
    assert asked == [(512, 2048, 512)] and asked_tiles == [(512, 512, 512)]
    assert linear_choice.choose(640, 1536, 512, KERNEL).choice == "torch"  # memory
    linear_choice.forget()
    assert linear_choice.choose(640, 1536, 512, KERNEL).choice == "torch"  # the file
    data = json.loads(cache_file.read_text())
    assert data["machines"]["another CPU | torch 0 | k"] == {"M1 N16 K16": other}
    assert data["machines"][linear_choice.machine_key(KERNEL)]["a name of another format"] == other
    assert len(asked) == 1


def test_cli_build_remeasure_prints_each_class(cache_file, monkeypatch, capsys):
    """``mha build --remeasure``'s step: one line per class, before and after, with the
    conditions; a machine with no record says so."""
    import mha.cli.build as cli_build

    monkeypatch.setattr(linear, "load", lambda: None)
    monkeypatch.setattr(linear, "kernel", lambda: KERNEL)
    assert cli_build._remeasure() == 0
    assert "no GEMM choice recorded for this machine yet" in capsys.readouterr().out
    inject(monkeypatch, 1.0, 2.0)
    linear_choice.choose(640, 1536, 512, KERNEL)
    monkeypatch.setattr(linear_choice, "measure", lambda shape: (1.0, 1.02, (0.95, 1.1)))
    assert cli_build._remeasure() == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("remeasured M512 N2048 K512: torch (was native): torch's GEMM: ")
    assert "measured at load" in line and "within this measurement's noise" in line
