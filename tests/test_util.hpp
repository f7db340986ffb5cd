// Paths to test inputs: generated fixtures and the fetched SmolLM2 model.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include <unistd.h>

namespace diffrun::test {

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

inline std::string source_dir() { return env_or("DIFFRUN_SOURCE_DIR", "."); }

// A generated fixture, e.g. fixture_path("tiny-llama-q4_k.gguf").
inline std::string fixture_path(const std::string& name) {
  return env_or("DIFFRUN_FIXTURE_DIR", "build/fixtures") + "/" + name;
}

inline std::string models_dir() {
  if (const char* d = std::getenv("DIFFRUN_MODELS"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/diffrun/models";
  return env_or("HOME", ".") + "/.cache/diffrun/models";
}

// A scratch directory <tmp>/diffrun-<name>-<pid>, removed with everything in it when destroyed.
struct ScratchDir {
  std::string path;
  explicit ScratchDir(const std::string& name)
      : path((std::filesystem::temp_directory_path() / ("diffrun-" + name + "-" + std::to_string(::getpid())))
                 .string()) {
    std::filesystem::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
};

inline std::string smollm2_path() { return models_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }
// Gemma 3 270M Q4_K_M, fetched on request (scripts/fetch_models gemma3); tests skip without it.
inline std::string gemma3_path() { return models_dir() + "/gemma-3-270m-q4_k_m.gguf"; }

}  // namespace diffrun::test
