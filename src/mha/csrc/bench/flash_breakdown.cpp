// The flash forward with parts of its AMX key loop left out, for benchmarks/probes/amx_breakdown.py
// only (never part of the package's extensions): the tile products (scores become 0) and / or
// the softmax (P is whatever the score buffer holds, alpha 1). Results are wrong by design;
// the op exists to be timed. It registers the forward's ops too (load it in its own process).
#include "flash/flash_attn.cpp"

namespace mha_flash {
namespace {

template <bool Tiles, bool Softmax>
struct SomeParts {
  static constexpr bool kTiles = Tiles, kSoftmax = Softmax;
};

// The AMX forward (bf16 q, k, v) with only the named parts of the key loop.
std::tuple<at::Tensor, at::Tensor> flash_breakdown_fwd(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v, double scale,
                                                       bool tiles, bool softmax) {
  const std::optional<at::Tensor> none;
  auto run = [&](auto parts) {
    return forward_impl<decltype(parts)>(q, k, v, none, none, false, scale, "amx", 0);
  };
  if (tiles && softmax) return run(AllParts{});
  if (tiles) return run(SomeParts<true, false>{});
  if (softmax) return run(SomeParts<false, true>{});
  return run(SomeParts<false, false>{});
}

}  // namespace
}  // namespace mha_flash

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("_flash_breakdown_fwd(Tensor q, Tensor k, Tensor v, float scale, bool tiles, "
        "bool softmax) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mha, CPU, m) { m.impl("_flash_breakdown_fwd", &mha_flash::flash_breakdown_fwd); }
