"""The peers mha is measured against, each behind a small adapter.

Shape legend: B batch, h heads, T sequence length (Tq = Tk = T here), d head dim,
d_model = h * d model width.

Every adapter takes torch inputs ``q, k, v`` of shape ``(B, h, T, d)`` and returns a
zero-argument callable doing exactly one attention call in the peer's own preferred layout and
dtype — conversions happen once, here, untimed. Optional peers are imported inside their
adapter; a missing one raises :class:`mha.bench.core.Skip` naming the extra to install
(``pip install 'mha[onnx]'``, ``'mha[jax]'``). The same goes for a peer that cannot serve a
case (ONNX Runtime has no bf16 CPU kernel: it runs fp16 instead and says so in the row note).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from mha.bench.core import Skip


def sdpa(q, k, v, causal: bool):
    """``torch.nn.functional.scaled_dot_product_attention`` (top-left causal == ours, Tq = Tk)."""
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def naive(q, k, v, causal: bool):
    """matmul + softmax + matmul, the textbook way (materializes the scores)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    T = q.shape[2]
    hidden = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None  # (T, T) True = hidden

    def fn():
        s = (q @ k.transpose(-2, -1)) * scale  # (B, h, T, d) @ (B, h, d, T) -> (B, h, T, T)
        if hidden is not None:
            s = s.masked_fill(hidden, float("-inf"))
        return torch.softmax(s, dim=-1) @ v  # (B, h, T, T) @ (B, h, T, d) -> (B, h, T, d)

    return fn


def flex(q, k, v, causal: bool):
    """``torch.compile(flex_attention)``; causal as a block mask (masked blocks are skipped).
    Compiles here (one call), so the timing sees the compiled kernel only."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise Skip(f"FlexAttention not in this torch: {e}") from e
    B, h, T, _ = q.shape
    # A fresh compile per case: dynamo stops compiling after config.recompile_limit (8) shapes
    # and silently runs flex_attention eagerly (unfused, materializing) — never time that.
    torch._dynamo.reset()
    block_mask = None
    t0 = time.perf_counter()
    try:
        if causal:
            def causal_mod(b, hh, q_idx, kv_idx):
                return q_idx >= kv_idx  # True = may attend

            # compiled: the eager version materializes the (T, T) mask (32 GiB at T = 65536)
            block_mask = torch.compile(create_block_mask)(causal_mod, None, None, T, T,
                                                          device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        compiled(q, k, v, block_mask=block_mask)
        took = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 — inductor needs a working C++ toolchain
        raise Skip(f"torch.compile(flex_attention) failed: {type(e).__name__}: "
                   f"{str(e).splitlines()[0][:200] if str(e) else ''}") from e
    fn = lambda: compiled(q, k, v, block_mask=block_mask)  # noqa: E731
    fn.note = f"compiled in {took:.1f} s (first call, untimed)"
    return fn


# ----------------------------------------------------------------------------- ONNX Runtime
def _ort_modules():
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError as e:
        raise Skip(f"{e.name} not installed: pip install 'mha[onnx]' "
                   f"(onnx, onnxruntime)") from e
    return onnx, ort, helper, TensorProto


def _ort_session(graph_nodes, inputs, outputs, helper, onnx, ort):
    graph = helper.make_graph(graph_nodes, "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                     helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # onnx 1.23 writes 11; onnxruntime 1.31 reads up to 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # shares cores w/ torch
    so.enable_cpu_mem_arena = False  # so the memory probe sees its buffers (see core docstring)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _ort_dtype(q):
    """(numpy dtype name, ONNX element type, note) for q's dtype; bf16 becomes fp16."""
    _, _, _, TensorProto = _ort_modules()
    if q.dtype == torch.float32:
        return "float32", TensorProto.FLOAT, ""
    if q.dtype in (torch.bfloat16, torch.float16):
        note = "fp16 (ONNX Runtime has no bf16 CPU kernel)" if q.dtype == torch.bfloat16 else ""
        return "float16", TensorProto.FLOAT16, note
    raise Skip(f"dtype {q.dtype} not measured for ONNX Runtime")


def _bsd(x, np_dtype: str):
    """(B, h, T, d) torch -> (B, T, h*d) numpy, contiguous."""
    B, h, T, d = x.shape
    return x.float().transpose(1, 2).reshape(B, T, h * d).numpy().astype(np_dtype)  # (B, T, h*d)


def ort_mha(q, k, v, causal: bool):
    """ONNX Runtime ``com.microsoft.MultiHeadAttention`` on the CPU (inputs (B, T, h*d))."""
    onnx, ort, helper, _ = _ort_modules()
    np_dtype, elem, note = _ort_dtype(q)
    B, h, T, d = q.shape
    io = [helper.make_tensor_value_info(n, elem, [B, T, h * d]) for n in ("q", "k", "v")]
    out = [helper.make_tensor_value_info("o", elem, [B, T, h * d])]
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft",
                            num_heads=h, unidirectional=int(causal))
    sess = _ort_session([node], io, out, helper, onnx, ort)
    feeds = {"q": _bsd(q, np_dtype), "k": _bsd(k, np_dtype), "v": _bsd(v, np_dtype)}
    fn = lambda: sess.run(None, feeds)  # noqa: E731
    fn.note = note
    return fn


def ort_gqa(q, k, v, causal: bool):
    """ONNX Runtime ``com.microsoft.GroupQueryAttention`` on the CPU (prefill, no past)."""
    onnx, ort, helper, TensorProto = _ort_modules()
    np_dtype, elem, note = _ort_dtype(q)
    import numpy as np

    B, h, T, d = q.shape
    h_kv = k.shape[1]
    io = [helper.make_tensor_value_info("q", elem, [B, T, h * d]),
          helper.make_tensor_value_info("k", elem, [B, T, h_kv * d]),
          helper.make_tensor_value_info("v", elem, [B, T, h_kv * d]),
          helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
          helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    out = [helper.make_tensor_value_info("o", elem, [B, T, h * d])]
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"],
                            ["o", "present_k", "present_v"], domain="com.microsoft",
                            num_heads=h, kv_num_heads=h_kv, causal=int(causal))
    sess = _ort_session([node], io, out, helper, onnx, ort)
    feeds = {"q": _bsd(q, np_dtype), "k": _bsd(k, np_dtype), "v": _bsd(v, np_dtype),
             "seqlens_k": np.full((B,), T - 1, dtype=np.int32),  # total length - 1, per row
             "total": np.array(T, dtype=np.int32)}
    try:
        sess.run(None, feeds)
    except Exception as e:  # noqa: BLE001 — e.g. a mode this ORT build does not implement
        raise Skip(f"GroupQueryAttention refused this case: {str(e).splitlines()[0][:200]}") from e
    fn = lambda: sess.run(["o"], feeds)  # noqa: E731
    fn.note = note
    return fn


def ort_gqa_decode(q, k, v, *, huge_pages: bool = True):
    """One decoding step through ONNX Runtime ``com.microsoft.GroupQueryAttention`` with a past
    K/V cache, the way ORT's generation loop runs it.

    q ``(B, h, 1, d)`` is the new token's query; k, v ``(B, h_kv, Tk, d)`` the cache *including*
    the new token at position Tk - 1. ORT gets the first Tk - 1 positions as ``past_key`` /
    ``past_value`` (BNSH, capacity Tk) and the new token as ``key`` / ``value``; the present
    outputs are bound (IOBinding) to the same buffers as the past inputs, so ORT appends in
    place instead of copying the history (its CPU kernel checks for the shared buffer). Every
    call rewrites position Tk - 1 with the same values, so repeated calls are identical.

    The past buffers are torch tensors handed to ORT without a copy, in the pages ``huge_pages``
    says (:func:`mha.hugepages.empty`, as :class:`mha.KVCache` allocates; False: ``torch.empty``'s
    4 KiB pages), so that ORT and the cache it is compared with read the same kind of memory.
    (A numpy copy would not: numpy advises huge pages on its large arrays by itself, which made
    ORT's step read faster than a plain read of the cache's bytes.)

    Returns the timed callable; ``fn.result()`` gives the last output as ``(B, h, 1, d)``.
    """
    onnx, ort, helper, TensorProto = _ort_modules()
    np_dtype, elem, note = _ort_dtype(q)
    import numpy as np

    B, h, _, d = q.shape
    h_kv, Tk = k.shape[1], k.shape[2]
    io_info = [helper.make_tensor_value_info("q", elem, [B, 1, h * d]),
               helper.make_tensor_value_info("k", elem, [B, 1, h_kv * d]),
               helper.make_tensor_value_info("v", elem, [B, 1, h_kv * d]),
               helper.make_tensor_value_info("past_key", elem, [B, h_kv, Tk, d]),
               helper.make_tensor_value_info("past_value", elem, [B, h_kv, Tk, d]),
               helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
               helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    out_info = [helper.make_tensor_value_info("o", elem, [B, 1, h * d]),
                helper.make_tensor_value_info("present_key", elem, [B, h_kv, Tk, d]),
                helper.make_tensor_value_info("present_value", elem, [B, h_kv, Tk, d])]
    node = helper.make_node("GroupQueryAttention",
                            ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"],
                            ["o", "present_key", "present_value"], domain="com.microsoft",
                            num_heads=h, kv_num_heads=h_kv)
    sess = _ort_session([node], io_info, out_info, helper, onnx, ort)
    # the cache in ORT's layout and dtype, converted once (untimed); (B, h_kv, Tk, d) each.
    # ortvalue_from_numpy wraps a CPU array without copying: the tensors are the buffers.
    from mha import hugepages

    t_dtype = torch.float32 if np_dtype == "float32" else torch.float16
    alloc = hugepages.empty if huge_pages else (lambda *s, dtype: torch.empty(s, dtype=dtype))
    held = [alloc(*x.shape, dtype=t_dtype).copy_(x) for x in (k, v)]  # (B, h_kv, Tk, d)
    past_k, past_v = (ort.OrtValue.ortvalue_from_numpy(t.numpy()) for t in held)
    binding = sess.io_binding()
    binding.bind_cpu_input("q", _bsd(q, np_dtype))  # (B, 1, h * d)
    binding.bind_cpu_input("k", _bsd(k[:, :, Tk - 1:], np_dtype))  # (B, 1, h_kv * d)
    binding.bind_cpu_input("v", _bsd(v[:, :, Tk - 1:], np_dtype))
    binding.bind_ortvalue_input("past_key", past_k)
    binding.bind_ortvalue_input("past_value", past_v)
    binding.bind_cpu_input("seqlens_k", np.full((B,), Tk - 1, dtype=np.int32))  # total - 1
    binding.bind_cpu_input("total", np.array(Tk, dtype=np.int32))
    binding.bind_output("o")
    binding.bind_ortvalue_output("present_key", past_k)  # the same buffers: append in place
    binding.bind_ortvalue_output("present_value", past_v)
    try:
        sess.run_with_iobinding(binding)
    except Exception as e:  # noqa: BLE001 — e.g. a dtype this ORT build has no CPU kernel for
        raise Skip(f"GroupQueryAttention refused this case: {str(e).splitlines()[0][:200]}") from e

    def result():
        o = torch.from_numpy(binding.get_outputs()[0].numpy().astype("float32"))  # (B, 1, h*d)
        return o.view(B, 1, h, d).transpose(1, 2)  # (B, h, 1, d)

    fn = lambda: sess.run_with_iobinding(binding)  # noqa: E731
    fn.result = result
    fn.buffers = held  # ORT reads and writes them: they live as long as the callable
    fn.note = note
    return fn


# ----------------------------------------------------------------------------- JAX
def jax_dpa(q, k, v, causal: bool):
    """``jax.nn.dot_product_attention`` under ``jax.jit`` (XLA CPU), inputs (B, T, h, d)."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as e:
        raise Skip(f"{e.name} not installed: pip install 'mha[jax]'") from e
    dtype = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}.get(q.dtype)
    if dtype is None:
        raise Skip(f"dtype {q.dtype} not measured for JAX")

    def conv(x):  # (B, h, T, d) torch -> (B, T, h, d) jax, on the CPU
        return jnp.asarray(x.float().transpose(1, 2).contiguous().numpy()).astype(dtype)

    qj, kj, vj = conv(q), conv(k), conv(v)
    f = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal))
    f(qj, kj, vj).block_until_ready()  # compile, untimed
    return lambda: f(qj, kj, vj).block_until_ready()


# ----------------------------------------------------------------------------- modules
def torch_module(d_model: int, h: int, dtype) -> torch.nn.MultiheadAttention:
    """``torch.nn.MultiheadAttention(batch_first=True)`` in eval mode."""
    return torch.nn.MultiheadAttention(d_model, h, batch_first=True, dtype=dtype).eval()


def torch_module_call(m: torch.nn.MultiheadAttention, x, causal: bool):
    """One self-attention call of ``m`` on x ``(B, T, d_model)``; returns (out, None)."""
    T = x.shape[1]
    hidden = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None  # True = hidden
    return lambda: m(x, x, x, need_weights=False, attn_mask=hidden, is_causal=causal)
