"""The native flash-attention kernel: its registered op, fake twin, autograd, and a thin function.

Shape legend: B batch, h query heads, h_kv key/value heads (h_kv divides h, g = h // h_kv),
Tq query length, Tk key length, d_k query/key head dim, d_v value head dim.

Three layers, as in flash-attention's interface:

1. ``torch.ops.mha.flash_attention_fwd`` — C++ (``csrc/flash/flash_attn.cpp``), built on first use
   by :func:`mha.ops.build.load_extension` and cached; its ``register_fake`` twin below only allocates
   shaped outputs, so ``torch.compile`` and ``torch.library.opcheck`` work.
2. ``register_autograd``: the backward is ``mha::flash_attention_bwd``, a custom op that runs
   the fused native kernel (``csrc/flash/flash_attn_bwd.cpp``, extension ``mha_flash_bwd``) or, if
   that cannot be built, :func:`flash_attention_bwd_torch`; both recompute the softmax weights
   from the saved log-sum-exp (never the whole ``(Tq, Tk)`` matrix for long sequences).
3. :func:`flash_attention` — the typed public function. In eager code it calls the op's CPU
   kernel below the Autograd key (``register_autograd``'s Python wrapper costs ~4 µs per call
   without grad and ~45 µs with it at ``(2, 8, 16, 64)``: docs/kernel.md), through :class:`_FlashFunction` (the
   same setup and backward as ``register_autograd``) when an input requires grad; under
   ``torch.compile`` / ``torch.export``, ``torch.func`` transforms and ``__torch_function__``
   overrides it calls the registered op itself (``benchmarks/probes/call_overhead.py``).

NaN / Inf semantics (the rule every backend follows):

1. Output row i (query i of head hh, batch b) is computed from q_i and the K/V rows of the keys
   j that row i may attend (mask AND causal AND window AND j < key_lengths[b]). A NaN or +-Inf
   in those inputs makes the row non-finite the way IEEE arithmetic of
   ``softmax(q k^T * scale) V`` does: a NaN in q_i makes the whole row NaN; a NaN/Inf in K_j of
   a visible key makes the row NaN; a NaN in V_j[d] of a visible key makes out[i, d] NaN; +-Inf
   in V can give +-Inf or NaN. The log-sum-exp of such a row is NaN (or +inf), never -inf.
2. K/V rows at keys row i may not attend never affect row i (no 0 * NaN from masked pairs
   inside partially masked blocks: they are never read into row i's result).
3. A row that may attend no key returns zeros (lse = -inf, zero gradients), whatever q_i is.

The backward follows the same rule: a pair (i, j) that row i may not attend contributes
exactly 0 to dq, dk and dv (``dS`` there is 0, never ``0 * NaN``, even where ``dP = dO V^T`` is
NaN); rows whose output is NaN give NaN gradients from every key they see (as SDPA does).
Double backward (a gradient of these gradients) is not supported: it raises and names
``backend="math"`` as the way out.
"""

from __future__ import annotations

import functools
import math
import os
import threading

import torch

from mha.ops import build, flash_choice

NAME = "mha_flash"
SOURCES = ("flash/flash_attn.cpp",)
_CHUNK_ELEMENTS = 1 << 20  # fp32 elements of one (B, h, rows, Tk) score chunk, PyTorch backward


def _register() -> None:
    torch.library.register_fake("mha::flash_attention_fwd")(_fwd_fake)
    torch.library.register_autograd("mha::flash_attention_fwd", _backward,
                                    setup_context=_setup_context)
    torch.library.register_fake("mha::flash_attention_paged_fwd")(_paged_fake)


@torch.compiler.assume_constant_result  # under torch.compile: once, at trace time
def unavailable() -> str | None:
    """Why the flash forward cannot run here (its build failed: warned once), or None. Once
    loaded, the extension is handed the bf16 kernel measured on this CPU (:func:`bf16_choice`)
    before anything else runs."""
    reason = build.load_extension(
        NAME, SOURCES, register=_register,
        instead="backend flash_cpu disabled, falling back to other backends")
    if reason is None:
        _hand_in("_flash_set_bf16_choice", bf16_choice)
    return reason


_handed_in: set[str] = set()  # the setter ops called in this process
_hand_in_lock = threading.Lock()


def _hand_in(setter: str, choice) -> None:
    """Call the setter op ``setter`` once per process with the measured kernel of
    ``choice()`` (nothing when nothing was measured: forced, AMX, no vdpbf16ps kernel)."""
    if setter in _handed_in:
        return
    picked = choice()  # may measure: outside the lock (flash_choice serializes measuring)
    with _hand_in_lock:
        if setter not in _handed_in:
            if isinstance(picked, flash_choice.Measured):
                build.ask(lambda: getattr(torch.ops.mha, setter)(picked.choice))
            _handed_in.add(setter)


@functools.cache
def kernel_key() -> str:
    """The flash extension's build key (sources, flags, toolchain, CPU): a new build is
    measured again. Only once it is loaded."""
    return build.load(NAME, SOURCES).parent.name


@functools.cache
def bf16_choice() -> flash_choice.Measured | str:
    """How the bf16 kernel of this process was chosen: the measurement
    (:class:`mha.ops.flash_choice.Measured`: measured once per CPU model, read from the cache
    after that), or why nothing was measured, in words (``MHA_FLASH_BF16`` set, the AMX tiles
    run, the build has no vdpbf16ps kernel). The extension must be loaded."""
    forced = os.environ.get("MHA_FLASH_BF16")
    if forced is not None:  # checked and refused by the kernel, as every bf16 call is
        return f"forced by MHA_FLASH_BF16={forced}"
    compiled = build.ask(torch.ops.mha.flash_attention_isa).split(",")
    if ("amx" in compiled or "amx-emulated" in compiled) \
            and not build.ask(torch.ops.mha.flash_attention_amx):
        return "the AMX tiles run first where the OS grants them (nothing to measure)"
    if "avx512bf16" not in compiled:
        return ("this build has no vdpbf16ps kernel (the CPU lacks AVX512_BF16): bf16 is "
                "widened to fp32, nothing to measure")
    try:
        return build.ask(lambda: flash_choice.choose(kernel_key()))
    except Exception as e:  # noqa: BLE001 -- the kernels run; only choosing between them failed
        # (the timing, or a cache record no check foresaw): the widened kernel, and why
        first = str(e).splitlines()[0] if str(e) else ""
        return f"not measured ({type(e).__name__}: {first}): bf16 is widened to fp32"


def bf16_said() -> str:
    """Which kernel bf16 inputs run and why, one sentence: the measured kernel and the two
    rates, or why nothing was measured. Raises as :func:`kernels` does when
    ``MHA_FLASH_BF16`` names a kernel this build cannot run."""
    kernel = kernels()["bfloat16"]
    choice = bf16_choice()
    if isinstance(choice, flash_choice.Measured):
        return choice.describe()
    return f"{kernel}: {choice}"


def _ready() -> None:
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"flash_attention: {reason}")


@functools.cache
def isa() -> str:
    """The instruction sets compiled into the kernel, e.g. ``portable,avx512f,avx512bf16``."""
    _ready()
    return build.ask(torch.ops.mha.flash_attention_isa)


@functools.cache
def kernels() -> dict[str, str]:
    """The tile kernel each dtype runs on this CPU, e.g. ``{"float32": "avx512f", ...}``: the
    choice the extension made once when it was loaded (``csrc/common/kernel_choice.h``: the
    CPU's instruction sets, whether the OS grants the AMX tile state, the bf16 kernel measured
    faster on this CPU, :func:`bf16_choice`, and ``MHA_FLASH_BF16``), read here once;
    :func:`bf16_said` says how the bf16 one was chosen (the two measured rates). Every consumer
    (the backend's deferral rule, ``mha build``, the bench's CPU record) asks this function.
    Raises RuntimeError naming the variable, its choices and why when ``MHA_FLASH_BF16`` names
    a kernel this build cannot run (as every bf16 call does)."""
    _ready()
    f32, bf16 = build.ask(torch.ops.mha.flash_attention_kernels)
    return {"float32": f32, "bfloat16": bf16}


@functools.cache
def amx_refused() -> str | None:
    """Why the AMX tiles compiled into this build do not run in this process (e.g. "the OS
    refuses the AMX tile state: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed (...)"): bf16
    calls then run the next kernel (:func:`kernels`). None when they run or are not compiled in.
    ``MHA_TEST_AMX_REFUSED=1`` (tests only) makes a build with tiles act as if refused."""
    _ready()
    return build.ask(torch.ops.mha.flash_attention_amx) or None


def _fwd_fake(q, k, v, key_lengths, mask, causal, scale, window=0, softcap=0.0, sinks=None,
              bias=None, alibi=None, plan=None, plan_bits=None):
    B, h, Tq, _ = q.shape
    torch._check(k.shape[0] == B and v.shape[0] == B, lambda: "q, k, v must share B")
    torch._check(k.shape[3] == q.shape[3], lambda: "k must have d_k like q")
    torch._check(h % k.shape[1] == 0, lambda: "h_kv must divide h")
    out = q.new_empty((B, Tq, h, v.shape[3])).permute(0, 2, 1, 3)  # (B, h, Tq, d_v)
    lse = q.new_empty((B, h, Tq), dtype=torch.float64)  # (B, h, Tq), see flash_attention
    return out, lse


def _setup_context(ctx, inputs, output):
    q, k, v, key_lengths, mask, causal, scale, window, softcap, sinks, bias, alibi, plan, \
        plan_bits = inputs + (0.0, None, None, None, None, None)[len(inputs) - 8:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_lengths, mask, sinks, bias, alibi, plan,
                          plan_bits)
    ctx.causal, ctx.scale, ctx.window, ctx.softcap = causal, scale, window, softcap


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, key_lengths, mask, sinks, bias, alibi, plan, plan_bits = ctx.saved_tensors
    ctx.bias_grad = bias is not None and ctx.needs_input_grad[10]
    dq, dk, dv, dbias = torch.ops.mha.flash_attention_bwd(
        grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask, ctx.causal, ctx.scale,
        ctx.window, ctx.softcap, sinks, bias, alibi, ctx.bias_grad, plan, plan_bits)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[9]:
        dsinks = sink_grad(grad_out, grad_lse, out, lse, sinks)
    if ctx.bias_grad:  # (B, h, Tq|1, Tk|1) summed over the dims the bias broadcasts on
        dims = [d for d in (0, 1) if bias.shape[d] == 1]
        dbias = dbias.sum(dim=dims, keepdim=True) if dims else dbias  # bias's shape
    else:
        dbias = None
    return dq, dk, dv, None, None, None, None, None, None, dsinks, dbias, None, None, None


def sink_grad(grad_out, grad_lse, out, lse, sinks):
    """``d loss / d sinks`` ``(h,)``: the sink is one more logit of each row with no value, so
    its ``dS = P_sink (0 - delta)`` with ``P_sink = exp(sink - lse)`` and
    ``delta = rowsum(dO O) - dlse`` (the fused backward's delta), summed over batch and rows."""
    f32 = torch.float32
    delta = torch.zeros_like(lse, dtype=f32)  # (B, h, Tq)
    if grad_out is not None:
        delta = (grad_out.to(f32) * out.to(f32)).sum(-1)  # (B, h, Tq)
    if grad_lse is not None:
        delta = delta - grad_lse.to(f32)
    p_sink = torch.exp(sinks.to(f32).view(1, -1, 1) - lse)  # (B, h, Tq)
    return (-(p_sink * delta)).sum(dim=(0, 2)).to(sinks.dtype)  # (h,)


def plan_chunk(plan: torch.Tensor, plan_bits: torch.Tensor, i0: int, i1: int, j0: int,
               j1: int) -> torch.Tensor:
    """A block plan's mask (True = may attend) over query rows [i0, i1) and keys [j0, j1):
    ``(B_p, h_p, i1 - i0, j1 - j0)``. plan ``(B_p, h_p, n_q, n_k)`` int32 entries (-2 empty,
    -1 full, e >= 0 partial), plan_bits ``(n_partial, 48, 128)`` (``csrc/common/block_plan.h``)."""
    bq, bk = plan_bits.shape[1], plan_bits.shape[2]
    i, j = torch.arange(i0, i1), torch.arange(j0, j1)  # (C,), (n,)
    e = plan[:, :, i // bq][:, :, :, j // bk].long()  # (B_p, h_p, C, n)
    bits = plan_bits[e.clamp(min=0), (i % bq)[:, None], (j % bk)[None]]  # (B_p, h_p, C, n)
    return (e == -1) | ((e >= 0) & bits)


def _allowed_chunk(i0: int, i1: int, j0: int, j1: int, Tq: int, Tk: int, causal: bool,
                   window: int, key_lengths: torch.Tensor | None, mask: torch.Tensor | None,
                   plan=None, plan_bits=None):
    """The mask (True = may attend) of query rows [i0, i1) and keys [j0, j1), broadcastable to
    ``(B, h, i1 - i0, j1 - j0)``; None when nothing is masked. ``window`` 0 means none."""
    allowed = None
    i = torch.arange(i0, i1).unsqueeze(1)  # (C, 1)
    j = torch.arange(j0, j1)  # (n,)
    if causal:
        allowed = (j[None] <= i + (Tk - Tq))[None, None]  # (1, 1, C, n)
    if window:
        wm = (j[None] > i + (Tk - Tq) - window)[None, None]  # (1, 1, C, n)
        allowed = wm if allowed is None else allowed & wm
    if key_lengths is not None:
        lm = (j < key_lengths.unsqueeze(1))[:, None, None, :]  # (B, 1, 1, n)
        allowed = lm if allowed is None else allowed & lm
    if mask is not None:
        m = mask if mask.shape[2] == 1 else mask[:, :, i0:i1]  # (B|1, h|1, C|1, Tk|1)
        m = m if m.shape[3] == 1 else m[..., j0:j1]  # (B|1, h|1, C|1, n|1)
        allowed = m if allowed is None else allowed & m
    if plan is not None:
        pm = plan_chunk(plan, plan_bits, i0, i1, j0, j1)  # (B_p, h_p, C, n)
        allowed = pm if allowed is None else allowed & pm
    return allowed


BWD_NAME = "mha_flash_bwd"
BWD_SOURCES = ("flash/flash_attn_bwd.cpp",)


def load_backward() -> str | None:
    """Build (or reuse) and load the fused backward ``csrc/flash/flash_attn_bwd.cpp`` (extension
    ``mha_flash_bwd``). Returns the reason it is unavailable (warned once), or None. Once
    loaded, it is handed the forward's measured bf16 kernel (its products follow it)."""
    reason = build.load_extension(
        BWD_NAME, BWD_SOURCES, instead="using the PyTorch backward",
        register=lambda: torch.library.register_fake("mha::flash_attention_bwd_fused")(_bwd_fake))
    if reason is None:
        _hand_in("_flash_bwd_set_bf16_choice",
                 lambda: bf16_choice() if unavailable() is None else "no forward to measure")
    return reason


@torch.library.custom_op("mha::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None,
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, key_lengths: torch.Tensor | None,
                        mask: torch.Tensor | None, causal: bool, scale: float,
                        window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                        bias_grad: bool = False, plan: torch.Tensor | None = None,
                        plan_bits: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv, dbias)`` of :func:`flash_attention`, in fp32 arithmetic: the
    fused native kernel ``mha::flash_attention_bwd_fused`` when it builds, else
    :func:`flash_attention_bwd_torch`. ``window`` 0 means none. ``dbias`` (with ``bias_grad``):
    float32 ``(B, h, Tq|1, Tk|1)``, the bias's gradient before the sum over its broadcast batch
    and head dims; else an empty tensor. ``plan``, ``plan_bits``: a block plan as in the
    forward, or None."""
    if load_backward() is None and not _wide_rows(lse).any():
        return torch.ops.mha.flash_attention_bwd_fused(
            grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask, causal, scale, window,
            softcap, sinks, bias, alibi, bias_grad, plan, plan_bits)
    return flash_attention_bwd_torch(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask,
                                     causal, scale, window, softcap, sinks, bias, alibi,
                                     bias_grad, plan, plan_bits)


# |lse| from which a row's P is not recomputed as exp(S - lse): the forward took such a row's
# softmax in double (csrc/flash/key_loop.h, kWideLogit: 2^24 in base 2), and past ~2^50 the
# double lse = m + log l no longer holds log l (P would lose the factor 1 / l) nor, once
# |lse| log2 e overflows float, anything. Such rows take flash_attention_bwd_torch's exact
# per-row softmax instead.
_WIDE_LSE = 2.0 ** 24 * math.log(2.0)


def _wide_rows(lse: torch.Tensor) -> torch.Tensor:
    """``(B, h, Tq)`` bool: the rows whose lse is finite and at least ``_WIDE_LSE`` in size."""
    return torch.isfinite(lse) & (lse.abs() >= _WIDE_LSE)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "flash_attention: double backward (a gradient of the gradients, e.g. "
        "torch.autograd.grad(..., create_graph=True) then grad again) is not supported by the "
        'native kernel (backend "flash_cpu"); use backend="math" for it')


flash_attention_bwd.register_autograd(_no_double_backward,
                                      setup_context=lambda ctx, inputs, output: None)


def flash_attention_bwd_torch(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask,
                              causal: bool, scale: float, window: int = 0, softcap: float = 0.0,
                              sinks=None, bias=None, alibi=None, bias_grad: bool = False,
                              plan=None, plan_bits=None):
    """The backward in PyTorch ops (fallback and test oracle): recomputes
    ``P = exp(S - lse)`` for chunks of query rows, reading only the keys between the chunk's
    first window start and its last causal diagonal (with a window: O(Tq w) work and memory).
    Masked pairs give exactly 0 (``dS`` selected, never ``0 * NaN``); Q and K enter the
    products with ``dS`` with non-finite elements as 0, and a row whose q is not finite or whose
    lse is +inf gets ``lse = NaN`` (P = NaN at every pair it sees, as softmax gives), so every
    pair such a row sees still carries its NaN (the module's NaN / Inf rule). The score
    variants (softcap, bias, ALiBi) are applied to each chunk's scores as the forward does;
    ``dS`` then passes through the softcap's derivative, and the bias gradient is ``dS`` per
    pair, summed over the bias's broadcast query and key dims."""
    B, h, Tq, d_k = q.shape
    h_kv, Tk, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // h_kv
    f32 = torch.float32
    window = window if 0 < window < Tk else 0  # w >= Tk hides no key
    dq = torch.zeros(B, h, Tq, d_k, dtype=f32)
    dk = torch.zeros(B, h_kv, Tk, d_k, dtype=f32)
    dv = torch.zeros(B, h_kv, Tk, d_v, dtype=f32)
    db = (torch.zeros(B, h, bias.shape[2], bias.shape[3], dtype=f32) if bias_grad
          else torch.zeros(0, dtype=f32))  # (B, h, Tq|1, Tk|1)
    if grad_out is None and grad_lse is None:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), db
    d_out = torch.zeros(B, h, Tq, d_v, dtype=f32) if grad_out is None else grad_out.to(f32)
    delta = (d_out * out.to(f32)).sum(-1)  # (B, h, Tq)
    if grad_lse is not None:
        delta = delta - grad_lse.to(f32)  # dS = P * (dP - delta + dlse)
    qf, kf, vf = q.to(f32), k.to(f32), v.to(f32)  # (B, h|h_kv, Tq|Tk, d_k|d_v)
    q_finite = torch.isfinite(qf).all(-1)  # (B, h, Tq)
    qf = torch.where(torch.isfinite(qf), qf, 0.0)  # (B, h, Tq, d_k)
    k_safe = torch.where(torch.isfinite(kf), kf, 0.0)  # (B, h_kv, Tk, d_k), for dq = dS K
    lse_safe = torch.where(q_finite & (lse != float("inf")), lse.to(f32), float("nan"))
    lse_safe = lse_safe.masked_fill(lse == float("-inf"), float("inf"))  # empty rows: P = 0
    wide = _wide_rows(lse)  # (B, h, Tq): P from the row's own softmax (see _WIDE_LSE)
    if window:  # rows <= w: a chunk reads at most rows + w - 1 < 2 w keys
        rows = max(1, min(Tq, window, _CHUNK_ELEMENTS // max(1, B * h * min(Tk, 2 * window))))
    else:
        rows = max(1, min(Tq, _CHUNK_ELEMENTS // max(1, B * h * Tk)))
    for i0 in range(0, Tq, rows):
        i1 = min(Tq, i0 + rows)
        C = i1 - i0
        j1 = min(Tk, i1 + Tk - Tq) if causal else Tk  # past the last key the chunk sees
        j0 = max(0, i0 + Tk - Tq - window + 1) if window else 0  # first row's window start
        if j1 <= j0:
            continue
        n = j1 - j0
        q_c = qf[:, :, i0:i1].reshape(B, h_kv, g * C, d_k)  # (B, h_kv, g*C, d_k)
        do_c = d_out[:, :, i0:i1].reshape(B, h_kv, g * C, d_v)  # (B, h_kv, g*C, d_v)
        k_c, v_c = kf[:, :, j0:j1], vf[:, :, j0:j1]  # (B, h_kv, n, d_k|d_v)
        s = (q_c @ k_c.transpose(-2, -1)).view(B, h, C, n) * scale  # (B, h, C, n)
        cap_grad = None
        if softcap:
            t = torch.tanh(s / softcap)  # (B, h, C, n)
            s, cap_grad = softcap * t, 1.0 - t * t
        if bias is not None:
            bc = bias if bias.shape[2] == 1 else bias[:, :, i0:i1]  # (B|1, h|1, C|1, Tk|1)
            s = s + (bc if bc.shape[3] == 1 else bc[..., j0:j1]).to(f32)  # (B, h, C, n)
        if alibi is not None:
            dist = (torch.arange(i0, i1)[:, None] + (Tk - Tq)
                    - torch.arange(j0, j1)[None]).to(f32)  # (C, n)
            s = s - alibi.to(f32).view(-1, h, 1, 1) * dist  # (B, h, C, n)
        p = torch.exp(s - lse_safe[:, :, i0:i1, None])  # (B, h, C, n)
        allowed = _allowed_chunk(i0, i1, j0, j1, Tq, Tk, causal, window, key_lengths, mask,
                                 plan, plan_bits)
        if allowed is not None:
            p = p.masked_fill(~allowed, 0.0)
        if wide[:, :, i0:i1].any():
            p = torch.where(wide[:, :, i0:i1, None] & q_finite[:, :, i0:i1, None],
                            _wide_softmax(s, allowed, sinks), p)  # (B, h, C, n)
        p_g = p.view(B, h_kv, g * C, n)  # (B, h, C, n) -> (B, h_kv, g*C, n)
        dv[:, :, j0:j1] += p_g.transpose(-2, -1) @ do_c  # (B, h_kv, n, d_v)
        dp = (do_c @ v_c.transpose(-2, -1)).view(B, h, C, n)  # (B, h, C, n)
        ds = p * (dp - delta[:, :, i0:i1, None])  # (B, h, C, n)
        if allowed is not None:
            ds = ds.masked_fill(~allowed, 0.0)  # dP may be NaN at a masked pair: dS is 0
        if bias_grad:  # summed over the bias's broadcast query / key dims
            part = ds.sum(dim=2, keepdim=True) if bias.shape[2] == 1 else ds
            part = part.sum(dim=3, keepdim=True) if bias.shape[3] == 1 else part
            rows_ = slice(None) if bias.shape[2] == 1 else slice(i0, i1)
            cols = slice(None) if bias.shape[3] == 1 else slice(j0, j1)
            db[:, :, rows_, cols] += part  # (B, h, C|1, n|1)
        if cap_grad is not None:  # dS of the scaled raw scores
            ds = torch.where(ds != 0, ds * cap_grad, ds)  # 0 stays 0 at masked pairs
        ds = ds.view(B, h_kv, g * C, n)  # (B, h, C, n) -> (B, h_kv, g*C, n)
        dq[:, :, i0:i1] = (ds @ k_safe[:, :, j0:j1]).view(B, h, C, d_k) * scale  # (B, h, C, d_k)
        dk[:, :, j0:j1] += (ds.transpose(-2, -1) @ q_c) * scale  # (B, h_kv, n, d_k)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), db


def _wide_softmax(s: torch.Tensor, allowed: torch.Tensor | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """``P`` ``(B, h, C, n)`` float32 of a chunk's scores ``s`` in float64, each row over the keys
    it may attend (``allowed``, None: all), its sink (``(h,)`` or None) in the denominator:
    exact for finite scores of any size (rows whose lse is too large to recompute P from)."""
    s64 = s.double()  # (B, h, C, n)
    if allowed is not None:
        s64 = s64.masked_fill(~allowed, float("-inf"))
    m = s64.amax(-1, keepdim=True)  # (B, h, C, 1)
    if sinks is not None:
        m = torch.maximum(m, sinks.double().view(1, -1, 1, 1))
    m = torch.where(torch.isinf(m), 0.0, m)  # no visible key (and no sink): P = 0 below
    e = torch.exp(s64 - m)  # (B, h, C, n)
    den = e.sum(-1, keepdim=True)  # (B, h, C, 1)
    if sinks is not None:
        den = den + torch.exp(sinks.double().view(1, -1, 1, 1) - m)
    return (e / den).float()


@flash_attention_bwd.register_fake
def _bwd_fake(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask, causal, scale,
              window=0, softcap=0.0, sinks=None, bias=None, alibi=None, bias_grad=False,
              plan=None, plan_bits=None):
    B, h, Tq, _ = q.shape
    dbias = (q.new_empty((B, h, bias.shape[2], bias.shape[3]), dtype=torch.float32)
             if bias_grad else q.new_empty((0,), dtype=torch.float32))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    key_lengths: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                    scale: float | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None,
                    alibi_slopes: torch.Tensor | None = None,
                    plan: tuple[torch.Tensor, torch.Tensor] | None = None,
                    lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``softmax(q k^T * scale) v`` on the CPU with the native kernel, and its log-sum-exp.

    Internal: the backends and tests call it with arguments ``mha.attention`` has validated
    (``mha.checks``); the public entry is ``mha.attention(..., backend="flash_cpu")``.

    Args:
        q: ``(B, h, Tq, d_k)``, float32 or bfloat16, any strides.
        k: ``(B, h_kv, Tk, d_k)``; query head ``i`` reads K/V head ``i // (h // h_kv)``.
        v: ``(B, h_kv, Tk, d_v)``.
        causal: query ``i`` sees keys ``j <= i + Tk - Tq`` (bottom-right). For Tq=2, Tk=5::

                1 1 1 1 0
                1 1 1 1 1

        key_lengths: ``(B,)`` integers; keys ``j >= key_lengths[b]`` are padding.
        mask: bool broadcastable to ``(B, h, Tq, Tk)``, True = may attend; read in place
            through its strides (broadcast dims are not expanded).
        scale: multiplies the scores; None means ``1 / sqrt(d_k)``.
        window: sliding window (use with ``causal``): query ``i`` sees only keys
            ``j > i + Tk - Tq - window``; key blocks left of it are skipped, in the forward
            and in the backward (O(Tq window) work). None: no window.
        softcap, sinks, bias, alibi_slopes: the score variants of :mod:`mha.scores`, applied
            in the kernel: ``softcap`` > 0 (scores ``softcap * tanh(s / softcap)``); ``sinks``
            ``(h,)`` (one logit per head in every denominator, differentiable); ``bias`` float,
            broadcastable to ``(B, h, Tq, Tk)``, read through its strides (size-1 dims are
            not expanded; differentiable); ``alibi_slopes`` ``(h,)`` or ``(B, h)``
            (``-slope (i + Tk - Tq - j)`` computed in the kernel). The log-sum-exp includes
            the sink (a row with no key then has ``lse = sinks[h]``).
        plan: a mask_mod's block plan for the kernel, ``(index, bits)`` from
            :meth:`mha.blockplan.BlockPlan.kernel_tensors` (built with ``block_q=48,
            block_k=128``): EMPTY key blocks are never read, FULL ones run with no mask,
            PARTIAL ones with the mask_mod's cached bits; ANDed with every other mask.
        lse: False returns None in place of the log-sum-exp (not converted to float32).

    Returns:
        ``out (B, h, Tq, d_v)`` in q's dtype (memory laid out as ``(B, Tq, h, d_v)``) and
        ``lse (B, h, Tq)`` float32, ``log sum_j exp(s_ij)`` over visible keys. Query rows that
        see no key give zeros and ``lse = -inf`` (and zero, finite gradients). NaN / Inf
        in the inputs follow the module's rule (see the module docstring).
    """
    return forward(q, k, v, causal, key_lengths, mask, scale, window, softcap, sinks, bias,
                   alibi_slopes, plan, lse)


def forward(q, k, v, causal, key_lengths, mask, scale, window, softcap, sinks, bias,
            alibi_slopes, plan, lse) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`flash_attention` with every argument in its order (what the backend calls per
    call: 14 keyword arguments cost more to pass than 14 in order)."""
    _ready()
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, h|1, Tq|1, Tk|1)
    if key_lengths is not None:
        key_lengths = torch.as_tensor(key_lengths).to(torch.int64)  # (B,)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    f32 = torch.float32
    if bias is not None:  # float32, 4-D, size-1 dims kept (no expansion)
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).to(f32)
    if sinks is not None:
        sinks = sinks.to(f32).contiguous()  # (h,)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(f32).reshape(-1, q.shape[1]).contiguous()  # (1|B, h)
    # No second validation here: mha.attention's boundary (mha.checks) has validated every
    # argument and the C++ op guards shapes, dtypes and lengths (TORCH_CHECK); a window <= 0
    # is no window there.
    # The op's lse is float64: the backward recomputes P from it, and at scores in the hundreds
    # (T5's unscaled logits) an fp32 lse would put ~1e-4 relative error into every P.
    index, bits = (None, None) if plan is None else plan
    args = (q, k, v, key_lengths, mask, bool(causal), scale, int(window or 0),
            float(softcap or 0.0), sinks, bias, alibi_slopes, index, bits)
    out, lse64 = _run_forward(args)
    return out, (lse64.float() if lse else None)  # (B, h, Tq, d_v), (B, h, Tq)


class _FlashFunction(torch.autograd.Function):
    """The forward op with ``register_autograd``'s setup and backward (:func:`_setup_context`,
    :func:`_backward`), as an autograd.Function: eager calls that need grad skip the
    registered Python Autograd kernel. ``apply`` takes the op's 14 arguments in its order.
    (The classic ``forward(ctx, ...)`` form: a separate ``setup_context`` makes ``apply`` bind
    the arguments with ``inspect`` on every call.)"""

    @staticmethod
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = torch.ops.mha.flash_attention_fwd.default(*args)
        _setup_context(ctx, args, output)
        return output

    backward = staticmethod(_backward)


# Function.apply without its Python wrapper, which binds default arguments and unwraps dead
# torch.func wrappers: used only when no transform is active and no argument is a
# torch.func wrapper, where the wrapper does nothing else.
_apply_unwrapped = functools.partial(super(torch.autograd.Function, _FlashFunction).apply)


def _run_forward(args: tuple):
    """``torch.ops.mha.flash_attention_fwd(*args)`` -> ``(out, lse float64)``, on the cheapest
    path that keeps the op's meaning: the registered op under a trace (compile, export), a
    ``torch.func`` transform or a ``__torch_function__`` override; else the CPU kernel below
    the Autograd key, through :class:`_FlashFunction` when autograd must record the call."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._has_torch_function(args)):
        return torch.ops.mha.flash_attention_fwd(*args)
    q, k, v, sinks, bias, alibi = args[0], args[1], args[2], args[9], args[10], args[11]
    if torch.is_grad_enabled() and (  # the float inputs (the others are integer or bool)
            q.requires_grad or k.requires_grad or v.requires_grad
            or (sinks is not None and sinks.requires_grad)
            or (bias is not None and bias.requires_grad)
            or (alibi is not None and alibi.requires_grad)):
        floats = [t for t in (q, k, v, sinks, bias, alibi) if t is not None]
        if any(map(torch._C._functorch.is_functorch_wrapped_tensor, floats)):
            return _FlashFunction.apply(*args)
        return _apply_unwrapped(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.mha.flash_attention_fwd.default(*args)


def _paged_fake(q, k_pages, v_pages, block_table, cu_seqlens_q, key_lengths, causal, scale,
                softcap=0.0, sinks=None):
    N, h, _ = q.shape
    out = q.new_empty((N, h, v_pages.shape[3]))  # (N, h, d_v)
    return out, q.new_empty((h, N), dtype=torch.float64)  # (h, N)


def flash_attention_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                          block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          key_lengths: torch.Tensor, *, causal: bool = True,
                          scale: float | None = None, softcap: float | None = None,
                          sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash forward over paged K/V: ragged rows of packed queries, K/V read through a
    block table while the kernel packs its key blocks (``csrc/flash/paged.h``), no copy.

    Internal: :meth:`mha.PagedKVCache.attend_varlen` calls it with arguments it has validated
    (the C++ op guards shapes, dtypes, lengths and every page index it reads). Forward only.

    Args:
        q: ``(N, h, d_k)`` float32 or bfloat16, the queries of B rows end to end.
        k_pages, v_pages: ``(P, h_kv, p, d_k)`` / ``(P, h_kv, p, d_v)`` contiguous pools in q's
            dtype; any page size ``p``.
        block_table: ``(B, M)`` int32, the pages of each row in order.
        cu_seqlens_q: ``(B + 1,)``: row b owns queries ``cu[b]:cu[b + 1]``, the last ``n_b``
            of its ``key_lengths[b]`` tokens.
        key_lengths: ``(B,)`` tokens of each row's sequence (K/V written already).
        causal: bottom-right per row: query ``i`` of row b sees keys
            ``j <= i + key_lengths[b] - n_b``. For n_b = 2, key_lengths[b] = 5::

                1 1 1 1 0
                1 1 1 1 1

        scale: None means ``1 / sqrt(d_k)``; softcap, sinks as in :func:`flash_attention`.

    Returns:
        ``out (N, h, d_v)`` in q's dtype and ``lse (h, N)`` float32 (``-inf``: no key; with
        sinks, the sink's logit). Rows that see no key give zeros. NaN / Inf as the module's rule.
    """
    _ready()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pages, v_pages)):
        raise RuntimeError("flash_attention_paged is forward only (inference): run it under "
                           "torch.no_grad() or torch.inference_mode(), or gather the K/V and "
                           "call mha.attention for gradients")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()  # (h,)
    cu = torch.as_tensor(cu_seqlens_q).to(torch.int64)  # (B + 1,)
    lengths = torch.as_tensor(key_lengths).to(torch.int64)  # (B,)
    out, lse = torch.ops.mha.flash_attention_paged_fwd(
        q, k_pages, v_pages, block_table.to(torch.int32), cu, lengths, bool(causal), scale,
        float(softcap or 0.0), sinks)
    return out, lse.float()  # (N, h, d_v), (h, N)

