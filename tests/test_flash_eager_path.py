"""``mha.ops.flash.flash_attention`` in eager code calls the CPU kernel below the Autograd key
(through ``_FlashFunction`` when an input requires grad); the registered op
``torch.ops.mha.flash_attention_fwd`` (``register_autograd``) is what traces call. Both give the
same outputs and the same gradients, bit for bit, for every differentiable input."""

from __future__ import annotations

import pytest
import torch

from mha.ops import flash

pytestmark = pytest.mark.skipif(flash.unavailable() is not None,
                                reason=f"flash_cpu cannot run here: {flash.unavailable()}")

B, H, H_KV, TQ, TK, D = 2, 4, 2, 7, 11, 32
CASES = ("plain", "causal+lengths", "mask+window", "sinks", "bias", "alibi", "softcap")


def _args(case: str, dtype: torch.dtype, grad: bool):
    """The op's 14 arguments in order, and which of them are differentiable leaves."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, TQ, D, generator=g).to(dtype)
    k, v = (torch.randn(B, H_KV, TK, D, generator=g).to(dtype) for _ in range(2))
    key_lengths = mask = sinks = bias = alibi = None
    causal, window, softcap = False, 0, 0.0
    if case == "causal+lengths":
        causal, key_lengths = True, torch.tensor([TK, 5])
    if case == "mask+window":
        causal, window = True, 4
        mask = (torch.rand(1, H, TQ, TK, generator=g) > 0.3)
    if case == "sinks":
        sinks = torch.randn(H, generator=g)
    if case == "bias":
        bias = torch.randn(1, H, TQ, TK, generator=g)
    if case == "alibi":
        alibi = torch.rand(1, H, generator=g)
    if case == "softcap":
        softcap = 5.0
    leaves = [t for t in (q, k, v, sinks, bias) if t is not None]
    for t in leaves:
        t.requires_grad_(grad)
    args = (q, k, v, key_lengths, mask, causal, D ** -0.5, window, softcap, sinks, bias, alibi,
            None, None)
    return args, leaves


def _grads(out, lse, leaves):
    g = torch.Generator().manual_seed(5)
    loss = (out.float() * torch.randn(out.shape, generator=g)).sum() + lse.float().sum() * 0.5
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_eager_path_equals_the_registered_op(case, dtype):
    args, leaves = _args(case, dtype, grad=True)
    eager_out, eager_lse = flash._run_forward(args)
    op_out, op_lse = torch.ops.mha.flash_attention_fwd(*args)
    assert torch.equal(eager_out, op_out) and torch.equal(eager_lse, op_lse)
    assert eager_out.grad_fn is not None
    for got, want in zip(_grads(eager_out, eager_lse, leaves), _grads(op_out, op_lse, leaves),
                         strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", CASES)
def test_without_grad_the_kernel_runs_and_records_nothing(case):
    args, _ = _args(case, torch.float32, grad=False)
    out, lse = flash._run_forward(args)
    want_out, want_lse = torch.ops.mha.flash_attention_fwd(*args)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert out.grad_fn is None and lse.grad_fn is None
    grad_args, _ = _args(case, torch.float32, grad=True)
    with torch.no_grad():
        out, _ = flash._run_forward(grad_args)
    assert out.grad_fn is None and torch.equal(out, want_out)


def test_flash_attention_lse_false_returns_none():
    args, _ = _args("plain", torch.float32, grad=False)
    q, k, v = args[:3]
    out, lse = flash.flash_attention(q, k, v, lse=False)
    want, want_lse = flash.flash_attention(q, k, v)
    assert lse is None and torch.equal(out, want) and want_lse.dtype == torch.float32


def test_torch_func_and_torch_function_modes_take_the_registered_op():
    args, _ = _args("bias", torch.float32, grad=False)
    q, k, v = args[:3]

    def one(q):  # (h, Tq, d) -> (h, Tq, d)
        return flash.flash_attention(q[None], k[:1], v[:1], bias=args[10])[0][0]

    batched = torch.vmap(one)(q[:1].expand(3, -1, -1, -1))  # (3, h, Tq, d)
    for row in batched:
        assert torch.equal(row, one(q[0]))

    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        out, _ = flash.flash_attention(q, k, v)
    assert torch.ops.mha.flash_attention_fwd in seen  # the packet: the registered op
    assert torch.ops.mha.flash_attention_fwd.default not in seen  # not the kernel below it
    assert torch.equal(out, flash.flash_attention(q, k, v)[0])
