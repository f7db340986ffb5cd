// Checkpoint recording for the reference: asks the sink first, converts f64 to float only when wanted.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "checkpoints/sink.hpp"
#include "checkpoints/vocabulary.hpp"

namespace diffrun::ref {

template <typename T>
class Recorder {
 public:
  Recorder(Sink& sink, int step) : sink_(sink), step_(step) {}

  bool wants(const char* base, int layer = -1) const { return sink_.wants(checkpoint_name(base, layer)); }

  // Records `data` (row-major, `shape` named by the vocabulary's layout of `base`) when the sink wants it,
  // then (isolation replay) overwrites it with the sink's replacement when there is one: the forward
  // pass continues from the replacement. A const tensor (one no later op reads) is never replaced.
  // stored_f16: the tensor holds f16-rounded values (emulated storage), recorded with native dtype f16.
  void operator()(const char* base, int layer, std::initializer_list<int64_t> shape, T* data, bool stored_f16 = false) {
    record(base, layer, shape, data, stored_f16);
    if (const float* r = sink_.replacement(step_, checkpoint_name(base, layer))) {
      std::copy(r, r + count(shape), data);
    }
  }
  void operator()(const char* base, int layer, std::initializer_list<int64_t> shape, const T* data) {
    record(base, layer, shape, data, false);
  }

  void ids(const char* base, std::span<const int32_t> ids) {
    if (sink_.wants(base)) sink_.record_ids(step_, base, ids);
  }

 private:
  static int64_t count(std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }

  void record(const char* base, int layer, std::initializer_list<int64_t> shape, const T* data, bool stored_f16) {
    const std::string name = checkpoint_name(base, layer);
    if (!sink_.wants(name)) return;
    const int64_t n = count(shape);
    const CheckpointKind* kind = find_checkpoint_kind(base);
    const char* layout = kind ? kind->layout : "";
    const std::span<const int64_t> dims(shape.begin(), shape.size());
    if constexpr (std::is_same_v<T, float>) {
      sink_.record(step_, name, layer, layout, dims, stored_f16 ? NativeDType::f16 : NativeDType::f32,
                   std::span<const float>(data, n));
    } else {
      const std::vector<float> narrowed(data, data + n);
      sink_.record(step_, name, layer, layout, dims, stored_f16 ? NativeDType::f16 : NativeDType::f64, narrowed);
    }
  }

  Sink& sink_;
  int step_;
};

}  // namespace diffrun::ref
