// The flash forward over paged K/V (mha::flash_attention_paged_fwd): ragged rows of packed
// queries, each attending its own sequence's keys read through a block table. Inference only
// (no lse for a backward; mha.ops.flash refuses inputs that require grad).
//
// Shape legend: B rows (sequences), N packed query tokens, h / h_kv query / K/V heads, P pages
// in the pool, p page size, M block-table entries per row, d_k / d_v head dims.
// q (N, h, d_k) contiguous rows; k_pages (P, h_kv, p, d_k), v_pages (P, h_kv, p, d_v)
// contiguous (mha.PagedKVCache's layout); block_table (B, M) int32; cu_seqlens_q (B + 1,)
// int64: row b owns tokens [cu[b], cu[b + 1]), the last n_b = cu[b + 1] - cu[b] positions of a
// sequence of key_lengths[b] tokens; causal is bottom-right per row (query i of row b sees
// keys j <= i + key_lengths[b] - n_b), so a chunk of a longer sequence sees its cached prefix.
// Out (N, h, d_v); lse (h, N) float64, natural log (-inf: no key).
//
// The work items, key loop and packing are the dense forward's (flash_attn.cpp): the Problem
// carries the block table and the row offsets (flash/problem.h), and packing each item's K/V
// block by block reads the pages directly (flash/pack_kv.h), so no gathered copy is made.
// Included by flash_attn.cpp after the kernel choice it uses.
#pragma once

namespace mha_flash {
namespace {

std::tuple<at::Tensor, at::Tensor> flash_attention_paged_fwd(
    const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& key_lengths,
    bool causal, double scale, double softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "flash_attention_paged";
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.dim() == 4, op,
              ": expected q (N, h, d_k), k_pages (P, h_kv, p, d_k), v_pages (P, h_kv, p, d_v), "
              "got ", q.sizes(), ", ", k_pages.sizes(), ", ", v_pages.sizes());
  TORCH_CHECK(q.scalar_type() == k_pages.scalar_type() && q.scalar_type() == v_pages.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              op, ": q, k_pages, v_pages must share one dtype, float32 or bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k_pages.is_contiguous() && v_pages.is_contiguous(), op,
              ": q rows and the page pools must be contiguous");
  const int64_t N = q.size(0), h = q.size(1), dk = q.size(2);
  const int64_t npages = k_pages.size(0), hkv = k_pages.size(1), page = k_pages.size(2);
  const int64_t dv = v_pages.size(3);
  TORCH_CHECK(k_pages.size(3) == dk && v_pages.size(0) == npages && v_pages.size(1) == hkv &&
                  v_pages.size(2) == page && hkv >= 1 && h % hkv == 0 && page >= 1 && dk >= 1 &&
                  dv >= 1,
              op, ": pools (P, h_kv, p, d) must match q (N, h, d_k) with h_kv dividing h, got ",
              q.sizes(), ", ", k_pages.sizes(), ", ", v_pages.sizes());
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, op,
              ": block_table must be (B, M) int32");
  const int64_t B = block_table.size(0), M = block_table.size(1);
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kLong && cu_seqlens_q.dim() == 1 &&
                  cu_seqlens_q.size(0) == B + 1 && key_lengths.scalar_type() == at::kLong &&
                  key_lengths.dim() == 1 && key_lengths.size(0) == B,
              op, ": cu_seqlens_q must be (B + 1,) int64 and key_lengths (B,) int64 for B = ", B);
  const at::Tensor bt = block_table.contiguous(), cu = cu_seqlens_q.contiguous();
  const at::Tensor kl = key_lengths.contiguous();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t* cup = cu.data_ptr<int64_t>();
  const int64_t* klp = kl.data_ptr<int64_t>();
  TORCH_CHECK(cup[0] == 0 && cup[B] == N, op, ": cu_seqlens_q must run from 0 to N = ", N);
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) {  // the memory guard: every page a row reads is in the pool
    TORCH_CHECK(cup[b + 1] >= cup[b], op, ": cu_seqlens_q must be non-decreasing");
    TORCH_CHECK(klp[b] >= 0 && klp[b] <= M * page, op, ": key_lengths[", b, "] = ", klp[b],
                " must lie in [0, M * p = ", M * page, "]");
    for (int64_t e = 0; e < (klp[b] + page - 1) / page; ++e)
      TORCH_CHECK(btp[b * M + e] >= 0 && btp[b * M + e] < npages, op, ": block_table[", b, ", ",
                  e, "] = ", btp[b * M + e], " is not a page of the pool [0, ", npages, ")");
    max_len = std::max(max_len, klp[b]);
  }
  const auto mods = mha_common::make_score_mods(softcap, sinks, std::nullopt, std::nullopt, B, h,
                                                N, max_len, op);
  at::Tensor out = at::empty({N, h, dv}, q.options());
  at::Tensor lse = at::empty({h, N}, q.options().dtype(at::kDouble));
  if (N == 0 || h == 0) return {out, lse};
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> P;
    P.q = q.data_ptr<T>();
    P.k = k_pages.data_ptr<T>();
    P.v = v_pages.data_ptr<T>();
    P.out = out.data_ptr<T>();
    P.lse = lse.data_ptr<double>();
    P.qs[0] = 0, P.qs[1] = q.stride(1), P.qs[2] = q.stride(0), P.qs[3] = 1;  // (1, h, N, d_k)
    P.os[0] = 0, P.os[1] = out.stride(1), P.os[2] = out.stride(0), P.os[3] = 1;
    fill_strides(k_pages, P.ks, 4, false);  // (P, h_kv, p, d_k): page, head, slot, column
    fill_strides(v_pages, P.vs, 4, false);
    P.mask = nullptr;
    P.key_lengths = klp;
    P.block_table = btp, P.bt_stride = M, P.page = page, P.cu_q = cup;
    P.B = B, P.h = h, P.hkv = hkv, P.Tq = N, P.Tk = max_len, P.dk = dk, P.dv = dv;
    P.scale = float(scale);
    P.causal = causal;
    P.window = 0;
    P.mods = mods;
    const std::string& kn = default_kernel(q.scalar_type());
    if (kn == "portable") return run_forward<PortableF32>(P);
#if defined(__AVX512F__)
    if (kn == "avx512f") return run_forward<Avx512F32>(P);
#endif
#if defined(MHA_FLASH_BF16_TILES)
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (kn == "avx512bf16") return run_forward<Avx512Bf16>(P);
#endif
#if defined(MHA_FLASH_AMX)
    if constexpr (std::is_same_v<T, at::BFloat16>)
      if (kn == "amx" && amx_permitted()) return run_forward<AmxBf16>(P);
#endif
#if defined(__AVX512F__)
    return run_forward<Avx512F32>(P);
#else
    return run_forward<PortableF32>(P);
#endif
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
  return {out, lse};
}

}  // namespace
}  // namespace mha_flash
