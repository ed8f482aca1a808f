"""Backend ``flash_cpu``: the native CPU flash-attention kernel (``mha/csrc/flash_attn.cpp``).

Shape legend: B batch, h heads, h_kv K/V heads, Tq/Tk lengths, d_k/d_v head dims.
A thin adapter: the capability table says what it serves; the kernel is built on first use
(:func:`mha.ops.flash.unavailable`). Training runs the fused native backward, sliding windows included
(O(Tq window) work and memory); a ``mask_mod`` runs through its block plan (:mod:`mha.blockplan`,
48-row x 128-key blocks: EMPTY blocks never read, FULL ones unmasked, PARTIAL ones with the
mask's cached bits), forward and backward; NaN / Inf follow the rule in :mod:`mha.ops.flash`. When the build
fails, one warning gives the reason, the backend rejects every call with that reason
(``mha.explain`` shows it) and dispatch falls back.
"""

from __future__ import annotations

import functools

import torch

from mha.backends.base import MOD_MASK_KINDS, AttentionCall, Backend, Capabilities
from mha.ops import flash
from mha.scores import VARIANT_KINDS
from mha.symbolic import size_below

PLAN_BLOCKS = (48, 128)  # (block_q, block_k) of the plans the kernel walks (csrc/common/block_plan.h)


def _unavailable() -> str | None:
    return flash.unavailable()  # looked up per call: tests replace it


PORTABLE_MIN_TK = 512  # from here on SDPA's fused kernel beats the portable loops (below)


@functools.cache
def _portable_kernel(dtype: torch.dtype) -> bool:
    """Whether ``dtype``'s tile kernel is the portable C++ loops on this CPU (no AVX-512). Only
    bf16 asks for the bf16 choice (a ``MHA_FLASH_BF16`` this build cannot run fails bf16 calls,
    never fp32 ones)."""
    if dtype == torch.float32:
        return "avx512f" not in flash.isa().split(",")
    return flash.kernels()["bfloat16"] == "portable"  # e.g. "avx512bf16", "amx"


@torch.compiler.assume_constant_result
def _portable(dtype: torch.dtype) -> bool:
    return _portable_kernel(dtype)


def _defers(call: AttentionCall) -> str | None:
    """On a CPU without AVX-512 the kernel runs its portable loops. Measured there (AMD EPYC,
    AVX2 only, 2 threads, one process, (B, 8, T, 64)): SDPA's fused kernel is faster at
    Tk >= 512 for fp32 and bf16 forward and fp32 training (2.2-3.1x in the `mha bench` record
    benchmarks/results/latest-epyc-zen3-avx2.json), while the portable loops stay
    ahead below Tk = 512 (1.1-1.8x at T = 32-256), with a sliding window (2.8x), in decode, and
    in bf16 training (3-8x: SDPA's bf16 backward). So dispatch leaves such calls to sdpa when
    sdpa needs no (Tq, Tk) mask for them."""
    if size_below(call.Tk, PORTABLE_MIN_TK, unsettled=True) or not _portable(call.dtype) \
            or call.scores.kinds:  # (torch.export: a Tk range across the threshold stays here)
        return None  # score variants: sdpa would need a (Tq, Tk) float mask or cannot serve
    kinds = call.masks.kinds
    cheap_for_sdpa = kinds in (frozenset(), frozenset({"key_lengths"}), frozenset({"mask"})) or (
        kinds == {"causal"} and call.Tq == call.Tk)
    if not cheap_for_sdpa or (call.dtype == torch.bfloat16 and call.needs_grad):
        return None
    return (f"portable loops on this CPU (no AVX-512): sdpa is faster at Tk >= "
            f"{PORTABLE_MIN_TK}, measured")


def _score_mod_reason(call: AttentionCall) -> list[str]:
    """Why a score_mod stays on blocksparse, in words (the table says "not supported")."""
    if call.score_mod is None:
        return []
    return ["(a score_mod is an arbitrary Python function of the scores: the kernel cannot call "
            "it per pair; blocksparse applies it per block in PyTorch ops. mask_mod alone runs "
            "here, through its block plan)"]


def _forward(call: AttentionCall):
    m, sc = call.masks, call.scores
    plan = None
    if m.mask_mod is not None:  # walked natively; causal / window / lengths / mask ANDed in
        from mha.blockplan import block_plan

        bq, bk = PLAN_BLOCKS
        plan = block_plan(m.mask_mod, call.B, call.h, call.Tq, call.Tk, block_q=bq,
                          block_k=bk, device=call.device).kernel_tensors()
    out, lse = flash.forward(call.q, call.k, call.v, m.causal, m.key_lengths, m.mask,
                             call.scale, m.window, sc.softcap, sc.sinks, sc.bias,
                             sc.alibi_slopes, plan, call.return_lse)
    return out, lse  # (B, h, Tq, d_v), (B, h, Tq) or None


AMX_SMALL_MAX_TK = 32  # up to this Tk, bf16 calls of an AMX build take the small path


def _note(call: AttentionCall) -> str | None:
    """Which tiles a bf16 call runs and why: bf16 calls on the AMX kernel of a
    ``MHA_AMX_EMULATE=1`` build run on software tiles (score variants and mask_mod plans go to
    the AVX-512 tiles, Tk <= 32 to the small path); where the build has AMX tiles the OS
    refuses, they run the next kernel, and say why; the vdpbf16ps or the widened fp32 tiles
    say that they were measured faster on this CPU, and the two rates
    (:func:`mha.ops.flash.bf16_choice`)."""
    from mha.ops import flash_choice

    if call.dtype != torch.bfloat16:
        return None
    amx = (not call.scores.kinds and call.masks.mask_mod is None
           and call.Tk > AMX_SMALL_MAX_TK)
    kernel = flash.kernels()["bfloat16"]
    if amx and "amx-emulated" in flash.isa().split(",") and kernel == "amx":
        return ("bf16 tiles: amx-emulated, software AMX tiles of a MHA_AMX_EMULATE=1 build: "
                "for tests, not for speed")
    choice = flash.bf16_choice()
    measured = choice.describe() if isinstance(choice, flash_choice.Measured) else None
    refused = flash.amx_refused()
    if amx and refused is not None and kernel != "amx":
        return f"bf16 tiles: {kernel}, not AMX: {refused}" + (f"; {measured}" if measured else "")
    return f"bf16 tiles: {measured}" if measured else None


BACKEND = Backend(
    name="flash_cpu",
    summary="native flash-attention kernel for the CPU (AVX-512 / AVX512_BF16), O(T d) memory",
    caps=Capabilities(devices=frozenset({"cpu"}),
                      dtypes=frozenset({torch.float32, torch.bfloat16}),
                      min_head_dim=16, max_head_dim=256, gqa=True, different_v_dim=True,
                      dropout=False, weights=False, lse=True, grad=True, mask_kinds=MOD_MASK_KINDS,
                      variants=VARIANT_KINDS),
    forward=_forward,
    extra_reasons=_score_mod_reason,
    unavailable=_unavailable,
    defers=_defers,
    note=_note,
)
