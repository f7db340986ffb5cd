// Synthetic dumps for the diff tests: a tiny llama config, every checkpoint, deterministic values, hooks to perturb.
// Dims: T tokens of the step, S cached positions after it.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dump/dump.hpp"

namespace diffrun::test {

inline ModelConfig synthetic_config() {
  ModelConfig c;
  c.arch = Arch::llama;
  c.n_layer = 4;
  c.n_embd = 8;
  c.n_head = 2;
  c.n_head_kv = 1;
  c.head_dim = 4;
  c.n_ff = 12;
  c.n_vocab = 16;
  c.n_ctx = 64;
  return c;
}

inline DumpMeta synthetic_meta(const std::string& backend, const std::string& precision) {
  DumpMeta m;
  m.backend = backend;
  m.precision = precision;
  m.model_path = "synthetic.gguf";
  m.model_fingerprint = "size=1;fnv1a64=0000000000000001";
  m.config = synthetic_config();
  m.prompt = "a <synthetic> & \"quoted\" prompt";
  m.token_ids = {1, 5, 9};
  return m;
}

// The value both sides hold before any perturbation: smooth, in [-1, 1], never all zero.
inline float synthetic_value(int step, int order, size_t i) {
  return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + 0.11 * order + 1.3 * step) * 0.9 + 0.05);
}

struct SyntheticDump {
  DumpMeta meta = synthetic_meta("cpu", "f64");
  std::vector<int> step_tokens = {3, 1, 1};            // T per step
  std::vector<int32_t> fed = {1, 5, 9, 7, 2};          // prompt then the decode tokens
  std::vector<int32_t> argmax = {7, 2, 4};             // per step, each its logits' argmax; empty: no attribute
  // Changes the values of one checkpoint before it is written.
  std::function<void(int step, const std::string& name, std::vector<float>& v)> perturb;
  // Leaves a checkpoint (or a step's "tokens") out.
  std::function<bool(int step, const std::string& name)> skip;
  // Writes this checkpoint with its first dimension cut to 1 (a shape mismatch).
  std::string shrink;

  void write(const std::string& path) const {
    DumpWriter w(path, meta);
    const ModelConfig& c = meta.config;
    int n_past = 0;
    for (int step = 0; step < static_cast<int>(step_tokens.size()); ++step) {
      const int T = step_tokens[step];
      const int S = n_past + T;
      for (const auto& name : checkpoint_names(c)) {
        if (skip && skip(step, name)) continue;
        const auto parsed = parse_checkpoint_name(name);
        const CheckpointKind& kind = *find_checkpoint_kind(parsed.base);
        if (name == "tokens") {
          std::vector<int32_t> ids(fed.begin() + n_past, fed.begin() + n_past + T);
          w.record_ids(step, name, ids);
          continue;
        }
        std::vector<int64_t> shape = checkpoint_shape(c, kind, T, S);
        if (name == shrink) shape[0] = 1;
        size_t n = 1;
        for (auto d : shape) n *= static_cast<size_t>(d);
        const int order = checkpoint_order(c, parsed.base, parsed.layer);
        std::vector<float> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = synthetic_value(step, order, i);
        // The backend's own choice is its logits' argmax: the last row's largest value at argmax[step].
        if (name == "result_output" && step < static_cast<int>(argmax.size()) && argmax[step] < shape.back())
          v[n - static_cast<size_t>(shape.back()) + static_cast<size_t>(argmax[step])] = 2.0f;
        if (perturb) perturb(step, name, v);
        w.record(step, name, parsed.layer, kind.layout, shape, NativeDType::f32, v);
      }
      n_past = S;
    }
    if (!argmax.empty()) w.set_attribute("argmax", argmax);
    w.finish();
  }
};

}  // namespace diffrun::test
