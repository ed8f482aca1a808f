// CPU flash-attention forward: online softmax over key blocks, O(T d) memory, fp32 and bf16.
//
// Shape legend: B batch, h query heads, h_kv key/value heads (g = h / h_kv query heads share
// one K/V head), Tq/Tk query/key lengths, d_k/d_v head dims. q (B, h, Tq, d_k),
// k (B, h_kv, Tk, d_k), v (B, h_kv, Tk, d_v), any strides; out (B, h, Tq, d_v) with the memory
// layout of (B, Tq, h, d_v); lse (B, h, Tq) natural-log log-sum-exp (-inf: no key) in float64:
// the backward recomputes P = 2^(s c - lse log2 e), and where scores reach hundreds (T5's
// unscaled logits) an fp32 lse would put ~1e-4 relative error into every recomputed P (and
// into dS through delta's cancellation); mha.ops.flash returns it to callers as float32.
//
// Masks (True = may attend, all combined with AND): causal aligned bottom-right (query i sees
// keys j <= i + Tk - Tq), key_lengths (B,) (keys j >= key_lengths[b] are padding), and a bool
// mask broadcastable to (B, h, Tq, Tk) read through its strides (stride 0 on broadcast dims),
// and a sliding window w > 0 (the left edge: query i sees keys j > i + Tk - Tq - w; used with
// causal). Query row i thus sees keys [key_start(i), key_limit(b, i)), before the bool mask.
// A mask_mod's block plan (common/block_plan.h) ANDs in per 48 x 128 block: EMPTY blocks are
// skipped (and not packed), FULL ones run unmasked, PARTIAL ones with the plan's bits.
//
// NaN and Inf (every kernel path follows this rule; so do flash_decode.cpp and flash_small.h):
//   1. Output row i is computed from q_i and the K/V rows of the keys it may attend only, the
//      way IEEE arithmetic of softmax(q k^T * scale) V does it: a NaN in q_i, or a NaN / Inf in
//      a visible K row (a NaN or +inf score), makes the whole row NaN and its lse NaN (the
//      row's running max keeps a NaN score, which max() would drop); a NaN in V_j[d] of a
//      visible key makes out[i, d] NaN; +-Inf in V gives +-Inf or NaN. lse is never -inf then.
//   2. K/V rows of keys row i may not attend never affect it. Scores of such keys are masked
//      before the max; their P is 0, and where the tiles' 0 * (a non-finite V) made a row's O
//      non-finite, its query block is run again with those products skipped (the exact pass,
//      Worker::key_loop): all-finite inputs never take it.
//   3. A row that may attend no key returns zeros and lse -inf, whatever q_i holds.
//   4. Finite scores, however large (a bias of -1e10 or -3e38), give the math's answer: rows
//      beyond the float softmax's reach run again with the wide softmax (key_loop.h).
//   (Known gap: a row whose visible scores are all -inf, from an Inf in K, returns zeros and
//   lse -inf, where IEEE softmax gives NaN: the kernels tell "no key" by a zero sum.)
//
// Work: an item is one (b, K/V head) and a range of query rows, for all g query heads of the
// group. The item packs its head's K (transposed) and V once into thread-local buffers, then
// walks 48-row query blocks; each block streams key blocks of Nb <= 128 keys through
// S = Q K^T (register tiles), the online-softmax update, and O = alpha O + P V. Key blocks past
// the last visible key (causal, key_lengths) or before the first (window) are never touched:
// with a window, work and packing are O(Tq w), not O(Tq Tk). Items are handed out from an
// atomic counter, costliest first; each item is computed by one thread in a fixed order, so the
// result does not depend on the thread count or the schedule (bitwise deterministic).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "common/finite.h"
#include "common/huge_pages.h"
#include "common/kernel_choice.h"
#include "common/qkv_checks.h"
#include "amx/flash_amx_loop.h"
#include "flash/flash_small.h"
#include "flash/key_loop.h"
#include "flash/pack_kv.h"
#include "flash/worker.h"

namespace mha_flash {
namespace {

// Items: (b, K/V head, query-row range). Enough items to keep every thread busy, but each
// large enough that packing its head's K/V is amortized over >= ~256 query rows.
template <typename T>
std::vector<Item> make_items(const Problem<T>& P, int nthreads) {
  const int64_t heads = P.B * P.hkv, g = P.h / P.hkv;
  std::vector<Item> items;
  for (int64_t b = 0; b < P.B; ++b) {
    const int64_t Tq = P.rows(b);  // paged calls: each row its own query count
    const int64_t max_chunks = (Tq + kRowsPerBlock - 1) / kRowsPerBlock;
    int64_t chunks = (4 * nthreads + heads - 1) / heads;
    chunks = std::min({chunks, max_chunks, std::max<int64_t>(1, Tq * g / 256)});
    chunks = std::max<int64_t>(chunks, 1);
    const int64_t rows = round_up((Tq + chunks - 1) / chunks, kRowsPerBlock);
    for (int64_t kh = 0; kh < P.hkv; ++kh)
      for (int64_t i0 = 0; i0 < Tq; i0 += rows) {
        const int64_t i1 = std::min(Tq, i0 + rows);
        auto seen = [&](int64_t i) {  // keys row i may see (before the bool mask)
          return double(std::max<int64_t>(0, P.key_limit(b, i) - P.key_start(i)));
        };
        double cost = double(i1 - i0) * (0.5 * (seen(i0) + seen(i1 - 1)) + 16.0);
        if (P.plan.on()) {  // the key blocks the plan visits (document masks: sum len_i^2)
          cost = 0.0;
          for (int64_t r0 = i0; r0 < i1; r0 += kRowsPerBlock) {
            const int64_t r1 = std::min(i1, r0 + kRowsPerBlock);
            const int64_t kb0 = P.key_start(r0) / kMaxKeysPerBlock;
            const int64_t kb1 = (P.key_limit(b, r1 - 1) + kMaxKeysPerBlock - 1) / kMaxKeysPerBlock;
            int64_t blocks = 0;
            for (int64_t hq = kh * g; hq < (kh + 1) * g; ++hq) {
              const int32_t* e = P.plan.row(b, hq, r0 / kRowsPerBlock);
              for (int64_t kb = kb0; kb < kb1; ++kb) blocks += e[kb] != mha_common::kPlanEmpty;
            }
            cost += double(r1 - r0) * (double(blocks) / double(g) *
                                           double(std::min<int64_t>(P.Tk, kMaxKeysPerBlock)) + 16.0);
          }
        }
        items.push_back({b, kh, i0, i1, cost});
      }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& c) { return a.cost > c.cost; });
  return items;
}

template <class K, class Parts = AllParts, typename T>
void run_forward(const Problem<T>& P) {
  const int nth = std::max(1, at::get_num_threads());
  const std::vector<Item> items = make_items(P, nth);
  double flops = 4.0 * double(P.B * P.h) * double(P.Tq) * double(P.Tk) * double(P.dk);
  if (P.cu_q) {  // paged: ragged rows, the items' (rows x keys seen) rather than B N max_len
    double pairs = 0.0;
    for (const Item& it : items) pairs += it.cost;
    flops = 4.0 * pairs * double(P.h / P.hkv) * double(P.dk);
  }
  const int64_t workers = flops < 2e6 ? 1 : std::min<int64_t>(nth, int64_t(items.size()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch<K> scratch;
#if defined(__AVX512F__)
    const mha_exp2::FlushToZero ftz(K::kLazySoftmax);  // softmax_lazy's exp2 relies on it
#endif
#if defined(MHA_FLASH_AMX)
    if constexpr (K::kAmx) K::configure();
#endif
    Worker<K, T, Parts> w(P, scratch);
    for (int64_t idx = next.fetch_add(1); idx < int64_t(items.size()); idx = next.fetch_add(1))
      w.run_item(items[idx]);
    trace_flush(at::get_thread_num());  // benchmark builds only (flash/trace.h)
    scratch.trim();
#if defined(MHA_FLASH_AMX)
    if constexpr (K::kAmx) K::release();
#endif
  });
}

}  // namespace
}  // namespace mha_flash
namespace mha_flash {
namespace {

// Why the forward's AMX tiles cannot run here, or "".
const std::string& amx_why_not() {
#if defined(MHA_FLASH_AMX)
  return mha_amx::tiles_unavailable();
#elif defined(MHA_AMX_TILES)
  static const std::string why =
      "no AMX tiles in the forward of this build (it needs avx512f, avx512bf16 and avx512dq too)";
  return why;
#else
  return mha_amx::tiles_unavailable();
#endif
}

std::string flash_attention_isa() {
  std::string isa = "portable";
#if defined(__AVX512F__)
  isa += ",avx512f";
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  isa += ",avx512bw,avx512vl";
#endif
#if defined(MHA_FLASH_BF16_TILES)
  isa += ",avx512bf16";
#endif
#if defined(MHA_FLASH_AMX) && defined(MHA_AMX_EMULATED)
  isa += ",amx-emulated";  // software tiles (MHA_AMX_EMULATE): for tests, not for speed
#elif defined(MHA_FLASH_AMX)
  isa += ",amx";
#endif
  return isa;
}


// bf16 inputs: AMX tiles first where they can run (compiled in and granted by the OS; else the
// next kernel: flash_attention_amx says why); else the kernel measured faster on this CPU
// (common/kernel_choice.h: vdpbf16ps tiles, or bf16 widened to fp32 when packed and the fp32
// tiles; handed in by mha.ops.flash_choice), the fp32 tiles when none was handed in.
// MHA_FLASH_BF16=avx512bf16 | avx512f | portable | amx overrides; a value this build cannot run
// is refused at every bf16 call (check_forced). Fixed per process, so results stay deterministic.
const std::string& default_kernel(at::ScalarType dtype) {
  static const std::string f32 =
#if defined(__AVX512F__)
      "avx512f";
#else
      "portable";
#endif
  if (dtype != at::kBFloat16) return f32;
  static const std::string bf16 = [] {
    if (const auto& env = mha_common::flash_bf16_override()) {
#if defined(MHA_FLASH_BF16_TILES)
      constexpr bool bf16_tiles = true;
#else
      constexpr bool bf16_tiles = false;
#endif
      mha_common::check_forced("MHA_FLASH_BF16", *env,
                               mha_common::flash_bf16_choices(mha_common::kUnitAvx512f,
                                                              bf16_tiles, amx_why_not()));
      return *env;
    }
#if defined(MHA_FLASH_AMX)
    if (amx_permitted()) return std::string("amx");
#endif
    const std::string measured = mha_common::flash_bf16_measured();
    return measured.empty() ? f32 : measured;  // the setter took only what this build runs
  }();
  return bf16;
}

// The kernels the test op may name for T's inputs, and why this build / CPU / OS cannot run
// each ("" when it can): MHA_FLASH_BF16's choices, plus "auto" and "small", in the words of
// check_forced.
template <typename T>
std::vector<mha_common::Choice> named_kernels() {
#if defined(MHA_FLASH_BF16_TILES)
  constexpr bool bf16_tiles = true;
#else
  constexpr bool bf16_tiles = false;
#endif
#if defined(MHA_FLASH_SMALL)
  const std::string small = "";
#else
  const std::string small = mha_common::build_lacks("avx512f", "AVX-512F",
                                                    mha_common::cpu_has_avx512f());
#endif
  std::vector<mha_common::Choice> choices = {{"auto", ""}, {"small", small}};
  for (mha_common::Choice c :
       mha_common::flash_bf16_choices(mha_common::kUnitAvx512f, bf16_tiles, amx_why_not())) {
    const bool bf16_only = c.name == "avx512bf16" || c.name == "amx";
    if (!std::is_same_v<T, at::BFloat16> && bf16_only && c.why_not.empty())
      c.why_not = "it takes bfloat16 inputs, not float32";
    choices.push_back(c);
  }
  return choices;
}

// The kernels chosen for float32 and bfloat16 inputs (raises for bf16 as a call would when
// MHA_FLASH_BF16 names a kernel this build cannot run).
std::vector<std::string> flash_attention_kernels() {
  return {default_kernel(at::kFloat), default_kernel(at::kBFloat16)};
}

// The bf16 kernel measured faster on this CPU (mha.ops.flash_choice), handed in once the
// extension is loaded and before its first bf16 call: "avx512bf16" or "avx512f" (refused when
// this build lacks it, or when a bf16 call already fixed another).
void flash_set_bf16_choice(std::string kernel) {
#if defined(MHA_FLASH_BF16_TILES)
  constexpr bool bf16_tiles = true;
#else
  constexpr bool bf16_tiles = false;
#endif
  mha_common::set_flash_bf16_measured(kernel, bf16_tiles, mha_common::kUnitAvx512f);
}

// Why the AMX tiles compiled into this build do not run in this process (the OS refuses the
// tile state), read by mha.explain and `mha build`; "" when they run or are not compiled in.
std::string flash_attention_amx() {
#if defined(MHA_FLASH_AMX)
  return amx_why_not();
#else
  return "";
#endif
}

}  // namespace
}  // namespace mha_flash
#include "flash/paged.h"  // the paged forward: run_forward and default_kernel above
namespace mha_flash {
namespace {

template <class Parts = AllParts>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v,
                                                const std::optional<at::Tensor>& key_lengths,
                                                const std::optional<at::Tensor>& mask,
                                                bool causal, double scale,
                                                const std::string& kernel, int64_t window,
                                                const mha_common::ScoreMods& mods = {},
                                                const mha_common::PlanView& plan = {}) {
  const mha_ops::QkvDims dims = mha_ops::check_qkv(q, k, v, "flash_attention");
  const int64_t B = dims.B, h = dims.h, Tq = dims.Tq, dk = dims.dk;
  const int64_t hkv = dims.hkv, Tk = dims.Tk, dv = dims.dv;
  TORCH_CHECK(dk >= 1 && dv >= 1, "flash_attention: head dims must be >= 1");
  at::Tensor out = at::empty({B, Tq, h, dv}, q.options()).permute({0, 2, 1, 3});
  at::Tensor lse = at::empty({B, h, Tq}, q.options().dtype(at::kDouble));
  if (B == 0 || h == 0 || Tq == 0) return {out, lse};
  mha_common::advise_huge_pages(out.data_ptr(), size_t(out.nbytes()));  // written once, below
  at::Tensor kl, m;
  if (key_lengths.has_value()) {
    TORCH_CHECK(key_lengths->dim() == 1 && key_lengths->size(0) == B,
                "flash_attention: key_lengths must have shape (B,) = (", B, ",), got ",
                key_lengths->sizes());
    kl = key_lengths->to(at::kLong).contiguous();
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4,
                "flash_attention: mask must be a 4-D bool tensor broadcastable to (B, h, Tq, Tk)");
    const int64_t want[4] = {B, h, Tq, Tk};
    for (int d = 0; d < 4; ++d)
      TORCH_CHECK(mask->size(d) == 1 || mask->size(d) == want[d],
                  "flash_attention: mask of shape ", mask->sizes(),
                  " is not broadcastable to (B, h, Tq, Tk) = (", B, ", ", h, ", ", Tq, ", ", Tk, ")");
    m = *mask;
  }
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> P;
    P.q = q.data_ptr<T>();
    P.k = k.data_ptr<T>();
    P.v = v.data_ptr<T>();
    P.out = out.data_ptr<T>();
    P.lse = lse.data_ptr<double>();
    fill_strides(q, P.qs, 4, false);
    fill_strides(k, P.ks, 4, false);
    fill_strides(v, P.vs, 4, false);
    fill_strides(out, P.os, 4, false);
    P.mask = m.defined() ? m.data_ptr<bool>() : nullptr;
    if (m.defined()) fill_strides(m, P.ms, 4, true);
    P.key_lengths = kl.defined() ? kl.data_ptr<int64_t>() : nullptr;
    if (P.key_lengths)
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(P.key_lengths[b] >= 0 && P.key_lengths[b] <= Tk,
                    "flash_attention: key_lengths must lie in [0, Tk=", Tk, "]");
    P.B = B, P.h = h, P.hkv = hkv, P.Tq = Tq, P.Tk = Tk, P.dk = dk, P.dv = dv;
    P.scale = float(scale);
    P.causal = causal;
    P.window = window > 0 && window < Tk ? window : 0;  // w >= Tk hides no key: no window
    P.mods = mods;
    P.plan = plan;
    std::string kn = kernel == "auto" ? default_kernel(q.scalar_type()) : kernel;
    // The score variants and block plans run in the register-tile key loop (key_block): the
    // AMX key loops and the small path hand such calls to the AVX-512 tiles.
    const bool variants = mods.any() || plan.on();
    if (variants && kernel == "auto" && kn == "amx") kn = "avx512f";
    TORCH_CHECK(!variants || (kn != "amx" && kn != "small"), "flash_attention: kernel '", kn,
                "' does not apply the score variants (softcap, sinks, bias, ALiBi) or block plans");
#if defined(MHA_FLASH_SMALL)
    if (kernel == "small" || (kernel == "auto" && !variants && small_path_applies(P, kn))) {
      TORCH_CHECK(small_path_applies(P), "flash_attention: the small path serves Tk <= ",
                  kSmallMaxKeys, " and head dims <= ", kSmallMaxDim, ", got Tk=", Tk);
      return run_small(P);
    }
#endif
    if (kn == "portable") return run_forward<PortableF32>(P);
#if defined(__AVX512F__)
    if (kn == "avx512f") return run_forward<Avx512F32>(P);  // bf16 inputs widened when packed
#endif
#if defined(MHA_FLASH_BF16_TILES)
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (kn == "avx512bf16") return run_forward<Avx512Bf16>(P);
#endif
#if defined(MHA_FLASH_AMX)
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (kn == "amx" && amx_permitted()) return run_forward<AmxBf16, Parts>(P);
#endif
    TORCH_CHECK(false, mha_common::forced_refusal("flash_attention: kernel", kn,
                                                  named_kernels<T>(),
                                                  "kernel 'auto' for the CPU's default"));
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
  return {out, lse};
}

// Score variants (common/score_mods.h): softcap 0 = none; sinks (h,), bias 4-D broadcastable
// to (B, h, Tq, Tk), alibi slopes (1|B, h), all float32. A mask_mod's block plan
// (common/block_plan.h): plan (1|B, 1|h, n_q, n_k) int32 and plan_bits (n_partial, 48, 128) bool,
// ANDed with the other masks.
std::tuple<at::Tensor, at::Tensor> flash_attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& mask,
    bool causal, double scale, int64_t window, double softcap,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& alibi, const std::optional<at::Tensor>& plan,
    const std::optional<at::Tensor>& plan_bits) {
  const auto mods = mha_common::make_score_mods(softcap, sinks, bias, alibi, q.size(0),
                                                q.size(1), q.size(2), k.size(2), "flash_attention");
  const auto pv = mha_common::make_plan_view(plan, plan_bits, q.size(0), q.size(1), q.size(2),
                                             k.size(2), "flash_attention");
  return forward_impl(q, k, v, key_lengths, mask, causal, scale, "auto", window, mods, pv);
}

// The forward with a named kernel ("auto", "portable", "avx512f", "avx512bf16", "amx", or
// "small": the small-problem path of flash_small.h), for tests.
std::tuple<at::Tensor, at::Tensor> flash_attention_fwd_kernel(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& mask,
    bool causal, double scale, std::string kernel, int64_t window, double softcap,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& alibi, const std::optional<at::Tensor>& plan,
    const std::optional<at::Tensor>& plan_bits) {
  const auto mods = mha_common::make_score_mods(softcap, sinks, bias, alibi, q.size(0),
                                                q.size(1), q.size(2), k.size(2), "flash_attention");
  const auto pv = mha_common::make_plan_view(plan, plan_bits, q.size(0), q.size(1), q.size(2),
                                             k.size(2), "flash_attention");
  return forward_impl(q, k, v, key_lengths, mask, causal, scale, kernel, window, mods, pv);
}

// The kernel's 2^x on a float32 tensor (x <= 0), for testing its accuracy.
at::Tensor flash_exp2(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "_flash_exp2: x must be float32");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const float* src = xc.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  const int64_t n = xc.numel();
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= n; i += kLanes)
    _mm512_storeu_ps(dst + i, exp2_avx512(_mm512_loadu_ps(src + i)));
  if (i < n) {
    const __mmask16 k = lanes_below(int(n - i));
    _mm512_mask_storeu_ps(dst + i, k, exp2_avx512(_mm512_maskz_loadu_ps(k, src + i)));
  }
#else
  for (; i < n; ++i) dst[i] = std::exp2(src[i]);
#endif
  return y;
}

// The one-pass softmax's 2^x (exp2_ftz_avx512, under flush-to-zero, every lane kept) on a
// float32 tensor, for testing its accuracy; exp2 itself where that function is not compiled in.
at::Tensor flash_exp2_ftz(const at::Tensor& x) {
#if defined(MHA_FLASH_LAZY_SOFTMAX)
  TORCH_CHECK(x.scalar_type() == at::kFloat, "_flash_exp2_ftz: x must be float32");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const float* src = xc.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  const mha_exp2::FlushToZero ftz(true);
  for (int64_t i = 0; i < xc.numel(); i += kLanes) {
    const __mmask16 k = lanes_below(int(std::min<int64_t>(kLanes, xc.numel() - i)));
    _mm512_mask_storeu_ps(dst + i, k, mha_exp2::exp2_ftz_avx512(_mm512_maskz_loadu_ps(k, src + i),
                                                                __mmask16(0xFFFF)));
  }
  return y;
#else
  return flash_exp2(x);
#endif
}

}  // namespace
}  // namespace mha_flash

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("flash_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, Tensor? mask, "
        "bool causal, float scale, int window=0, float softcap=0., Tensor? sinks=None, "
        "Tensor? bias=None, Tensor? alibi=None, Tensor? plan=None, Tensor? plan_bits=None) "
        "-> (Tensor, Tensor)");
  m.def("_flash_attention_fwd_kernel(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, "
        "Tensor? mask, bool causal, float scale, str kernel, int window=0, float softcap=0., "
        "Tensor? sinks=None, Tensor? bias=None, Tensor? alibi=None, Tensor? plan=None, "
        "Tensor? plan_bits=None) -> (Tensor, Tensor)");
  m.def("flash_attention_paged_fwd(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor key_lengths, bool causal, float scale, float softcap=0., "
        "Tensor? sinks=None) -> (Tensor, Tensor)");
  m.def("_flash_exp2(Tensor x) -> Tensor");
  m.def("_flash_exp2_ftz(Tensor x) -> Tensor");
  m.def("flash_attention_isa() -> str", &mha_flash::flash_attention_isa);
  m.def("flash_attention_kernels() -> str[]", &mha_flash::flash_attention_kernels);
  m.def("flash_attention_amx() -> str", &mha_flash::flash_attention_amx);
  m.def("_flash_set_bf16_choice(str kernel) -> ()", &mha_flash::flash_set_bf16_choice);
}

TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("flash_attention_fwd", &mha_flash::flash_attention_fwd);
  m.impl("_flash_attention_fwd_kernel", &mha_flash::flash_attention_fwd_kernel);
  m.impl("flash_attention_paged_fwd", &mha_flash::flash_attention_paged_fwd);
  m.impl("_flash_exp2", &mha_flash::flash_exp2);
  m.impl("_flash_exp2_ftz", &mha_flash::flash_exp2_ftz);
}
