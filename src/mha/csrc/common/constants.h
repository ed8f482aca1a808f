// Constants and small arithmetic shared by every native kernel (flash forward and backward,
// decode, linear). Header-only, no dependencies.
#pragma once

#include <cstdint>
#include <limits>

namespace mha_common {

constexpr int kLanes = 16;  // fp32 lanes of one 512-bit vector
// Products per partial sum of an fp32 score (a dot product over d_k): a longer dot product is
// summed in blocks of this many, each block into fresh accumulators, the blocks' sums then
// added in order (docs/kernel.md, "Scores of d_k > 128"). d_k <= kDotBlock: one in-order sum.
constexpr int kDotBlock = 128;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
constexpr double kLog2eD = 1.4426950408889634, kLn2d = 0.6931471805599453;
constexpr float kInf = std::numeric_limits<float>::infinity(), kNegInf = -kInf;

// x rounded up to a multiple of m (x >= 0, m > 0).
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace mha_common
