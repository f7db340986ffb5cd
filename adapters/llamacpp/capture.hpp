// Capture of llama.cpp graph nodes from its eval callback: raw names ("#k" for repeats), shape reversed(ne), values as float.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ggml.h>

namespace diffrun::llamacpp {

// One graph node as the raw dump stores it.
struct CapturedNode {
  std::string name;             // ggml name, "#k" appended for the k-th repeat within the step (k >= 2)
  std::vector<int64_t> shape;   // reversed(ne): row-major, ggml's ne[0] last (fastest)
  const char* native = "f32";   // what llama.cpp computed it in: "f32", "f16", "bf16"
  std::vector<float> values;    // contiguous, row-major in `shape`
};

// The eval callback's state for one step at a time. Every named node the scheduler computes is
// asked for (ask = true returns true) and then handed over as a CapturedNode: non-contiguous views
// are gathered through their strides, f16/bf16 are widened to float32 (exact). Nodes of other types
// (quantized, integer) are counted in `skipped` and not captured.
class Capture {
 public:
  using Consumer = std::function<void(const CapturedNode&)>;
  explicit Capture(Consumer consume) : consume_(std::move(consume)) {}

  // Starts a step: the repeat counters restart, so "#k" counts within one step.
  void begin_step() { seen_.clear(); }

  // Nodes captured and skipped since construction.
  int64_t captured() const { return captured_; }
  const std::map<std::string, int64_t>& skipped() const { return skipped_; }  // "name (type)" -> count

  // After llama_decode: rethrows an error raised while capturing (the callback stopped the graph).
  void rethrow_if_failed();

  // Pass as llama_context_params::cb_eval with `this` as cb_eval_user_data.
  static bool eval_callback(ggml_tensor* t, bool ask, void* user_data);

 private:
  void take(const ggml_tensor* t);

  Consumer consume_;
  std::map<std::string, int> seen_;            // name -> repeats so far in this step
  std::map<std::string, size_t> rank_;         // name -> rank first stored (kept when a dim becomes 1)
  std::map<std::string, int64_t> skipped_;
  int64_t captured_ = 0;
  bool failed_ = false;
  std::exception_ptr error_;
};

}  // namespace diffrun::llamacpp
