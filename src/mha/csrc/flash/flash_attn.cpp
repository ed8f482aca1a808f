// CPU flash-attention forward: online softmax over key blocks, O(T d) memory, fp32 and bf16.
//
// Shape legend: B batch, h query heads, h_kv key/value heads (g = h / h_kv query heads share
// one K/V head), Tq/Tk query/key lengths, d_k/d_v head dims. q (B, h, Tq, d_k),
// k (B, h_kv, Tk, d_k), v (B, h_kv, Tk, d_v), any strides; out (B, h, Tq, d_v) with the memory
// layout of (B, Tq, h, d_v); lse (B, h, Tq) fp32 natural-log log-sum-exp (-inf: no key).
//
// Masks (True = may attend, all combined with AND): causal aligned bottom-right (query i sees
// keys j <= i + Tk - Tq), key_lengths (B,) (keys j >= key_lengths[b] are padding), and a bool
// mask broadcastable to (B, h, Tq, Tk) read through its strides (stride 0 on broadcast dims),
// and a sliding window w > 0 (the left edge: query i sees keys j > i + Tk - Tq - w; used with
// causal). Query row i thus sees keys [key_start(i), key_limit(b, i)), before the bool mask.
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
#include "common/kernel_choice.h"
#include "flash/flash_attn_kernels.h"
#include "common/qkv_checks.h"
#include "common/tensor_access.h"

namespace mha_flash {
namespace {

constexpr int64_t kRowsPerBlock = 48;  // query rows per block: 8 register tiles of 6 rows
constexpr int64_t kMaxKeysPerBlock = 128;
constexpr int kMaxVecsPerBlock = kMaxKeysPerBlock / kLanes;
using mha_common::fill_strides;
using mha_common::kLn2;
using mha_common::kLog2e;
using mha_common::round_up;

// Which parts of the AMX key loop run: both, in every kernel the package builds. Only the
// benchmark translation unit bench/flash_breakdown.cpp (benchmarks/amx_breakdown.py) passes a
// policy that leaves the tile products or the softmax out, to time the rest.
struct AllParts {
  static constexpr bool kTiles = true, kSoftmax = true;
};

template <typename T>
struct Problem {
  const T *q, *k, *v;
  T* out;
  float* lse;
  int64_t qs[4], ks[4], vs[4], os[4], ms[4];  // strides; ms is 0 on broadcast mask dims
  const bool* mask;                            // or nullptr
  const int64_t* key_lengths;                  // (B,) or nullptr
  int64_t B, h, hkv, Tq, Tk, dk, dv;
  float scale;
  bool causal;
  int64_t window;  // > 0: sliding window (the left edge); <= 0: none

  // Keys [0, limit) may be visible to query row i of batch b (before the bool mask).
  int64_t key_limit(int64_t b, int64_t i) const {
    int64_t lim = key_lengths ? key_lengths[b] : Tk;
    if (causal) lim = std::min(lim, i + Tk - Tq + 1);
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
  Buffer<float> s, o, m, alpha, lsum, arun;
  Buffer<typename K::p_t> p, prun;
  Buffer<uint16_t> bits;
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


template <class K, typename T, class Parts>
struct Worker {
  using packed_t = typename K::packed_t;
  using p_t = typename K::p_t;
  const Problem<T>& P;
  int64_t Nb, dkp, dvp, g;
  Scratch<K>& sc;

  Worker(const Problem<T>& p, Scratch<K>& scratch) : P(p), sc(scratch) {
    Nb = std::min<int64_t>(kMaxKeysPerBlock, round_up(std::max<int64_t>(P.Tk, 1), K::kKeyAlign));
    dkp = round_up(P.dk, K::kDkAlign);
    dvp = round_up(P.dv, kLanes);
    g = P.h / P.hkv;
  }

  // K transposed per key block: [dkp][Nb] (fp32) or [dkp/2][Nb][2] (bf16 pairs of d_k).
  // V: [keys][dvp] (fp32) or [keys/2][dvp][2] (bf16 pairs of keys). Zeros past kend / d.
  // Keys [kbeg, kend) are packed (kbeg a multiple of Nb; key kbeg at offset 0), up to kend
  // rounded to 16 (32 for AMX; the tiles never read further); zeros past kend.
  void pack_kv(int64_t b, int64_t kh, int64_t kbeg, int64_t kend, packed_t* kt,
               packed_t* vp) const {
    const int64_t nkeys = round_up(kend, K::kKeyAlign);
    const T* kbase = P.k + b * P.ks[0] + kh * P.ks[1];
    const T* vbase = P.v + b * P.vs[0] + kh * P.vs[1];
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
          const float* kbj = kbase + j * P.ks[2];
          for (int64_t kk0 = 0; kk0 < dkp; kk0 += kLanes) {  // dkp == d_k for fp32
            const __mmask16 cols = lanes_below(int(dkp - kk0));
            __m512 r[kLanes];
            for (int t = 0; t < kLanes; ++t)  // key j + t, columns kk0..; zeros past kend
              r[t] = t < nreal ? _mm512_maskz_loadu_ps(cols, kbj + t * P.ks[2] + kk0)
                               : _mm512_setzero_ps();
            transpose16(r);  // r[c]: column kk0 + c of the 16 keys
            for (int c = 0; c < int(std::min<int64_t>(kLanes, dkp - kk0)); ++c)
              _mm512_storeu_ps(kblk + (kk0 + c) * Nb, r[c]);
          }
          for (int64_t jj = j; jj < j + kLanes; ++jj)
            pack_v_row(vbase + jj * P.vs[2], jj - kbeg, jj < kend, vp);
        }
      } else if (P.ks[2] * kLanes < (int64_t(1) << 28)) {
        const __m512i idx = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(int32_t(P.ks[2])));
        for (; j < nkeys; j += kLanes) {
          const __mmask16 real = lanes_below(int(std::min<int64_t>(kend - j, kLanes)));
          float* kblk = kt + ((j - kbeg) / Nb) * dkp * Nb + j % Nb;
          const float* kbj = kbase + j * P.ks[2];
          for (int64_t kk = 0; kk < dkp; ++kk)
            _mm512_storeu_ps(kblk + kk * Nb, _mm512_mask_i32gather_ps(
                                                 _mm512_setzero_ps(), real, idx, kbj + kk * P.ks[3], 4));
          for (int64_t jj = j; jj < j + kLanes; ++jj)
            pack_v_row(vbase + jj * P.vs[2], jj - kbeg, jj < kend, vp);
        }
      }
    }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    // bf16 pair layouts: a (d, d+1) pair of K is one 32-bit word of a K row, so K^T pairs are
    // 32-bit gathers; V pairs interleave two rows 16 columns at a time.
    if constexpr (std::is_same_v<T, at::BFloat16> && K::kPairs) {
      if (P.dk % 2 == 0 && P.ks[3] == 1 && P.vs[3] == 1 && P.ks[2] * 2 * kLanes < (int64_t(1) << 30)) {
        const __m512i idx = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(int32_t(P.ks[2] * 2)));
        for (; j < nkeys; j += kLanes) {
          const __mmask16 real = lanes_below(int(std::min<int64_t>(kend - j, kLanes)));
          uint16_t* kblk =
              reinterpret_cast<uint16_t*>(kt) + ((j - kbeg) / Nb) * dkp * Nb + (j % Nb) * 2;
          const char* kbj = reinterpret_cast<const char*>(kbase + j * P.ks[2]);
          for (int64_t pr = 0; pr < dkp / 2; ++pr) {
            const __m512i w = pr < P.dk / 2
                ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, idx, kbj + pr * 4, 1)
                : _mm512_setzero_si512();
            _mm512_storeu_si512(kblk + pr * Nb * 2, w);
          }
          for (int64_t jj = j; jj < j + kLanes; jj += 2) pack_v_pair_bf16(vbase, jj, kbeg, kend, vp);
        }
      }
    }
#endif
#endif
    for (; j < nkeys; ++j) {
      const bool real = j < kend;
      packed_t* kblk = kt + ((j - kbeg) / Nb) * dkp * Nb;
      const int64_t n = j % Nb;
      const T* krow = kbase + j * P.ks[2];
      for (int64_t kk = 0; kk < dkp; ++kk) {
        const packed_t x = (real && kk < P.dk) ? pack_elem<packed_t>(krow[kk * P.ks[3]]) : packed_t(0);
        if constexpr (K::kPairs) kblk[(kk / 2) * Nb * 2 + n * 2 + (kk & 1)] = x;
        else kblk[kk * Nb + n] = x;
      }
      pack_v_row(vbase + j * P.vs[2], j - kbeg, real, vp);
    }
  }

#if defined(__AVX512BW__) && defined(__AVX512VL__)
  // V rows j, j + 1 (j even) into [(j - kbeg)/2][dvp][2]; rows at or past kend are zeros.
  void pack_v_pair_bf16(const T* vbase, int64_t j, int64_t kbeg, int64_t kend,
                        packed_t* vp) const {
    const auto* r0 = reinterpret_cast<const uint16_t*>(vbase + j * P.vs[2]);
    const auto* r1 = reinterpret_cast<const uint16_t*>(vbase + (j + 1) * P.vs[2]);
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

  // V row into packed row j (relative to the first packed key).
  void pack_v_row(const T* vrow, int64_t j, bool real, packed_t* vp) const {
    if constexpr (!K::kPairs) {
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

  void zero_rows(int64_t b, int64_t hq, int64_t i0, int64_t i1) const {
    for (int64_t i = i0; i < i1; ++i) {
      T* orow = P.out + b * P.os[0] + hq * P.os[1] + i * P.os[2];
      for (int64_t c = 0; c < P.dv; ++c) orow[c * P.os[3]] = T(0);
      P.lse[(b * P.h + hq) * P.Tq + i] = kNegInf;
    }
  }

  void run_item(const Item& it) {
    const int64_t kend = P.key_limit(it.b, it.i1 - 1);
    const int64_t kbeg = P.key_start(it.i0) / Nb * Nb;  // first key block any row sees
    const int64_t h0 = it.kh * g;
    if (kend <= kbeg) {
      for (int64_t hq = h0; hq < h0 + g; ++hq) zero_rows(it.b, hq, it.i0, it.i1);
      return;
    }
    const int64_t nkeys = round_up(kend, Nb) - kbeg;
    packed_t* kt = sc.kt.get(nkeys * dkp);
    packed_t* vp = sc.v.get(nkeys * dvp);
    pack_kv(it.b, it.kh, kbeg, kend, kt, vp);
    for (int64_t hq = h0; hq < h0 + g; ++hq)
      for (int64_t i0 = it.i0; i0 < it.i1; i0 += kRowsPerBlock)
        query_block(it.b, hq, i0, std::min(it.i1, i0 + kRowsPerBlock), kbeg, kt, vp);
  }

  // kt, vp: keys packed from kbeg (pack_kv).
  void query_block(int64_t b, int64_t hq, int64_t i0, int64_t i1, int64_t kbeg,
                   const packed_t* kt, const packed_t* vp) {
    const int rows = int(i1 - i0);
    const int64_t kend = P.key_limit(b, i1 - 1);
    const int64_t jlo = P.key_start(i0) / Nb * Nb;  // the block's first key block (>= kbeg)
    if (kend <= jlo) return zero_rows(b, hq, i0, i1);
    kt += (jlo - kbeg) / Nb * dkp * Nb;  // key block jlo
    vp += (jlo - kbeg) * dvp;            // same offset for both V layouts (jlo - kbeg is even)
    const int rp = K::kAmx ? int(round_up(rows, 16)) : rows;  // AMX tiles take 16 rows
    packed_t* q = sc.q.get(rp * dkp);
    // AMX: one 16-row S and P (a group at a time), two groups' S (group_pair_runs); the exact
    // pass (key_loop) takes rows of each, as the other kernels do
    float* s = sc.s.get(std::max(K::kAmx ? 32 : 0, rp) * Nb);
    p_t* p = sc.p.get(std::max(K::kAmx ? 16 : 0, rp) * Nb);
    float* o = sc.o.get(rp * dvp);
    float* m = sc.m.get(rows);
    float* alpha = sc.alpha.get(rows);
    float* lsum = sc.lsum.get(rows * kLanes);
    uint16_t* bits = sc.bits.get(rows * kMaxVecsPerBlock);
    const T* qbase = P.q + b * P.qs[0] + hq * P.qs[1];
    for (int r = 0; r < rows; ++r) {
      const T* qrow = qbase + (i0 + r) * P.qs[2];
      constexpr bool same_bits =  // packing copies the bits (fp32, or bf16 kept as bf16)
          std::is_same_v<T, packed_t> ||
          (std::is_same_v<T, at::BFloat16> && std::is_same_v<packed_t, uint16_t>);
      if (same_bits && P.qs[3] == 1 && dkp == P.dk) {
        std::memcpy(q + r * dkp, qrow, dkp * sizeof(packed_t));
      } else {
        for (int64_t kk = 0; kk < dkp; ++kk)
          q[r * dkp + kk] = kk < P.dk ? pack_elem<packed_t>(qrow[kk * P.qs[3]]) : packed_t(0);
      }
    }
    std::fill(q + rows * dkp, q + rp * dkp, packed_t(0));  // AMX padding rows
    const bool* mrow0 = P.mask ? P.mask + b * P.ms[0] + hq * P.ms[1] : nullptr;
    key_loop(b, i0, rows, rp, jlo, kend, mrow0, q, kt, vp, s, p, o, m, alpha, lsum, bits, false);
    // The tiles multiply every key of a block by its P, P = 0 at keys a row may not attend, and
    // 0 * NaN (or Inf) in V is NaN: a non-finite O in a row whose l is finite (not NaN: then
    // every output of the row is NaN anyway) may come from such a key. Only then is the block
    // run again with those products skipped (key_loop's exact pass): finite inputs never pay.
    bool redo = false;
    for (int r = 0; r < rows && !redo; ++r) {
      const float l = K::row_sum(lsum + r * kLanes);
      redo = !std::isnan(l) && !mha_finite::all_finite(o + r * dvp, P.dv);
    }
    if (redo)
      key_loop(b, i0, rows, rp, jlo, kend, mrow0, q, kt, vp, s, p, o, m, alpha, lsum, bits, true);
    for (int r = 0; r < rows; ++r) {  // O / l and the log-sum-exp
      // l == 0: the row saw no key (zeros, lse -inf). l NaN (a NaN or +inf score reached the
      // row): inv and lse are NaN, so is the whole row. Never both: a row that saw a key has
      // a P of 1 at its max.
      const float l = K::row_sum(lsum + r * kLanes);
      const float inv = l != 0.f ? 1.f / l : 0.f;
      T* orow = P.out + b * P.os[0] + hq * P.os[1] + (i0 + r) * P.os[2];
      store_row(o + r * dvp, inv, orow);
      P.lse[(b * P.h + hq) * P.Tq + i0 + r] = l != 0.f ? (m[r] + std::log2(l)) * kLn2 : kNegInf;
    }
  }

  // The key loop of one query block (rows from i0) over keys [jlo, kend): m, lsum, o start from
  // an empty row. exact: products of P with V rows a row may not attend are skipped (pv_exact)
  // in every block some row does not see whole; the AMX kernel runs it on its vector tiles.
  void key_loop(int64_t b, int64_t i0, int rows, int rp, int64_t jlo, int64_t kend,
                const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* vp,
                float* s, p_t* p, float* o, float* m, float* alpha, float* lsum, uint16_t* bits,
                bool exact) {
    std::fill(m, m + rows, kNegInf);
    std::fill(lsum, lsum + rows * kLanes, 0.f);
    std::fill(o, o + rp * dvp, 0.f);
#if defined(MHA_FLASH_AMX)
    if constexpr (K::kAmx) {
      if (!exact) {
        std::fill(p, p + 16 * Nb, p_t(0));  // rows of a partial last group stay finite
        return key_loop_amx(b, i0, rows, jlo, kend, mrow0, q, kt, vp, s, p, o, m, alpha, lsum,
                            bits);
      }
    }
#endif
    // From the 16 keys holding the first row's window start (0 without a window) to the
    // end of its packed block, then whole blocks: the tiles read packed K^T at a column offset.
    for (int64_t j0 = P.key_start(i0) / kLanes * kLanes; j0 < kend; j0 = (j0 / Nb + 1) * Nb) {
      const int jn = int(std::min((j0 / Nb + 1) * Nb, kend) - j0);
      const int nv = (jn + kLanes - 1) / kLanes;
      const packed_t* ktb = kt + ((j0 - jlo) / Nb) * dkp * Nb + (j0 % Nb) * (K::kPairs ? 2 : 1);
      const packed_t* vb = vp + (j0 - jlo) * dvp;  // same offset for both V layouts (even)
      switch (nv) {
#define MHA_KEY_BLOCK(NV) \
  case NV: key_block<NV>(b, i0, rows, j0, jn, mrow0, q, ktb, vb, s, p, o, m, alpha, lsum, bits, exact); break;
        MHA_KEY_BLOCK(1) MHA_KEY_BLOCK(2) MHA_KEY_BLOCK(3) MHA_KEY_BLOCK(4)
        MHA_KEY_BLOCK(5) MHA_KEY_BLOCK(6) MHA_KEY_BLOCK(7) MHA_KEY_BLOCK(8)
#undef MHA_KEY_BLOCK
        default: TORCH_CHECK(false, "flash_attention: bad key block width");
      }
    }
  }

  // O = alpha O + P V for the rows [i0, i0 + rows) of one key block (keys j0 + n, n < jn),
  // adding only the keys each row may attend (key_start, key_limit, the bool mask): the exact
  // pass for blocks where a row would otherwise add 0 * (a non-finite V). Plain loops (hostile
  // inputs only). p rows of Nb (fp32, or bf16 bits), v packed from key j0 (fp32 [n][dvp], or
  // bf16 pairs [n/2][dvp][2]).
  void pv_exact(int64_t b, int64_t i0, int rows, int64_t j0, int jn, const bool* mrow0,
                const p_t* p, const packed_t* v, float* o, const float* alpha) const {
    auto to_float = [](auto x) {
      if constexpr (std::is_same_v<decltype(x), uint16_t>) {
        const uint32_t u = uint32_t(x) << 16;  // bf16 bits: the top half of an fp32
        float f;
        std::memcpy(&f, &u, sizeof(f));
        return f;
      } else {
        return float(x);
      }
    };
    for (int r = 0; r < rows; ++r) {
      const int64_t i = i0 + r, lo = P.key_start(i), hi = P.key_limit(b, i);
      const bool* mrow = mrow0 ? mrow0 + i * P.ms[2] : nullptr;
      float* orow = o + r * dvp;
      for (int64_t c = 0; c < dvp; ++c) orow[c] *= alpha[r];
      for (int n = 0; n < jn; ++n) {
        const int64_t j = j0 + n;
        if (j < lo || j >= hi || (mrow && !mrow[j * P.ms[3]])) continue;
        const float pj = to_float(p[r * Nb + n]);
        for (int64_t c = 0; c < P.dv; ++c) {
          const packed_t x = K::kPairs ? v[(n / 2) * dvp * 2 + c * 2 + (n & 1)] : v[n * dvp + c];
          orow[c] += pj * to_float(x);
        }
      }
    }
  }

  // out row = o * inv, in T (the output's last dim is contiguous: it is allocated so)
  void store_row(const float* o, float inv, T* __restrict orow) const {
    int64_t c = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (; c + kLanes <= P.dv; c += kLanes) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + c), iv);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(orow + c, x);
      } else {  // round to nearest even, as at::BFloat16 does
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c), mha_tiles::to_bf16(x));
      }
    }
#endif
    for (; c < P.dv; ++c) orow[c] = T(o[c] * inv);
  }

  // The online-softmax update of RS rows of one key block (rows of s and p are Nb long; bit
  // masks kMaxVecsPerBlock words per row). bf16 kernels: the one-pass softmax with lazy
  // rescaling (for scale > 0; the masked variant only where some lane may be masked).
  template <int NV, int RS>
  void softmax(bool unmasked, const float* s, const int* nvalid, const uint16_t* bits, float c,
               float* m, float* lsum, float* alpha, p_t* p) const {
#if defined(__AVX512F__)
    if constexpr (K::kLazySoftmax) {
      if (c > 0.f) {
        if (unmasked)
          K::template softmax_lazy<NV, RS, false>(s, Nb, nvalid, bits, kMaxVecsPerBlock, c, m,
                                                  lsum, alpha, p, Nb);
        else
          K::template softmax_lazy<NV, RS, true>(s, Nb, nvalid, bits, kMaxVecsPerBlock, c, m,
                                                 lsum, alpha, p, Nb);
        return;
      }
    }
#endif
    K::template softmax_rows<NV, RS>(s, Nb, nvalid, bits, kMaxVecsPerBlock, c, m, lsum, alpha,
                                     p, Nb);
  }

#if defined(MHA_FLASH_AMX)
  // AMX, d_v <= 64 (NC = dvp / 16 tiles): each 16-row group walks its key blocks with O kept
  // in tiles 4.. across them (a tile store costs about a tile product here): S = Q K^T (tiles)
  // into s, the softmax into P, O rescaled only where a row's (lazy) max moved, O += P V.
  // With d_k <= 64 too (KC = dkp / 32 tiles), Q stays in tiles 2.. across the key blocks.
  // Wider d_v (NC = 0): O lives in o, and the steps (key block, 16-row group) run key block by
  // key block, so the groups of a query block reuse the block's K / V from L1. The tile unit and
  // the vector units do not overlap on this CPU (measured), so nothing is software-pipelined.
  // s: [16][Nb] floats, p: [16][Nb] bf16, o: [rp][dvp], per-row m / alpha / lsum. Keys
  // [jlo, kend); kt, vp start at key jlo. A group starts at the 32 keys holding its first
  // row's window start (P V reads whole 32-key chunks of V) and ends at its last row's limit.
  void key_loop_amx(int64_t b, int64_t i0, int rows, int64_t jlo, int64_t kend,
                    const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* vp,
                    float* s, p_t* p, float* o, float* m, float* alpha, float* lsum,
                    uint16_t* bits) {
    const int nc = dvp <= 64 ? int(dvp / 16) : 0;
    const int groups = (rows + 15) / 16;
    int g0 = 0;
    if (!nc)  // d_v > 64: groups two at a time (K / V from L2 once for both)
      for (; g0 + 1 < groups; g0 += 2) {
        const int r0 = g0 * 16, rgb = std::min(16, rows - r0 - 16);
        const int64_t ia = i0 + r0;
        const int64_t ja = std::max(jlo, P.key_start(ia) / 32 * 32);
        const int64_t jz = std::min(kend, P.key_limit(b, ia + 16 + rgb - 1));
        group_pair_runs(b, ia, rgb, ja, jz, jlo, kend, mrow0, q + r0 * dkp, kt, vp, s,
                        o + r0 * dvp, m + r0, alpha + r0, lsum + r0 * kLanes, bits);
      }
    const int left = groups - g0;  // NC > 0: every group; else the one left over, if any
    const int64_t blocks = nc ? 1 : (kend - jlo + Nb - 1) / Nb;
    for (int64_t t = 0; t < blocks * left; ++t) {  // NC = 0: (block, group); else (group)
      const int r0 = (g0 + int(t % left)) * 16, rg = std::min(16, rows - r0);
      const int64_t ia = i0 + r0;
      int64_t ja = std::max(jlo, P.key_start(ia) / 32 * 32);
      int64_t jz = std::min(kend, P.key_limit(b, ia + rg - 1));
      if (!nc) {  // the one key block of this step, clipped to what the group sees
        ja = std::max(ja, jlo + t / left * Nb);
        jz = std::min(jz, jlo + (t / left + 1) * Nb);
      }
      const int kc = nc && dkp <= 64 ? int(dkp / 32) : 0;  // Q tiles kept (d_k <= 64)
      switch (nc * 10 + kc) {
#define MHA_GROUP_LOOP(NC, KC) \
  case NC * 10 + KC: group_loop_amx<NC, KC>(b, ia, rg, ja, jz, jlo, kend, mrow0, q + r0 * dkp, kt, vp, s, p, o + r0 * dvp, m + r0, alpha + r0, lsum + r0 * kLanes, bits); break;
        MHA_GROUP_LOOP(0, 0) MHA_GROUP_LOOP(1, 0) MHA_GROUP_LOOP(2, 0) MHA_GROUP_LOOP(3, 0)
        MHA_GROUP_LOOP(4, 0) MHA_GROUP_LOOP(1, 1) MHA_GROUP_LOOP(2, 1) MHA_GROUP_LOOP(3, 1)
        MHA_GROUP_LOOP(4, 1) MHA_GROUP_LOOP(1, 2) MHA_GROUP_LOOP(2, 2) MHA_GROUP_LOOP(3, 2)
        MHA_GROUP_LOOP(4, 2)
#undef MHA_GROUP_LOOP
        default: TORCH_CHECK(false, "flash_attention: bad tile count");
      }
    }
  }

  // Keys [ja, jz) for the rg rows of one group starting at row ia (q, o, m, alpha, lsum
  // already offset to the group's first row); NC > 0: O in tiles from zero, stored to o at the
  // end; NC = 0: O in o.
  template <int NC, int KC>
  void group_loop_amx(int64_t b, int64_t ia, int rg, int64_t ja, int64_t jz, int64_t jlo,
                      int64_t kend, const bool* mrow0, const packed_t* q, const packed_t* kt,
                      const packed_t* vp, float* s, p_t* p, float* o, float* m, float* alpha,
                      float* lsum, uint16_t* bits) {
    if constexpr (NC > 0) K::template o_tiles_zero<NC>();
    if constexpr (KC > 0) K::template q_tiles_load<KC>(q, dkp);
    bool o_zero = NC > 0;  // O tiles still zero: nothing to rescale (O in o: scaled anyway)
    if constexpr (!Parts::kTiles) std::fill(s, s + 16 * Nb, 0.f);  // finite scores
    for (int64_t j0 = ja; j0 < jz; j0 = (j0 / Nb + 1) * Nb) {
      const int jn = int(std::min((j0 / Nb + 1) * Nb, kend) - j0);
      const int nv = (jn + kLanes - 1) / kLanes;
      const packed_t* ktb = kt + ((j0 - jlo) / Nb) * dkp * Nb + (j0 % Nb) * 2;
      if constexpr (!Parts::kTiles) {
      } else if constexpr (KC > 0) {
        K::template qk_group_qres<KC>(ktb, Nb, nv, s, Nb);
      } else {
        K::qk_group(q, dkp, ktb, Nb, nv, s, Nb);
      }
      softmax_step(b, ia, rg, j0, nv, mrow0, s, p, m, alpha, lsum, bits);
      if (!o_zero && moved(alpha, rg)) {  // rare with the lazy max: scale the rows whose max moved
        if constexpr (NC > 0) K::template o_tiles<NC, true>(o, dvp);
        scale_o_rows(o, rg, alpha, dvp);
        if constexpr (NC > 0) K::template o_tiles<NC, false>(o, dvp);
      }
      const packed_t* vb = vp + (j0 - jlo) * dvp;
      if constexpr (!Parts::kTiles) {
      } else if constexpr (NC > 0) {
        K::template pv_group<NC>(p, Nb, vb, dvp, (jn + 31) / 32);
      } else {
        K::pv_block(p, Nb, vb, dvp, (jn + 31) / 32, o);
      }
      o_zero = false;
    }
    if constexpr (NC > 0) K::template o_tiles<NC, true>(o, dvp);
  }

  static constexpr int kRunBlocks = 4;  // key blocks per run (group_pair_runs)

  // Two groups, A (16 rows from ia) and B (rgb rows from ia + 16), over keys [ja, jz) (the
  // union of theirs; the softmax masks what a row does not see) in runs of kRunBlocks: phase
  // A computes both groups' S with each K tile loaded once (qk_pair) and their softmax into
  // P; phase B walks the run once per 32 columns of O, both groups' O in tiles 4-7 and each
  // V tile used by both (pv_pair). K and V stream from L2 once per two groups; O passes through
  // memory once per run and 32 columns. q, o, m, alpha, lsum: from A's first row; s: 32 rows.
  void group_pair_runs(int64_t b, int64_t ia, int rgb, int64_t ja, int64_t jz, int64_t jlo,
                       int64_t kend, const bool* mrow0, const packed_t* q, const packed_t* kt,
                       const packed_t* vp, float* s, float* o, float* m, float* alpha,
                       float* lsum, uint16_t* bits) {
    p_t* pr = sc.prun.get(kRunBlocks * 32 * Nb);  // P: [block][group][16][Nb]
    float* ar = sc.arun.get(kRunBlocks * 32);     // alpha: [block][group][16]
    int64_t jrun[kRunBlocks];
    int jnrun[kRunBlocks];
    if (rgb < 16)  // P rows past group B's last stay zero (finite) in P V
      for (int i = 0; i < kRunBlocks; ++i)
        std::fill(pr + (i * 32 + 16 + rgb) * Nb, pr + (i + 1) * 32 * Nb, p_t(0));
    if constexpr (!Parts::kTiles) std::fill(s, s + 32 * Nb, 0.f);  // finite scores
    bool first = true;  // o is still zero
    for (int64_t j0 = ja; j0 < jz; first = false) {
      int nb = 0;
      for (; nb < kRunBlocks && j0 < jz; ++nb, j0 = (j0 / Nb + 1) * Nb) {
        const int jn = int(std::min((j0 / Nb + 1) * Nb, kend) - j0);
        const int nv = (jn + kLanes - 1) / kLanes;
        const packed_t* ktb = kt + ((j0 - jlo) / Nb) * dkp * Nb + (j0 % Nb) * 2;
        if constexpr (Parts::kTiles) K::qk_pair(q, dkp, ktb, Nb, nv, s, s + 16 * Nb, Nb);
        p_t* pa = pr + nb * 32 * Nb;
        softmax_step(b, ia, 16, j0, nv, mrow0, s, pa, m, alpha, lsum, bits);
        softmax_step(b, ia + 16, rgb, j0, nv, mrow0, s + 16 * Nb, pa + 16 * Nb, m + 16,
                     alpha + 16, lsum + 16 * kLanes, bits);
        std::copy(alpha, alpha + 16 + rgb, ar + nb * 32);
        jrun[nb] = j0;
        jnrun[nb] = jn;
      }
      for (int c0 = 0; c0 < dvp / 16; c0 += 2) {
        if (c0 + 1 < dvp / 16)
          pv_pair_run<2>(nb, pr, ar, jrun, jnrun, rgb, jlo, vp + c0 * 32, o + c0 * 16, first);
        else
          pv_pair_run<1>(nb, pr, ar, jrun, jnrun, rgb, jlo, vp + c0 * 32, o + c0 * 16, first);
      }
    }
  }
  // Phase B of group_pair_runs for NC2 tiles of O per group (o, v offset to their first column).
  template <int NC2>
  void pv_pair_run(int nb, const p_t* pr, const float* ar, const int64_t* jrun,
                   const int* jnrun, int rgb, int64_t jlo, const packed_t* vp, float* o,
                   bool o_zero) {
    float* ob = o + 16 * dvp;
    K::template o_pair<NC2, false>(o, ob, dvp);
    for (int i = 0; i < nb; ++i) {
      const float* a = ar + i * 32;
      if (!o_zero && (moved(a, 16) || moved(a + 16, rgb))) {
        K::template o_pair<NC2, true>(o, ob, dvp);
        scale_o_rows(o, 16, a, NC2 * 16);
        scale_o_rows(ob, rgb, a + 16, NC2 * 16);
        K::template o_pair<NC2, false>(o, ob, dvp);
      }
      if constexpr (Parts::kTiles)
        K::template pv_pair<NC2>(pr + i * 32 * Nb, pr + (i * 32 + 16) * Nb, Nb,
                                 vp + (jrun[i] - jlo) * dvp, dvp, (jnrun[i] + 31) / 32);
      o_zero = false;
    }
    K::template o_pair<NC2, true>(o, ob, dvp);
  }

  // The softmax of one group's key block (nv 16-key vectors) into p, P's odd 16-key tail zeroed
  // (P V takes 32-key chunks).
  void softmax_step(int64_t b, int64_t ia, int rg, int64_t j0, int nv, const bool* mrow0,
                    const float* s, p_t* p, float* m, float* alpha, float* lsum,
                    uint16_t* bits) const {
    if constexpr (!Parts::kSoftmax) return std::fill(alpha, alpha + rg, 1.f);
    switch (nv) {
#define MHA_KEY_STEP(NV) \
  case NV: softmax_group<NV>(b, ia, rg, j0, mrow0, s, p, m, alpha, lsum, bits); break;
      MHA_KEY_STEP(1) MHA_KEY_STEP(2) MHA_KEY_STEP(3) MHA_KEY_STEP(4)
      MHA_KEY_STEP(5) MHA_KEY_STEP(6) MHA_KEY_STEP(7) MHA_KEY_STEP(8)
#undef MHA_KEY_STEP
      default: TORCH_CHECK(false, "flash_attention: bad key block width");
    }
    if (nv % 2)
      for (int r = 0; r < rg; ++r)
        std::fill(p + r * Nb + nv * kLanes, p + r * Nb + (nv + 1) * kLanes, p_t(0));
  }

  static bool moved(const float* alpha, int rg) {
    bool any = false;
    for (int r = 0; r < rg; ++r) any |= alpha[r] != 1.f;
    return any;
  }
  // Rows r < rg of o (row stride dvp, the first cols columns) times alpha[r], where != 1.
  void scale_o_rows(float* o, int rg, const float* alpha, int64_t cols) const {
    for (int r = 0; r < rg; ++r) {
      if (alpha[r] == 1.f) continue;
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int64_t c = 0; c < cols; c += kLanes)
        _mm512_storeu_ps(o + r * dvp + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * dvp + c), a));
    }
  }
#endif

  // The softmax of rows [ia, ia + rg) (a query block, or one AMX group) for the key block at
  // j0 (NV vectors): scores st (rows of Nb), P into p (rows of Nb); m, alpha, lsum of the rows.
  template <int NV>
  void softmax_group(int64_t b, int64_t ia, int rg, int64_t j0, const bool* mrow0,
                     const float* st, p_t* p, float* m, float* alpha, float* lsum,
                     uint16_t* bits) const {
    constexpr int W = NV * kLanes;
    // some row's window starts inside this block (rows further down start further right)
    const bool left = j0 < P.key_start(ia + rg - 1);
    const bool unmasked = mrow0 == nullptr && !left && j0 + W <= P.key_limit(b, ia);
    const float c = P.scale * kLog2e;
    constexpr int RS = NV <= 4 ? 4 : 2;  // rows per softmax call (x[RS][NV] in registers)
    for (int r0 = 0; r0 < rg; r0 += RS) {
      const int rs = std::min(RS, rg - r0);
      int nvalid[RS];
      for (int r = r0; r < r0 + rs; ++r) {
        nvalid[r - r0] = unmasked ? W : int(std::clamp<int64_t>(P.key_limit(b, ia + r) - j0, 0, W));
        uint16_t* br = bits + r * kMaxVecsPerBlock;
        if (mrow0) mask_bits(mrow0 + (ia + r) * P.ms[2], P.ms[3], j0, P.Tk, NV, br);
        else if (left) std::fill(br, br + NV, uint16_t(0xFFFF));
        if (left) clear_left_of(P.key_start(ia + r) - j0, NV, br);
      }
      const uint16_t* rb = (mrow0 || left) ? bits + r0 * kMaxVecsPerBlock : nullptr;
      if (rs == RS)
        softmax<NV, RS>(unmasked, st + r0 * Nb, nvalid, rb, c, m + r0, lsum + r0 * kLanes,
                        alpha + r0, p + r0 * Nb);
      else
        for (int r = 0; r < rs; ++r)
          softmax<NV, 1>(unmasked, st + (r0 + r) * Nb, nvalid + r,
                         rb ? rb + r * kMaxVecsPerBlock : nullptr, c, m + r0 + r,
                         lsum + (r0 + r) * kLanes, alpha + r0 + r, p + (r0 + r) * Nb);
    }
  }

  template <int NV>
  void key_block(int64_t b, int64_t i0, int rows, int64_t j0, int jn,
                 const bool* mrow0, const packed_t* q, const packed_t* kt, const packed_t* v,
                 float* s, p_t* p, float* o, float* m, float* alpha, float* lsum,
                 uint16_t* bits, bool exact) {
    for (int c0 = 0; c0 < NV; c0 += 4) {  // S = Q K^T in column chunks of <= 64 keys
      const packed_t* kc = kt + c0 * kLanes * (K::kPairs ? 2 : 1);
      float* sc = s + c0 * kLanes;
      switch (std::min(4, NV - c0)) {
        case 1: for_row_tiles<rows_for(1)>(rows, QkTile<K, 1>{q, kc, dkp, Nb, int(dkp), sc, Nb}); break;
        case 2: for_row_tiles<rows_for(2)>(rows, QkTile<K, 2>{q, kc, dkp, Nb, int(dkp), sc, Nb}); break;
        case 3: for_row_tiles<rows_for(3)>(rows, QkTile<K, 3>{q, kc, dkp, Nb, int(dkp), sc, Nb}); break;
        default: for_row_tiles<rows_for(4)>(rows, QkTile<K, 4>{q, kc, dkp, Nb, int(dkp), sc, Nb}); break;
      }
    }
    softmax_group<NV>(b, i0, rows, j0, mrow0, s, p, m, alpha, lsum, bits);
    // exact pass: the tiles where every row sees every key of the block, else pv_exact
    if (exact && !(mrow0 == nullptr && j0 >= P.key_start(i0 + rows - 1) &&
                   j0 + jn <= P.key_limit(b, i0)))
      return pv_exact(b, i0, rows, j0, jn, mrow0, p, v, o, alpha);
    const int nvt = int(dvp / kLanes);
    for (int c0 = 0; c0 < nvt; c0 += 4) {
      const packed_t* vc = v + c0 * kLanes * (K::kPairs ? 2 : 1);
      float* oc = o + c0 * kLanes;
      switch (std::min(4, nvt - c0)) {
        case 1: for_row_tiles<rows_for(1)>(rows, PvTile<K, 1>{p, Nb, vc, dvp, jn, oc, dvp, alpha}); break;
        case 2: for_row_tiles<rows_for(2)>(rows, PvTile<K, 2>{p, Nb, vc, dvp, jn, oc, dvp, alpha}); break;
        case 3: for_row_tiles<rows_for(3)>(rows, PvTile<K, 3>{p, Nb, vc, dvp, jn, oc, dvp, alpha}); break;
        default: for_row_tiles<rows_for(4)>(rows, PvTile<K, 4>{p, Nb, vc, dvp, jn, oc, dvp, alpha}); break;
      }
    }
  }
};

// Items: (b, K/V head, query-row range). Enough items to keep every thread busy, but each
// large enough that packing its head's K/V is amortized over >= ~256 query rows.
template <typename T>
std::vector<Item> make_items(const Problem<T>& P, int nthreads) {
  const int64_t heads = P.B * P.hkv, g = P.h / P.hkv;
  const int64_t max_chunks = (P.Tq + kRowsPerBlock - 1) / kRowsPerBlock;
  int64_t chunks = (4 * nthreads + heads - 1) / heads;
  chunks = std::min({chunks, max_chunks, std::max<int64_t>(1, P.Tq * g / 256)});
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows = round_up((P.Tq + chunks - 1) / chunks, kRowsPerBlock);
  std::vector<Item> items;
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t kh = 0; kh < P.hkv; ++kh)
      for (int64_t i0 = 0; i0 < P.Tq; i0 += rows) {
        const int64_t i1 = std::min(P.Tq, i0 + rows);
        auto seen = [&](int64_t i) {  // keys row i may see (before the bool mask)
          return double(std::max<int64_t>(0, P.key_limit(b, i) - P.key_start(i)));
        };
        const double keys = 0.5 * (seen(i0) + seen(i1 - 1));
        items.push_back({b, kh, i0, i1, double(i1 - i0) * (keys + 16.0)});
      }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& c) { return a.cost > c.cost; });
  return items;
}

template <class K, class Parts = AllParts, typename T>
void run_forward(const Problem<T>& P) {
  const int nth = std::max(1, at::get_num_threads());
  const std::vector<Item> items = make_items(P, nth);
  const double flops = 4.0 * double(P.B * P.h) * double(P.Tq) * double(P.Tk) * double(P.dk);
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
    scratch.trim();
#if defined(MHA_FLASH_AMX)
    if constexpr (K::kAmx) K::release();
#endif
  });
}

}  // namespace
}  // namespace mha_flash
#include "flash/flash_small.h"  // the small-problem path (short keys); uses the definitions above
namespace mha_flash {
namespace {

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
#if defined(MHA_FLASH_AMX)
  isa += ",amx";
#endif
  return isa;
}


// bf16 inputs: vdpbf16ps tiles where the dot-product unit is fast (AMD Zen 4/5: twice the
// fp32 FMA rate); elsewhere (Intel cores run vdpbf16ps at half the fp32 FMA FLOP rate, measured)
// bf16 is widened to fp32 when packed and runs the fp32 tiles. MHA_FLASH_BF16=avx512bf16 |
// avx512f | portable overrides. Fixed per process, so results stay deterministic.
const std::string& default_kernel(at::ScalarType dtype) {
  static const std::string f32 =
#if defined(__AVX512F__)
      "avx512f";
#else
      "portable";
#endif
  static const std::string bf16 = [] {
    if (const auto& env = mha_common::flash_bf16_override()) return *env;
#if defined(MHA_FLASH_AMX)
    if (amx_permitted()) return std::string("amx");
#endif
#if defined(MHA_FLASH_BF16_TILES)
    if (mha_common::bf16_dot_is_fast()) return std::string("avx512bf16");
#endif
    return f32;
  }();
  return dtype == at::kBFloat16 ? bf16 : f32;
}

// The kernels chosen for float32 and bfloat16 inputs.
std::vector<std::string> flash_attention_kernels() {
  return {default_kernel(at::kFloat), default_kernel(at::kBFloat16)};
}

template <class Parts = AllParts>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v,
                                                const std::optional<at::Tensor>& key_lengths,
                                                const std::optional<at::Tensor>& mask,
                                                bool causal, double scale,
                                                const std::string& kernel, int64_t window) {
  const mha_ops::QkvDims dims = mha_ops::check_qkv(q, k, v, "flash_attention");
  const int64_t B = dims.B, h = dims.h, Tq = dims.Tq, dk = dims.dk;
  const int64_t hkv = dims.hkv, Tk = dims.Tk, dv = dims.dv;
  TORCH_CHECK(dk >= 1 && dv >= 1, "flash_attention: head dims must be >= 1");
  at::Tensor out = at::empty({B, Tq, h, dv}, q.options()).permute({0, 2, 1, 3});
  at::Tensor lse = at::empty({B, h, Tq}, q.options().dtype(at::kFloat));
  if (B == 0 || h == 0 || Tq == 0) return {out, lse};
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
    P.lse = lse.data_ptr<float>();
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
    const std::string& kn = kernel == "auto" ? default_kernel(q.scalar_type()) : kernel;
#if defined(MHA_FLASH_SMALL)
    if (kernel == "small" || (kernel == "auto" && small_path_applies(P, kn))) {
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
      if (kn == "amx") {
        TORCH_CHECK(amx_permitted(), "flash_attention: the OS does not grant AMX to this process");
        return run_forward<AmxBf16, Parts>(P);
      }
#endif
    TORCH_CHECK(false, "flash_attention: kernel '", kn, "' is not available for ", q.scalar_type(),
                " in this build (", flash_attention_isa(), ")");
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> flash_attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& mask,
    bool causal, double scale, int64_t window) {
  return forward_impl(q, k, v, key_lengths, mask, causal, scale, "auto", window);
}

// The forward with a named kernel ("auto", "portable", "avx512f", "avx512bf16", "amx", or
// "small": the small-problem path of flash_small.h), for tests.
std::tuple<at::Tensor, at::Tensor> flash_attention_fwd_kernel(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_lengths, const std::optional<at::Tensor>& mask,
    bool causal, double scale, std::string kernel, int64_t window) {
  return forward_impl(q, k, v, key_lengths, mask, causal, scale, kernel, window);
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
        "bool causal, float scale, int window=0) -> (Tensor, Tensor)");
  m.def("_flash_attention_fwd_kernel(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, "
        "Tensor? mask, bool causal, float scale, str kernel, int window=0) -> (Tensor, Tensor)");
  m.def("_flash_exp2(Tensor x) -> Tensor");
  m.def("_flash_exp2_ftz(Tensor x) -> Tensor");
  m.def("flash_attention_isa() -> str", &mha_flash::flash_attention_isa);
  m.def("flash_attention_kernels() -> str[]", &mha_flash::flash_attention_kernels);
}

TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("flash_attention_fwd", &mha_flash::flash_attention_fwd);
  m.impl("_flash_attention_fwd_kernel", &mha_flash::flash_attention_fwd_kernel);
  m.impl("_flash_exp2", &mha_flash::flash_exp2);
  m.impl("_flash_exp2_ftz", &mha_flash::flash_exp2_ftz);
}
