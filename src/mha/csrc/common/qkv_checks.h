// The q/k/v validation every op of mha's native kernels starts with (forward, backward and
// decode), so the three give the same error in the same words. Python validates first
// (mha.checks); this guards direct torch.ops calls.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace mha_ops {

// q (B, h, Tq, d_k), k (B, h_kv, Tk, d_k), v (B, h_kv, Tk, d_v).
struct QkvDims {
  int64_t B, h, Tq, dk, hkv, Tk, dv;
};

// 4-D CPU tensors of one dtype (float32 or bfloat16) whose shapes agree, h_kv dividing h.
inline QkvDims check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const char* op) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
              ": q, k, v must be 4-D (B, h, T, d), got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op,
              ": q, k, v must be CPU tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k, v must share one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op,
              ": dtype must be float32 or bfloat16, got ", q.scalar_type());
  const QkvDims d{q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), k.size(2), v.size(3)};
  TORCH_CHECK(k.size(0) == d.B && v.size(0) == d.B && k.size(3) == d.dk && v.size(1) == d.hkv &&
                  v.size(2) == d.Tk && d.hkv > 0 && d.h % d.hkv == 0,
              op, ": expected q (B, h, Tq, d_k), k (B, h_kv, Tk, d_k), v (B, h_kv, Tk, d_v) "
              "with h_kv dividing h; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  return d;
}

}  // namespace mha_ops
