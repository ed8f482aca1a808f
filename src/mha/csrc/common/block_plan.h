// A block plan as the flash kernels read it (mha.blockplan builds it from a mask_mod): for each
// query block of kPlanRows rows and key block of kPlanKeys keys, one int32 entry
//   kPlanEmpty  no pair may attend: the block is never read
//   kPlanFull   every pair may attend: computed with no mask
//   e >= 0      partial: bits[e] (kPlanRows, kPlanKeys) bool holds the mask_mod's value of each
//               pair (True = may attend; False past Tq / Tk)
// in a table index (B_p, h_p, n_q, n_k) with B_p, h_p 1 where the mask ignores b / h (stride 0).
//
// Why a dense entry table and not the plan's CSR rows: the forward walks a query block's key
// blocks, the backward a key block's query blocks; one table serves both orders, at one int32 per
// (48 x 128)-pair block (T = 16k: 45 KB, 1/6144 of a bool mask). Why 48 x 128: the forward's query
// block is 8 register tiles of 6 rows (kRowsPerBlock = 48) and its key block is at most 128 keys
// (kMaxKeysPerBlock), so a plan block is exactly a kernel block; the backward walks plan query
// blocks of 48 rows against its 64-key blocks (half a plan block each).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "common/tensor_access.h"

namespace mha_common {

constexpr int64_t kPlanRows = 48;
constexpr int64_t kPlanKeys = 128;
constexpr int32_t kPlanEmpty = -2;
constexpr int32_t kPlanFull = -1;

struct PlanView {
  const int32_t* index = nullptr;  // null: no plan
  int64_t s[3] = {0, 0, 0};        // strides of b, h, query block (0 on broadcast dims)
  const bool* bits = nullptr;      // (n_partial, kPlanRows, kPlanKeys)

  bool on() const { return index != nullptr; }
  // The n_k entries of query block qb of batch b, query head hq.
  const int32_t* row(int64_t b, int64_t hq, int64_t qb) const {
    return index + b * s[0] + hq * s[1] + qb * s[2];
  }
  // The bits of partial entry e: row r of the block at r * kPlanKeys.
  const bool* block_bits(int32_t e) const { return bits + int64_t(e) * kPlanRows * kPlanKeys; }
};

// The plan of one call from the op's optional arguments (built by mha.blockplan for these sizes;
// checked here because the kernels index memory with it).
inline PlanView make_plan_view(const std::optional<at::Tensor>& index,
                               const std::optional<at::Tensor>& bits, int64_t B, int64_t h,
                               int64_t Tq, int64_t Tk, const char* op) {
  PlanView p;
  TORCH_CHECK(index.has_value() == bits.has_value(), op,
              ": plan and plan_bits come together (both or neither)");
  if (!index.has_value()) return p;
  const int64_t nq = (Tq + kPlanRows - 1) / kPlanRows, nk = (Tk + kPlanKeys - 1) / kPlanKeys;
  TORCH_CHECK(index->scalar_type() == at::kInt && index->dim() == 4 &&
                  (index->size(0) == 1 || index->size(0) == B) &&
                  (index->size(1) == 1 || index->size(1) == h) && index->size(2) == nq &&
                  index->size(3) == nk && index->stride(3) == 1,
              op, ": plan must be int32 (1|B, 1|h, ceil(Tq/", kPlanRows, "), ceil(Tk/", kPlanKeys,
              ")) = (1|", B, ", 1|", h, ", ", nq, ", ", nk, ") with unit key stride, got ",
              index->sizes());
  TORCH_CHECK(bits->scalar_type() == at::kBool && bits->dim() == 3 &&
                  bits->size(1) == kPlanRows && bits->size(2) == kPlanKeys && bits->is_contiguous(),
              op, ": plan_bits must be a contiguous bool (n_partial, ", kPlanRows, ", ", kPlanKeys,
              "), got ", bits->sizes());
  const at::Tensor ic = index->contiguous();
  const int32_t* e = ic.data_ptr<int32_t>();
  const int64_t n = bits->size(0);
  for (int64_t x = 0; x < ic.numel(); ++x)
    TORCH_CHECK(e[x] >= kPlanEmpty && e[x] < n, op, ": plan entry ", e[x],
                " is neither empty (-2), full (-1) nor a partial block < ", n);
  p.index = index->data_ptr<int32_t>();
  fill_strides(*index, p.s, 3, true);
  p.bits = bits->data_ptr<bool>();
  return p;
}

}  // namespace mha_common
