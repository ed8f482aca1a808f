"""``mha bench``'s records and outputs without measuring: the CPU record and its kind, the
per-kind sections of the markdown files, the per-kind result files, and the plot of ratios to
the fastest peer — all from fixtures (cpuinfo texts, saved runs)."""

from __future__ import annotations

import json

import pytest

from mha.bench import cpu, report
from mha.bench.core import Row
from mha.bench.plot import plot, speedups
from mha.cli import main

XEON_FLAGS = "fpu sse avx avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile"
ZEN5_FLAGS = "fpu sse avx avx2 fma avx512f avx512bw avx512_bf16 avx_vnni"
ZEN4_FLAGS = "fpu sse avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"
ZEN3_FLAGS = "fpu sse avx fma avx2 sha_ni vaes"


def cpuinfo(vendor: str, name: str, family: int, model: int, flags: str, n: int = 2) -> str:
    block = (f"processor\t: {{i}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
             f"model\t\t: {model}\nmodel name\t: {name}\nstepping\t: 1\nflags\t\t: {flags}\n\n")
    return "".join(block.format(i=i) for i in range(n))


@pytest.mark.parametrize("text, kind, flags", [
    (cpuinfo("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+", 6, 143, XEON_FLAGS),
     "xeon-amx", list(cpu.ISA_FLAGS)),
    (cpuinfo("AuthenticAMD", "AMD EPYC", 26, 2, ZEN5_FLAGS), "epyc-zen5-avx512",
     ["avx2", "fma", "avx512f", "avx512_bf16"]),
    (cpuinfo("AuthenticAMD", "AMD EPYC", 25, 1, ZEN3_FLAGS), "epyc-zen3-avx2", ["avx2", "fma"]),
    (cpuinfo("AuthenticAMD", "AMD EPYC", 25, 17, ZEN4_FLAGS), "epyc-zen4-avx512",
     ["avx2", "fma", "avx512f", "avx512_bf16"]),
    (cpuinfo("AuthenticAMD", "AMD Ryzen 9 7950X", 25, 97, ZEN4_FLAGS), "ryzen-zen4-avx512",
     ["avx2", "fma", "avx512f", "avx512_bf16"]),
    (cpuinfo("AuthenticAMD", "AMD EPYC", 27, 0, ZEN5_FLAGS), "epyc-avx512",
     ["avx2", "fma", "avx512f", "avx512_bf16"]),
    (cpuinfo("GenuineIntel", "QEMU Virtual CPU", 6, 6, "fpu sse sse2"), "intel-portable", []),
    ("", "cpu-portable", []),
])
def test_cpu_record_and_kind_from_cpuinfo(text, kind, flags):
    rec = cpu.record(text, with_native=False)
    assert rec["kind"] == kind and rec["flags"] == flags
    cpu.check_record(rec)  # what a run saves, a report accepts
    if text:
        assert rec["cpus"] == 2 and rec["stepping"] == 1
        assert rec["family"] == int(text.split("cpu family\t: ")[1].split("\n")[0])
        assert kind in cpu.describe(rec) and rec["model_name"] in cpu.describe(rec)


def _peak(key: str, how: str) -> dict:
    return {"key": key, "label": key, "value": 100.0, "unit": "GFLOP/s", "how": how}


@pytest.mark.parametrize("name, peaks, kind", [
    ("AMD EPYC", {"fp32": _peak("fp32", "AVX-512 vfmadd231ps loop"),
                  "bf16_avx512": _peak("bf16_avx512", "vdpbf16ps loop")}, "epyc-avx512"),
    ("AMD EPYC", {"fp32": _peak("fp32", "AVX2 vfmadd231ps loop")}, "epyc-avx2"),
    ("Intel(R) Xeon(R) Platinum 8480+", {"fp32": _peak("fp32", "AVX-512 vfmadd231ps loop"),
                                         "bf16_avx512": _peak("bf16_avx512", "x"),
                                         "bf16_amx": _peak("bf16_amx", "x")}, "xeon-amx"),
])
def test_kind_of_a_run_without_cpu_record_is_inferred_from_its_peaks(name, peaks, kind):
    rec = cpu.of_run({"meta": {"cpu": name}, "peaks": peaks, "rows": []})
    assert rec["kind"] == kind and "inferred" in rec


def _row(case: str, impl: str, seconds: float | None, suite: str = "attention", **kw) -> dict:
    r = Row(suite=suite, case=case, impl=impl, seconds=seconds, samples=3, flops=1e9,
            status="ok" if seconds else "skipped", reason="" if seconds else "not here",
            baseline="torch sdpa", **kw)
    return r.to_dict()


def a_run(kind: str, fastest_peer: float = 2.0) -> dict:
    """A saved run of CPU kind ``kind``: two attention cases (one without any peer measured)
    and a decode case with a memory-read probe."""
    rec = cpu.record(cpuinfo("AuthenticAMD", "AMD EPYC", 25, 1, ZEN3_FLAGS), with_native=False)
    rec["kind"] = kind
    rows = [_row("c1", "mha:flash_cpu", 0.5), _row("c1", "mha auto", 0.5),
            _row("c1", "torch sdpa", fastest_peer), _row("c1", "naive torch", 8.0),
            _row("c1", "jax xla", None),
            _row("alone", "mha auto", 1.0), _row("alone", "torch sdpa", None),
            _row("step", "mha", 1e-4, suite="decode", metric="gbs", bytes=1e6),
            _row("step", "torch sdpa", 4e-4, suite="decode", metric="gbs", bytes=1e6),
            _row("step", "read K+V (torch.sum)", 5e-5, suite="decode", metric="gbs", bytes=1e6)]
    return {"meta": {"started": "2026-01-01 00:00:00", "threads": 2, "load_start": 0.1,
                     "load_end": 0.2, "cpu": rec["model_name"], "cpu_info": rec},
            "peaks": {"fp32": _peak("fp32", "AVX2 vfmadd231ps loop")}, "rows": rows}


def test_speedups_are_against_the_fastest_peer_not_mha_nor_probes():
    rows = report.rows_from_run(a_run("epyc-zen3-avx2"))
    best, ratios = speedups([r for r in rows if r.case == "c1"])
    assert best.impl == "torch sdpa"
    assert ratios == {"mha:flash_cpu": 4.0, "mha auto": 4.0, "torch sdpa": 1.0,
                      "naive torch": 0.25}
    best, ratios = speedups([r for r in rows if r.case == "step"])
    assert best.impl == "torch sdpa" and "read K+V (torch.sum)" not in ratios
    assert ratios["mha"] == pytest.approx(4.0)
    assert speedups([r for r in rows if r.case == "alone"]) == (None, {})


def test_plot_renders_ratio_panels_from_a_json_fixture(tmp_path):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(a_run("epyc-zen3-avx2")))
    out = plot(report.load_json(saved), tmp_path / "p.png")
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    nothing = a_run("epyc-zen3-avx2")
    nothing["rows"] = [r for r in nothing["rows"] if r["case"] == "alone"]
    with pytest.raises(ValueError, match="no case has a measured peer"):
        plot(nothing, tmp_path / "none.png")


@pytest.mark.parametrize("headline_only", [False, True])
def test_markdown_rewrites_only_the_section_of_the_run_kind(tmp_path, headline_only):
    doc = tmp_path / "doc.md"
    begin, end = (report.HEAD_BEGIN, report.HEAD_END) if headline_only else (report.MD_BEGIN,
                                                                            report.MD_END)
    # the single-section form: one block without kinds is replaced by the kind's section
    doc.write_text(f"# doc\n\n{begin}\nold table, no kind\n{end}\n\nafter\n")
    first = a_run("epyc-zen5-avx512", fastest_peer=2.0)
    report.write_markdown(first, doc, headline_only=headline_only)
    report.write_markdown(a_run("xeon-amx", fastest_peer=3.0), doc, headline_only=headline_only)
    text = doc.read_text()
    assert "old table, no kind" not in text and text.startswith("# doc\n\n")
    assert text.endswith(f"{end}\n\nafter\n")
    assert text.index("begin epyc-zen5-avx512 -->") < text.index("begin xeon-amx -->")
    render = report.headline if headline_only else report.markdown
    assert render(first) in text
    # a new run of the first kind replaces its section and keeps the other kind's
    again = a_run("epyc-zen5-avx512", fastest_peer=5.0)
    report.write_markdown(again, doc, headline_only=headline_only, plot_link="r/latest-e.png")
    text2 = doc.read_text()
    assert render(first) not in text2 and render(again) in text2
    assert "![mha bench, epyc-zen5-avx512](r/latest-e.png)" in text2
    assert render(a_run("xeon-amx", fastest_peer=3.0)) in text2
    assert text2.count("begin epyc-zen5-avx512 -->") == 1 and text2.count("begin xeon-amx -->") == 1
    assert text2.index("begin epyc-zen5-avx512 -->") < text2.index("begin xeon-amx -->")


def test_from_json_files_the_outputs_under_the_run_kind(tmp_path, capsys):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(a_run("xeon-amx")))
    out = tmp_path / "results"
    readme = tmp_path / "README.md"
    assert main(["bench", "--from-json", str(saved), "--out", str(out),
                 "--headline", str(readme)]) == 0
    assert [p.name for p in out.iterdir()] == ["latest-xeon-amx.png"]
    assert "![mha bench, xeon-amx](results/latest-xeon-amx.png)" in readme.read_text()
    assert "latest-xeon-amx.json" in report.latest_path(a_run("xeon-amx"), out, "json").name


@pytest.mark.parametrize("kind", ["../../etc/x", "Xeon AMX", "", "a" * 41])
def test_a_saved_run_with_an_unusable_kind_is_refused(tmp_path, capsys, kind):
    saved = tmp_path / "run.json"
    run = a_run("epyc-zen3-avx2")
    run["meta"]["cpu_info"]["kind"] = kind
    saved.write_text(json.dumps(run))
    out = tmp_path / "results"
    assert main(["bench", "--from-json", str(saved), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--from-json" in err and "meta.cpu_info.kind" in err and "Traceback" not in err
    assert not out.exists()
