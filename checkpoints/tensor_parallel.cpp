#include "checkpoints/tensor_parallel.hpp"

#include <algorithm>
#include <string>

#include "checkpoints/vocabulary.hpp"
#include "model/error.hpp"

namespace diffrun {

std::string tp_refusal(const ModelConfig& cfg, int world, int64_t f_unit) {
  const std::string n = std::to_string(world);
  if (world < 1) return "the tensor-parallel world size must be at least 1, not " + n;
  if (world == 1) return "";
  if (cfg.moe) return "mixtures of experts are not split over ranks (expert parallelism is not built)";
  if (cfg.n_head % world != 0)
    return "the model's " + std::to_string(cfg.n_head) + " attention heads do not split evenly over " + n + " ranks";
  if (cfg.n_head_kv % world != 0 && world % cfg.n_head_kv != 0)
    return "the model's " + std::to_string(cfg.n_head_kv) + " KV heads neither split evenly over " + n +
           " ranks nor copy evenly onto them";
  if (f_unit < 1 || cfg.n_ff % f_unit != 0)
    return "the FFN width " + std::to_string(cfg.n_ff) + " is not a multiple of the down projection's block of " +
           std::to_string(f_unit) + " channels";
  if (cfg.n_ff / f_unit < world)
    return "the FFN width " + std::to_string(cfg.n_ff) + " holds " + std::to_string(cfg.n_ff / f_unit) +
           " blocks of " + std::to_string(f_unit) + " channels, fewer than the " + n + " ranks";
  return "";
}

TpSlice tp_slice(const ModelConfig& cfg, int rank, int world, int64_t f_unit) {
  TpSlice s;
  s.rank = rank;
  s.world = world;
  const int h = cfg.n_head / world;
  s.h0 = rank * h;
  s.h1 = s.h0 + h;
  if (cfg.n_head_kv >= world) {
    const int kv = cfg.n_head_kv / world;
    s.kv0 = rank * kv;
    s.kv1 = s.kv0 + kv;
  } else {  // one KV head, copied on world / Hkv ranks
    s.kv0 = rank * cfg.n_head_kv / world;
    s.kv1 = s.kv0 + 1;
  }
  const int64_t units = cfg.n_ff / f_unit;
  s.f0 = units * rank / world * f_unit;
  s.f1 = units * (rank + 1) / world * f_unit;
  return s;
}

ModelConfig tp_local_config(const ModelConfig& cfg, const TpSlice& s) {
  ModelConfig local = cfg;
  local.n_head = s.h1 - s.h0;
  local.n_head_kv = s.kv1 - s.kv0;
  local.n_ff = static_cast<int>(s.f1 - s.f0);
  return local;
}

ShardSpec megatron_shard(std::string_view name, const TpSlice& s) {
  ShardSpec spec;
  if (s.world <= 1) return spec;
  const std::string base = parse_checkpoint_name(name).base;
  if (base == "attn_out" || base == "ffn_out") {
    spec.partial = true;
    return spec;
  }
  const CheckpointKind* kind = find_checkpoint_kind(base);
  if (kind == nullptr) return spec;
  for (const std::string& letter : layout_dims(kind->layout)) {
    if (letter == "H") {
      spec = {"H", s.h0, s.h1 - s.h0, false};
    } else if (letter == "Hkv") {
      spec = {"Hkv", s.kv0, s.kv1 - s.kv0, false};
    } else if (letter == "F") {
      spec = {"F", s.f0, s.f1 - s.f0, false};
    } else {
      continue;
    }
    break;
  }
  return spec;
}

void place_shard(std::span<float> whole, std::span<const int64_t> whole_shape, int dim, int64_t offset,
                 std::span<const float> piece) {
  if (dim < 0 || static_cast<size_t>(dim) >= whole_shape.size()) throw Error("place_shard: no dimension " + std::to_string(dim));
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; ++i) outer *= whole_shape[static_cast<size_t>(i)];
  for (size_t i = static_cast<size_t>(dim) + 1; i < whole_shape.size(); ++i) inner *= whole_shape[i];
  const int64_t full = whole_shape[static_cast<size_t>(dim)];
  if (outer * inner == 0) return;
  const int64_t extent = static_cast<int64_t>(piece.size()) / (outer * inner);
  if (extent * outer * inner != static_cast<int64_t>(piece.size()) || offset < 0 || offset + extent > full ||
      static_cast<int64_t>(whole.size()) != outer * full * inner)
    throw Error("place_shard: a piece of " + std::to_string(piece.size()) + " values at offset " +
                std::to_string(offset) + " does not fit dimension " + std::to_string(dim) + " of " +
                std::to_string(full));
  for (int64_t o = 0; o < outer; ++o)
    std::copy_n(piece.begin() + o * extent * inner, extent * inner, whole.begin() + (o * full + offset) * inner);
}

std::vector<float> take_slice(std::span<const float> v, std::span<const int64_t> shape, int dim, int64_t from,
                              int64_t to) {
  if (dim < 0 || static_cast<size_t>(dim) >= shape.size()) throw Error("take_slice: no dimension " + std::to_string(dim));
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; ++i) outer *= shape[static_cast<size_t>(i)];
  for (size_t i = static_cast<size_t>(dim) + 1; i < shape.size(); ++i) inner *= shape[i];
  const int64_t full = shape[static_cast<size_t>(dim)], n = to - from;
  if (from < 0 || n < 0 || to > full || static_cast<int64_t>(v.size()) != outer * full * inner)
    throw Error("take_slice: elements " + std::to_string(from) + ".." + std::to_string(to) + " of dimension " +
                std::to_string(dim) + " of " + std::to_string(full) + " (" + std::to_string(v.size()) + " values)");
  std::vector<float> out(static_cast<size_t>(outer * n * inner));
  for (int64_t o = 0; o < outer; ++o)
    std::copy_n(v.begin() + (o * full + from) * inner, n * inner, out.begin() + o * n * inner);
  return out;
}

std::vector<float> add_partials(const std::vector<std::span<const float>>& ranks) {
  if (ranks.empty()) return {};
  const size_t n = ranks.front().size();
  for (const auto& r : ranks)
    if (r.size() != n) throw Error("add_partials: the ranks' partial sums differ in size");
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    double sum = 0;
    for (const auto& r : ranks) sum += r[i];
    out[i] = static_cast<float>(sum);
  }
  return out;
}

}  // namespace diffrun
