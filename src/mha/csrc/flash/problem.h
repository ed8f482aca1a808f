// The flash forward's problem and per-thread state: block sizes, the Problem (pointers,
// strides, masks; which keys a row may attend), grow-only scratch buffers, the register-tile
// row walkers, the bool mask's bits per key block, and the work item.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/block_plan.h"
#include "common/constants.h"
#include "common/score_mods.h"
#include "common/tensor_access.h"
#include "flash/flash_attn_kernels.h"

namespace mha_flash {
namespace {

constexpr int64_t kRowsPerBlock = 48;  // query rows per block: 8 register tiles of 6 rows
constexpr int64_t kMaxKeysPerBlock = 128;
constexpr int kMaxVecsPerBlock = kMaxKeysPerBlock / kLanes;
// a block plan's blocks are the kernel's blocks (common/block_plan.h says why)
static_assert(mha_common::kPlanRows == kRowsPerBlock && mha_common::kPlanKeys == kMaxKeysPerBlock);
using mha_common::fill_strides;
using mha_common::kLn2;
using mha_common::kLn2d;
using mha_common::kLog2e;
using mha_common::round_up;

// Which parts of the AMX key loop run: both, in every kernel the package builds. Only the
// benchmark translation unit bench/flash_breakdown.cpp (benchmarks/probes/amx_breakdown.py) passes a
// policy that leaves the tile products or the softmax out, to time the rest.
struct AllParts {
  static constexpr bool kTiles = true, kSoftmax = true;
};

template <typename T>
struct Problem {
  const T *q, *k, *v;
  T* out;
  double* lse;  // natural log, in double: the backward recomputes P from it (see flash_attn.cpp)
  int64_t qs[4], ks[4], vs[4], os[4], ms[4];  // strides; ms is 0 on broadcast mask dims
  const bool* mask;                            // or nullptr
  const int64_t* key_lengths;                  // (B,) or nullptr
  int64_t B, h, hkv, Tq, Tk, dk, dv;
  float scale;
  bool causal;
  int64_t window;  // > 0: sliding window (the left edge); <= 0: none
  mha_common::ScoreMods mods;  // softcap, sinks, bias, ALiBi (common/score_mods.h)
  mha_common::PlanView plan;   // a mask_mod's block plan (common/block_plan.h), or off
  // Paged K/V (flash/paged.h), else nullptr: k, v are page pools (P, h_kv, p, d) and key j of
  // row b lives in page block_table[b * bt_stride + j / page], slot j % page; q and out are
  // packed (N, h, d) tokens (qs[0] = os[0] = 0, Tq = N), row b owning tokens
  // [cu_q[b], cu_q[b + 1]), causal aligned to its own length key_lengths[b].
  const int32_t* block_table = nullptr;
  const int64_t* cu_q = nullptr;
  int64_t bt_stride = 0, page = 1;

  // The query rows of batch row b, and the packed token of its first one.
  int64_t rows(int64_t b) const { return cu_q ? cu_q[b + 1] - cu_q[b] : Tq; }
  int64_t row0(int64_t b) const { return cu_q ? cu_q[b] : 0; }
  const T* q_row(int64_t b, int64_t hq, int64_t i) const {
    return q + b * qs[0] + hq * qs[1] + (row0(b) + i) * qs[2];
  }
  T* out_row(int64_t b, int64_t hq, int64_t i) const {
    return out + b * os[0] + hq * os[1] + (row0(b) + i) * os[2];
  }
  double& lse_at(int64_t b, int64_t hq, int64_t i) const {  // (B, h, Tq), paged (h, N)
    return lse[cu_q ? hq * Tq + cu_q[b] + i : (b * h + hq) * Tq + i];
  }
  // Key / value row j of (b, K/V head kh): through the block table when paged (j < the row's
  // key length there: entries past it are not pages).
  const T* k_row(int64_t b, int64_t kh, int64_t j) const {
    if (block_table)
      return k + int64_t(block_table[b * bt_stride + j / page]) * ks[0] + kh * ks[1] +
             (j % page) * ks[2];
    return k + b * ks[0] + kh * ks[1] + j * ks[2];
  }
  const T* v_row(int64_t b, int64_t kh, int64_t j) const {
    if (block_table)
      return v + int64_t(block_table[b * bt_stride + j / page]) * vs[0] + kh * vs[1] +
             (j % page) * vs[2];
    return v + b * vs[0] + kh * vs[1] + j * vs[2];
  }

  // Keys [0, limit) may be visible to query row i of batch b (before the bool mask).
  int64_t key_limit(int64_t b, int64_t i) const {
    int64_t lim = key_lengths ? key_lengths[b] : Tk;
    if (causal) lim = std::min(lim, i + (cu_q ? lim - rows(b) : Tk - Tq) + 1);
    return std::max<int64_t>(lim, 0);
  }
  // Keys j < start are left of query row i's window (0 without a window); grows with i.
  int64_t key_start(int64_t i) const {
    return window > 0 ? std::max<int64_t>(0, i + Tk - Tq - window + 1) : 0;
  }
};

template <typename E>
struct Buffer {  // grow-only, 64-byte aligned scratch
  E* ptr = nullptr;
  size_t cap = 0;
  E* get(size_t n) {
    if (n > cap) {
      std::free(ptr);
      ptr = static_cast<E*>(std::aligned_alloc(64, round_up(std::max<size_t>(n, 1) * sizeof(E), 64)));
      TORCH_CHECK(ptr != nullptr, "flash_attention: out of memory for scratch");
      cap = n;
    }
    return ptr;
  }
  void trim(size_t keep) {  // release a large buffer after a call
    if (cap * sizeof(E) > keep) {
      std::free(ptr);
      ptr = nullptr;
      cap = 0;
    }
  }
  ~Buffer() { std::free(ptr); }
};

// A thread's scratch, kept between calls (no page faults on every call); packed K/V buffers
// above kKeepBytes are released after each call so long sequences do not pin memory.
template <class K>
struct Scratch {
  static constexpr size_t kKeepBytes = size_t(8) << 20;
  Buffer<typename K::packed_t> kt, v, q;
  Buffer<float> s, o, m, alpha, lsum, arun, psum;
  Buffer<typename K::p_t> p, prun;
  Buffer<uint16_t> bits;
  Buffer<double> wm, wl;  // the wide softmax's running max and sum per row
  void trim() {
    kt.trim(kKeepBytes);
    v.trim(kKeepBytes);
  }
};

template <typename P, typename T>
inline P pack_elem(T x) {
  if constexpr (std::is_same_v<P, uint16_t>) return x.x;  // bf16 bits as they are
  else return static_cast<float>(x);
}

// Calls f.template run<R>(r0) over `rows` rows in tiles of RMAX rows, then the remainder.
template <int R, class F>
struct Remainder {
  static void go(int rem, int r0, const F& f) {
    if (rem == R) f.template run<R>(r0);
    else Remainder<R - 1, F>::go(rem, r0, f);
  }
};
template <class F>
struct Remainder<0, F> {
  static void go(int, int, const F&) {}
};
template <int RMAX, class F>
inline void for_row_tiles(int rows, const F& f) {
  int r0 = 0;
  for (; r0 + RMAX <= rows; r0 += RMAX) f.template run<RMAX>(r0);
  if (rows > r0) Remainder<RMAX - 1, F>::go(rows - r0, r0, f);
}

template <class K, int NV>
struct QkTile {
  const typename K::packed_t *q, *kt;
  int64_t ldq, ldk;
  int dkp;
  float* s;
  int64_t lds;
  template <int R>
  void run(int r0) const {
    K::template qk<R, NV>(q + r0 * ldq, ldq, kt, ldk, dkp, s + r0 * lds, lds);
  }
};

// Q K^T with the lazy softmax's fast path (K::qk_exp): P and per-row sums psum from the tile.
template <class K, int NV>
struct QkExpTile {
  const float *q, *kt;
  int64_t ldq, ldk;
  int dkp;
  float* s;
  int64_t lds;
  float c;
  const float* m;
  float* p;
  int64_t ldp;
  float* psum;
  bool first;
  template <int R>
  void run(int r0) const {
    K::template qk_exp<R, NV>(q + r0 * ldq, ldq, kt, ldk, dkp, s + r0 * lds, lds, c, m + r0,
                              p + r0 * ldp, ldp, psum + r0 * kLanes, first);
  }
};

template <class K, int CV>
struct PvTile {
  const typename K::p_t* p;
  int64_t ldp;
  const typename K::packed_t* v;
  int64_t dvp;
  int n;
  float* o;
  int64_t ldo;
  const float* alpha;
  template <int R>
  void run(int r0) const {
    K::template pv<R, CV>(p + r0 * ldp, ldp, v, dvp, n, o + r0 * ldo, ldo, alpha + r0);
  }
};

// Bits of the bool mask for one row and one key block: bit `lane` of word v is key
// j0 + 16 v + lane. Keys at or past Tk read as masked.
inline void mask_bits(const bool* row, int64_t stride, int64_t j0, int64_t Tk, int nv,
                      uint16_t* bits) {
  for (int v = 0; v < nv; ++v) {
    const int64_t jb = j0 + v * kLanes;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    if (stride == 1 && jb + kLanes <= Tk) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + jb));
      bits[v] = _mm_test_epi8_mask(x, x);
      continue;
    }
#endif
    uint16_t w = 0;
    for (int l = 0; l < kLanes && jb + l < Tk; ++l) w |= uint16_t(row[(jb + l) * stride] ? 1u << l : 0u);
    bits[v] = w;
  }
}

// ANDs the plan bits of one row into bits (as mask_bits makes them): row points at the row's
// kPlanKeys bools of a partial block, c is key j0's column in it (c + 16 nv <= kPlanKeys).
inline void and_plan_bits(const bool* row, int64_t c, int nv, uint16_t* bits) {
  uint16_t w[kMaxVecsPerBlock];
  mask_bits(row, 1, c, mha_common::kPlanKeys, nv, w);
  for (int v = 0; v < nv; ++v) bits[v] &= w[v];
}

// The 16-key vectors [vlo, vhi) of a partial plan block that hold a key some row may attend
// (the OR of its kPlanRows rows; keys outside are masked for every row, so they never enter S).
// A document boundary inside a block thus costs the vectors up to it, not the whole block.
inline void plan_vectors(const bool* block, int& vlo, int& vhi) {
  constexpr int kWords = int(mha_common::kPlanKeys / 8);
  uint64_t any[kWords] = {};
  for (int64_t r = 0; r < mha_common::kPlanRows; ++r) {
    uint64_t w[kWords];
    std::memcpy(w, block + r * mha_common::kPlanKeys, sizeof(w));
    for (int x = 0; x < kWords; ++x) any[x] |= w[x];
  }
  vlo = int(mha_common::kPlanKeys / kLanes), vhi = 0;
  for (int v = 0; v < int(mha_common::kPlanKeys / kLanes); ++v)
    if (any[2 * v] | any[2 * v + 1]) vlo = std::min(vlo, v), vhi = v + 1;
}

// Clears the bits of keys left of a row's window: keys j0 + n with n < e (bits as mask_bits).
inline void clear_left_of(int64_t e, int nv, uint16_t* bits) {
  for (int v = 0; v < nv; ++v) {
    const int64_t n = std::clamp<int64_t>(e - int64_t(v) * kLanes, 0, kLanes);
    bits[v] &= uint16_t(~((1u << n) - 1u));
  }
}

struct Item {
  int64_t b, kh, i0, i1;
  double cost;
};

}  // namespace
}  // namespace mha_flash
