"""``mha bench``: the harness (interleaving, medians, ratios, memory probe, skips and errors),
the attention suite's guards (result check, memory budget), and the command end to end on a
tiny grid — JSON, markdown and PNG produced from real measurements, filed under this machine's
CPU kind."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from mha.bench import attention, core, cpu, report
from mha.bench.core import Case, Context, Impl, Skip
from mha.cli import main

FAST = dict(repeat=3, min_time=0.01, sample_time=0.002, max_case_time=5.0)


def _matmul_impl(name, n, log=None):
    def make():
        a = torch.randn(n, n)

        def fn():
            if log is not None:
                log.append(name)
            return a @ a  # (n, n) @ (n, n)

        return fn

    return Impl(name, make)


def test_measure_rows_ratios_and_rates():
    case = Case("mm", [_matmul_impl("small", 32), _matmul_impl("big", 128)],
                flops=2.0 * 128**3, baseline="big")
    rows = {r.impl: r for r in core.measure(case, Context(**FAST), "unit")}
    for r in rows.values():
        assert r.ok and r.seconds > 0 and r.samples >= 3 and r.calls >= r.samples
        assert r.gflops == pytest.approx(case.flops / r.seconds / 1e9)
        assert r.suite == "unit" and r.case == "mm"
    assert rows["big"].ratio == pytest.approx(1.0)
    assert rows["small"].ratio == pytest.approx(rows["big"].seconds / rows["small"].seconds)


def test_measure_interleaves_implementations():
    log: list[str] = []
    case = Case("order", [_matmul_impl("A", 16, log), _matmul_impl("B", 16, log)])
    ctx = Context(repeat=4, min_time=0.0, sample_time=0.0, max_case_time=5.0)
    core.measure(case, ctx)
    # set-up: each impl's first call (memory) and one warm-up call, A then B; then the timed
    # samples (one call each here) alternate A, B, A, B, ...
    assert log[:4] == ["A", "A", "B", "B"]
    timed = log[4:]
    assert len(timed) >= 8 and timed == ["A", "B"] * (len(timed) // 2)


def test_skip_and_error_become_rows_not_numbers():
    def skip():
        raise Skip("install mha[onnx]")

    def broken():
        raise RuntimeError("no kernel")

    def fails_later():
        def fn():
            raise ValueError("bad shape")
        return fn

    case = Case("c", [Impl("s", skip), Impl("e", broken), Impl("f", fails_later)])
    rows = {r.impl: r for r in core.measure(case, Context(**FAST))}
    assert rows["s"].status == "skipped" and rows["s"].reason == "install mha[onnx]"
    assert rows["e"].status == "error" and "no kernel" in rows["e"].reason
    assert rows["f"].status == "error" and "bad shape" in rows["f"].reason
    assert all(r.seconds is None and r.gflops is None for r in rows.values())


def test_table_shows_square_brackets_of_notes_as_text():
    from rich.console import Console

    case = Case("c", [Impl("jax [xla]", lambda: (_ for _ in ()).throw(
        Skip("jax not installed: pip install 'mha[jax]'")))])
    rows = core.measure(case, Context(**FAST), "unit")
    console = Console(record=True, width=200)
    report.print_tables(rows, {}, console)
    text = console.export_text()
    assert "pip install 'mha[jax]'" in text and "jax [xla]" in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS probe reads /proc")
def test_memory_probe_sees_a_large_transient_allocation():
    n = 64 * 2**20 // 4  # 64 MiB of fp32

    def big():
        return lambda: float(torch.ones(n).sum())  # allocates, touches, frees

    def small():
        x = torch.ones(1024)
        return lambda: float(x.sum())

    rows = {r.impl: r for r in core.measure(Case("m", [Impl("big", big), Impl("small", small)]),
                                            Context(**FAST))}
    assert rows["big"].mem_bytes >= 60 * 2**20
    assert rows["small"].mem_bytes < 16 * 2**20


def test_unknown_suite_is_a_reason():
    mod, why = core.load_suite("no_such_suite_xyz")
    assert mod is None and "not installed" in why
    assert set(core.SUITES) >= {"attention", "decode", "hf"}


def test_shape_flops_count_half_when_causal():
    dense = attention.Shape(2, 3, 16, 8, "fp32", False)
    causal = attention.Shape(2, 3, 16, 8, "fp32", True)
    assert dense.flops == 4 * 2 * 3 * 16 * 16 * 8
    assert causal.flops == dense.flops / 2


def test_wrong_result_is_an_error_row():
    s = attention.Shape(1, 2, 8, 4, "fp32", False)
    inp = attention._Inputs(s)

    def wrong():
        q, k, v = inp.qkv()
        return lambda: torch.zeros_like(q) + 1.0

    rows = core.measure(Case("w", [Impl("wrong", attention._checked(wrong, inp, s, 1e-4))]),
                        Context(**FAST))
    assert rows[0].status == "error" and "wrong result" in rows[0].reason


def _case_inputs(make) -> attention._Inputs:
    """The case's shared inputs an impl's make closes over (at any depth)."""
    todo = [make]
    while todo:
        for cell in todo.pop().__closure__ or ():
            x = cell.cell_contents
            if isinstance(x, attention._Inputs):
                return x
            if callable(x) and getattr(x, "__closure__", None):
                todo.append(x)
    raise AssertionError("no _Inputs in the impl's closures")


@pytest.mark.parametrize("causal", [False, True])
def test_mha_auto_row_times_the_flash_op_itself(causal):
    """The attention case's "mha auto" callable returns the flash op's own output tensor layout
    and values: no copy, no other backend between the bench and the kernel."""
    from mha.ops import flash

    if flash.unavailable() is not None:
        pytest.skip(f"flash kernel unavailable: {flash.unavailable()}")
    case = attention.attention_case(attention.Shape(1, 4, 256, 64, "fp32", causal),
                                    Context(**FAST))
    impl = next(i for i in case.impls if i.name == "mha auto")
    with torch.no_grad():
        fn = impl.make()
        assert fn.note == "dispatch chose flash_cpu"
        out = fn()
        q, k, v = _case_inputs(impl.make).qkv()
        want, _ = torch.ops.mha._flash_attention_fwd_kernel(q, k, v, None, None, causal,
                                                            64 ** -0.5, "auto")
    assert torch.equal(out, want)
    assert out.stride() == want.stride()  # the op's (B, Tq, h, d) memory, not a copy of it
    case.teardown()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_module_case_times_the_frozen_module_checked(dtype):
    """bf16 and fp32 module rows add ``mha module frozen`` (weights packed once): checked against
    nn.MultiheadAttention like the others where the fused forward runs, else skipped with
    freeze()'s reason."""
    from mha.ops import self_attention

    rows = {r.impl: r for r in core.measure(
        attention.module_case(attention.Shape(2, 2, 8, 16, dtype, False), Context(**FAST)),
        Context(**FAST))}
    frozen = rows["mha module frozen"]
    missing = self_attention.tiles(attention._DTYPES[dtype])
    if missing is None:
        assert frozen.ok and frozen.check.startswith("same weights"), frozen
        fused = f"fused {dtype} forward" in frozen.check  # where the measured gate lets it run
        assert ("weights packed once by freeze()" in frozen.check) == fused, frozen.check
        assert "weights packed once" not in rows["mha module"].check
    else:
        assert frozen.status == "skipped" and missing in frozen.reason
    for long_or_causal in (attention.Shape(1, 2, 65, 16, dtype, False),
                           attention.Shape(2, 2, 8, 16, dtype, True)):  # never fused: no row
        names = [i.name for i in attention.module_case(long_or_causal, Context(**FAST)).impls]
        assert names == ["torch nn.MHA", "mha module"]


def test_memory_budget_skips_materializing_impls_with_the_figure():
    s = attention.Shape(1, 2, 64, 16, "fp32", True)
    ctx = Context(**FAST, mem_budget=1024, impl_filter=("naive", "torch sdpa"))
    rows = {r.impl: r for r in core.measure(attention.attention_case(s, ctx), ctx)}
    assert rows["naive torch"].status == "skipped"
    assert "would need" in rows["naive torch"].reason
    assert rows["torch sdpa"].ok  # bounded memory: never skipped for size
    assert set(rows) == {"naive torch", "torch sdpa"}


def test_cli_end_to_end_tiny_grid(tmp_path):
    md = tmp_path / "bench.md"
    md.write_text("# title\n\nprose\n")
    rc = main(["bench", "--quick", "--suite", "attention",
               "--filter", "32x8x20x64 fp32", "--impl", "sdpa", "--impl", "naive",
               "--impl", "auto", "--repeat", "3", "--min-time", "0.02",
               "--out", str(tmp_path), "--markdown", str(md)])
    assert rc == 0
    kind = cpu.record(with_native=False)["kind"]
    run = json.loads((tmp_path / f"latest-{kind}.json").read_text())
    assert {"meta", "peaks", "rows"} <= set(run)
    machine = run["meta"]["cpu_info"]
    assert machine["kind"] == kind and machine["cpus"] >= 1
    assert set(machine["flags"]) <= set(cpu.ISA_FLAGS)
    assert set(machine["native"]) in ({"isa", "float32", "bfloat16"}, {"error"})
    assert run["peaks"]["fp32"]["value"] is None or run["peaks"]["fp32"]["value"] > 0
    assert run["peaks"]["mm_fp32"]["value"] > 0
    rows = [r for r in run["rows"] if r["suite"] == "attention"]
    assert {r["case"] for r in rows} == {"32x8x20x64 fp32 dense"}
    assert {"torch sdpa", "naive torch", "mha auto", "mha:sdpa"} <= {r["impl"] for r in rows}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["seconds"] > 0 and r["samples"] >= 3
        assert r["gflops"] == pytest.approx(4 * 32 * 8 * 20 * 20 * 64 / r["seconds"] / 1e9)
        assert r["check"].startswith("max |out - SDPA fp32|")
    base = next(r for r in rows if r["impl"] == "torch sdpa")
    assert base["ratio"] == pytest.approx(1.0)
    png = (tmp_path / f"latest-{kind}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    text = md.read_text()
    assert text.startswith("# title\n\nprose\n") and report.MD_BEGIN in text
    assert f"<!-- mha-bench:begin {kind} -->" in text and f"latest-{kind}.png" in text
    assert "32x8x20x64 fp32 dense" in text and "naive torch" in text

    # the README's summary: mha's row against the fastest other implementation of the case
    readme = tmp_path / "README.md"
    assert main(["bench", "--from-json", str(tmp_path / f"latest-{kind}.json"), "--out", "",
                 "--headline", str(readme)]) == 0
    head = readme.read_text()
    mine = next(r for r in rows if r["impl"] == "mha auto")
    best = min((r for r in rows if not r["impl"].startswith("mha")), key=lambda r: r["seconds"])
    line = next(ln for ln in head.splitlines() if "32x8x20x64 fp32 dense" in ln)
    assert report.HEAD_BEGIN in head and f"| {best['impl']} | " in line
    assert line.endswith(f"| {best['seconds'] / mine['seconds']:.2f} |")

    # regenerate the markdown from the JSON without measuring: same tables
    md2 = tmp_path / "again.md"
    assert main(["bench", "--from-json", str(tmp_path / f"latest-{kind}.json"), "--out", "",
                 "--markdown", str(md2)]) == 0
    assert report.markdown(run) in md2.read_text()


def test_mm_peak_shrinks_the_product_that_would_take_too_long():
    """``torch.mm``'s peak is timed on the requested size unless one product would take longer
    than ``longest`` (bf16 on a CPU without bf16 arithmetic): then on a smaller power of two."""
    import torch

    from mha.bench.peaks import _mm_peak

    rate, m = _mm_peak(torch.float32, 512, 0.0, longest=1e9)
    assert m == 512 and rate > 0
    rate, m = _mm_peak(torch.float32, 512, 0.0, longest=0.0)
    assert m == 256 and rate > 0


@pytest.mark.parametrize("error, raised", [
    (RuntimeError("MHA_FLASH_BF16=bogus is not a choice: expected one of avx512bf16, ..."), True),
    (RuntimeError("flash_attention: the build failed (no compiler)"), False),
])
def test_native_path_raises_a_forcing_refusal_and_records_a_missing_build(monkeypatch, error,
                                                                          raised):
    """The CPU record keeps a missing build as a fact; a forcing this build cannot run is the
    user's to fix, so it is raised (the CLI shows it as one line)."""
    from mha.ops import flash

    def refuse():
        raise error

    monkeypatch.setattr(flash, "isa", lambda: "portable")
    monkeypatch.setattr(flash, "kernels", refuse)
    if raised:
        with pytest.raises(RuntimeError, match="MHA_FLASH_BF16=bogus is not a choice"):
            cpu.native_path()
    else:
        assert cpu.native_path() == {"error": f"RuntimeError: {error}"}
