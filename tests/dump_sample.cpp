// Writes a small dump with every checkpoint of a qwen3-shaped config (for the Python reader's tests),
// or prints the checkpoint vocabulary as JSON: `dump_sample OUT.h5` | `dump_sample --vocab-json`.
// Dims: T tokens of the step, S cached positions after it.
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include "dump/dump.hpp"

namespace {

using namespace diffrun;

ModelConfig sample_config() {
  ModelConfig c;
  c.arch = Arch::qwen3;
  c.n_layer = 2;
  c.n_embd = 8;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 2;
  c.n_ff = 12;
  c.n_vocab = 19;
  c.n_ctx = 64;
  c.rope_theta = 1000000.0;
  c.rope_type = RopeType::neox;
  c.rms_eps = 1e-6;
  c.tied_output = true;
  c.qk_norm = true;
  return c;
}

// Step 0: a 5-token prefill; step 1: one decode token. Element i of a dataset holds
// step * 1000 + order + i / 1024 (exact in float32), so a reader can check every value.
void write_sample(const char* path) {
  DumpMeta meta;
  meta.backend = "cpu";
  meta.precision = "f32";
  meta.model_path = "fixtures/sample-qwen3.gguf";
  meta.model_fingerprint = "size=4096;fnv1a64=00000000deadbeef";
  meta.config = sample_config();
  meta.prompt = "Caf\xc3\xa9 \xe2\x9c\x93";
  meta.token_ids = {2, 3, 5, 7, 11};
  meta.facts = {{"device", "sample"}, {"tf32", "off"}};
  DumpWriter w(path, meta);
  const ModelConfig& c = meta.config;
  const int steps_T[2] = {5, 1};
  const std::vector<int32_t> fed = {2, 3, 5, 7, 11, 13};  // the prompt, then the decode step's token
  int n_past = 0;
  for (int step = 0; step < 2; ++step) {
    const int T = steps_T[step];
    const int S = n_past + T;
    for (const auto& name : checkpoint_names(c)) {
      const auto parsed = parse_checkpoint_name(name);
      const CheckpointKind& kind = *find_checkpoint_kind(parsed.base);
      const int order = checkpoint_order(c, parsed.base, parsed.layer);
      if (name == "tokens") {
        std::vector<int32_t> ids(fed.begin() + n_past, fed.begin() + n_past + T);
        w.record_ids(step, name, ids);
        continue;
      }
      const auto shape = checkpoint_shape(c, kind, T, S);
      size_t n = 1;
      for (auto d : shape) n *= static_cast<size_t>(d);
      std::vector<float> v(n);
      for (size_t i = 0; i < n; ++i)
        v[i] = static_cast<float>(step * 1000 + order) + static_cast<float>(i) / 1024.0f;
      w.record(step, name, parsed.layer, kind.layout, shape, parsed.base == "Qnorm" ? NativeDType::f16 : NativeDType::f32,
               v);
    }
    n_past = S;
  }
  w.set_attribute("argmax", {7, 13});
  w.finish();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fputs("usage: dump_sample OUT.h5 | dump_sample --vocab-json\n", stderr);
    return 2;
  }
  try {
    if (std::strcmp(argv[1], "--vocab-json") == 0) {
      std::puts(diffrun::vocabulary_json().c_str());
      return 0;
    }
    write_sample(argv[1]);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dump_sample: %s\n", e.what());
    return 2;
  }
}
