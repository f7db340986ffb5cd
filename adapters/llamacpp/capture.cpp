// Capture of llama.cpp graph nodes from its eval callback (see capture.hpp).
#include "capture.hpp"

#include <algorithm>
#include <cstring>
#include <exception>

#include <ggml-backend.h>

namespace diffrun::llamacpp {

namespace {

// Value of element (i0, i1, i2, i3) of a f32/f16/bf16/i32 tensor whose bytes (from offset 0) are `raw`. An i32 node
// (ffn_moe_topk: expert ids) is stored as floats, exact below 2^24, with native dtype f32 as the reference records
// its ids (the format keeps i32 for `tokens`).
float element(const ggml_tensor* t, const uint8_t* raw, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  const uint8_t* p = raw + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
  switch (t->type) {
    case GGML_TYPE_F32: {
      float v;
      std::memcpy(&v, p, sizeof v);
      return v;
    }
    case GGML_TYPE_F16: {
      ggml_fp16_t v;
      std::memcpy(&v, p, sizeof v);
      return ggml_fp16_to_fp32(v);
    }
    case GGML_TYPE_BF16: {
      ggml_bf16_t v;
      std::memcpy(&v, p, sizeof v);
      return ggml_bf16_to_fp32(v);
    }
    case GGML_TYPE_I32: {
      int32_t v;
      std::memcpy(&v, p, sizeof v);
      return static_cast<float>(v);
    }
    default: return 0.0f;  // unreachable: take() only gathers the three float types and i32
  }
}

const char* native_name(ggml_type type) {
  switch (type) {
    case GGML_TYPE_F16: return "f16";
    case GGML_TYPE_BF16: return "bf16";
    default: return "f32";
  }
}

}  // namespace

bool Capture::eval_callback(ggml_tensor* t, bool ask, void* user_data) {
  auto* self = static_cast<Capture*>(user_data);
  if (ask) return true;  // observe every node: the scheduler then hands each one over after computing it
  if (self->failed_) return false;
  try {
    self->take(t);
  } catch (...) {
    // Returning false stops the graph; llama_decode fails and the caller rethrows this error.
    self->error_ = std::current_exception();
    self->failed_ = true;
    return false;
  }
  return true;
}

void Capture::rethrow_if_failed() {
  if (failed_) std::rethrow_exception(error_);
}

void Capture::take(const ggml_tensor* t) {
  const char* raw_name = ggml_get_name(t);
  if (!raw_name || !*raw_name) {
    ++skipped_[std::string("(unnamed ") + ggml_op_desc(t) + ")"];
    return;
  }
  std::string base(raw_name);
  // HDF5 reserves '/' as the path separator.
  std::replace(base.begin(), base.end(), '/', '_');
  if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_BF16 && t->type != GGML_TYPE_I32) {
    ++skipped_[base + " (" + ggml_type_name(t->type) + ")"];
    return;
  }
  const int k = ++seen_[base];
  CapturedNode node;
  node.name = k == 1 ? base : base + "#" + std::to_string(k);
  node.native = native_name(t->type);

  // Rank: ggml's own (trailing ne == 1 dropped), but never below the rank this name had when first
  // stored, so a [T, H, Dh] node stays 3-D at a decode step where T = 1.
  size_t rank = static_cast<size_t>(ggml_n_dims(t));
  auto [it, fresh] = rank_.emplace(node.name, rank);
  if (!fresh) rank = it->second = std::max(it->second, rank);
  for (size_t d = rank; d-- > 0;) node.shape.push_back(t->ne[d]);

  // ggml_nbytes spans every element through the strides, so one copy covers a non-contiguous view.
  std::vector<uint8_t> raw(ggml_nbytes(t));
  ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
  node.values.resize(static_cast<size_t>(ggml_nelements(t)));
  size_t i = 0;
  for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
      for (int64_t i1 = 0; i1 < t->ne[1]; ++i1)
        for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) node.values[i++] = element(t, raw.data(), i0, i1, i2, i3);
  consume_(node);
  ++captured_;
}

}  // namespace diffrun::llamacpp
