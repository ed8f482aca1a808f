"""Backend ``flash_decode``: the native decode kernel (:mod:`mha.ops.decode`), for Tq <= 16
with few query rows per K/V head (from 16 in fp32, 32 in bf16 it defers to flash_cpu).

Shape legend: B batch, h query heads, h_kv K/V heads, Tq/Tk lengths, d_k/d_v head dims.
Listed first in dispatch: it serves inference calls with few queries (decoding steps against
a :class:`mha.KVCache`, small verification windows of speculative decoding) and rejects
everything else with reasons, so prefill and training go to the next backend.
"""

from __future__ import annotations

import functools

import torch

from mha.backends.base import AttentionCall, Backend, Capabilities
from mha.ops import decode, flash
from mha.symbolic import size_below


def _forward(call: AttentionCall):
    m, sc = call.masks, call.scores
    out = decode.call_op(call.q, call.k, call.v, key_lengths=m.key_lengths, mask=m.mask,
                         causal=m.causal, scale=call.scale, softcap=sc.softcap, sinks=sc.sinks,
                         bias=sc.bias, alibi_slopes=sc.alibi_slopes)
    return out, None  # (B, h, Tq, d_v)


def _extra_reasons(call: AttentionCall) -> list[str]:
    reasons = []
    if not size_below(call.Tq, decode.MAX_TQ + 1, unsettled=False):
        # under torch.export a Tq range reaching past MAX_TQ goes whole to the next backend
        length = ("Tq (a range under torch.export) may exceed" if torch.compiler.is_exporting()
                  else f"Tq={call.Tq} >")  # (formatting a symbolic size would specialize it)
        reasons.append(f"query length {length} {decode.MAX_TQ} (a decode kernel; "
                       "prefill goes to the next backend)")
    return reasons


# Query rows per K/V head (g * Tq) from which the tile kernel (flash_cpu) is the faster one
# without grad, by dtype; and the key length from which flash_decode keeps a call with one query
# head per K/V head all the same (docs/kernel.md "Few query rows: decode kernel or tiles").
DEFER_ROWS = {torch.float32: 16, torch.bfloat16: 32}
KEEP_MHA_TK = 256
# The tile kernels those thresholds were measured against (epyc-zen5-avx512); with another one (the
# portable loops, AMX tiles) flash_decode keeps every call it serves.
MEASURED_TILES = {torch.float32: ("avx512f",), torch.bfloat16: ("avx512bf16", "avx512f")}


@functools.cache
def tiles_measured(dtype: torch.dtype) -> bool:
    """Whether flash_cpu runs ``dtype`` on a tile kernel :data:`DEFER_ROWS` was measured on."""
    if dtype not in MEASURED_TILES or flash.unavailable() is not None:
        return False
    try:
        kernel = flash.kernels()[str(dtype).removeprefix("torch.")]
    except RuntimeError:  # MHA_FLASH_BF16 names a kernel this build cannot run
        return False
    return kernel in MEASURED_TILES[dtype]


@torch.compiler.assume_constant_result
def _tiles_measured(dtype: torch.dtype) -> bool:
    return tiles_measured(dtype)


def _defers(call: AttentionCall) -> str | None:
    """flash_decode keeps every query row of a K/V group in flight against each key; the tile
    kernel fills its register tiles from about 16 rows (fp32) or 32 rows (bf16) per K/V head
    on, and measured faster there except with one query head per K/V head against 256 keys or
    more (there flash_decode led with many heads). Fewer rows stay on the decode kernel, and so
    does every call where flash_cpu's kernel for the dtype is not one it was measured against
    (:data:`MEASURED_TILES`)."""
    limit = DEFER_ROWS.get(call.dtype)
    if limit is None or not _tiles_measured(call.dtype):
        return None
    g = call.h // call.h_kv
    rows = g * call.Tq
    if size_below(rows, limit, unsettled=True):
        return None  # (torch.export: a Tq range across the threshold stays on flash_decode)
    if g == 1 and not size_below(call.Tk, KEEP_MHA_TK, unsettled=False):
        return None
    return (f"{rows} query rows per K/V head (h / h_kv x Tq) >= {limit}: the tile kernel "
            f"(flash_cpu) is faster from there, measured")


def _note(call: AttentionCall) -> str | None:
    """bf16 q.k on the AMX tiles of a ``MHA_AMX_EMULATE=1`` build runs in software (where they
    fit: G = h / h_kv * Tq <= 16 query rows, d_k % 32 == 0, d_k <= 128, runs of 32 keys); where
    the build has AMX tiles the OS refuses, it runs on vdpbf16ps, and says why."""
    fits = (call.h // call.h_kv * call.Tq <= 16 and call.d_k % 32 == 0 and call.d_k <= 128
            and call.Tk >= 32)
    if call.dtype != torch.bfloat16 or not fits:
        return None
    qk = decode.bf16_qk()
    if qk == "amx-emulated":
        return ("bf16 q.k: amx-emulated, software AMX tiles of a MHA_AMX_EMULATE=1 build: "
                "for tests, not for speed")
    refused = decode.amx_refused()
    if refused is not None and not refused.startswith("MHA_DECODE_BF16"):
        return f"bf16 q.k: {qk}, not AMX: {refused}"
    return None


BACKEND = Backend(
    name="flash_decode",
    summary="native flash-decoding kernel: Tq <= 16 against long K/V, KV split across threads",
    caps=Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        mask_kinds=frozenset({"causal", "key_lengths", "mask"}),
        gqa=True, different_v_dim=True, dropout=False, weights=False, grad=False,
        # softcap, bias, ALiBi on the kernel's fp32 score blocks; the sink in its final merge
        variants=frozenset({"softcap", "sinks", "bias", "alibi"}),
    ),
    forward=_forward,
    unavailable=decode.unavailable,
    extra_reasons=_extra_reasons,
    defers=_defers,
    note=_note,
)
