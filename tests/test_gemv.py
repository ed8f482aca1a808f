"""The packed weight-stationary projections (mha.ops.gemv): against an fp64 reference on the
same rounded weights (the repository's rule: at most 2x the error of the same product summed in
the low precision, plus the floor), on shapes that are not multiples of the kernel's blocks;
NaN and Inf propagate; bad input is refused naming the argument; results do not depend on the
thread count.

Shape legend: x (M, K), weight (N, K), out (M, N).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mha.ops import gemv
from threads import with_threads

from oracle import FLOOR, max_err

if gemv.load() is not None:
    pytest.skip(f"the gemv extension did not build: {gemv.load()}", allow_module_level=True)

KINDS = gemv.KINDS
SHAPES = [  # (M, N, K): N, K off the 32-column panels and the k pairs, M off the 4-row tiles
    (1, 1, 1), (1, 31, 15), (1, 33, 63), (2, 64, 130), (3, 100, 577), (4, 32, 2),
    (5, 200, 129), (7, 65, 31), (16, 96, 64), (17, 47, 201),
]


def _inputs(M, N, K, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    return x, w, b


def _check(got, x, packed, bias):
    """got within 2x the low-precision error of the fp64 product on the packed weight."""
    ref = gemv.reference(x.double(), packed, None if bias is None else bias.double())
    w = packed.unpack()  # (N, K) fp32, the rounded weight
    if x.dtype == torch.bfloat16:  # the same product in bf16 (torch's bf16 GEMM)
        low = F.linear(x, w.bfloat16(), None if bias is None else bias.bfloat16())
    else:
        low = F.linear(x, w, bias)
    budget = 2 * max_err(low, ref) + FLOOR[x.dtype]
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert max_err(got, ref) <= budget, (max_err(got, ref), budget)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64_on_the_rounded_weight(kind, M, N, K, bias):
    x, w, b = _inputs(M, N, K)
    packed = gemv.pack(w, kind)
    b = b if bias else None
    _check(gemv.gemv(x, packed, b), x, packed, b)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_activations_and_leading_dims(kind):
    x, w, b = _inputs(6, 70, 45, dtype=torch.bfloat16)
    packed = gemv.pack(w, kind)
    _check(gemv.gemv(x, packed, b), x, packed, b)
    x3 = x.view(2, 3, 45)  # (M, K) -> (B, T, K)
    assert torch.equal(gemv.gemv(x3, packed, b), gemv.gemv(x, packed, b).view(2, 3, 70))


def test_the_rounding_of_the_weight():
    """bf16: the weight rounded to nearest bf16; int8: within half a step of its row's scale."""
    _, w, _ = _inputs(1, 37, 19)
    assert torch.equal(gemv.pack(w, "bf16").unpack(), w.bfloat16().float())
    q = gemv.pack(w, "int8")
    step = w.abs().amax(dim=1, keepdim=True) / 127  # (N, 1)
    assert ((q.unpack() - w).abs() <= step / 2 * (1 + 1e-5)).all()
    assert q.nbytes < gemv.pack(w, "bf16").nbytes


@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_propagate(kind):
    x, w, _ = _inputs(5, 40, 33)
    x[1, 3] = float("nan")
    x[2, 32] = float("inf")  # the last, unpaired k
    w[7, 5] = float("nan")
    packed = gemv.pack(w, kind)
    got = gemv.gemv(x, packed)
    ref = gemv.reference(x.double(), packed)
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.isinf(), ref.isinf())
    assert got[1].isnan().all() and got[:, 7].isnan().all() and got[2].isinf().any()
    finite = ref.isfinite()
    assert max_err(got[finite], ref[finite]) < 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_the_thread_count_does_not_change_the_result(kind):
    x, w, b = _inputs(3, 8200, 1030)  # over 8 MB in both kinds: the kernel runs threads
    packed = gemv.pack(w, kind)
    one = with_threads(1, lambda: gemv.gemv(x, packed, b))
    two = with_threads(2, lambda: gemv.gemv(x, packed, b))
    assert torch.equal(one, two)


def test_empty_rows():
    _, w, b = _inputs(1, 9, 5)
    out = gemv.gemv(torch.empty(0, 5), gemv.pack(w, "bf16"), b)
    assert out.shape == (0, 9)


def test_opcheck():
    x, w, b = _inputs(3, 40, 21)
    for kind in KINDS:
        p = gemv.pack(w, kind)
        torch.library.opcheck(torch.ops.mha.gemv.default, (x, p.data, p.scale, p.n, p.k, b))


@pytest.mark.parametrize("call,arg", [
    (lambda p: gemv.gemv(torch.randn(2, 6), p), "x"),  # K is 5
    (lambda p: gemv.gemv(torch.randn(2, 5).double(), p), "x"),
    (lambda p: gemv.gemv(torch.randn(2, 5), p, torch.randn(8)), "bias"),
    (lambda p: gemv.pack(torch.randn(2, 3, 4), "bf16"), "weight"),
    (lambda p: gemv.pack(torch.ones(3, 4, dtype=torch.int32), "bf16"), "weight"),
    (lambda p: gemv.pack(torch.randn(3, 4), "fp8"), "kind"),
])
def test_bad_input_is_refused_naming_the_argument(call, arg):
    packed = gemv.pack(torch.randn(9, 5), "bf16")
    with pytest.raises(ValueError, match=rf"^{arg} "):
        call(packed)


def test_the_fallback_is_the_reference(monkeypatch):
    """Without the extension gemv runs the reference: the same values up to fp32 sums."""
    x, w, b = _inputs(2, 50, 40)
    packed = gemv.pack(w, "bf16")
    fast = gemv.gemv(x, packed, b)
    monkeypatch.setattr(gemv, "load", lambda: "mha_gemv unavailable (test)")
    slow = gemv.gemv(x, packed, b)
    assert max_err(fast, slow) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_x_and_bias(kind):
    """The kernel has no backward: a call needing a gradient runs the reference's torch ops, so
    x and a bias requiring grad get dy W and dy summed (before, x.grad stayed None behind
    torch's 'autograd kernel was not registered' warning)."""
    x, w, b = _inputs(3, 40, 21)
    packed = gemv.pack(w, kind)
    x.requires_grad_(True)
    b.requires_grad_(True)
    dy = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    gemv.gemv(x, packed, b).backward(dy)
    W = packed.unpack().double()  # (N, K), the rounded weight the product uses
    assert x.grad is not None and b.grad is not None
    assert torch.allclose(x.grad.double(), dy.double() @ W, atol=1e-4)  # (M, N) @ (N, K)
    assert torch.allclose(b.grad, dy.sum(0), atol=1e-5)
    with torch.no_grad():  # inference keeps the kernel: the same values
        assert max_err(gemv.gemv(x, packed, b), gemv.reference(x, packed, b)) < 1e-4
