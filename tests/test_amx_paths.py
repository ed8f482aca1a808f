"""The AMX tile kernels against the float64 oracle: the flash forward (every tile layout), its
backward, the paged forward and decode, on AMX CPUs and, through software tiles, on CPUs
without AMX.

Shape legend: B batch, h query heads, h_kv K/V heads, Tq/Tk lengths, d_k/d_v head dims, G =
h / h_kv * Tq (decode's query rows per K/V group), N packed queries, p page size.

Where the CPU has AMX the hardware runs the checks; on an AVX512_BF16 CPU without AMX they run
on the software model of the tile unit (``csrc/amx/amx_emulate.h``, a ``MHA_AMX_EMULATE=1``
build: cached under a key of its own, ~70 s to compile once); elsewhere the module is skipped
with the reason. The kernels pick their path once per process, so one subprocess, started with
``MHA_FLASH_BF16=amx MHA_DECODE_BF16=amx`` (and ``MHA_AMX_EMULATE=1`` where emulated), runs
every check of :data:`CHECKS` and prints one JSON line; each check is one test here.

Every check is judged by the repository's rule (tests/oracle.py: at most 2x the error of the
naive bf16 computation plus a floor; the NaN / Inf rule of tests/test_hostile_nan_kernels.py,
whose float64 oracle it reuses). The forward is forced by name (``amx``) so that no shape goes
to the small-problem path; the paged forward and decode take the process's choice, read back
first (``selected``).

The forward's tile layouts (csrc/amx/flash_amx_kernel.h, flash_amx_loop.h), with dkp = d_k
rounded up to 32, dvp = d_v rounded up to 16, 48-row query blocks of 16-row groups:
d_k, d_v <= 64 (O and Q resident: NC = dvp / 16 O tiles, KC = dkp / 32 Q tiles); d_v <= 64 <
d_k (O resident, Q reloaded); d_v > 64 with two groups at a time (group_pair_runs: runs of 4
key blocks, O 32 columns at a time, a last 16-column tile when dvp / 16 is odd) and a group
left over (pv_block: O 64 columns at a time, a narrower rest).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from amx_mode import current, mode, tile_state_refused

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    """Every check's outcome from one subprocess: check -> "ok" | the failure."""
    import subprocess

    forced, name = current()
    if forced is None:
        pytest.skip(name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MHA_FLASH_BF16", "MHA_DECODE_BF16", "MHA_AMX_EMULATE", "MHA_LINEAR")}
    env.update(forced)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    res = subprocess.run([sys.executable, __file__, name], env=env, capture_output=True,
                         text=True, timeout=1800)
    assert res.returncode == 0, f"the {name} process failed:\n{res.stderr[-4000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the subprocess
def _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, seed, drift=False):
    """Random bf16 q, k, v. ``drift``: the scores of a random half of the rows grow along the
    keys by up to 60 (d_k ** -0.5 q.k), so that their running max moves again and again (the
    lazy softmax rescales O when it grows by 2^16) while the other rows' stays."""
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Tq, d_k, generator=g)
    k = torch.randn(B, h_kv, Tk, d_k, generator=g)
    v = torch.randn(B, h_kv, Tk, d_v, generator=g).bfloat16()
    if drift:
        u = torch.randn(d_k, generator=g)
        u = u / u.norm() * d_k ** 0.25  # |u|^2 d_k^-0.5 = 1
        rows = (torch.rand(B, h, Tq, 1, generator=g) > 0.5).float()  # (B, h, Tq, 1)
        q = q + rows * u
        k = k + torch.linspace(0, 60, Tk)[:, None] * u  # (B, h_kv, Tk, d_k)
    return q.bfloat16(), k.bfloat16(), v


def _masks(kind, B, h, Tq, Tk, seed):
    """(causal, key_lengths, mask, window) of one mask kind; ``window_w`` = causal + window w."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    if kind == "none":
        return False, None, None, None
    if kind == "causal":
        return True, None, None, None
    if kind == "key_lengths":  # 19 keys (not a multiple of 16), random, none (B > 1: the last)
        kl = torch.randint(1, Tk + 1, (B,), generator=g)
        kl[0] = min(Tk, 19)
        if B > 1:
            kl[-1] = 0
        return False, kl, None, None
    if kind == "bool":  # (B, 1, Tq, Tk): rows that may attend nothing, a group that may not
        mask = torch.rand(B, 1, Tq, Tk, generator=g) > 0.3
        mask[:, :, 0] = False
        mask[:, :, 16:32] = False
        return False, None, mask, None
    if kind == "bool_heads":  # (1, h, 1, Tk): per head and key, broadcast over rows
        return False, None, torch.rand(1, h, 1, Tk, generator=g) > 0.5, None
    if kind.startswith("window_"):
        return True, None, None, int(kind.split("_")[1])
    raise ValueError(kind)


def _amx_forward(q, k, v, causal, kl, mask, window, scale=None):
    """``(out, lse)`` of the AMX forward, forced by name (never the small path)."""
    import torch

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.mha._flash_attention_fwd_kernel(q, k, v, kl, mask, causal, scale, "amx",
                                                     window or 0)


def _judge(cases, run) -> str:
    """Run ``run(case)`` for each case; "ok", or the failures (the first few, with their case)."""
    failed = []
    for case in cases:
        try:
            run(case)
        except AssertionError as e:
            failed.append(f"{case}: {e}")
    if failed:
        return f"failed {len(failed)}/{len(cases)}: " + " | ".join(failed[:4])
    return "ok"


def _forward_case(case) -> None:
    from test_hostile_nan_kernels import allowed_mask, check_rule

    B, h, h_kv, Tq, Tk, d_k, d_v, kind = case
    drift = kind.endswith("+drift")
    kind = kind.removesuffix("+drift")
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, seed=Tq * 1000 + Tk + d_v, drift=drift)
    causal, kl, mask, window = _masks(kind, B, h, Tq, Tk, seed=Tk)
    out, lse = _amx_forward(q, k, v, causal, kl, mask, window)
    allowed = allowed_mask(B, h, Tq, Tk, causal=causal, key_lengths=kl, mask=mask, window=window)
    check_rule(out, lse, q, k, v, allowed, d_k ** -0.5)


# (B, h, h_kv, Tq, Tk, d_k, d_v, masks). Comments: the layout (NC O tiles, KC Q tiles) and the
# edges each case is there for. 48-row query blocks: Tq = 48 is three groups, 40 two and a
# group of 8, 20 a pair with a group of 4; 128-key blocks, 32-key P V chunks.
FORWARD = [
    # d_k, d_v <= 64: O and Q resident
    (1, 2, 2, 48, 64, 32, 16, "none"),            # NC 1, KC 1
    (2, 2, 1, 37, 100, 64, 64, "causal"),         # NC 4, KC 2; GQA; Tq < Tk
    (1, 3, 1, 20, 45, 20, 40, "key_lengths"),     # NC 3, KC 1; d_k, d_v padded
    (1, 2, 2, 33, 129, 48, 24, "bool"),           # NC 2, KC 2; one key past a block
    (2, 4, 2, 130, 300, 64, 64, "window_45"),     # window not a multiple of 32, Tq != Tk
    (1, 2, 1, 1, 1, 32, 32, "none"),              # one query, one key
    (1, 1, 1, 200, 200, 64, 48, "causal"),        # blocks of 48 rows, keys up to the diagonal
    # d_v <= 64 < d_k: Q reloaded per key chunk
    (1, 2, 1, 50, 77, 128, 64, "causal"),         # NC 4
    (1, 2, 2, 17, 300, 96, 16, "window_70"),      # NC 1, 3 Q tiles
    (2, 2, 2, 64, 150, 80, 50, "bool_heads"),     # NC 4, d_k 80 padded to 96
    # d_v > 64: group pairs (rows >= 32 in a block) and a group left over
    (1, 4, 2, 64, 200, 64, 128, "none"),          # pairs of groups, O 32 columns x 4
    (1, 2, 2, 48, 160, 128, 80, "causal"),        # pair + one left; dvp / 16 = 5: a lone tile
    (1, 2, 2, 20, 700, 64, 72, "none"),           # pair with a group of 4; runs of 4 blocks x 2
    (1, 2, 2, 40, 1100, 32, 96, "key_lengths"),   # several runs; a 0-key row, pair + 8 left
    (1, 1, 1, 10, 50, 32, 96, "none"),            # one group left over only (pv_block 4 + 2)
    (1, 2, 2, 100, 40, 64, 256, "causal"),        # Tq > Tk: rows with no key; dvp 256
    (2, 6, 2, 97, 257, 80, 112, "key_lengths"),   # GQA 3; 3 Q tiles; dvp / 16 = 7
    (1, 2, 2, 150, 150, 64, 128, "window_37"),    # each group's own first key chunk
    (1, 2, 1, 96, 333, 160, 160, "bool"),         # masked rows and groups inside pairs
    (1, 2, 2, 15, 17, 64, 200, "causal"),         # under one group, under one P V chunk
    # running maxima that move in some rows of a group or pair and not in others: O rescaled
    (1, 2, 2, 48, 600, 64, 64, "none+drift"),     # O in tiles: stored, scaled, loaded
    (1, 2, 2, 48, 1100, 64, 128, "none+drift"),   # pairs: across runs of 4 blocks and within
    (1, 2, 1, 40, 700, 128, 80, "causal+drift"),  # pair + a group left over, a lone O tile
    (1, 2, 2, 100, 300, 96, 48, "window_150+drift"),
]


def check_forward() -> str:
    return _judge(FORWARD, _forward_case)


# NaN / Inf on a shape of each layout, every poison and mask kind of the hostile module
HOSTILE_SHAPES = [(1, 2, 1, 40, 100, 64, 64),    # O and Q resident
                  (2, 4, 2, 53, 97, 128, 16),    # O resident, Q reloaded
                  (1, 1, 1, 100, 260, 64, 80)]   # pairs, a group left over, a lone O tile


def _hostile_case(case) -> None:
    import torch

    from test_hostile_nan_kernels import _mask_args, _poison, _seed, allowed_mask, check_rule

    shape, poison, mask_kind = case
    B, h, h_kv, Tq, Tk, d_k, d_v = shape
    g = torch.Generator().manual_seed(_seed("amx", shape, poison, mask_kind))
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, seed=_seed(shape, poison, mask_kind))
    causal, kl, mask, window = _mask_args(mask_kind, B, h, Tq, Tk, g)
    allowed = allowed_mask(B, h, Tq, Tk, causal=causal, key_lengths=kl, mask=mask, window=window)
    q, k, v = _poison(poison, q, k, v, allowed, g)
    out, lse = _amx_forward(q, k, v, causal, kl, mask, window)
    check_rule(out, lse, q, k, v, allowed, d_k ** -0.5)


def check_nonfinite() -> str:
    from test_hostile_nan_kernels import MASKS, POISON

    # every (poison, mask) pair on the first shape, every other one (alternating) on the rest
    cases = [(shape, poison, mask) for i, poison in enumerate(POISON)
             for j, mask in enumerate(MASKS) for n, shape in enumerate(HOSTILE_SHAPES)
             if n == 0 or (i + j + n) % 2 == 0]
    return _judge(cases, _hostile_case)


# (B, h, h_kv, Tq, Tk, d_k, d_v, masks) through the fused backward of this process's forcing
BACKWARD = [
    (1, 2, 2, 64, 64, 64, 64, "none"),
    (1, 4, 2, 40, 97, 64, 64, "causal"),          # GQA, Tq != Tk
    (2, 2, 1, 70, 130, 32, 96, "key_lengths"),
    (1, 2, 2, 100, 100, 128, 80, "window_33"),
    (1, 2, 2, 50, 70, 48, 24, "bool"),
]


def _backward_case(case) -> None:
    import torch

    import mha
    from mha import reference
    from test_hostile_nan_kernels import allowed_mask

    B, h, h_kv, Tq, Tk, d_k, d_v, kind = case
    q, k, v = (t.requires_grad_() for t in _inputs(B, h, h_kv, Tq, Tk, d_k, d_v, seed=Tk + d_v))
    causal, kl, mask, window = _masks(kind, B, h, Tq, Tk, seed=Tq)
    if kl is not None:
        kl[kl == 0] = 1  # a row with no key has no gradient to compare (zeros here, NaN in fp64)
    dout = torch.randn(B, h, Tq, d_v, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = mha.attention(q, k, v, causal=causal, key_lengths=kl, mask=mask, window=window,
                        backend="flash_cpu")
    got = torch.autograd.grad(out, (q, k, v), dout)
    allowed = allowed_mask(B, h, Tq, Tk, causal=causal, key_lengths=kl, mask=mask, window=window)
    empty = ~allowed.any(-1, keepdim=True)  # (B, h, Tq, 1): rows with no key
    allowed = allowed | empty  # fp64 reference: such rows attend all keys, their dout zeroed
    dout = dout.masked_fill(empty, 0)

    def grads(ts, upcast):
        ins = [t.detach().to(ts).requires_grad_() for t in (q, k, v)]
        o = reference.attention(*ins, allowed=allowed, upcast=upcast)[0]
        return torch.autograd.grad(o, ins, dout.to(o.dtype))

    exact, naive = grads(torch.float64, True), grads(torch.bfloat16, False)
    for name, a, e, n in zip("qkv", got, exact, naive, strict=True):
        err = (a.double() - e).abs().max().item()
        budget = 2 * (n.double() - e).abs().max().item() + 1e-2
        assert err <= budget, f"grad_{name}: {err:.3e} > {budget:.3e}"


def check_backward() -> str:
    return _judge(BACKWARD, _backward_case)


# Paged prefill: (sequence lengths, queries per sequence, page size, h, h_kv, d)
PAGED = [
    ([300, 129, 200], [100, 129, 57], 16, 6, 2, 64),   # groups, pairs of rows, decode rows
    ([77, 1, 500], [1, 1, 300], 7, 4, 4, 32),           # pages not a multiple of 16
    ([260, 40], [48, 33], 64, 2, 1, 128),               # d 128: Q reloaded per key chunk
]


def _paged_case(case) -> None:
    import torch

    from mha.ops import flash
    from test_paged_prefill import _check_rows, _cu, _filled

    lengths, counts, p, h, h_kv, d = case
    cache, ids, gen = _filled(lengths, p=p, h_kv=h_kv, d=d, dtype=torch.bfloat16)
    q = torch.randn(sum(counts), h, d, generator=gen).bfloat16()  # (N, h, d)
    cu = _cu(counts)
    with torch.no_grad():
        out = cache.attend_varlen(0, q, ids, cu)  # (N, h, d)
    _check_rows(cache, ids, q, cu, out, dtype=torch.bfloat16)
    assert flash.kernels()["bfloat16"] == "amx"
    for i, s in enumerate(ids):  # the dense AMX kernel on the gathered K/V: the same bits
        k, v = cache.gather(0, s)  # (1, h_kv, L, d)
        if k.shape[2] < 128:
            continue  # shorter rows: the two forwards size their key blocks differently
        qs = q[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0)  # (1, h, n, d)
        want, _ = _amx_forward(qs, k, v, True, None, None, None)  # (1, h, n, d)
        assert torch.equal(out[cu[i]:cu[i + 1]], want[0].transpose(0, 1)), f"row {i} bits"


def check_paged() -> str:
    return _judge(PAGED, _paged_case)


# Decode (B, h, h_kv, Tq, Tk, d, masks): G = h / h_kv * Tq from 1 to 16, d_k 32 .. 128, Tk
# not a multiple of 32 (the tiles take 32 keys at a time, the vector path the rest)
DECODE = [
    (2, 4, 4, 1, 77, 32, "none"),          # G 1
    (1, 8, 4, 1, 300, 64, "key_lengths"),  # G 2
    (1, 3, 1, 1, 33, 96, "none"),          # G 3
    (1, 2, 2, 4, 100, 128, "causal"),      # G 4
    (2, 10, 2, 1, 1000, 64, "bool"),       # G 5
    (1, 7, 1, 1, 65, 32, "none"),          # G 7
    (1, 8, 2, 2, 500, 128, "causal"),      # G 8
    (1, 9, 3, 4, 129, 64, "bool_heads"),   # G 12
    (1, 5, 1, 3, 257, 96, "causal"),       # G 15
    (3, 16, 1, 1, 1000, 64, "none"),       # G 16
    (1, 4, 2, 8, 2049, 32, "key_lengths"),  # G 16; several splits
    (1, 2, 1, 1, 31, 64, "none"),          # fewer keys than one tile step: vectors only
]


def _decode_case(case) -> None:
    import torch

    from mha.ops import decode
    from test_hostile_nan_kernels import allowed_mask, check_rule

    B, h, h_kv, Tq, Tk, d, kind = case
    q, k, v = _inputs(B, h, h_kv, Tq, Tk, d, d, seed=Tk * 7 + h)
    causal, kl, mask, _ = _masks(kind, B, h, Tq, Tk, seed=Tk)
    with torch.no_grad():
        out = decode.flash_decode(q, k, v, key_lengths=kl, mask=mask, causal=causal)
    allowed = allowed_mask(B, h, Tq, Tk, causal=causal, key_lengths=kl, mask=mask)
    check_rule(out, None, q, k, v, allowed, d ** -0.5)


def check_decode() -> str:
    return _judge(DECODE, _decode_case)


def _decode_paged_case(case) -> None:
    import torch

    from mha.ops import decode
    from test_hostile_nan_kernels import allowed_mask, check_rule

    h, h_kv, Tq, lengths, page, d = case
    B = len(lengths)
    g = torch.Generator().manual_seed(page)
    M = max(-(-L // page) for L in lengths)
    pages = B * M + 2
    kp = torch.randn(pages, h_kv, page, d, generator=g).bfloat16()  # (P, h_kv, p, d)
    vp = torch.randn(pages, h_kv, page, d, generator=g).bfloat16()  # (P, h_kv, p, d)
    order = torch.randperm(pages, generator=g)[: B * M].reshape(B, M).int()  # (B, M)
    q = torch.randn(B, h, Tq, d, generator=g).bfloat16()
    kl = torch.tensor(lengths)
    with torch.no_grad():
        out = decode.flash_decode(q, kp, vp, key_lengths=kl, causal=True, block_table=order)
    Tk = M * page
    k = kp[order.long()].permute(0, 2, 1, 3, 4).reshape(B, h_kv, Tk, d)  # (B, h_kv, Tk, d)
    v = vp[order.long()].permute(0, 2, 1, 3, 4).reshape(B, h_kv, Tk, d)  # (B, h_kv, Tk, d)
    allowed = allowed_mask(B, h, Tq, Tk, key_lengths=kl)
    allowed &= (torch.arange(Tk)[None, None, None, :]
                <= torch.arange(Tq)[None, None, :, None] + kl[:, None, None, None] - Tq)
    check_rule(out, None, q, k, v, allowed, d ** -0.5)


# Paged decode (h, h_kv, Tq, lengths, page, d): runs of a page, 32 keys at a time on tiles
DECODE_PAGED = [(8, 2, 1, [300, 77], 64, 64), (4, 1, 3, [200, 129, 40], 48, 128),
                (2, 2, 2, [100], 16, 32)]


def check_decode_paged() -> str:
    return _judge(DECODE_PAGED, _decode_paged_case)


def check_decode_nonfinite() -> str:
    from test_hostile_nan_kernels import MASKS, POISON

    def run(case):
        import torch

        from mha.ops import decode
        from test_hostile_nan_kernels import _mask_args, _poison, allowed_mask, check_rule

        poison, mask_kind = case
        B, h, h_kv, Tq, Tk, d = 2, 8, 2, 2, 100, 64  # G 8
        g = torch.Generator().manual_seed(POISON.index(poison) * 10 + MASKS.index(mask_kind))
        q, k, v = _inputs(B, h, h_kv, Tq, Tk, d, d, seed=3)
        causal, kl, mask, window = _mask_args(mask_kind, B, h, Tq, Tk, g)
        if window is not None:
            return  # decode has no window
        allowed = allowed_mask(B, h, Tq, Tk, causal=causal, key_lengths=kl, mask=mask)
        q, k, v = _poison(poison, q, k, v, allowed, g)
        with torch.no_grad():
            out = decode.flash_decode(q, k, v, key_lengths=kl, mask=mask, causal=causal)
        check_rule(out, None, q, k, v, allowed, d ** -0.5)

    return _judge([(p, m) for p in POISON for m in MASKS], run)


def check_explain() -> str:
    """``mha.explain`` names software tiles where they serve a call (bf16), and only there."""
    import torch

    import mha
    from mha.ops import flash

    q = torch.randn(1, 4, 64, 64).bfloat16()
    k = torch.randn(1, 2, 100, 64).bfloat16()
    said = {v.backend: str(v) for v in mha.explain(q, k, k)}
    said_decode = {v.backend: str(v) for v in mha.explain(q[:, :, :1], k, k)}
    said_fp32 = {v.backend: str(v) for v in mha.explain(q.float(), k.float(), k.float())}
    emulated = "amx-emulated" in flash.isa().split(",")  # the build `selected` checked
    for what, line in (("prefill", said["flash_cpu"]), ("decode", said_decode["flash_decode"])):
        if ("amx-emulated" in line) != emulated:
            return f"failed: {what}: {line!r}"
    if "amx-emulated" in said_fp32["flash_cpu"]:
        return f"failed: fp32: {said_fp32['flash_cpu']!r}"
    return "ok"


def check_selected(expect: str) -> str:
    from mha.ops import decode, flash

    if expect not in flash.isa().split(","):
        return f"the build lacks {expect} (isa {flash.isa()})"
    picked = (flash.kernels()["bfloat16"], decode.bf16_qk())
    if picked != ("amx", expect):
        return f"expected the forward on amx and decode on {expect}, the process runs {picked}"
    return "ok"


CHECKS = {
    "forward": check_forward,
    "forward_nonfinite": check_nonfinite,
    "backward": check_backward,
    "paged": check_paged,
    "decode": check_decode,
    "decode_paged": check_decode_paged,
    "decode_nonfinite": check_decode_nonfinite,
    "explain": check_explain,
}


@pytest.mark.parametrize("check", ["selected", *CHECKS])
def test_amx(results, check):
    if check != "selected" and results["selected"] != "ok":
        pytest.fail(f"not run, the process did not select the AMX paths: {results[check]}")
    assert results[check] == "ok", f"{check}: {results[check]}"


def test_the_mode_follows_the_cpu_flags():
    avx512 = {"avx512f", "avx512bw", "avx512_bf16"}
    assert mode(avx512 | {"amx_tile", "amx_bf16"}) == (
        {"MHA_FLASH_BF16": "amx", "MHA_DECODE_BF16": "amx"}, "amx")
    assert mode(avx512) == ({"MHA_FLASH_BF16": "amx", "MHA_DECODE_BF16": "amx",
                              "MHA_AMX_EMULATE": "1"}, "amx-emulated")
    forced, why = mode({"avx2", "fma", "avx512f"})
    assert forced is None and why.startswith("no avx512_bf16 on this CPU")
    # an AMX CPU whose OS refuses the tile state: a reason to skip, not a failure
    refused = "the OS refuses the AMX tile state: arch_prctl(ARCH_REQ_XCOMP_PERM) failed (x)"
    forced, why = mode(avx512 | {"amx_tile", "amx_bf16"}, refused)
    assert forced is None and why.startswith(f"the CPU has AMX but {refused}")
    forced, why = mode(avx512, "the OS refuses the AMX tile state (MHA_TEST_AMX_REFUSED=1)")
    assert forced is None and "MHA_TEST_AMX_REFUSED=1" in why


def test_the_os_answer_follows_the_seam(monkeypatch):
    monkeypatch.setenv("MHA_TEST_AMX_REFUSED", "1")
    assert "MHA_TEST_AMX_REFUSED=1" in tile_state_refused()
    assert current()[0] is None


def main(expect: str) -> None:
    """Run every check in this process (its variables already set): one JSON line, check ->
    "ok" | the failure; each check reports the selection's verdict when it is wrong."""
    from check_runner import run_checks
    from mha.ops import build, decode, flash

    # this process's build (software tiles where emulated) of the three kernels the checks
    # run, compiled at once where it is not cached yet (one CPU each)
    build.prebuild(((flash.NAME, flash.SOURCES), (flash.BWD_NAME, flash.BWD_SOURCES),
                    (decode.EXTENSION, decode.SOURCES)))
    run_checks(check_selected(expect), CHECKS, timings=True)


if __name__ == "__main__":
    main(sys.argv[1])
