// CPU flash-attention backward (FlashAttention-2's algorithm): O(T d) memory, fp32 math.
//
// Shape legend: B batch, h query heads, h_kv key/value heads (g = h / h_kv query heads share
// one K/V head), Tq/Tk query/key lengths, d_k/d_v head dims, Br/Bc query rows/keys per block.
// Inputs q (B, h, Tq, d_k), k (B, h_kv, Tk, d_k), v (B, h_kv, Tk, d_v), out and grad_out
// (B, h, Tq, d_v), lse and grad_lse (B, h, Tq), any strides. Returns dq, dk, dv (contiguous,
// in q's dtype). Masks as in the forward (True = may attend, combined with AND): causal aligned
// bottom-right (query i sees keys j <= i + Tk - Tq), key_lengths (B,), a bool mask
// broadcastable to (B, h, Tq, Tk) read through its strides (stride 0 on broadcast dims), and
// a sliding window w > 0 exactly as the forward's (the left edge: query i sees keys
// j > i + Tk - Tq - w; with causal, keys i + Tk - Tq - w < j <= i + Tk - Tq).
//
// For each key block j (Bc keys) and each query block i (Br rows) that can see it:
//   S = Q_i K_j^T,  P = exp(S scale - lse_i) (masked -> 0),  dP = dO_i V_j^T,
//   dS = P (dP - delta_i) with delta_i = rowsum(dO_i O_i) - dlse_i,
//   dV_j += P^T dO_i,  dK_j += dS^T Q_i scale,  dQ_i += dS K_j scale.
// Query blocks wholly above the causal diagonal of a key block or wholly right of its window,
// and keys past key_lengths, are never touched (with a window the work is O(Tq w)). No (Tq, Tk)
// matrix exists: S, P, dP, dS live in one Br x Bc scratch per thread.
//
// NaN / Inf (the rule every backend follows, see mha.native): a pair (i, j) row i may not
// attend contributes exactly 0 to every gradient. dP = dO V^T and S can be NaN there (a NaN in
// V_j or K_j), so P and dS are selected to 0 on masked lanes (never 0 * NaN); the operands the
// products multiply by dS (Q in dK += dS^T Q, K in dQ += dS K) are packed with non-finite
// elements as 0, and a row whose q is non-finite (or whose lse is +inf) gets lse = NaN, so its
// visible pairs still give P = dS = NaN. Rows whose output is NaN have delta = rowsum(dO O) =
// NaN, hence NaN gradients from each key they see (as SDPA); rows that see no key get zero
// gradients.
//
// Work: a unit is one (b, K/V head) and one of S interleaved subsets of its key blocks
// (j = s, s + S, ...), for all g query heads of the group. It owns its dK_j, dV_j outright and
// accumulates dQ for the group's rows in its own fp32 buffer; with S > 1 those partial dQ are
// summed in the order s = 0, 1, ... after the parallel loop. S depends only on the shape, and
// every unit is computed by one thread in a fixed order, so the result is bitwise the same for
// any thread count or schedule.
//
// Files: flash/bwd_problem.h (Problem, Scratch, block sizes), flash/bwd_rows.h (P and dS of
// a row block; packing the group's rows), flash/bwd_bf16_pack.h (bf16 operands),
// flash/bwd_unit.h (one unit, in named stages), amx/flash_amx_bwd.h (the products on AMX
// tiles), flash/bwd_small.h (the small-problem path: Tk <= 64, scores transposed); this file:
// checks, the parallel drivers' choice and the op registration.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/constants.h"
#include "common/kernel_choice.h"
#include "common/qkv_checks.h"
#include "common/tensor_access.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "flash/bwd_small.h"
#include "flash/bwd_unit.h"

namespace mha_flash_bwd {
namespace {

// Whether the AMX tile products are compiled in (amx/flash_amx_bwd.h) and Linux grants this
// process the tile state.
bool amx_tiles_usable() {
#if defined(MHA_BWD_AMX)
  return mha_amx::amx_permitted();
#else
  return false;
#endif
}

// The arithmetic of the products for bf16 inputs, as the forward picks its bf16 kernel: "amx"
// (tdpbf16ps tiles) where they are compiled in and usable; else the forward's measured kernel
// (common/kernel_choice.h, handed in by mha.ops.flash_choice through this extension's setter):
// "bf16" (vdpbf16ps) for avx512bf16, "fp32" for avx512f or when none was handed in.
// MHA_FLASH_BF16=amx | avx512bf16 forces the tiles | vdpbf16ps, avx512f | portable fp32; a value
// this build cannot run is refused as the forward refuses it (check_forced); math "amx" /
// "bf16" / "fp32" (the test op) overrides both. Fixed per process.
std::string bf16_products(const std::string& math) {
#if defined(MHA_BWD_BF16)
  constexpr bool pairs_built = true;
#else
  constexpr bool pairs_built = false;
#endif
  TORCH_CHECK(math != "bf16" || pairs_built,
              "flash_attention_bwd: bf16 products are not compiled in");
  TORCH_CHECK(math != "amx" || amx_tiles_usable(), "flash_attention_bwd: no AMX tile products: ",
              mha_amx::tiles_unavailable().empty() ? std::string("not compiled in")
                                                   : mha_amx::tiles_unavailable());
  if (math != "auto") return math;
  if (const auto& env = mha_common::flash_bf16_override()) {
#if defined(MHA_BWD_AMX)
    const std::string amx_why_not = mha_amx::tiles_unavailable();
#elif defined(MHA_AMX_TILES)
    const std::string amx_why_not = "no AMX tiles in the backward of this build (no bf16 pairs)";
#else
    const std::string amx_why_not = mha_amx::tiles_unavailable();
#endif
    mha_common::check_forced("MHA_FLASH_BF16", *env,
                             mha_common::flash_bf16_choices(mha_common::kUnitAvx512f,
                                                            pairs_built, amx_why_not));
    if (*env == "amx") return "amx";
    return *env == "avx512bf16" ? "bf16" : "fp32";
  }
  if (amx_tiles_usable()) return "amx";
  static const std::string measured =
      mha_common::flash_bf16_measured() == "avx512bf16" ? "bf16" : "fp32";
  return measured;  // the setter took avx512bf16 only where the bf16 pairs are compiled in
}

// The forward's measured bf16 kernel handed to the backward (mha.ops.flash_choice), as the
// forward's setter takes it: "avx512bf16" (vdpbf16ps products) or "avx512f" (fp32 products).
void flash_bwd_set_bf16_choice(std::string kernel) {
#if defined(MHA_BWD_BF16)
  constexpr bool pairs_built = true;
#else
  constexpr bool pairs_built = false;
#endif
  mha_common::set_flash_bf16_measured(kernel, pairs_built, mha_common::kUnitAvx512f);
}

// dbias: the bias gradient (B, h, Tq|1, Tk|1) in fp32 when bias_grad, else an empty tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& mask, bool causal, double scale, const std::string& math,
    int64_t window, const mha_common::ScoreMods& mods = {},
    const std::optional<at::Tensor>& bias = std::nullopt, bool bias_grad = false,
    const mha_common::PlanView& plan = {}) {
  TORCH_CHECK(math == "auto" || math == "amx" || math == "bf16" || math == "fp32" ||
                  math == "small",
              "flash_attention_bwd: math must be 'auto', 'amx', 'bf16', 'fp32' or 'small', got '",
              math, "'");
  const mha_ops::QkvDims dims = mha_ops::check_qkv(q, k, v, "flash_attention_bwd");
  const int64_t B = dims.B, h = dims.h, Tq = dims.Tq, dk = dims.dk;
  const int64_t hkv = dims.hkv, Tk = dims.Tk, dv = dims.dv;
  const std::vector<int64_t> row_shape{B, h, Tq};
  TORCH_CHECK(out.sizes() == at::IntArrayRef({B, h, Tq, dv}) && lse.sizes() == row_shape,
              "flash_attention_bwd: expected out (B, h, Tq, d_v) and lse (B, h, Tq), got ",
              out.sizes(), " and ", lse.sizes());
  if (grad_out.has_value())
    TORCH_CHECK(grad_out->sizes() == out.sizes(),
                "flash_attention_bwd: grad_out must have out's shape ", out.sizes(), ", got ",
                grad_out->sizes());
  if (grad_lse.has_value())
    TORCH_CHECK(grad_lse->sizes() == lse.sizes(),
                "flash_attention_bwd: grad_lse must have lse's shape ", lse.sizes(), ", got ",
                grad_lse->sizes());
  const auto f32 = at::kFloat, dt = q.scalar_type();
  const bool nothing = (!grad_out.has_value() && !grad_lse.has_value()) || B == 0 || h == 0 ||
                       Tq == 0 || Tk == 0;
  // gradients in q's dtype; the kernel writes every element (zeros where no row sees a key)
  auto make = [&](at::IntArrayRef shape) {
    return nothing ? at::zeros(shape, q.options()) : at::empty(shape, q.options());
  };
  at::Tensor dq = make({B, h, Tq, dk}), dkey = make({B, hkv, Tk, dk}),
             dval = make({B, hkv, Tk, dv});
  TORCH_CHECK(!bias_grad || bias.has_value(), "flash_attention_bwd: bias_grad needs a bias");
  // accumulated pair by pair (a unit owns its (b, heads) rows and its key blocks)
  at::Tensor dbias = bias_grad ? at::zeros({B, h, bias->size(2), bias->size(3)},
                                           q.options().dtype(at::kFloat))
                               : at::empty({0}, q.options().dtype(at::kFloat));
  if (nothing) return {dq, dkey, dval, dbias};
  // out and grad_out in q's dtype (a copy only if they differ), lse in float64 (the forward's:
  // P is recomputed from it as hi + lo parts), grad_lse in fp32
  const at::Tensor of = out.to(dt), lf = lse.to(at::kDouble);
  at::Tensor gof, glf, kl, m;
  if (grad_out.has_value()) gof = grad_out->to(dt);
  if (grad_lse.has_value()) glf = grad_lse->to(f32);
  if (key_lengths.has_value()) {
    TORCH_CHECK(key_lengths->dim() == 1 && key_lengths->size(0) == B,
                "flash_attention_bwd: key_lengths must have shape (B,) = (", B, ",), got ",
                key_lengths->sizes());
    kl = key_lengths->to(at::kLong).contiguous();
    const int64_t* len = kl.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(len[b] >= 0 && len[b] <= Tk,
                  "flash_attention_bwd: key_lengths must lie in [0, Tk=", Tk, "]");
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4,
                "flash_attention_bwd: mask must be a 4-D bool tensor broadcastable to "
                "(B, h, Tq, Tk)");
    const int64_t want[4] = {B, h, Tq, Tk};
    for (int d = 0; d < 4; ++d)
      TORCH_CHECK(mask->size(d) == 1 || mask->size(d) == want[d], "flash_attention_bwd: mask ",
                  mask->sizes(), " is not broadcastable to (B, h, Tq, Tk) = (", B, ", ", h, ", ",
                  Tq, ", ", Tk, ")");
    m = *mask;
  }
  const int64_t groups = B * hkv, nblocks = (Tk + kBc - 1) / kBc;
  // a bias shared by every key (Tk dim 1) is accumulated by one unit per row: no split
  const bool shared_key_bias = bias_grad && bias->size(3) == 1;
  const int64_t splits = shared_key_bias ? 1 : std::max<int64_t>(
      1, std::min(nblocks, (kMinUnits + groups - 1) / groups));
  at::Tensor part;
  if (splits > 1) part = at::empty({splits, B, h, Tq, dk}, q.options().dtype(f32));

  auto run = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> P;
    P.q = q.data_ptr<T>(), P.k = k.data_ptr<T>(), P.v = v.data_ptr<T>();
    P.out = of.data_ptr<T>(), P.lse = lf.data_ptr<double>();
    fill_strides(q, P.qs, 4, false);
    fill_strides(k, P.ks, 4, false);
    fill_strides(v, P.vs, 4, false);
    fill_strides(of, P.os, 4, false);
    fill_strides(lf, P.ls, 3, false);
    P.go = gof.defined() ? gof.data_ptr<T>() : nullptr;
    if (gof.defined()) fill_strides(gof, P.gos, 4, false);
    P.glse = glf.defined() ? glf.data_ptr<float>() : nullptr;
    if (glf.defined()) fill_strides(glf, P.gls, 3, false);
    P.key_lengths = kl.defined() ? kl.data_ptr<int64_t>() : nullptr;
    P.mask = m.defined() ? m.data_ptr<bool>() : nullptr;
    if (m.defined()) fill_strides(m, P.ms, 4, true);
    P.B = B, P.h = h, P.hkv = hkv, P.Tq = Tq, P.Tk = Tk, P.dk = dk, P.dv = dv;
    P.scale = float(scale);
    P.causal = causal;
    P.window = window > 0 && window < Tk ? window : 0;  // w >= Tk hides no key: no window
    P.splits = splits;
    P.dq = dq.data_ptr<T>(), P.dkey = dkey.data_ptr<T>(), P.dval = dval.data_ptr<T>();
    P.dq_part = splits > 1 ? part.data_ptr<float>() : nullptr;
    P.mods = mods;
    P.plan = plan;
    if (bias_grad) {
      P.dbias = dbias.data_ptr<float>();
      fill_strides(dbias, P.dbs, 4, true);
    }
    // Few keys: every key of a head in one block, scores transposed (flash/bwd_small.h), for
    // the shapes it serves and, by itself, below its measured crossover.
#if defined(MHA_BWD_SMALL)
    if (math == "small" || (math == "auto" && small_bwd_chosen(P))) {
      TORCH_CHECK(small_bwd_serves(P), "flash_attention_bwd: the small path serves Tk <= ",
                  kSmallBwdMaxKeys, " and head dims <= ", kSmallBwdMaxDim,
                  " without a window, score variants or block plans; got Tk=", Tk, ", d_k=", dk,
                  ", d_v=", dv);
      return run_small_bwd(P);
    }
#else
    TORCH_CHECK(math != "small", "flash_attention_bwd: the small path needs an AVX-512F build");
#endif
    // bf16 products pay for their packing from one whole block each way on (measured: at
    // 32 x 8 x 20 x 64 they were ~15 % slower than fp32, at 4 x 8 x 512 x 64 ~30 % faster)
    const bool big = Tq >= kBr && Tk >= kBc;
    const std::string arith = std::is_same_v<T, at::BFloat16> ? bf16_products(math) : "fp32";
    const bool pairs = arith != "fp32" && (math != "auto" || big);
    const bool tiles = pairs && arith == "amx";  // on AMX tiles (a unit may still take pairs)
    at::parallel_for(0, groups * splits, 1, [&](int64_t u0, int64_t u1) {
      Scratch w;
#if defined(MHA_BWD_AMX)
      if (tiles) amx_configure();  // per thread, for this parallel region
#endif
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t s = u % splits, grp = u / splits;
        run_unit(P, grp / hkv, grp % hkv, s, w, pairs, tiles);
      }
#if defined(MHA_BWD_AMX)
      if (tiles) amx_release();
#endif
    });
    if (splits > 1) {  // dQ = scale * (part_0 + part_1 + ...), in that order
      const int64_t n = B * h * Tq * dk;
      const float* src = P.dq_part;
      T* dst = P.dq;
      at::parallel_for(0, n, 1 << 14, [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e) {
          float acc = src[e];
          for (int64_t s = 1; s < splits; ++s) acc += src[s * n + e];
          dst[e] = T(acc * P.scale);
        }
      });
    }
  };
  if (dt == at::kFloat) run(float{});
  else run(at::BFloat16{});
  return {dq, dkey, dval, dbias};
}

// Score variants as in the forward (softcap 0 = none; sinks, bias, alibi float32); the sinks'
// gradient is computed from lse and delta in mha.ops.flash.sink_grad. plan, plan_bits: a
// mask_mod's block plan as in the forward (common/block_plan.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd_fused(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& mask, bool causal, double scale, int64_t window,
    double softcap, const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& alibi, bool bias_grad,
    const std::optional<at::Tensor>& plan, const std::optional<at::Tensor>& plan_bits) {
  const auto mods = mha_common::make_score_mods(softcap, sinks, bias, alibi, q.size(0), q.size(1),
                                                q.size(2), k.size(2), "flash_attention_bwd");
  const auto pv = mha_common::make_plan_view(plan, plan_bits, q.size(0), q.size(1), q.size(2),
                                             k.size(2), "flash_attention_bwd");
  return backward_impl(grad_out, grad_lse, q, k, v, out, lse, key_lengths, mask, causal, scale,
                       "auto", window, mods, bias, bias_grad, pv);
}

// The backward with the products' arithmetic named ("auto", "amx", "bf16", "fp32"), or
// "small" (the small-problem path of flash/bwd_small.h), for tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd_fused_math(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_lse,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& key_lengths,
    const std::optional<at::Tensor>& mask, bool causal, double scale, std::string math,
    int64_t window) {
  auto [dq, dkey, dval, unused] = backward_impl(grad_out, grad_lse, q, k, v, out, lse,
                                                key_lengths, mask, causal, scale, math, window);
  return {dq, dkey, dval};
}

// Which arithmetic the backward's products use for bf16 inputs of at least one 64-row query
// block and one 64-key block ("amx", "bf16" or "fp32"; smaller problems always run fp32).
std::string flash_attention_bwd_bf16_math() { return bf16_products("auto"); }

}  // namespace
}  // namespace mha_flash_bwd

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("flash_attention_bwd_fused(Tensor? grad_out, Tensor? grad_lse, Tensor q, Tensor k, "
        "Tensor v, Tensor out, Tensor lse, Tensor? key_lengths, Tensor? mask, bool causal, "
        "float scale, int window=0, float softcap=0., Tensor? sinks=None, Tensor? bias=None, "
        "Tensor? alibi=None, bool bias_grad=False, Tensor? plan=None, Tensor? plan_bits=None) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("_flash_attention_bwd_fused_math(Tensor? grad_out, Tensor? grad_lse, Tensor q, "
        "Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_lengths, Tensor? mask, "
        "bool causal, float scale, str math, int window=0) -> (Tensor, Tensor, Tensor)");
  m.def("flash_attention_bwd_bf16_math() -> str", &mha_flash_bwd::flash_attention_bwd_bf16_math);
  m.def("_flash_bwd_set_bf16_choice(str kernel) -> ()",
        &mha_flash_bwd::flash_bwd_set_bf16_choice);
}

TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("flash_attention_bwd_fused", &mha_flash_bwd::flash_attention_bwd_fused);
  m.impl("_flash_attention_bwd_fused_math", &mha_flash_bwd::flash_attention_bwd_fused_math);
}
