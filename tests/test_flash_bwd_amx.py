"""The fused backward's five products on AMX tiles (``csrc/amx/flash_amx_bwd.h``).

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims.

The tile products run where the CPU has AMX-BF16 (natively) and, on a CPU with AVX512_BF16 but
no AMX, on the software model of the tile unit (``csrc/amx/amx_emulate.h``: a build with
``MHA_AMX_EMULATE=1``, its own cache entry, numerically the instruction's definition). The
kernel choice is read once per process (``MHA_FLASH_BF16=amx``), so the whole module runs in ONE
subprocess with those variables: it runs every case of ``CASES`` and the extra checks and
prints one JSON line; each test below reads its case's verdict.

Each case judges dq, dk, dv against the float64 reference with the repository's rule
(tests/oracle.py, as tests/test_flash_bwd.py: at most 2x the naive bf16 error plus the floor
times the size of the cancellation ``dS = P (dP - delta)`` cannot avoid), and checks that the
tile products agree with the ``vdpbf16ps`` products (the same bf16 operands, summed in another
order) to a few bf16 roundings. The NaN / Inf cases use tests/test_hostile_nan_backward.py's
pair-by-pair reference and rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from amx_mode import current

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

# name -> (B, h, h_kv, Tq, Tk, d_k, d_v, causal, key_lengths, mask kind, window, layout)
CASES = {
    "dense_one_block": (1, 2, 2, 64, 64, 64, 64, False, None, None, 0, "bhtd"),
    "causal_square": (1, 2, 2, 130, 130, 64, 64, True, None, None, 0, "bthd"),
    "causal_tq_below_tk": (1, 2, 2, 70, 200, 32, 32, True, None, None, 0, "bthd"),
    "causal_tq_above_tk": (1, 2, 2, 150, 66, 96, 96, True, None, None, 0, "bthd"),
    "dense_tq_above_tk": (2, 1, 1, 97, 64, 128, 128, False, None, None, 0, "strided"),
    "gqa_causal_d128": (1, 6, 2, 100, 100, 128, 128, True, None, None, 0, "bthd"),
    "key_lengths": (3, 2, 1, 90, 129, 64, 64, False, (129, 37, 1), None, 0, "bthd"),
    "mask_full": (2, 2, 2, 77, 93, 64, 64, False, None, "full", 0, "bthd"),
    "mask_keys_causal": (2, 3, 1, 80, 80, 32, 32, True, None, "keys", 0, "bthd"),
    "dk96_dv32": (1, 2, 1, 72, 88, 96, 32, True, None, None, 0, "bthd"),
    "dk32_dv128": (1, 2, 2, 88, 72, 32, 128, False, None, None, 0, "bthd"),
    "odd_edges_d17_d15": (1, 3, 3, 67, 93, 17, 15, True, (93,), None, 0, "strided"),
    "rows_beyond_one_run": (1, 2, 1, 600, 70, 64, 64, False, None, None, 0, "bthd"),
    "window": (1, 2, 2, 300, 300, 64, 64, True, None, None, 50, "bthd"),
    "head_dim_256": (1, 1, 1, 64, 96, 256, 256, True, None, None, 0, "bthd"),
}
NAN_CASES = ["kv_seen_by_some_rows", "kv_past_key_lengths", "q_rows"]
NAN_SPECS = ["mask", "no_causal", "window"]
EXTRA = ["selected", "random_shapes", "auto_runs_the_tiles", "variants_and_mask_mod",
         "same_bits_across_threads", "dout_nan_units_fall_back"]
SCALE = 0.3




@cache
def _run_subprocess() -> dict:
    """Every check's verdict from one process with the tile products forced; {} plus a
    "skip" reason where they cannot run."""
    forced, why = current()  # native tiles, or the software ones
    if forced is None:
        return {"skip": why}
    env = {k: v for k, v in os.environ.items() if k not in ("MHA_AMX_EMULATE", "MHA_LINEAR")}
    env.update(forced)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE),
                                         *filter(None, [env.get("PYTHONPATH")])])
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=1800)
    assert res.returncode == 0, f"the AMX backward process failed:\n{res.stderr[-4000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def _verdict(name: str) -> None:
    results = _run_subprocess()
    if "skip" in results:
        pytest.skip(results["skip"])
    assert results[name] == "ok", f"{name}: {results[name]}"


@pytest.mark.parametrize("name", [*CASES, *(f"nan_{c}_{s}" for c in NAN_CASES
                                            for s in NAN_SPECS), *EXTRA])
def test_amx_backward(name):
    _verdict(name)


# ----------------------------------------------------------------------------- the subprocess
def _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, layout, seed):
    import torch

    from kernel_inputs import layout_tensor, qkv

    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(B, h, h_kv, Tq, Tk, d_k, d_v, torch.bfloat16, layout, g=g)
    go = layout_tensor(B, h, Tq, d_v, torch.bfloat16, layout, g)  # (B, h, Tq, d_v)
    gl = torch.randn(B, h, Tq, generator=g).bfloat16().float()  # grad_lse (B, h, Tq)
    return q, k, v, go, gl


def _spec(case, seed):
    import torch

    from kernel_inputs import bool_mask
    from mha.masks import MaskSpec

    B, h, _, Tq, Tk, _, _, causal, lengths, mask, window, _ = CASES[case]
    kl = torch.tensor(lengths) if lengths else None
    return MaskSpec(causal, kl, bool_mask(mask, B, h, Tq, Tk, seed), window or None)


def _bwd(go, gl, q, k, v, out, lse, spec, math):
    import torch

    from mha.ops import flash

    assert flash.load_backward() is None, flash.load_backward()
    return torch.ops.mha._flash_attention_bwd_fused_math(
        go, gl, q, k, v, out, lse, spec.key_lengths, spec.mask, spec.causal, SCALE, math,
        spec.window or 0)


def check_case(case: str) -> str:
    import torch

    from mha.ops import flash
    from test_flash_bwd import _cancellation, _reference_grads

    from oracle import FLOOR, max_err

    B, h, h_kv, Tq, Tk, d_k, d_v, *_, layout = CASES[case]
    seed = Tq * 7 + Tk
    q, k, v, go, gl = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, layout, seed)
    spec = _spec(case, seed)
    out, lse = flash.flash_attention(q, k, v, causal=spec.causal, key_lengths=spec.key_lengths,
                                      mask=spec.mask, scale=SCALE, window=spec.window)
    got = _bwd(go, gl, q, k, v, out, lse, spec, "amx")
    pairs = _bwd(go, gl, q, k, v, out, lse, spec, "bf16")
    want, ref_out = _reference_grads(q, k, v, go, gl.bfloat16(), spec, SCALE, upcast=True)
    low, _ = _reference_grads(q, k, v, go, gl.bfloat16(), spec, SCALE, upcast=False)
    size = max(1.0, _cancellation(q, k, go, ref_out, SCALE))
    for name, a, w, lo, p in zip("qkv", got, want, low, pairs, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == w.shape, f"d{name}: {a.dtype} {a.shape}"
        assert torch.isfinite(a).all(), f"d{name}: non-finite"
        budget = 2 * max_err(lo, w) + FLOOR[torch.bfloat16] * max(size, w.abs().max().item())
        err = max_err(a, w)
        assert err <= budget, f"d{name}: error {err:.3e} > {budget:.3e}"
        # the vdpbf16ps products: same operands, fp32 sums in another order, then bf16
        gap = (a.double() - p.double()).abs()
        allowed = 2 ** -7 * p.double().abs() + 1e-3 * max(1.0, p.double().abs().max().item())
        assert (gap <= allowed).all(), \
            f"d{name}: {int((gap > allowed).sum())} elements off the vdpbf16ps products"
    return "ok"


def check_random_shapes(n: int = 30) -> str:
    """n seeded random calls in the space of tests/test_flash_bwd.py's bf16 test (GQA, Tq and
    Tk 1..140, odd head dims, key_lengths, masks, layouts), each judged like a case above."""
    import random

    from kernel_inputs import key_lengths

    rng = random.Random(2024)
    for i in range(n):
        h_kv = rng.choice([1, 2])
        case = (rng.choice([1, 2]), h_kv * rng.choice([1, 3]), h_kv, rng.randint(1, 140),
                rng.randint(1, 140), rng.choice([16, 17, 33, 64, 128]),
                rng.choice([15, 24, 64, 100]), rng.random() < 0.5, None,
                rng.choice([None, "full", "keys"]), 0, rng.choice(["bhtd", "bthd", "strided"]))
        lengths = key_lengths(case[0], case[4], i, rng.random() < 0.5)
        case = (*case[:8], tuple(lengths.tolist()) if lengths is not None else None, *case[9:])
        CASES[f"random_{i}"] = case
        try:
            check_case(f"random_{i}")
        except AssertionError as e:
            raise AssertionError(f"(B, h, h_kv, Tq, Tk, d_k, d_v, causal, lengths, mask, "
                                 f"window, layout) = {case}: {e}") from None
        finally:
            del CASES[f"random_{i}"]
    return "ok"


def check_nan(case: str, spec_name: str) -> str:
    import torch

    import test_hostile_nan_backward as hn
    from kernel_inputs import qkv

    spec = hn.SPECS[spec_name]()
    q, k, v = hn._poison(*qkv(hn.B, hn.H, hn.H_KV, hn.TQ, hn.TK, hn.D_K, hn.D_V,
                                torch.bfloat16, "bthd", seed=7), case)
    go = torch.randn(hn.B, hn.H, hn.TQ, hn.D_V,
                     generator=torch.Generator().manual_seed(8)).bfloat16()
    allowed = spec.dense(hn.B, hn.H, hn.TQ, hn.TK)  # (B, H, TQ, TK)
    out, lse, want = hn.rule_reference(q, k, v, go, allowed, hn.SCALE, torch.float64)
    _, _, low = hn.rule_reference(q, k, v, go, allowed, hn.SCALE, torch.bfloat16)
    got = hn._backward("amx", go, q, k, v, out.bfloat16(), lse.float(), spec)
    for name, a, w, lo in zip("qkv", got, want, low, strict=True):
        hn._assert_rule(a.double(), w, lo.double(), torch.bfloat16, f"d{name}")
    return "ok"


def check_selected() -> str:
    import torch

    from mha.ops import flash

    if not any(i.startswith("amx") for i in flash.isa().split(",")):
        # the CPU can run the tiles (amx_mode.mode), so a build without them is a failure
        return f"failed: no AMX tiles compiled in (isa {flash.isa()})"
    if flash.load_backward() is not None:
        return f"failed: the backward did not build: {flash.load_backward()}"
    math = torch.ops.mha.flash_attention_bwd_bf16_math()
    return "ok" if math == "amx" else f"failed: the backward runs {math} products"


def check_auto_runs_the_tiles() -> str:
    """The op autograd calls (``flash_attention_bwd_fused``: the arithmetic chosen per process,
    here MHA_FLASH_BF16=amx; from one 64 x 64 block on) gives the tile products' bits, not the
    vdpbf16ps ones; and training through mha.attention stays within the oracle's budget."""
    import torch

    import mha
    from mha.masks import MaskSpec
    from mha.ops import flash
    from test_flash_bwd import _cancellation, _reference_grads

    from oracle import FLOOR, max_err

    B, h, T, d = 1, 2, 96, 64
    q, k, v, go, _ = _inputs(B, h, h, T, T, d, d, "bthd", seed=3)
    spec = MaskSpec(True, None, None, None)
    out, lse = flash.flash_attention(q, k, v, causal=True, scale=SCALE)
    assert flash.load_backward() is None
    chosen = torch.ops.mha.flash_attention_bwd_fused(go, None, q, k, v, out, lse, None, None,
                                                     True, SCALE)[:3]
    tiles = _bwd(go, None, q, k, v, out, lse, spec, "amx")
    pairs = _bwd(go, None, q, k, v, out, lse, spec, "bf16")
    assert all(torch.equal(a, t) for a, t in zip(chosen, tiles, strict=True)), \
        "the chosen arithmetic's gradients differ from the tile products'"
    assert not all(torch.equal(t, p) for t, p in zip(tiles, pairs, strict=True)), \
        "the tile and vdpbf16ps products gave the same bits: the check cannot tell them apart"
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(mha.attention(*ins, causal=True, scale=SCALE, backend="flash_cpu"),
                              ins, go)
    zero = torch.zeros(B, h, T)
    want, ref_out = _reference_grads(q, k, v, go, zero, spec, SCALE, upcast=True)
    low, _ = _reference_grads(q, k, v, go, zero, spec, SCALE, upcast=False)
    size = max(1.0, _cancellation(q, k, go, ref_out, SCALE))
    for name, a, w, lo in zip("qkv", got, want, low, strict=True):
        budget = 2 * max_err(lo, w) + FLOOR[torch.bfloat16] * max(size, w.abs().max().item())
        assert max_err(a, w) <= budget, f"autograd d{name}: {max_err(a, w):.3e} > {budget:.3e}"
    return "ok"


def check_variants_and_mask_mod() -> str:
    """Score variants (softcap, ALiBi; sinks and a bias with their gradients) and a mask_mod's
    block plan (48-row query blocks, EMPTY ones skipped: runs of rows break there) around the
    tile products: training through mha.attention against float64 autograd."""
    import torch

    import mha
    from mha import mods, reference
    from test_flash_bwd import _cancellation
    from test_flash_plan import _expected, _grads
    from test_variants import _allowed

    from oracle import FLOOR, max_err

    g = torch.Generator().manual_seed(11)
    B, h, h_kv, T, d = 1, 4, 2, 160, 64

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).bfloat16()

    q, k, v = rand(B, h, T, d), rand(B, h_kv, T, d), rand(B, h_kv, T, d)
    sinks, bias = rand(h), rand(1, h, T, T)
    fixed = {"softcap": 20.0, "alibi_slopes": mha.alibi_slopes(h).bfloat16()}
    def gap(b, h, q_idx, kv_idx):  # rows 48..95 see no key: their 48-row plan blocks EMPTY
        return (q_idx < 48) | (q_idx >= 96)

    for mod, masks in ((None, {"causal": True}),
                       (mods.document(cu_seqlens=torch.tensor([0, 50, 120, 160])), {}),
                       (gap, {})):
        allowed = _allowed(q, k, masks) if mod is None else _expected(q, k, mod, masks)

        def run(backend=None, upcast=False, mod=mod, masks=masks, allowed=allowed):
            def fn(q, k, v, sinks, bias):
                if backend is None:
                    return reference.attention(q, k, v, allowed=allowed, upcast=upcast,
                                               sinks=sinks, bias=bias, **fixed)[0]
                return mha.attention(q, k, v, mask_mod=mod, backend=backend, sinks=sinks,
                                     bias=bias, **masks, **fixed)
            return fn

        inputs = [q, k, v, sinks, bias]
        ref, go, out = _grads(run(upcast=True), [t.double() for t in inputs])
        low = _grads(run(), inputs)[0]
        got = _grads(run("flash_cpu"), inputs)[0]
        size = max(1.0, _cancellation(q, k, go, out, d ** -0.5))
        for what, a, r, lo in zip(["q", "k", "v", "sinks", "bias"], got, ref, low, strict=True):
            assert torch.isfinite(a).all(), f"grad {what} not finite"
            budget = 2 * max_err(lo, r) + FLOOR[torch.bfloat16] * max(size, r.abs().max().item())
            err = max_err(a, r)
            assert err <= budget, \
                f"mask_mod={mod is not None} grad {what}: error {err:.3e} > {budget:.3e}"
    return "ok"


def check_same_bits_across_threads() -> str:
    import torch

    from mha.ops import flash

    q, k, v, go, gl = _inputs(2, 4, 2, 160, 150, 64, 64, "bthd", seed=5)
    spec = _spec("causal_square", 5)
    out, lse = flash.flash_attention(q, k, v, causal=True, scale=SCALE)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (2, 1, 2):
            torch.set_num_threads(n)
            runs.append(_bwd(go, gl, q, k, v, out, lse, spec, "amx"))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True)), \
            "gradients differ between thread counts"
    return "ok"


def check_dout_nan_units_fall_back() -> str:
    """A unit whose grad_out holds NaN runs the vdpbf16ps products (bit for bit); the other
    units keep the tiles."""
    import torch

    from mha.masks import MaskSpec
    from mha.ops import flash

    q, k, v, go, _ = _inputs(2, 2, 2, 80, 80, 64, 64, "bthd", seed=9)
    go = go.clone()
    go[0, 1, 33, 5] = float("nan")
    spec = MaskSpec(True, None, None, None)
    out, lse = flash.flash_attention(q, k, v, causal=True, scale=SCALE)
    tiles = _bwd(go, None, q, k, v, out, lse, spec, "amx")
    pairs = _bwd(go, None, q, k, v, out, lse, spec, "bf16")
    for name, t, p in zip("qkv", tiles, pairs, strict=True):
        assert torch.equal(t[0, 1].isnan(), p[0, 1].isnan()), f"d{name}: NaN elsewhere"
        assert torch.equal(t[0, 1].nan_to_num(), p[0, 1].nan_to_num()), \
            f"d{name}: the NaN unit is not the vdpbf16ps one"
        assert torch.isfinite(t[1]).all(), f"d{name}: NaN reached another unit"
    return "ok"


def main() -> None:
    """Run every check in this process (its variables already set); print one JSON line,
    check -> "ok" | the failure."""
    from check_runner import run_checks

    checks = {c: (lambda c=c: check_case(c)) for c in CASES}
    checks.update({f"nan_{c}_{s}": (lambda c=c, s=s: check_nan(c, s))
                   for c in NAN_CASES for s in NAN_SPECS})
    checks.update({"random_shapes": check_random_shapes,
                   "auto_runs_the_tiles": check_auto_runs_the_tiles,
                   "variants_and_mask_mod": check_variants_and_mask_mod,
                   "same_bits_across_threads": check_same_bits_across_threads,
                   "dout_nan_units_fall_back": check_dout_nan_units_fall_back})
    run_checks(check_selected(), checks)


if __name__ == "__main__":
    main()
