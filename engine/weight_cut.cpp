#include "engine/weight_cut.hpp"

#include <cstring>

namespace diffrun::engine {

Cut cut_of(TensorRole role, const ModelConfig& cfg, const WeightCut* c) {
  using R = TensorRole;
  if (c == nullptr || c->slice.world <= 1) return {};
  const TpSlice& s = c->slice;
  const TpSlice& q = c->q_rows;
  const TpSlice& kv = c->kv_rows;
  const int64_t Dh = cfg.head_dim;
  switch (role) {
    case R::wq: return {q.h0 * Dh, q.h1 * Dh, 0, -1};
    case R::bq: return {0, -1, q.h0 * Dh, q.h1 * Dh};
    case R::wk: case R::wv: return {kv.kv0 * Dh, kv.kv1 * Dh, 0, -1};
    case R::bk: case R::bv: return {0, -1, kv.kv0 * Dh, kv.kv1 * Dh};
    case R::wo: return {0, -1, s.h0 * Dh, s.h1 * Dh};
    case R::w_gate: case R::w_up: return {s.f0, s.f1, 0, -1};
    case R::w_down: return {0, -1, s.f0, s.f1};
    default: return {};
  }
}

std::span<const std::byte> cut_bytes(const GgufFile& file, const TensorInfo& t, const Cut& cut,
                                     std::vector<std::byte>& gathered) {
  const int64_t bs = ggml_block_elements(t.type), bb = static_cast<int64_t>(ggml_block_bytes(t.type));
  const int64_t file_cols = t.ne.empty() ? 1 : t.ne[0];
  const int64_t row_bytes = file_cols / bs * bb;
  const int64_t piece = (cut.c1 - cut.c0) / bs * bb, skip = cut.c0 / bs * bb;
  const size_t bytes = static_cast<size_t>((cut.r1 - cut.r0) * piece);
  std::span<const std::byte> all = file.tensor_data(t);
  if (cut.c0 == 0 && cut.c1 == file_cols) return all.subspan(static_cast<size_t>(cut.r0 * row_bytes), bytes);
  gathered.resize(bytes);
  for (int64_t r = cut.r0; r < cut.r1; ++r)
    std::memcpy(gathered.data() + (r - cut.r0) * piece, all.data() + r * row_bytes + skip, static_cast<size_t>(piece));
  return gathered;
}

}  // namespace diffrun::engine
