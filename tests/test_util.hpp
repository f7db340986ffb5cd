// Paths to test inputs (generated fixtures, the fetched SmolLM2 model) and per-process scratch directories.
#pragma once

#include <cctype>
#include <cerrno>
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

// A new, empty directory <tmp>/diffrun-<name>-XXXXXX made by mkdtemp (<tmp> is TMPDIR, else /tmp):
// unique to the call, so concurrent runs (ctest -j, two checkouts on one machine) never share or
// delete each other's files. Characters other than [A-Za-z0-9_-] in `name` (e.g. the '/' of a
// parameterized test's name) become '_'. The caller removes it.
inline std::filesystem::path make_scratch_dir(const std::string& name) {
  std::string safe = name;
  for (char& c : safe)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) c = '_';
  std::string tmpl = (std::filesystem::temp_directory_path() / ("diffrun-" + safe + "-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::system_error(errno, std::generic_category(), "mkdtemp " + tmpl);
  return tmpl;
}

// A make_scratch_dir directory, removed with everything in it when destroyed.
struct ScratchDir {
  std::string path;
  explicit ScratchDir(const std::string& name) : path(make_scratch_dir(name).string()) {}
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
