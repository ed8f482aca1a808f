// Packing one item's K and V into the kernels' layouts (Worker::pack_kv and its row helpers):
// K transposed per key block, V by rows, bf16 in pairs where the kernel takes pairs.
// Rows are read through Problem::k_row / v_row, so paged K/V (a block table) packs from its
// pages in the same pass, no gathered copy: fp32 transposes 16 key rows wherever each lives,
// and the bf16 pair gathers take each row's offset (one stride when p is a multiple of 16, so
// 16 keys lie in one page; else the 16 offsets from the block table), so any page size packs
// with vectors; the strided fp32 gathers serve dense K only (pages are contiguous rows). Keys
// at or past kend are never addressed.
#pragma once

#include "flash/worker.h"

namespace mha_flash {
namespace {

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::pack_kv(int64_t b, int64_t kh, int64_t kbeg, int64_t kend, packed_t* kt,
             packed_t* vp) const {
  const int64_t nkeys = round_up(kend, K::kKeyAlign);
  const bool paged = P.block_table != nullptr;
  int64_t j = kbeg;
#if defined(__AVX512F__)
  // fp32: 16 keys at a time into K^T: rows of 16 d_k columns transposed in registers when
  // K's last dim is contiguous (3-4x cheaper than gathers on AMD cores: measured, the gathers
  // were ~6 % of causal T = 2048), else one (masked) gather per d_k column
  if constexpr (std::is_same_v<T, float> && std::is_same_v<packed_t, float>) {
    if (P.ks[3] == 1) {
      for (; j < nkeys; j += kLanes) {
        const int nreal = int(std::clamp<int64_t>(kend - j, 0, kLanes));
        float* kblk = kt + ((j - kbeg) / Nb) * dkp * Nb + j % Nb;
        const float* krows[kLanes];  // key j + t's row (a page's slot when paged)
        for (int t = 0; t < nreal; ++t) krows[t] = P.k_row(b, kh, j + t);
        for (int64_t kk0 = 0; kk0 < dkp; kk0 += kLanes) {  // dkp == d_k for fp32
          const __mmask16 cols = lanes_below(int(dkp - kk0));
          __m512 r[kLanes];
          for (int t = 0; t < kLanes; ++t)  // key j + t, columns kk0..; zeros past kend
            r[t] = t < nreal ? _mm512_maskz_loadu_ps(cols, krows[t] + kk0)
                             : _mm512_setzero_ps();
          transpose16(r);  // r[c]: column kk0 + c of the 16 keys
          for (int c = 0; c < int(std::min<int64_t>(kLanes, dkp - kk0)); ++c)
            _mm512_storeu_ps(kblk + (kk0 + c) * Nb, r[c]);
        }
        for (int64_t jj = j; jj < j + kLanes; ++jj)
          pack_v_row(jj < kend ? P.v_row(b, kh, jj) : nullptr, jj - kbeg, jj < kend, vp);
      }
    } else if (!paged && P.ks[2] * kLanes < (int64_t(1) << 28)) {
      const __m512i idx = _mm512_mullo_epi32(
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(int32_t(P.ks[2])));
      for (; j < nkeys; j += kLanes) {
        const __mmask16 real = lanes_below(int(std::min<int64_t>(kend - j, kLanes)));
        float* kblk = kt + ((j - kbeg) / Nb) * dkp * Nb + j % Nb;
        const float* kbj = P.k_row(b, kh, j);
        for (int64_t kk = 0; kk < dkp; ++kk)
          _mm512_storeu_ps(kblk + kk * Nb, _mm512_mask_i32gather_ps(
                                               _mm512_setzero_ps(), real, idx, kbj + kk * P.ks[3], 4));
        for (int64_t jj = j; jj < j + kLanes; ++jj)
          pack_v_row(jj < kend ? P.v_row(b, kh, jj) : nullptr, jj - kbeg, jj < kend, vp);
      }
    }
  }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  // bf16 pair layouts: a (d, d+1) pair of K is one 32-bit word of a K row, so K^T pairs are
  // 32-bit gathers; V pairs interleave two rows 16 columns at a time.
  if constexpr (std::is_same_v<T, at::BFloat16> && K::kPairs) {
    if (P.dk % 2 == 0 && P.ks[3] == 1 && P.vs[3] == 1 && P.ks[2] * 2 * kLanes < (int64_t(1) << 30)) {
      const __m512i rows16 = _mm512_mullo_epi32(  // byte offsets of 16 rows at K's row stride
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(int32_t(P.ks[2] * 2)));
      // paged with p a multiple of 16: the 16 keys (j a multiple of 16) lie in one page
      const bool one_page = !paged || P.page % kLanes == 0;
      for (; j < nkeys; j += kLanes) {
        const int nreal = int(std::clamp<int64_t>(kend - j, 0, kLanes));
        const __mmask16 real = lanes_below(nreal);
        uint16_t* kblk =
            reinterpret_cast<uint16_t*>(kt) + ((j - kbeg) / Nb) * dkp * Nb + (j % Nb) * 2;
        // key j's row (AMX packs 32 keys: a last 16 past kend gathers nothing, any row serves)
        const char* kbj = reinterpret_cast<const char*>(P.k_row(b, kh, j < kend ? j : kbeg));
        __m512i idx = rows16;
        if (!one_page) {  // the 16 rows may span pages: each row's byte offset from key j's
          alignas(64) int32_t off[kLanes] = {};
          bool fits = true;
          for (int t = 0; t < nreal; ++t) {
            const int64_t o = reinterpret_cast<const char*>(P.k_row(b, kh, j + t)) - kbj;
            fits = fits && o >= INT32_MIN && o <= INT32_MAX;
            off[t] = int32_t(o);
          }
          if (!fits) break;  // pages over 2 GiB apart: the scalar loop packs from key j on
          idx = _mm512_load_si512(off);
        }
        for (int64_t pr = 0; pr < dkp / 2; ++pr) {
          const __m512i w = pr < P.dk / 2
              ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, idx, kbj + pr * 4, 1)
              : _mm512_setzero_si512();
          _mm512_storeu_si512(kblk + pr * Nb * 2, w);
        }
        for (int64_t jj = j; jj < j + kLanes; jj += 2) pack_v_pair_bf16(b, kh, jj, kbeg, kend, vp);
      }
    }
  }
#endif
#endif
  for (; j < nkeys; ++j) {
    const bool real = j < kend;
    packed_t* kblk = kt + ((j - kbeg) / Nb) * dkp * Nb;
    const int64_t n = j % Nb;
    const T* krow = real ? P.k_row(b, kh, j) : nullptr;
    for (int64_t kk = 0; kk < dkp; ++kk) {
      const packed_t x = (real && kk < P.dk) ? pack_elem<packed_t>(krow[kk * P.ks[3]]) : packed_t(0);
      if constexpr (K::kPairs) kblk[(kk / 2) * Nb * 2 + n * 2 + (kk & 1)] = x;
      else kblk[kk * Nb + n] = x;
    }
    pack_v_row(real ? P.v_row(b, kh, j) : nullptr, j - kbeg, real, vp);
  }
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
template <class K, typename T, class Parts>
void Worker<K, T, Parts>::pack_v_pair_bf16(int64_t b, int64_t kh, int64_t j, int64_t kbeg,
                      int64_t kend, packed_t* vp) const {
  const auto* r0 = j < kend ? reinterpret_cast<const uint16_t*>(P.v_row(b, kh, j)) : nullptr;
  const auto* r1 = j + 1 < kend ? reinterpret_cast<const uint16_t*>(P.v_row(b, kh, j + 1)) : nullptr;
  uint16_t* dst = reinterpret_cast<uint16_t*>(vp) + ((j - kbeg) / 2) * dvp * 2;
  for (int64_t c = 0; c < dvp; c += kLanes) {
    const __mmask16 m = lanes_below(int(std::min<int64_t>(P.dv - c, kLanes)));
    const __m256i a = j < kend ? _mm256_maskz_loadu_epi16(m, r0 + c) : _mm256_setzero_si256();
    const __m256i b = j + 1 < kend ? _mm256_maskz_loadu_epi16(m, r1 + c) : _mm256_setzero_si256();
    const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                      _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    _mm512_storeu_si512(dst + c * 2, w);
  }
}
#endif

template <class K, typename T, class Parts>
void Worker<K, T, Parts>::pack_v_row(const T* vrow, int64_t j, bool real, packed_t* vp) const {
  if constexpr (!K::kPairs) {
    if (v_in_place) return;
    if (!real) return std::fill(vp + j * dvp, vp + (j + 1) * dvp, packed_t(0));
    if (std::is_same_v<T, packed_t> && P.vs[3] == 1) {
      std::memcpy(vp + j * dvp, vrow, P.dv * sizeof(packed_t));
      std::fill(vp + j * dvp + P.dv, vp + (j + 1) * dvp, packed_t(0));
      return;
    }
  }
  for (int64_t c = 0; c < dvp; ++c) {
    const packed_t x = (real && c < P.dv) ? pack_elem<packed_t>(vrow[c * P.vs[3]]) : packed_t(0);
    if constexpr (K::kPairs) vp[(j / 2) * dvp * 2 + c * 2 + (j & 1)] = x;
    else vp[j * dvp + c] = x;
  }
}

}  // namespace
}  // namespace mha_flash
