// Names of the architectures and RoPE types, alone in a file so the C API's vocabulary checks link without the GGUF reader.
#include "model/config.hpp"

namespace diffrun {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::llama: return "llama";
    case Arch::qwen2: return "qwen2";
    case Arch::qwen3: return "qwen3";
  }
  return "unknown";
}

const char* rope_type_name(RopeType r) { return r == RopeType::norm ? "norm" : "neox"; }

}  // namespace diffrun
