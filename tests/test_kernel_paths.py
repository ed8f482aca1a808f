"""Every kernel path this CPU can run, forced one at a time, against the float64 oracle.

The native kernels pick their path once per process from the CPU and a few environment
variables (README, "Environment variables"): ``MHA_FLASH_BF16`` (the flash forward's bf16 tile
kernel; the fused backward's products follow it: AMX tiles for ``amx``, vdpbf16ps for
``avx512bf16``, fp32 otherwise),
``MHA_DECODE_BF16`` (the decode kernel's bf16 q.k: AMX or vdpbf16ps) and ``MHA_LINEAR`` (the
module's projections: mha.linear's tiles or torch's GEMM). Because they are read once, each
row of ``PATHS`` runs in a subprocess of its own with its variables set, and that one process
runs every check of the row: the forcing took effect (for the forward, whose choice can be
read back), then the forward, the backward, decoding and the bf16 projections against the
float64 oracle with the repository's rule (tests/oracle.py: at most 2x the naive bf16 error
plus a floor).

A row runs where the CPU has the instruction sets it needs, read from the CPU's flags (never
its vendor); elsewhere it is skipped with the reason ("no amx_bf16 on this CPU"), so an AMX
machine runs the AMX rows and an AVX2-only machine only the portable one. The ``amx-emulated``
row runs the AMX kernels on software tiles (``MHA_AMX_EMULATE=1``: a build of its own, cached
like any other) on AVX512_BF16 CPUs without AMX, and is skipped where the CPU has AMX (the
``amx`` row runs the hardware there); besides the forward's choice it reads back the decode
kernel's (``mha.ops.decode.bf16_qk``).

Shape legend: B batch, h heads, h_kv K/V heads, Tq/Tk lengths, d head dim.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from amx_mode import AMX_FLAGS, cpu_flags, current

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


@dataclass(frozen=True)
class KernelPath:
    """One forced configuration: the variables that force it, the CPU flags it executes on
    (and those that make it pointless: ``absent``), the forward tile kernel the forcing must
    select, the name the build lists for it (``flash.isa()``), and the checks its process
    runs."""

    name: str
    env: dict = field(hash=False)
    needs: frozenset
    forward: str  # flash.kernels()["bfloat16"] when forced
    checks: tuple = ("forward", "backward", "decode")
    absent: frozenset = frozenset()
    isa: str | None = None  # in flash.isa() when built; None: the forward's name
    decode: str | None = None  # decode.bf16_qk() when forced; None: not read back


PATHS = [
    KernelPath("avx512bf16", {"MHA_FLASH_BF16": "avx512bf16", "MHA_DECODE_BF16": "avx512bf16",
                              "MHA_LINEAR": "native"},
               frozenset({"avx512f", "avx512_bf16"}), "avx512bf16",
               ("forward", "backward", "decode", "linear_bf16_tiles")),
    KernelPath("avx512f", {"MHA_FLASH_BF16": "avx512f", "MHA_LINEAR": "torch"},
               frozenset({"avx512f"}), "avx512f",
               ("forward", "backward", "decode", "linear_torch")),
    KernelPath("portable", {"MHA_FLASH_BF16": "portable"}, frozenset(), "portable",
               ("forward", "backward", "decode_portable")),
    KernelPath("amx", {"MHA_FLASH_BF16": "amx", "MHA_DECODE_BF16": "amx"},
               frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}), "amx",
               decode="amx"),
    KernelPath("amx-emulated", {"MHA_AMX_EMULATE": "1", "MHA_FLASH_BF16": "amx",
                                "MHA_DECODE_BF16": "amx"},
               frozenset({"avx512f", "avx512_bf16"}), "amx",
               absent=frozenset({"amx_tile", "amx_bf16"}), isa="amx-emulated",
               decode="amx-emulated"),
]
FORCING = ("MHA_FLASH_BF16", "MHA_DECODE_BF16", "MHA_LINEAR", "MHA_AMX_EMULATE")




@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_forced_path(path: KernelPath):
    missing = sorted(path.needs - cpu_flags())
    if missing:
        pytest.skip(f"no {' / '.join(missing)} on this CPU: the {path.name} path cannot run here")
    present = sorted(path.absent & cpu_flags())
    if present:
        pytest.skip(f"{' / '.join(present)} on this CPU: the hardware path runs instead of "
                    f"{path.name}")
    if AMX_FLAGS <= path.needs and current()[0] is None:
        pytest.skip(current()[1])  # an AMX CPU whose OS refuses the tile state
    import subprocess

    env = dict(os.environ, **path.env)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE),
                                         *filter(None, [env.get("PYTHONPATH")])])
    for name in set(FORCING) - path.env.keys():
        env.pop(name, None)  # the row's defaults, not the caller's forcing
    selection = f"{path.forward}:{path.isa or path.forward}:{path.decode or ''}"
    res = subprocess.run([sys.executable, __file__, selection, *path.checks], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"the {path.name} process failed:\n{res.stderr[-4000:]}"
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert list(results) == ["selected", *path.checks]
    not_built = {k: v for k, v in results.items() if v.startswith("not built:")}
    if not_built and len(not_built) == len(results):
        pytest.skip(f"{path.name}: {next(iter(not_built.values()))}")
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, f"{path.name}: {failed}"


@dataclass(frozen=True)
class Refusal:
    """A forcing this build / CPU / OS cannot honour (or, ``refused`` None, a fallback it must
    take instead): the variables, the CPU flags it applies on (``needs``; ``absent`` must be
    missing), and what the child checks (:func:`check_refusal`)."""

    name: str
    env: dict = field(hash=False)
    refused: tuple | None  # the words every refused bf16 call must say; None: no refusal
    needs: frozenset = frozenset()
    absent: frozenset = frozenset()


REFUSALS = [
    Refusal("flash_unknown", {"MHA_FLASH_BF16": "avx512"},
            ("MHA_FLASH_BF16=avx512 is not a choice: expected one of avx512bf16, avx512f, "
             "portable, amx",)),
    Refusal("decode_unknown", {"MHA_DECODE_BF16": "vdpbf16ps"},
            ("MHA_DECODE_BF16=vdpbf16ps is not a choice: expected one of amx, avx512bf16",)),
    Refusal("flash_amx_without_tiles", {"MHA_FLASH_BF16": "amx"},
            ("MHA_FLASH_BF16=amx cannot run here: no AMX tiles in this build: the CPU lacks "
             "amx_bf16", "choices this build can run: avx512bf16, avx512f, portable"),
            absent=AMX_FLAGS),
    Refusal("decode_amx_without_tiles", {"MHA_DECODE_BF16": "amx"},
            ("MHA_DECODE_BF16=amx cannot run here: no AMX tiles in this build: the CPU lacks "
             "amx_bf16", "choices this build can run: avx512bf16"),
            needs=frozenset({"avx512f", "avx512_bf16"}), absent=AMX_FLAGS),
    Refusal("flash_avx512f_without_it", {"MHA_FLASH_BF16": "avx512f"},
            ("MHA_FLASH_BF16=avx512f cannot run here: this build lacks avx512f",),
            absent=frozenset({"avx512f"})),
    # an OS that refuses the tile state (forced by the test seam, on software tiles): the
    # default falls back to the next kernel and says why; forcing amx is refused
    Refusal("os_refuses_tiles_default", {"MHA_AMX_EMULATE": "1", "MHA_TEST_AMX_REFUSED": "1"},
            None, needs=frozenset({"avx512f", "avx512_bf16"}), absent=AMX_FLAGS),
    Refusal("os_refuses_tiles_forced", {"MHA_AMX_EMULATE": "1", "MHA_TEST_AMX_REFUSED": "1",
                                        "MHA_FLASH_BF16": "amx", "MHA_DECODE_BF16": "amx"},
            ("=amx cannot run here: the OS refuses the AMX tile state "
             "(MHA_TEST_AMX_REFUSED=1)",),
            needs=frozenset({"avx512f", "avx512_bf16"}), absent=AMX_FLAGS),
]
SEAMS = ("MHA_TEST_AMX_REFUSED",)


@pytest.mark.parametrize("case", REFUSALS, ids=[r.name for r in REFUSALS])
def test_forcing_that_cannot_run(case: Refusal):
    """A value that cannot run here is refused at every bf16 call with the variable, the
    value, the choices and why (fp32 calls unaffected); an OS that refuses the AMX tile state
    makes the default fall back to the next kernel, with the reason in mha.explain."""
    flags = cpu_flags()
    if not case.needs <= flags or case.absent & flags:
        pytest.skip(f"{case.name} applies on a CPU with {sorted(case.needs) or 'any flags'} "
                    f"and without {sorted(case.absent)}")
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in FORCING + SEAMS}
    env.update(case.env)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    words = json.dumps(case.refused)
    res = subprocess.run([sys.executable, __file__, "--refusal", words], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"the {case.name} process failed:\n{res.stderr[-4000:]}"
    verdict = json.loads(res.stdout.strip().splitlines()[-1])
    assert verdict == "ok", f"{case.name}: {verdict}"


def test_a_named_kernel_is_refused_in_the_words_of_the_forcing_rule():
    """The test op ``_flash_attention_fwd_kernel`` refuses a kernel it cannot run with the
    words of ``check_forced`` (csrc/common/kernel_choice.h: one source): the name, the value,
    the choices and why."""
    import torch

    from mha.ops import flash

    if flash.unavailable() is not None:
        pytest.skip(f"the flash kernel is not built: {flash.unavailable()}")
    q = torch.randn(1, 2, 8, 16)  # (B, h, T, d)
    op = torch.ops.mha._flash_attention_fwd_kernel
    with pytest.raises(RuntimeError) as unknown:
        op(q, q, q, None, None, False, 0.25, "avx512")
    first = str(unknown.value).splitlines()[0]
    assert first.startswith("flash_attention: kernel=avx512 is not a choice: expected one of "
                            "auto, small, avx512bf16, avx512f, portable, amx (this build can "
                            "run: auto, "), first
    assert first.endswith("; kernel 'auto' for the CPU's default)"), first
    with pytest.raises(RuntimeError) as fp32:
        op(q, q, q, None, None, False, 0.25, "avx512bf16")
    first = str(fp32.value).splitlines()[0]
    assert first.startswith("flash_attention: kernel=avx512bf16 cannot run here: "), first
    assert "(choices this build can run: auto, " in first, first
    if "avx512bf16" in flash.isa():
        assert "it takes bfloat16 inputs, not float32" in first, first


def test_mha_build_says_why_the_amx_tiles_are_not_used():
    """``mha build`` where the build has AMX tiles the OS refuses (the seam, software tiles):
    the bf16 choices are the next kernels, each with the reason, exit 0."""
    flags = cpu_flags()
    if not {"avx512f", "avx512_bf16"} <= flags or AMX_FLAGS & flags:
        pytest.skip("needs the software tiles: a CPU with AVX512_BF16 and without AMX")
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in FORCING + SEAMS}
    env.update(MHA_AMX_EMULATE="1", MHA_TEST_AMX_REFUSED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    res = subprocess.run([sys.executable, "-m", "mha.cli", "build"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    why = "the OS refuses the AMX tile state (MHA_TEST_AMX_REFUSED=1)"
    lines = res.stdout.splitlines()
    assert any("bfloat16 -> avx512bf16" in ln for ln in lines), res.stdout
    assert f"  AMX tiles not used: {why}" in lines, res.stdout
    assert f"  decode, bfloat16 q.k: avx512bf16 (not AMX: {why})" in lines, res.stdout
    assert "  backward, bfloat16 inputs: bf16 products (vdpbf16ps)" in lines, res.stdout


def check_refusal(words: list[str] | None) -> str:
    """In the child: every bf16 entry point refuses with ``words`` (those the forcing reaches:
    the flash forward, its backward and paged forward, decode, the read-backs), fp32 runs; or
    (``words`` None) the AMX fallback: the next kernel runs bf16 and explain says why."""
    import torch

    import mha
    from mha.ops import decode, flash

    q, k, v = _inputs(1, 4, 2, 70, 100, 64, seed=1)
    d1 = q[:, :, :1]
    if words is None:
        if flash.load_backward() is not None:
            return f"not built: {flash.load_backward()}"
        picked = (flash.kernels()["bfloat16"], decode.bf16_qk(),
                  torch.ops.mha.flash_attention_bwd_bf16_math())
        if picked != ("avx512bf16", "avx512bf16", "bf16"):
            return f"failed: expected the fallback (avx512bf16 x2, bf16), got {picked}"
        why = flash.amx_refused() or ""
        if "refuses the AMX tile state" not in why or decode.amx_refused() != why:
            return f"failed: reasons {why!r} / {decode.amx_refused()!r}"
        said = [str(v) for v in [*mha.explain(q, k, v), *mha.explain(d1, k, v)]]
        chosen = [line for line in said if " chosen " in line and f"not AMX: {why}" in line]
        if [line.split()[0] for line in chosen] != ["flash_cpu", "flash_decode"]:
            return f"failed: explain does not say why: {said}"
        check_forward()
        _decode(False)
        return "ok"
    attempts = {
        "forward": lambda: mha.attention(q, k, v, backend="flash_cpu"),
        "kernels": flash.kernels,
        "backward": lambda: flash.load_backward() or torch.ops.mha.flash_attention_bwd_bf16_math(),
        "decode": lambda: decode.flash_decode(d1, k, v),
        "bf16_qk": decode.bf16_qk,
        "small": lambda: mha.attention(q[:, :, :8], k[:, :, :32], v[:, :, :32],
                                       backend="flash_cpu"),  # the small-problem path
    }
    refused = []
    for name, fn in attempts.items():
        try:
            fn()
        except RuntimeError as e:
            msg = str(e).splitlines()[0]
            if not all(w in msg for w in words):
                return f"failed: {name}: {msg!r} lacks {words}"
            refused.append(name)
    var = words[0].partition("=")[0]  # "" when the words fit both variables
    want = ({"forward", "kernels", "backward", "small"} if var == "MHA_FLASH_BF16" else
            {"decode", "bf16_qk"} if var == "MHA_DECODE_BF16" else set(attempts))
    if set(refused) != want:
        return f"failed: refused by {sorted(refused)}, expected {sorted(want)}"
    f32 = [t.float() for t in (q, k, v)]  # fp32 calls never read the bf16 choice
    mha.attention(*f32, backend="flash_cpu")
    decode.flash_decode(f32[0][:, :, :1], f32[1], f32[2])
    return "ok"


# ----------------------------------------------------------------------------- the subprocess
def _inputs(B, h, h_kv, Tq, Tk, d, seed, grad=False):
    import torch

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, d, generator=g).bfloat16().requires_grad_(grad)
               for n, T in ((h, Tq), (h_kv, Tk), (h_kv, Tk)))
    return q, k, v


def _allowed(B, h, Tq, Tk, causal):
    import mha

    return mha.causal_mask(Tq, Tk) if causal else None


def check_selected(selection: str) -> str:
    """``forward:isa:decode``: the forward kernel the forcing selects, the name the build lists
    it under, and the decode kernel's bf16 q.k (empty: not read back)."""
    from mha.ops import decode, flash

    forward, isa, qk = selection.split(":")
    if isa not in flash.isa().split(","):
        return f"not built: the {isa} kernel is not compiled in (isa {flash.isa()})"
    got = flash.kernels()["bfloat16"]
    if got != forward:
        return f"expected the {forward} kernel, the process runs {got}"
    if qk and decode.bf16_qk() != qk:
        return f"expected the decode q.k on {qk}, the process runs {decode.bf16_qk()}"
    if flash.load_backward() is None:  # the fused backward's products follow the forward's
        import torch

        want = {"amx": "amx", "avx512bf16": "bf16"}.get(forward, "fp32")
        math = torch.ops.mha.flash_attention_bwd_bf16_math()
        if math != want:
            return f"expected the backward's bf16 products on {want}, the process runs {math}"
    return "ok"


def check_forward() -> str:
    import mha

    from oracle import assert_within_budget

    for B, h, h_kv, Tq, Tk, d, causal in ((2, 4, 4, 70, 70, 64, False),
                                         (1, 8, 2, 33, 129, 64, True),
                                         (2, 2, 2, 200, 200, 128, True)):
        q, k, v = _inputs(B, h, h_kv, Tq, Tk, d, seed=Tq)
        out = mha.attention(q, k, v, causal=causal, backend="flash_cpu")
        kr, vr = (t.repeat_interleave(h // h_kv, 1) for t in (k, v))
        assert_within_budget(out, q, kr, vr, _allowed(B, h, Tq, Tk, causal),
                             what=f"forward {B}x{h}/{h_kv}x{Tq}x{Tk}x{d} causal={causal}")
    return "ok"


def check_backward() -> str:
    import torch

    import mha
    from mha import reference

    for B, h, Tq, Tk, d, causal in ((2, 4, 64, 64, 64, False), (1, 2, 40, 97, 64, True)):
        q, k, v = _inputs(B, h, h, Tq, Tk, d, seed=d + Tk, grad=True)
        g = torch.Generator().manual_seed(7)
        dout = torch.randn(B, h, Tq, d, generator=g).bfloat16()
        allowed = _allowed(B, h, Tq, Tk, causal)
        got = torch.autograd.grad(mha.attention(q, k, v, causal=causal, backend="flash_cpu"),
                                  (q, k, v), dout)
        ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        exact = torch.autograd.grad(reference.attention(*ins64, allowed=allowed, upcast=True)[0],
                                    ins64, dout.double())
        ins16 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        naive = torch.autograd.grad(reference.attention(*ins16, allowed=allowed, upcast=False)[0],
                                    ins16, dout)
        for name, a, e, n in zip("qkv", got, exact, naive, strict=True):
            err = (a.double() - e).abs().max().item()
            budget = 2 * (n.double() - e).abs().max().item() + 1e-2
            assert err <= budget, \
                f"grad_{name} ({Tq}x{Tk} causal={causal}): {err:.3e} > {budget:.3e}"
    return "ok"


def _decode(portable: bool) -> str:
    import torch

    from mha.ops import decode

    from oracle import assert_within_budget

    if decode.unavailable() is not None:
        return f"not built: {decode.unavailable()}"
    for B, h, h_kv, Tq, Tk, d, causal in ((2, 8, 2, 1, 300, 64, False),
                                         (1, 4, 4, 4, 77, 128, True),
                                         (3, 16, 1, 1, 1000, 64, False)):
        q, k, v = _inputs(B, h, h_kv, Tq, Tk, d, seed=Tk)
        out = decode.flash_decode(q, k, v, causal=causal, portable=portable)
        kr, vr = (t.repeat_interleave(h // h_kv, 1) for t in (k, v))
        assert out.dtype == torch.bfloat16
        assert_within_budget(out, q, kr, vr, _allowed(B, h, Tq, Tk, causal),
                             what=f"decode {B}x{h}/{h_kv}x{Tq}x{Tk}x{d} portable={portable}")
    return "ok"


def _module_bf16(expect: str) -> str:
    import torch

    import mha

    torch.manual_seed(0)
    m = mha.MultiHeadAttention(256, 4).bfloat16()
    x = torch.randn(16, 24, 256).bfloat16()
    said = m.explain(x).splitlines()[1:3]
    assert all(expect in line for line in said), said
    with torch.no_grad():
        y = m(x).double()
        ref, _ = mha.reference.multi_head_attention(x.double(), x.double(), upcast=True,
                                                    **m.per_head_weights())
    err = (y - ref).abs().max().item()
    assert err < 2e-2 * max(1.0, ref.abs().max().item()), f"module bf16: error {err:.3e}"
    return "ok"


CHECKS = {
    "forward": check_forward,
    "backward": check_backward,
    "decode": lambda: _decode(False),
    "decode_portable": lambda: _decode(True),
    "linear_bf16_tiles": lambda: _module_bf16("the native bf16 tiles: forced by MHA_LINEAR=native"),
    "linear_torch": lambda: _module_bf16("torch's bf16 GEMM: forced by MHA_LINEAR=torch"),
}


def main(selection: str, checks: list[str]) -> None:
    """Run the checks in this process (its variables already set); print one JSON line,
    check -> "ok" | the failure | "not built: ..."."""
    from check_runner import run_checks

    run_checks(check_selected(selection), {name: CHECKS[name] for name in checks})


if __name__ == "__main__":
    if sys.argv[1] == "--refusal":
        try:
            print(json.dumps(check_refusal(json.loads(sys.argv[2]))))
        except AssertionError as e:
            print(json.dumps(f"failed: {e}"))
    else:
        main(sys.argv[1], sys.argv[2:])
