"""Training with a sliding window: the backward of ``flash_attention(..., window=w)``.

Shape legend: B batch, h query heads, h_kv key/value heads, Tq/Tk lengths, d_k/d_v head dims,
w window. Query i sees keys ``i + Tk - Tq - w < j <= i + Tk - Tq`` (bottom-right), and-ed with
key_lengths and a bool mask. The gradients dq, dk, dv of the fused native backward (fp32 and
both arithmetics of its bf16 products) and of the PyTorch fallback (in many chunks) are judged
against autograd through the float64 loop with the window materialized (tests/oracle.py's
rule); training with a window must run in O(T w) memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha
from examples import examples
from kernel_inputs import bool_mask, qkv
from mha import dispatch, reference
from mha.masks import MaskSpec
from mha.ops import flash

from oracle import FLOOR, max_err

LENGTHS = [1, 2, 17, 63, 64, 65, 100, 129, 150]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert flash.unavailable() is None, flash.unavailable()
    assert flash.load_backward() is None  # a build failure fails these tests


def _paths() -> list[tuple[str, torch.dtype]]:
    """(path, dtype): "autograd" is the fused kernel through flash_attention's autograd,
    "fp32" / "bf16" name the fused kernel's product arithmetic, "torch" the PyTorch fallback."""
    bf16 = ["bf16", "fp32"] if "avx512bf16" in flash.isa().split(",") else ["fp32"]
    return ([("autograd", torch.float32), ("autograd", torch.bfloat16), ("torch", torch.float32),
             ("torch", torch.bfloat16)] + [(m, torch.bfloat16) for m in bf16])


def _reference_grads(q, k, v, go, gl, spec: MaskSpec, scale, upcast):
    """Gradients of sum(out * go) + sum(lse * gl) (rows that see a key) by autograd through the
    per-head reference loop with the materialized mask, in float64 (upcast) or the inputs'
    dtype; and the float64 (or low) output."""
    B, h, Tq, _ = q.shape
    Tk = k.shape[2]
    dt = torch.float64 if upcast else q.dtype
    ins = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
    allowed = spec.dense(B, h, Tq, Tk)  # (B, h, Tq, Tk)
    out = reference.attention(*ins, allowed=allowed, scale=scale)[0]  # (B, h, Tq, d_v)
    kk = ins[1].repeat_interleave(h // k.shape[1], 1)  # (B, h, Tk, d_k)
    s = torch.einsum("bhqd,bhkd->bhqk", ins[0], kk) * scale  # (B, h, Tq, Tk)
    lse = s.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # (B, h, Tq)
    fin = torch.isfinite(lse)
    loss = (out * go.to(dt)).sum() + (lse[fin] * gl.to(dt)[fin]).sum()
    return torch.autograd.grad(loss, ins), out.detach()


def _grads(path, q, k, v, go, gl, spec: MaskSpec, scale):
    """dq, dk, dv of sum(out * go) + sum(lse * gl) by one of _paths()."""
    if path == "autograd":
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash.flash_attention(*ins, causal=spec.causal, key_lengths=spec.key_lengths,
                                          mask=spec.mask, scale=scale, window=spec.window)
        loss = (out * go).sum() + (torch.where(torch.isfinite(lse), lse, 0) * gl).sum()
        return torch.autograd.grad(loss, ins)
    out, lse = flash.flash_attention(q, k, v, causal=spec.causal, key_lengths=spec.key_lengths,
                                      mask=spec.mask, scale=scale, window=spec.window)
    args = (go, gl, q, k, v, out, lse, spec.key_lengths, spec.mask, spec.causal, scale)
    if path == "torch":
        chunk = flash._CHUNK_ELEMENTS
        flash._CHUNK_ELEMENTS = 3000  # a few rows per chunk: the chunks' key ranges differ
        try:
            return flash.flash_attention_bwd_torch(*args, spec.window)[:3]
        finally:
            flash._CHUNK_ELEMENTS = chunk
    return torch.ops.mha._flash_attention_bwd_fused_math(*args, path, spec.window)


def _assert_close_to_reference(got, q, k, v, go, gl, spec, scale):
    want, out = _reference_grads(q, k, v, go, gl, spec, scale, upcast=True)
    low, _ = _reference_grads(q, k, v, go, gl, spec, scale, upcast=False)
    # dS = P (dP - rowsum(dO O)) cancels: eps * sum|dO O| * scale * |q or k| is unavoidable
    terms = (go.double() * out).abs().sum(-1).max().item()
    size = max(1.0, terms * scale * max(q.abs().max().item(), k.abs().max().item(), 1.0))
    for name, a, w, lo in zip("qkv", got, want, low, strict=True):
        assert a.dtype == q.dtype and a.shape == w.shape and torch.isfinite(a).all()
        budget = 2 * max_err(lo, w) + FLOOR[q.dtype] * max(size, w.abs().max().item())
        assert max_err(a, w) <= budget, f"d{name}: error {max_err(a, w):.3e} > {budget:.3e}"


@pytest.mark.parametrize("path,dtype", _paths())
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_window_gradients_vs_fp64_reference(path, dtype, data):
    """Windows 1 to past Tk (w >= Tk is plain causal), odd sizes, Tq != Tk, GQA, d_v != d_k,
    key_lengths and masks combined, lse gradients on or off."""
    Tq = data.draw(st.sampled_from(LENGTHS), label="Tq")
    Tk = data.draw(st.sampled_from(LENGTHS), label="Tk")
    w = data.draw(st.one_of(st.just(1), st.integers(1, Tk + 3)), label="w")
    h_kv = data.draw(st.sampled_from([1, 2]), label="h_kv")
    h = h_kv * data.draw(st.sampled_from([1, 3]), label="group")
    d_k, d_v = data.draw(st.sampled_from([(32, 32), (64, 24), (17, 80)]), label="d_k, d_v")
    B = data.draw(st.integers(1, 2), label="B")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    kl = None
    if data.draw(st.booleans(), label="key_lengths"):
        kl = torch.tensor([Tk, data.draw(st.integers(0, Tk), label="len1")])[:B]
    mask = bool_mask(data.draw(st.sampled_from([None, "keys", "full", "rows"]), label="mask"),
                     B, h, Tq, Tk, seed)
    use_gl = data.draw(st.booleans(), label="grad of lse")
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(B, h, h_kv, Tq, Tk, d_k, d_v, dtype, "bthd", g=g)
    go = torch.randn(B, h, Tq, d_v, generator=g).to(dtype)  # (B, h, Tq, d_v)
    gl = torch.randn(B, h, Tq, generator=g) * use_gl  # (B, h, Tq)
    spec = MaskSpec(True, kl, mask, w)
    got = _grads(path, q, k, v, go, gl, spec, 0.3)
    _assert_close_to_reference(got, q, k, v, go, gl, spec, 0.3)


@pytest.mark.parametrize("path", ["autograd", "torch"])
def test_window_gradients_skip_keys_outside_every_window(path):
    """Keys no query's window reaches (Tq < Tk: the first keys) get exactly zero dk, dv; the
    rows left of every key (Tq > Tk) get exactly zero dq; both against the reference."""
    q, k, v = qkv(1, 4, 2, 70, 200, 32, 24, torch.float32, "bthd", seed=5)
    go = torch.randn(1, 4, 70, 24)
    gl = torch.zeros(1, 4, 70)
    spec = MaskSpec(True, None, None, 9)
    dq, dk, dv = _grads(path, q, k, v, go, gl, spec, 0.2)
    assert dk[:, :, : 200 - 70 - 8].abs().max() == 0 and dv[:, :, : 200 - 70 - 8].abs().max() == 0
    _assert_close_to_reference((dq, dk, dv), q, k, v, go, gl, spec, 0.2)
    q2, k2, v2 = qkv(1, 2, 2, 150, 60, 32, 32, torch.float32, "bthd", seed=6)
    go2 = torch.randn(1, 2, 150, 32)
    dq2, _, _ = _grads(path, q2, k2, v2, go2, torch.zeros(1, 2, 150), MaskSpec(True, None, None, 5),
                       0.2)
    assert dq2[:, :, :90].abs().max() == 0  # rows i < Tq - Tk see no key
    assert dq2[:, :, 90:].abs().max() > 0


def test_window_bwd_deterministic_across_thread_counts():
    q, k, v = qkv(1, 4, 1, 301, 700, 64, 64, torch.float32, "bthd", seed=3)
    go = torch.randn(1, 4, 301, 64)
    out, lse = flash.flash_attention(q, k, v, causal=True, window=150)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (2, 1, 2):
            torch.set_num_threads(n)
            runs.append(torch.ops.mha.flash_attention_bwd_fused(go, None, q, k, v, out, lse, None,
                                                                None, True, 0.125, 150))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def test_flash_cpu_serves_window_training():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 40, 40, 16, 16, torch.float32))
    call = mha.functional.make_call(q, k, v, causal=True, window=8)
    assert dispatch.choose(call, None).name == "flash_cpu"
    out = mha.attention(q, k, v, causal=True, window=8)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().max() > 0


def test_window_opcheck():
    q, k, v = qkv(2, 4, 2, 37, 45, 32, 24, torch.float32, "bthd", seed=4)
    kl = torch.tensor([45, 30])
    out, lse = flash.flash_attention(q, k, v, causal=True, key_lengths=kl, window=11)
    go, gl = torch.randn_like(out), torch.randn_like(lse)
    args = (go, gl, q, k, v, out, lse, kl, None, True, 0.25, 11)
    torch.library.opcheck(torch.ops.mha.flash_attention_bwd_fused.default, args)
    torch.library.opcheck(torch.ops.mha.flash_attention_bwd.default, args)


_MEMORY_PROBE = textwrap.dedent("""
    import sys
    import torch
    import mha

    T, w, d = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    def step(t):
        q, k, v = (torch.randn(1, 1, t, d, requires_grad=True) for _ in range(3))
        mha.attention(q, k, v, causal=True, window=w).sum().backward()

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    torch.set_num_threads(2)
    step(4 * w)  # build / load the kernels and warm the allocator
    q, k, v = (torch.randn(1, 1, T, d, requires_grad=True) for _ in range(3))
    before = peak_kib()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak to the current RSS
        f.write("5")
    rss = peak_kib()
    mha.attention(q, k, v, causal=True, window=w).sum().backward()
    print(peak_kib() - rss, before)
""")


def test_window_training_memory_is_o_t_w():
    """Forward + backward at T=16384, w=128 in a fresh process: the peak RSS grows by far less
    than one (T, T) bool mask would take (T^2 bytes, 256 MiB); bound T^2 / 4 bytes."""
    T, w, d = 16384, 128, 32
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(T), str(w), str(d)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    growth_kib = int(run.stdout.split()[0])
    assert growth_kib * 1024 < T * T // 4, f"peak RSS grew {growth_kib} KiB"
