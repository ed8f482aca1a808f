"""The CPU a run measured: what it is, which instruction sets matter, and its kind.

A benchmark figure means little without the machine, and "AMD EPYC" (the model name a VM
shows) does not say which: the project runs on Intel Xeons with AMX, on AMD EPYC Zen 5 with
AVX-512, and on older EPYCs with AVX2 only. :func:`record` reads ``/proc/cpuinfo`` once per
run and keeps

* ``vendor``, ``model_name``, ``family``, ``model``, ``stepping`` as the kernel reports them;
* ``flags``: the subset of :data:`ISA_FLAGS` the CPU has (the ones mha's kernels and the
  peers' libraries choose paths by);
* ``cpus`` (logical CPUs the kernel lists) and ``usable`` (the ones this process may run on);
* ``kind``: a short label derived from the above by :func:`kind` — ``<line>[-<core>]-<isa>``
  such as ``xeon-amx``, ``epyc-zen5-avx512``, ``epyc-zen4-avx512``, ``epyc-zen3-avx2`` — under
  which docs and result files keep the latest figures of each kind of machine apart;
* ``native``: the native kernel path mha compiled here (``mha.ops.flash.isa()`` and the tile each
  dtype runs), or why it could not be built.

Runs saved before this record existed carry only the model name; :func:`of_run` infers their
kind from what they do carry (the peaks measured the AVX-512 / AVX2 / AMX loops the CPU had).
"""

from __future__ import annotations

import os
import re

# The flags that decide kernel paths (mha's tiles, MKL/oneDNN's, ONNX Runtime's), in the
# spelling of /proc/cpuinfo.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")

# A kind is used in file names (latest-<kind>.json) and markdown markers: keep it plain.
KIND_PATTERN = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
_VENDOR_LINE = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
_PRODUCT_LINES = ("xeon", "epyc", "core", "ryzen", "threadripper")

# AMD's cores by (cpu family, model range), as AMD numbers them. A VM shows every EPYC as "AMD
# EPYC", and the flags alone do not tell a Zen 4 (512-bit operations issued as two 256-bit
# halves, ~half the FMA and vdpbf16ps rate per clock) from a Zen 5 (full-width AVX-512): both
# have avx512f and avx512_bf16. Intel's model names name the part, so no table is kept for them.
AMD_CORES = (
    (23, range(0x00, 0x30), "zen"), (23, range(0x30, 0x100), "zen2"),
    (25, range(0x00, 0x10), "zen3"), (25, range(0x10, 0x20), "zen4"),
    (25, range(0x20, 0x60), "zen3"), (25, range(0x60, 0xB0), "zen4"),
    (26, range(0x00, 0x100), "zen5"),
)


def core(vendor: str | None, family: int | None, model: int | None) -> str | None:
    """The core (``zen4``, ``zen5``, ...) of an AMD CPU from :data:`AMD_CORES`, else None."""
    if vendor != "AuthenticAMD" or family is None or model is None:
        return None
    return next((name for fam, models, name in AMD_CORES if fam == family and model in models),
                None)


def parse_cpuinfo(text: str) -> dict:
    """The fields of the first processor block of a ``/proc/cpuinfo`` text, and the number of
    processors listed. Missing fields are None (other architectures, containers)."""
    first: dict[str, str] = {}
    cpus = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            continue
        if key == "processor":
            cpus += 1
        if cpus <= 1:
            first.setdefault(key, value.strip())
    flags = set(first.get("flags", "").split())

    def number(key: str) -> int | None:
        v = first.get(key, "")
        return int(v) if v.isdigit() else None

    return {"vendor": first.get("vendor_id"), "model_name": first.get("model name"),
            "family": number("cpu family"), "model": number("model"),
            "stepping": number("stepping"), "flags": [f for f in ISA_FLAGS if f in flags],
            "cpus": cpus or None}


def kind(vendor: str | None, model_name: str | None, flags, family: int | None = None,
         model: int | None = None) -> str:
    """``<line>[-<core>]-<isa>``: the product line named in the model name (xeon, epyc, ...;
    else the vendor: intel, amd; else ``cpu``), the core where :func:`core` knows it, and the
    widest matrix/vector path the flags allow (``amx`` with AMX-BF16 tiles, ``avx512`` with
    AVX-512F, ``avx2`` with AVX2 + FMA, else ``portable``)."""
    name = (model_name or "").lower()
    line = next((p for p in _PRODUCT_LINES if p in name), None)
    line = line or _VENDOR_LINE.get(vendor or "", "cpu")
    flags = set(flags)
    if {"amx_bf16", "amx_tile"} <= flags:
        isa = "amx"
    elif "avx512f" in flags:
        isa = "avx512"
    elif {"avx2", "fma"} <= flags:
        isa = "avx2"
    else:
        isa = "portable"
    named = core(vendor, family, model)
    return f"{line}-{named}-{isa}" if named else f"{line}-{isa}"


def native_path() -> dict:
    """The native kernel path mha compiled on this machine: ``{"isa": ..., "float32": tile,
    "bfloat16": tile}``, or ``{"error": reason}`` when the extension cannot be built. A
    ``MHA_FLASH_BF16`` this build cannot run is raised (:mod:`mha.ops.forcing`), not recorded."""
    from mha.ops import forcing

    try:
        from mha.ops import flash

        return {"isa": flash.isa(), **flash.kernels()}
    except Exception as e:  # noqa: BLE001 — a missing build is a fact to record, not a crash
        if forcing.is_refusal(e):
            raise
        return {"error": f"{type(e).__name__}: {e}"}


def record(cpuinfo_text: str | None = None, *, with_native: bool = True) -> dict:
    """This machine's CPU record (see the module docstring). ``cpuinfo_text`` replaces
    ``/proc/cpuinfo`` (tests); ``with_native=False`` leaves out the native kernel path."""
    if cpuinfo_text is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo_text = f.read()
        except OSError:
            cpuinfo_text = ""
    rec = parse_cpuinfo(cpuinfo_text)
    if rec["model_name"] is None:
        import platform

        rec["model_name"] = platform.processor() or None
    try:
        rec["usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        rec["usable"] = os.cpu_count()
    rec["kind"] = kind(rec["vendor"], rec["model_name"], rec["flags"], rec["family"],
                       rec["model"])
    if with_native:
        rec["native"] = native_path()
    return rec


def of_run(run: dict) -> dict:
    """The CPU record of a saved run: its own (``meta.cpu_info``), or for a run without one,
    a record inferred from its model name (``meta.cpu``) and the peak loops it measured."""
    meta = run.get("meta", {})
    rec = meta.get("cpu_info")
    if isinstance(rec, dict) and isinstance(rec.get("kind"), str):
        return rec
    name = meta.get("cpu") if isinstance(meta.get("cpu"), str) else None
    peaks = run.get("peaks", {})
    fp32_how = str(peaks.get("fp32", {}).get("how", ""))
    flags = []
    if fp32_how.startswith("AVX-512"):
        flags.append("avx512f")
    elif fp32_how.startswith("AVX2"):
        flags += ["avx2", "fma"]
    if "bf16_avx512" in peaks:
        flags.append("avx512_bf16")
    if "bf16_amx" in peaks:
        flags += ["amx_bf16", "amx_tile"]
    vendor = ("AuthenticAMD" if name and "amd" in name.lower() else
              "GenuineIntel" if name and "intel" in name.lower() else None)
    return {"vendor": vendor, "model_name": name, "flags": flags,
            "kind": kind(vendor, name, flags),
            "inferred": "from the model name and the peak loops measured (the run has no CPU "
                        "record)"}


def describe(rec: dict) -> str:
    """One line for headers and plot titles, e.g. ``epyc-zen3-avx2: AMD EPYC (family 25 model 1
    stepping 1; avx2 fma; 2 CPUs); native kernels float32 portable, bfloat16 portable``."""
    ids = " ".join(f"{k} {rec[k]}" for k in ("family", "model", "stepping")
                   if rec.get(k) is not None)
    isa = " ".join(rec.get("flags") or []) or "no AVX2/AVX-512/AMX"
    parts = [p for p in (ids, isa, f"{rec['cpus']} CPUs" if rec.get("cpus") else "") if p]
    text = f"{rec.get('kind', '?')}: {rec.get('model_name') or '?'} ({'; '.join(parts)})"
    nat = rec.get("native")
    if isinstance(nat, dict):
        if "error" in nat:
            text += "; native kernels not built"
        else:
            text += (f"; native kernels float32 {nat.get('float32', '?')}, "
                     f"bfloat16 {nat.get('bfloat16', '?')}")
    if rec.get("inferred"):
        text += f" — kind inferred {rec['inferred']}"
    return text


def check_record(rec, where: str = "meta.cpu_info") -> None:
    """Raise ValueError naming the field unless ``rec`` is a CPU record a report can use (its
    ``kind`` becomes part of file names and markers, so it must match :data:`KIND_PATTERN`)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where} must be an object, got {type(rec).__name__}")
    k = rec.get("kind")
    if not isinstance(k, str) or not KIND_PATTERN.fullmatch(k) or len(k) > 40:
        raise ValueError(f"{where}.kind must be a short label of lower-case letters, digits and "
                         f"dashes (e.g. epyc-zen3-avx2), got {str(k)[:40]!r}")
    flags = rec.get("flags", [])
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise ValueError(f"{where}.flags must be an array of strings")
    for key in ("vendor", "model_name"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            raise ValueError(f"{where}.{key} must be a string or null")
    for key in ("family", "model", "stepping", "cpus", "usable"):
        v = rec.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ValueError(f"{where}.{key} must be an integer or null")
    if rec.get("native") is not None and not isinstance(rec["native"], dict):
        raise ValueError(f"{where}.native must be an object or null")
